"""What the generator-target exporters share (styletts2_targets, dreamtalk_targets, face_targets): their
error classes, how they read the utterances of an AvaMERG folder, and whether targets they wrote were made
under today's voice map and mouth rule."""

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
    from empatheia_jax.data import raw_layout, schema

    raw = Path(raw)
    if not raw.is_dir():
        raise UsageError(f"RAW folder {raw} does not exist")
    if dialogues is not None:
        return list(dialogues)
    try:
        names = list(splits) if splits else raw_layout.discover_splits(raw)
    except FileNotFoundError as e:
        raise UsageError(str(e)) from e
    out = []
    for split in names:
        path = raw_layout.split_json_path(raw, split)
        if not os.path.isfile(path):
            raise UsageError(f"split {split!r}: {path} does not exist")
        out.extend(schema.load_dialogues(path))
    return out


# The kinds whose values follow the voice map (the listener's style rule and voices:
# kokoro_voices.MAP_VERSION) or the mouth rule (visemes.MOUTH_VERSION), and the version keys the exporters
# record for them in meta.json.
VERSIONED_KINDS = {"speech_style": ("voice_map_version",),
                   "video_content": ("voice_map_version", "mouth_version"),
                   "video_style": ("voice_map_version",)}


def stale_targets(directory: str | os.PathLike) -> list[str]:
    """Why the Kokoro and face targets in `directory` must be made again, [] when they are current: a kind
    missing (never written, or its writer did not finish) or made under another voice map or mouth rule
    than today's (`VERSIONED_KINDS`). Shards that embed stale targets must be prepared again too."""
    from empatheia_jax.data.targets import TargetFormatError, read_targets_meta
    from empatheia_jax.generators.kokoro_voices import MAP_VERSION
    from empatheia_jax.generators.visemes import MOUTH_VERSION

    try:
        meta = read_targets_meta(Path(directory))
    except TargetFormatError as e:
        return [str(e)]
    today = {"voice_map_version": MAP_VERSION, "mouth_version": MOUTH_VERSION}
    why = []
    for kind, keys in VERSIONED_KINDS.items():
        entry = meta.get(kind)
        if not isinstance(entry, dict):
            why.append(f"no {kind} targets")
            continue
        why += [f"{kind} made with {key} {entry.get(key)!r}, today's is {today[key]!r}"
                for key in keys if entry.get(key) != today[key]]
    return why


def safe_torch_load(path: Path, hint: str) -> Any:
    """`torch.load(weights_only=True)` of a user's checkpoint (our safe-loading rule): a file holding pickled
    Python objects is refused with `hint` (how to convert it to safetensors), any other failure named."""
    import pickle

    import torch

    try:
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UsageError(f"{path} does not load with torch.load(weights_only=True): it holds pickled Python "
                         f"objects, which we do not unpickle; {hint}") from e
    except Exception as e:  # noqa: BLE001 - torch raises many types for a foreign or truncated file
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UsageError(f"{path}: not a readable torch checkpoint ({type(e).__name__}: {first})") from e
