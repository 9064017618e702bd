"""Which parameters a training stage may update, as named groups turned into one `nnx` filter.

A stage says `{"lora", "added_rows"}`; `trainable_filter` turns that into the filter that
`nnx.Optimizer(model, tx, wrt=...)` and `nnx.split(model, wrt, ...)` take, so the optimizer state covers only
those parameters and everything else stays bit-identical. `added_rows` selects only the `*_extra` rows of the
added tokens, never the pretrained embedding / lm_head tables (the NExT-GPT #40/#71 mistake).

Modules built later (Content Synchronizer, Style Disentangler, projections) add their groups with
`register_group`, naming the attribute their parameters live under.
"""

from __future__ import annotations

from collections.abc import Iterable

from flax import nnx

ADDED_ROW_PARAMS = ("embed_extra", "lm_head_extra")

_GROUPS: dict[str, nnx.filterlib.Filter] = {
    "lora": nnx.LoRAParam,
    "added_rows": nnx.All(nnx.Param, nnx.Any(*(nnx.PathContains(n) for n in ADDED_ROW_PARAMS))),
}


def register_group(name: str, filter_: nnx.filterlib.Filter) -> None:
    """Adds a trainable group (e.g. `"cs"` -> `nnx.All(nnx.Param, nnx.PathContains("content_sync"))`).

    Registering an equal filter again is a no-op, so a module that registers its groups at import time
    survives `importlib.reload`; a different filter under a taken name is an error.
    """
    if name in _GROUPS:
        if _GROUPS[name] == filter_:
            return
        raise ValueError(f"trainable group {name!r} is already registered")
    _GROUPS[name] = filter_


def groups() -> tuple[str, ...]:
    return tuple(sorted(_GROUPS))


def trainable_filter(names: Iterable[str]) -> nnx.filterlib.Filter:
    """One nnx filter selecting the parameters of every named group (`nnx.Nothing` for no group)."""
    names = sorted(set(names))
    unknown = [n for n in names if n not in _GROUPS]
    if unknown:
        raise ValueError(f"unknown trainable groups {unknown}; known: {list(groups())}")
    if not names:
        return nnx.Nothing
    return nnx.Any(*(_GROUPS[n] for n in names))
