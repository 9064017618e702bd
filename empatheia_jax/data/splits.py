"""Checking a shards folder before a pass reads it: the split exists, its files hold what the manifest says.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from empatheia_jax.data import schema, shard_format
from empatheia_jax.data.shard_reader import ShardReader


class ShardsError(ValueError):
    """A shards folder that cannot be evaluated as asked: an unreadable or foreign manifest, a split it lacks
    or holds no records of, a shard file missing or not what the manifest lists, features of another encoder
    than the model's. The message names the folder, split or file; `empatheia eval` prints it as one line and
    exits 2. (A folder that does not exist is a `FileNotFoundError`; a record that fails to decode while
    reading, `shard_format.ShardRecordError`.)"""


def check_split(shards_dir: str | os.PathLike, split: str) -> dict[str, Any]:
    """The manifest of `shards_dir`, after checking it has `split` and that the split's shard files are there
    with the record counts the manifest lists (ArrayRecord footers only: cheap, and a truncated copy fails
    here rather than in the middle of the pass). Errors name the folder, the split or the file."""
    if not Path(shards_dir).is_dir():
        raise FileNotFoundError(f"shards folder {shards_dir} does not exist (run data/prepare.py first)")
    try:
        m = shard_format.load_manifest(shards_dir)
    except FileNotFoundError:
        raise
    except ValueError as e:  # invalid JSON, or not our manifest format
        raise ShardsError(str(e)) from e
    splits = m.get("splits")
    if not isinstance(splits, Mapping) or split not in splits:
        known = sorted(splits) if isinstance(splits, Mapping) else []
        raise ShardsError(f"{shards_dir} has no split {split!r}; its manifest lists {known}")
    if not splits[split].get("records"):
        raise ShardsError(f"split {split!r} of {shards_dir} has no records")
    try:
        ShardReader.for_split(shards_dir, split)
    except shard_format.ShardRecordError as e:
        raise ShardsError(f"split {split!r} of {shards_dir}: {e}") from e
    except (KeyError, TypeError) as e:  # a manifest entry without path/records
        raise ShardsError(f"{Path(shards_dir) / shard_format.MANIFEST}: malformed entry of split {split!r} "
                          f"({type(e).__name__}: {e})") from e
    return m


def emotion_map_of(manifest: Mapping[str, Any]) -> schema.EmotionMap:
    """The emotion classes of a shards folder (its manifest's map; avamerg7 for older folders)."""
    name = ((manifest.get("emotion_map") or {}).get("name")) or "avamerg7"
    return schema.EmotionMap.load(name)
