"""Training checkpoints: save, keep, resume, and stop cleanly on preemption.

A run must survive being killed. Training is long and runs on preemptible machines, so the trainer saves
often, resumes exactly where it stopped, and saves once more when the scheduler sends SIGTERM. Each stage
starts from the previous stage's checkpoint (`--init_from`). None of this may ever leave a checkpoint that
looks complete but is not: a resume from a half-written step would silently train from garbage.

The writing is orbax's `CheckpointManager`; this module only decides what goes into a step and how it is
named, kept, checked and read back:

```
DIR/<step>/params/      orbax StandardSave: nnx.to_pure_dict(params), keys as strings ("layers.0.kernel")
DIR/<step>/opt_state/   same for the optimizer state (absent when saved with opt_state=None)
DIR/<step>/ema/         the averaged weights, params' keys (only a run with optim.ema_decay > 0, train/ema.py)
DIR/<step>/data/        JSON: the grain iterator state (absent when saved with data_state=None)
DIR/<step>/meta/        JSON: the trainer's dict (resolved config, stage, counters) + {"step": step}
DIR/<step>/metrics/     JSON: the metrics passed to save ({} when none), what best-step tracking reads
DIR/<step>.orbax-checkpoint-tmp*     a step being written (or whose writer was killed): never a step
```

- Atomicity is orbax's: a step is written under a temporary name and renamed to `<step>` only after every
  file of every item is written (in the background thread when async). A killed writer leaves only the
  temporary folder, which no reader counts as a step and which the next `TrainCheckpointer` deletes.
- Parameters are stored as plain nested dicts of arrays (`nnx.to_pure_dict`), not as `nnx.State` pytrees:
  the files then do not depend on nnx's Variable classes, and restore rebuilds a State of the *target's*
  structure with `nnx.replace_by_pure_dict`. Keys and shapes are checked against orbax's stored metadata
  first, so a model that does not match names the parameter instead of failing inside TensorStore.
- `PreemptionWatcher` turns SIGTERM into a flag that the loop polls (a signal handler must not save: it
  runs between two bytecodes of arbitrary code, possibly inside a jitted step's dispatch).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx, traverse_util
from jax.sharding import SingleDeviceSharding

from empatheia_jax.weights.checkpoint_io import (
    CheckpointError,
    _flat_params,
    _key,
    _nested_str,
    _unreadable_keys,
)


def checkpoints_of(path: str | Path) -> Path:
    """A training workdir means its checkpoints folder; anything else (that folder, a step) is kept."""
    path = Path(path)
    return path / CHECKPOINT_DIR if (path / CHECKPOINT_DIR).is_dir() else path




CHECKPOINT_DIR = "checkpoints"


__all__ = [
    "CheckpointError",
    "PreemptionWatcher",
    "Restored",
    "TrainCheckpointer",
    "read_meta",
    "resolve_checkpoint",
    "stage_finished",
]

ARRAY_ITEMS = ("params", "opt_state", "ema")
JSON_ITEMS = ("data", "meta")
_TMP_SUFFIX = ".orbax-checkpoint-tmp"


@dataclasses.dataclass
class Restored:
    step: int
    params: Any  # nnx.State with the target's structure (or a nested dict, if the target was one)
    opt_state: Any | None  # same, or None when not requested
    data_state: dict | None  # the input-pipeline iterator state; None when the step was saved without one
    meta: dict  # the trainer's dict + {"step": step}


# ----------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------


def _registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    # Explicit handlers, so a fresh manager can read metadata and restore any subset of the items.
    reg = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for name in ARRAY_ITEMS:
        reg.add(name, ocp.args.StandardSave, ocp.StandardCheckpointHandler)
        reg.add(name, ocp.args.StandardRestore, ocp.StandardCheckpointHandler)
    for name in JSON_ITEMS:
        reg.add(name, ocp.args.JsonSave, ocp.JsonCheckpointHandler)
        reg.add(name, ocp.args.JsonRestore, ocp.JsonCheckpointHandler)
    return reg


def _complete_steps(directory: Path) -> list[int]:
    """Finalized steps in a manager directory (temporary folders of interrupted writes are not steps)."""
    if not directory.is_dir():
        return []
    return sorted(m.step for m in ocp.path.step.standard_name_format().find_all(directory))


def _interrupted(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob(f"*{_TMP_SUFFIX}*")) if directory.is_dir() else []


def _pick_step(directory: Path, steps: list[int], step: int | None) -> int:
    """`step`, or the latest when None, checked against the complete steps; errors name the directory."""
    if step is None:
        if not steps:
            if not directory.is_dir():
                raise CheckpointError(f"no checkpoint directory {directory}")
            tmp = _interrupted(directory)
            raise CheckpointError(f"{directory} holds no complete checkpoint step"
                                  + (f" (interrupted writes only: {tmp})" if tmp else ""))
        return steps[-1]
    if int(step) not in steps:
        raise CheckpointError(f"{directory} has no complete step {step}; steps: {steps}")
    return int(step)


def _json_copy(value: Any, what: str) -> Any:
    # A deep copy (the async write must not see later mutations) that also fails early and clearly.
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be JSON-serializable: {e}") from e


def _pure_flat(state: Any) -> dict[tuple, Any]:
    return _flat_params(state) if isinstance(state, nnx.State) else traverse_util.flatten_dict(state)


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _key_impl(x: Any) -> Any:
    if isinstance(x, jax.Array):
        return jax.random.key_impl(x)
    found = []  # an abstract key: key_impl needs a key array, which it gets while tracing
    jax.eval_shape(lambda k: found.append(jax.random.key_impl(k)), x)
    return found[0]


def _saveable(state: Any) -> dict:
    """The nested, string-keyed dict orbax writes; typed PRNG keys (nnx RNG streams) as their raw data."""
    flat = _pure_flat(state)
    return _nested_str({k: jax.random.key_data(v) if _is_key(v) else v for k, v in flat.items()})


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    """The restore target of one leaf: its shape, dtype and sharding (one local device if it has none)."""
    sharding = getattr(x, "sharding", None) or SingleDeviceSharding(jax.local_devices()[0])
    if _is_key(x):  # stored as key_data: one more trailing (unsharded) dimension
        x = jax.eval_shape(jax.random.key_data, x)
    dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)
    return jax.ShapeDtypeStruct(np.shape(x), dtype, sharding=sharding)


def _rebuild(target: Any, restored: Mapping) -> Any:
    """The target's structure holding the restored values (the target itself is left untouched)."""
    stored = traverse_util.flatten_dict(dict(restored))
    values = {}
    for k, v in _pure_flat(target).items():
        value = stored[tuple(str(p) for p in k)]
        values[k] = jax.random.wrap_key_data(value, impl=_key_impl(v)) if _is_key(v) else value
    values = traverse_util.unflatten_dict(values)
    if not isinstance(target, nnx.State):
        return values
    out = jax.tree.map(lambda x: x, target)  # new State and Variable objects, same structure
    nnx.replace_by_pure_dict(out, values)
    return out


