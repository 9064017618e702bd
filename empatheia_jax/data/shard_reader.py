"""Random access to the ArrayRecord shards of one split: `ShardReader`.

Kept apart from `shard_format` (what a record and a shard folder are, shared by writers and readers) and
from the grain pipeline (`input_pipeline`): this is only the reading side, one place where opening, reading
and decoding fail with a `ShardRecordError` that names the shard file and record index. Used by the
pipeline's workers, by evaluation (prompts, gold targets) and by the data tools.
"""

from __future__ import annotations

import bisect
import collections
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from empatheia_jax.data import shard_format
from empatheia_jax.data.shard_format import ShardRecordError

_READER_OPTIONS = "readahead_buffer_size:0"


def _decode_record(data: bytes, *, shard: str, index: int) -> dict[str, Any]:
    try:
        return shard_format.decode_shard_record(data, shard=shard, index=index)
    except ShardRecordError:
        raise
    except Exception as e:  # keep one error type, naming shard and record, for every decode failure
        raise ShardRecordError(f"{shard} record {index}: cannot decode ({type(e).__name__}: {e})") from e


class ShardReader:
    """Random access to the records of one split; every failure names the shard file and record index.

    Picklable (grain workers): readers are opened lazily per process and dropped when pickled.
    """

    def __init__(self, paths: Sequence[str | os.PathLike[str]], expected_counts: Sequence[int] | None = None):
        self.paths = [os.fspath(p) for p in paths]
        counts = []
        for j, p in enumerate(self.paths):
            try:
                r = _open_reader(p)
                counts.append(int(r.num_records()))
                r.close()
            except Exception as e:
                raise ShardRecordError(f"{p}: cannot open ArrayRecord shard ({e})") from e
            if expected_counts is not None and counts[-1] != expected_counts[j]:
                raise ShardRecordError(
                    f"{p}: {counts[-1]} records but the manifest lists {expected_counts[j]} (replaced?)"
                )
        self.counts = counts
        self._ends = [int(x) for x in np.cumsum(counts)] if counts else []
        self._readers: dict[int, Any] = {}

    @classmethod
    def for_split(cls, shards_dir: str | os.PathLike[str], split: str) -> ShardReader:
        """The shards of `split` as listed by `SHARDS/manifest.json` (record counts checked)."""
        m = shard_format.load_manifest(shards_dir)
        if split not in m["splits"]:
            raise KeyError(f"{shards_dir}: no split {split!r}; the manifest has {sorted(m['splits'])}")
        shards = m["splits"][split]["shards"]
        paths = [os.path.join(os.fspath(shards_dir), s["path"]) for s in shards]
        return cls(paths, [int(s["records"]) for s in shards])

    def __len__(self) -> int:
        return int(self._ends[-1]) if self._ends else 0

    def locate(self, index: int) -> tuple[int, int]:
        """(shard number, record index inside that shard) of global record `index`."""
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} out of range [0, {len(self)})")
        s = bisect.bisect_right(self._ends, index)
        return s, index - (int(self._ends[s - 1]) if s else 0)

    def _reader(self, s: int) -> Any:
        r = self._readers.get(s)
        if r is None:
            try:
                r = self._readers[s] = _open_reader(self.paths[s])
            except Exception as e:
                raise ShardRecordError(f"{self.paths[s]}: cannot open ArrayRecord shard ({e})") from e
        return r

    def read(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Decoded records for global `indices`."""
        return [rec for _, rec in self.read_located(indices)]

    def read_located(self, indices: Sequence[int]) -> list[tuple[str, dict[str, Any]]]:
        """("{shard} record {i}", record) for global `indices`; one read call per shard touched."""
        by_shard: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
        for j, gi in enumerate(indices):
            s, local = self.locate(int(gi))
            by_shard[s].append((local, j))
        out: list[Any] = [None] * len(indices)
        for s, items in by_shard.items():
            path = self.paths[s]
            reader = self._reader(s)
            positions = [p for p, _ in items]
            try:
                blobs = reader.read(positions)
            except Exception:
                blobs = []
                for p in positions:  # find the bad record to name it
                    try:
                        blobs.append(reader.read([p])[0])
                    except Exception as e:
                        raise ShardRecordError(f"{path} record {p}: cannot read ({e})") from e
            for (p, j), blob in zip(items, blobs, strict=True):
                out[j] = (f"{path} record {p}", _decode_record(blob, shard=path, index=p))
        return out

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.read([index])[0]

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_readers"] = {}
        return state


def _open_reader(path: str) -> Any:
    from array_record.python import array_record_module

    return array_record_module.ArrayRecordReader(path, _READER_OPTIONS, file_reader_buffer_size=32768)


__all__ = ["ShardReader"]
