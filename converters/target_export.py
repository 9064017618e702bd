"""What the generator-target exporters share (styletts2_targets, dreamtalk_targets, face_targets): their
error classes and how they read the utterances of an AvaMERG folder."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any


class UsageError(ValueError):
    """A problem with the command line or the user's files (not with one utterance); `main` exits 2."""


class TargetExportError(RuntimeError):
    """One or more utterances failed; the message lists each with its id. Nothing was committed."""


def raw_dialogues(raw: str | os.PathLike, splits: list[str] | None = None,
                  dialogues: Iterable[Any] | None = None) -> list[Any]:
    """`dialogues` when given (e.g. the ones that passed validation), else every dialogue of RAW's split
    files (`splits`, default all); a missing folder or split file is a `UsageError` naming it."""
    from empatheia_jax import schema
    from empatheia_jax.shard_format import discover_splits

    raw = Path(raw)
    if not raw.is_dir():
        raise UsageError(f"RAW folder {raw} does not exist")
    if dialogues is not None:
        return list(dialogues)
    try:
        names = list(splits) if splits else discover_splits(raw)
    except FileNotFoundError as e:
        raise UsageError(str(e)) from e
    out = []
    for split in names:
        path = schema.split_json_path(raw, split)
        if not os.path.isfile(path):
            raise UsageError(f"split {split!r}: {path} does not exist")
        out.extend(schema.load_dialogues(path))
    return out