def _first_difference(stored: dict[str, Any], wanted: dict[str, Any]) -> str | None:
    """Describes the first key (in sorted order) whose presence or shape differs, and how many others do."""
    diffs = []
    for k in sorted(set(stored) | set(wanted)):
        if k not in stored:
            diffs.append(f"key {k!r} (shape {tuple(wanted[k].shape)} in the target) is not in the checkpoint")
        elif k not in wanted:
            diffs.append(f"key {k!r} (shape {tuple(stored[k].shape)} in the checkpoint) is not in the target")
        elif tuple(stored[k].shape) != tuple(wanted[k].shape):
            diffs.append(f"key {k!r} has shape {tuple(stored[k].shape)} in the checkpoint but "
                         f"{tuple(wanted[k].shape)} in the target")
    if not diffs:
        return None
    more = f" (and {len(diffs) - 1} more differing keys)" if len(diffs) > 1 else ""
    return diffs[0] + more


def _damaged(step_dir: Path, flats: dict[str, dict[tuple, Any]], e: Exception) -> CheckpointError:
    """The error for a step folder orbax cannot read, naming the arrays whose files are damaged."""
    cause = (str(e.__cause__ or e) or type(e).__name__).splitlines()[0].split(" [tensorstore_spec")[0][:300]
    for name, flat in flats.items():  # restores each array alone: slow, but only on this error path
        bad = _unreadable_keys(step_dir / name, flat)
        if bad:
            more = f" (+{len(bad) - 5} more)" if len(bad) > 5 else ""
            return CheckpointError(f"cannot read {name} {bad[:5]}{more} from step folder {step_dir} "
                                   f"(missing or corrupt file?): {cause}")
    return CheckpointError(f"cannot read step folder {step_dir} (missing or corrupt file?): {cause}")


def _best_fn(metric: str, mode: str):
    """The metric of one step's metrics dict; a step without it (or with NaN) ranks worst, never raises."""
    worst = math.inf if mode == "min" else -math.inf

    def fn(metrics: Mapping[str, Any] | None) -> float:
        value = (metrics or {}).get(metric)
        try:
            value = float(value)
        except (TypeError, ValueError):
            return worst
        return worst if math.isnan(value) else value

    return fn


