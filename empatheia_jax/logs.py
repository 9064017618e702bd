"""Logging of every command-line entry point: libraries at WARNING unless `--verbose`, ours at INFO.

`configure(verbose)` is the one place that sets this; `empatheia train|eval|chat` (after absl parsed its
flags) and the argparse scripts (`empatheia_jax.weights.hf_to_flax`, `data.make_sample`, `data.prepare`,
`data.import_ed`) call it first thing. Why it is more than `logging.basicConfig`:

- absl's `app.run` puts its handler on the root logger and, unless `--verbosity` was given, raises absl's
  verbosity to INFO after parsing; orbax logs through absl, so a checkpoint restore alone printed ~100
  `I1125 ... checkpoint_manager.py:...]` lines around the result. The root level decides what libraries
  print (orbax, jax, grain, absl); an explicit `--verbosity`/`-v` still wins.
- transformers keeps its own handler and level (from `TRANSFORMERS_VERBOSITY`, read on its first use); the
  C++ side of XLA/TensorFlow reads `TF_CPP_MIN_LOG_LEVEL` when it loads. Both are set as environment
  defaults (a user's own value wins), so they also hold in spawned worker processes (grain's `mp_prefetch`,
  `data.prepare --workers`), which inherit the environment but not this process's logging setup. Those
  workers never install a handler, so Python's last-resort handler prints only warnings there anyway.
- Our own `empatheia_jax` loggers (resume notes, preemption, skipped examples) are what a user should read:
  they get their own plain stderr handler (message only, `WARNING: ` for warnings) instead of absl's
  timestamped prefix, and do not propagate to the root handlers (no double printing).
"""

from __future__ import annotations

import logging
import os
import sys

OUR_LOGGER = "empatheia_jax"


class _StderrHandler(logging.StreamHandler):
    """Writes to the `sys.stderr` of the moment, not the one at creation: a `main()` called in-process (tests,
    notebooks) may run while stderr is temporarily replaced, and a handler bound to that object would write
    to a closed file afterwards."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        del value


class _PlainFormatter(logging.Formatter):
    """The message alone for INFO and below, `LEVEL: message` above: readable next to tqdm and results."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if record.levelno <= logging.INFO else f"{record.levelname}: {text}"


def configure(verbose: bool = False) -> None:
    """Quiet libraries (WARNING), or everything at INFO with `verbose`; our logger at INFO either way.

    Idempotent: a second call only changes levels. Call it before jax/transformers are imported where
    possible (the environment defaults are read when they load).
    """
    level = logging.INFO if verbose else logging.WARNING
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0" if verbose else "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "info" if verbose else "warning")

    from absl import flags
    from absl import logging as absl_logging
    from absl.logging import converter

    root = logging.getLogger()
    if absl_logging.get_absl_handler() not in root.handlers and not root.handlers:
        # argparse scripts: no handler yet (absl apps have absl's). A plain one, so --verbose shows INFO.
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    verbosity = flags.FLAGS["verbosity"]
    if verbosity.present:  # the user's explicit --verbosity/-v wins over our default
        v = verbosity.value
        level = converter.absl_to_standard(v) if v <= converter.ABSL_DEBUG else logging.DEBUG - (v - 1)
    else:
        # absl applies it: the root level under absl's handler, else absl's own logger. Setting the value
        # does not mark the flags parsed (an argparse script has not parsed absl flags).
        verbosity.value = converter.standard_to_absl(level)
    root.setLevel(level)
    # transformers has its own handler and does not propagate; its level otherwise comes from the env default.
    logging.getLogger("transformers").setLevel(level)

    ours = logging.getLogger(OUR_LOGGER)
    ours.setLevel(logging.INFO)
    if not any(getattr(h, "_empatheia", False) for h in ours.handlers):
        handler = _StderrHandler()
        handler.setFormatter(_PlainFormatter("%(message)s"))
        handler._empatheia = True  # noqa: SLF001 - marks our handler, so a second call adds none
        ours.addHandler(handler)
    ours.propagate = False