# ----------------------------------------------------------------------------------------------------------
# The checkpointer
# ----------------------------------------------------------------------------------------------------------


class TrainCheckpointer:
    """An orbax CheckpointManager for one training run (see the module docstring for the layout).

    Keep policy: the last `keep` steps always; with keep_best also the best step by `best_metric`
    (`best_mode` "min" or "max") among the steps saved with that metric, however old. It is orbax's
    preservation policy, LatestN(keep) OR BestN(1).

    There must be one writer per directory, called by every process of the job with the same arguments.
    With create=True (a writer) construction also deletes temporary folders left by killed writers;
    create=False opens an existing directory without touching it, which is what a reader (--init_from,
    evaluation of a run still writing) must use. Not thread-safe (orbax's manager is not).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep: int = 3,
        keep_best: bool = False,
        best_metric: str = "eval/total",
        best_mode: str = "min",
        async_save: bool = True,
        create: bool = True,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
        self.directory = Path(directory).absolute()
        self.best_metric = best_metric
        self._best = _best_fn(best_metric, best_mode)
        policies: list[Any] = [ocp.checkpoint_managers.LatestN(n=keep)]
        if keep_best:
            # Steps saved without the metric rank worst (see _best_fn) and are passed an empty metrics dict
            # (orbax warns on None); among equals the sort is stable, so BestN then keeps the newest such
            # step, which LatestN keeps anyway: no checkpoint is kept only because it has no metric.
            policies.append(ocp.checkpoint_managers.BestN(
                get_metric_fn=self._best, reverse=best_mode == "min", n=1,
                keep_checkpoints_without_metrics=False,
            ))
        options = ocp.CheckpointManagerOptions(
            # best_fn is what makes orbax write the metrics item and answer best_step(); which steps are
            # *kept* is decided by preservation_policy alone.
            best_fn=self._best,
            best_mode=best_mode,
            preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
            enable_async_checkpointing=async_save,
            create=create,
            cleanup_tmp_directories=create,  # a reader must not delete the write in flight of a live run
        )
        self._mngr = ocp.CheckpointManager(self.directory, options=options, handler_registry=_registry())
        # Orbax deletes leftover temporary folders in a background future that it awaits only before the
        # next save; await it now, so a manager that only restores does not leave that thread running.
        await_cleanup = getattr(self._mngr, "_maybe_await_cleanup_tmp_directory", None)
        if await_cleanup is not None:
            await_cleanup()
        self._closed = False

    # -- saving ----------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        *,
        params: Any,
        opt_state: Any,
        data_state: dict | None,
        meta: dict,
        metrics: dict[str, float] | None = None,
        force: bool = False,
        ema: Any = None,
    ) -> bool:
        """Starts writing `step` (in the background when async) and returns whether a save happened.

        A step that already exists (or is being written) is never overwritten: the call returns False, so
        "resume from step N, then preempted at step N" is harmless. A step older than the latest one is
        also skipped (latest_step() would keep pointing at the newer one) unless force=True.

        Returns once the arrays are copied to host memory: the caller may then donate or overwrite
        params/opt_state (the jitted step does). A save started while another is in flight first waits for
        it. `params`/`opt_state` are nnx.State (or nested dicts) of arrays; opt_state=None and
        data_state=None leave those items out. `ema` (params' structure: the averaged weights of a run that
        keeps a parameter EMA, train/ema.py) is written as the `ema` item when given. Multi-process: every
        process calls save with the same step.
        """
        step = int(step)
        if meta.get("step", step) != step:
            raise ValueError(f"meta['step']={meta['step']!r} but saving step {step}")
        steps = self.all_steps()
        if step in steps or (steps and step < steps[-1] and not force):
            return False
        items = {
            "params": ocp.args.StandardSave(_saveable(params)),
            "meta": ocp.args.JsonSave(_json_copy({**meta, "step": step}, "meta")),
        }
        if opt_state is not None:
            items["opt_state"] = ocp.args.StandardSave(_saveable(opt_state))
        if ema is not None:
            items["ema"] = ocp.args.StandardSave(_saveable(ema))
        if data_state is not None:
            items["data"] = ocp.args.JsonSave(_json_copy(data_state, "data_state"))
        metrics = {str(k): float(v) for k, v in (metrics or {}).items()}
        return bool(self._mngr.save(step, args=ocp.args.Composite(**items), metrics=metrics, force=True))

    def wait_until_finished(self) -> None:
        """Blocks until an in-flight async save is on disk under its final name (re-raises its error)."""
        self._mngr.wait_until_finished()

    # -- what is there -------------------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Saved steps, ascending; includes a step whose async write is still in flight."""
        return sorted(int(s) for s in self._mngr.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def saved_metrics(self, step: int) -> dict[str, float]:
        """The metrics saved with `step` ({} when none): the final step's hold the run's final evaluation."""
        return {str(k): float(v) for k, v in (self._mngr.metrics(step) or {}).items()}

    def best_step(self) -> int | None:
        """The step with the best `best_metric` among those saved with it; None when no step has it."""
        step = self._mngr.best_step()
        if step is None or math.isinf(self._best(self._mngr.metrics(step))):
            return None
        return int(step)

    # -- restoring -------------------------------------------------------------------------------------

    def restore(self, step: int | None = None, *, params: Any, opt_state: Any = None,
                item: str = "params") -> Restored:
        """Reads `step` (None = latest) into the structure, shardings and dtypes of the targets.

        `params` / `opt_state` are live nnx.State trees of jax.Arrays (possibly sharded over a mesh) or
        trees of jax.ShapeDtypeStruct with `.sharding`; the targets themselves are not modified.
        opt_state=None skips the optimizer state. item="ema" reads the `ema` item (the averaged weights)
        into the `params` target instead of the `params` item. Raises CheckpointError when the directory has
        no such step, when the stored keys/shapes differ from a target, or when a file is missing or corrupt.
        """
        self.wait_until_finished()
        step = _pick_step(self.directory, self.all_steps(), step)
        step_dir = self.directory / str(step)

        if item not in ("params", "ema"):
            raise ValueError(f"item must be 'params' or 'ema', got {item!r}")
        wanted = {item: params} if opt_state is None else {item: params, "opt_state": opt_state}
        flats = {name: {k: _abstract(v) for k, v in _pure_flat(t).items()} for name, t in wanted.items()}
        self._check_items(step_dir, flats)
        args = {name: ocp.args.StandardRestore(_nested_str(flat)) for name, flat in flats.items()}
        args.update({name: ocp.args.JsonRestore() for name in JSON_ITEMS if (step_dir / name).is_dir()})
        try:
            out = self._mngr.restore(step, args=ocp.args.Composite(**args))
        except Exception as e:
            raise _damaged(step_dir, flats, e) from e
        return Restored(
            step=step,
            params=_rebuild(params, out[item]),
            opt_state=None if opt_state is None else _rebuild(opt_state, out["opt_state"]),
            data_state=out["data"] if "data" in args else None,
            meta=dict(out["meta"]),
        )

    @staticmethod
    def _check_items(step_dir: Path, flats: dict[str, dict[tuple, Any]]) -> None:
        """Items present, and stored keys/shapes (orbax's metadata, no array read) equal to the targets'."""
        if not (step_dir / "meta").is_dir():
            raise CheckpointError(f"{step_dir}: the 'meta' item is missing (not a training checkpoint?)")
        for name, flat in flats.items():
            item_dir = step_dir / name
            if not item_dir.is_dir():
                raise CheckpointError(f"{step_dir}: the {name!r} item is missing (saved with {name}=None?)")
            handler = ocp.StandardCheckpointHandler()
            try:
                tree = handler.metadata(item_dir).tree
            except Exception as e:
                raise _damaged(step_dir, {name: flat}, e) from e
            finally:
                handler.close()
            stored = {_key(k): v for k, v in traverse_util.flatten_dict(dict(tree)).items()}
            diff = _first_difference(stored, {_key(k): v for k, v in flat.items()})
            if diff:
                raise CheckpointError(f"{item_dir} does not match the {name} target: {diff}")

    # -- lifetime -------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Waits for an in-flight save and releases orbax's threads. Idempotent."""
        if not self._closed:
            self._closed = True
            self._mngr.close()

    def __enter__(self) -> TrainCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------------------
# Reading without a model: meta, and what --init_from points at
# ----------------------------------------------------------------------------------------------------------


def read_meta(directory: str | os.PathLike, step: int | None = None) -> tuple[int, dict]:
    """(step, meta) of `step` (None = latest) in a manager directory, without building any model."""
    directory = Path(directory).absolute()
    step = _pick_step(directory, _complete_steps(directory), step)
    meta_dir = directory / str(step) / "meta"
    try:
        meta = ocp.JsonCheckpointHandler().restore(meta_dir)
    except Exception as e:
        raise CheckpointError(f"cannot read {meta_dir}: {e}") from e
    return int(step), dict(meta)


def weights_item(meta: Mapping[str, Any]) -> str:
    """The item that holds a run's trained weights, given a step's meta: its parameter EMA when the run
    kept one (optim.ema_decay > 0, train/ema.py), else the parameters themselves."""
    return "ema" if meta.get("ema") else "params"


def resolve_checkpoint(path: str | os.PathLike) -> tuple[Path, int]:
    """What `--init_from` points at, as (manager directory, step).

    Accepts a checkpoint-manager directory (-> its latest complete step) or one step folder inside it
    (e.g. WORKDIR/checkpoints/120). A temporary folder of an interrupted write, or a folder holding no
    complete step, is a CheckpointError that says what was found.
    """
    p = Path(path).absolute()
    hint = "pass a checkpoint directory (e.g. WORKDIR/checkpoints) or a step folder in it (.../120)"
    if not p.exists():
        raise CheckpointError(f"--init_from {p}: no such file or directory; {hint}")
    if _TMP_SUFFIX in p.name:
        raise CheckpointError(f"--init_from {p}: an interrupted (or in-progress) write, not a step")
    if p.is_dir() and p.name.isdigit() and (p / "meta").is_dir():
        step = int(p.name)
        if step not in _complete_steps(p.parent):
            raise CheckpointError(f"--init_from {p}: not a complete step of {p.parent}")
        return p.parent, step
    steps = _complete_steps(p)
    if not steps:
        tmp = _interrupted(p)
        found = f"interrupted writes only: {tmp}" if tmp else "no step folders"
        raise CheckpointError(f"--init_from {p}: {found}; {hint}")
    return p, steps[-1]


def stage_finished(workdir: str | os.PathLike, stage: str) -> bool:
    """Whether a training workdir's `stage` reached its last step: a complete checkpoint at or past the
    schedule's steps in the config.json the trainer wrote at its start (False without one).

    Why: `empatheia train` exits 0 after a preemption checkpoint too, so a caller that chains stages
    (launch/ed_reference.py) asks this before it exports a partial stage or starts the next one."""
    workdir = Path(workdir)
    config = workdir / "config.json"
    if not config.is_file():
        return False
    steps = json.loads(config.read_text())["schedule"][stage]["steps"]
    saved = _complete_steps(workdir / CHECKPOINT_DIR)
    return bool(saved) and saved[-1] >= steps


# ----------------------------------------------------------------------------------------------------------
# Preemption
# ----------------------------------------------------------------------------------------------------------


class PreemptionWatcher:
    """Installs SIGTERM (and optionally SIGINT) handlers that only set a flag; the loop polls it.

        with PreemptionWatcher() as watcher:
            for step in ...:
                ...train step...
                if watcher.requested(step):
                    ckpt.save(step, ...); ckpt.wait_until_finished(); break

    `requested(step)` is True once this process got one of the signals, or any process did, or jax's
    preemption service announced a sync point at `step` (multi-process jobs started with
    `jax.distributed.initialize`, whose C++ notifier handles SIGTERM if it was installed after this
    watcher). In a multi-process job it is a collective: every process must call it at the same steps
    (simplest: every step), and all get the same answer, so all save the same step. Once True it stays
    True. With SIGINT watched, a SIGINT after a first signal raises KeyboardInterrupt, so Ctrl-C twice
    still stops a stuck run.
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM,)) -> None:
        self.signals = tuple(signals)
        self.received: int | None = None  # the first signal number received by this process
        self._agreed = False
        self._previous: dict[int, Any] = {}
        for sig in self.signals:  # raises ValueError outside the main thread, as signal.signal does
            self._previous[sig] = signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: types.FrameType | None) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.received is None:
            self.received = signum

    def requested(self, step: int | None) -> bool:
        """step=None: only the signals, not jax's preemption sync point (work before the first step)."""
        if self._agreed:
            return True
        local = self.received is not None
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            flags = multihost_utils.process_allgather(np.asarray([int(local)], np.int32))
            local = bool(np.asarray(flags).any())
        self._agreed = local or (step is not None and _reached_preemption_sync_point(step))
        return self._agreed

    def restore_handlers(self) -> None:
        """Puts back the handlers that were installed before this watcher. Idempotent."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def __enter__(self) -> PreemptionWatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore_handlers()


def _reached_preemption_sync_point(step: int) -> bool:
    """jax's preemption notice; False when the distributed preemption service is not running."""
    from jax.experimental import multihost_utils

    try:
        return bool(multihost_utils.reached_preemption_sync_point(int(step)))
    except RuntimeError:  # jax.distributed initialized with the preemption service disabled
        return False
