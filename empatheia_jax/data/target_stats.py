"""How the generator targets of a split of shards are spread: the per-dimension mean and variance of the
content rows.

Why: the content loss can weigh each dimension by its spread (`losses.balanced_dim_weights`, config
`loss.ccl_scale`), a model that fixes the dims its generator never reads (`EmpatheiaConfig.cv_dims`) must
find them at 0 in its targets, and both are properties of the data the run trains on, not of the model. It is
read from the shards, not stored in them, so shards prepared before it existed serve as they are; a fixed
sample of records (evenly spaced over the split, at most `max_records`) keeps the cost bounded on a large
corpus and makes the result the same on every host and on every resume.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from empatheia_jax.data.shard_format import ShardRecordError
from empatheia_jax.data.shard_reader import ShardReader

MAX_RECORDS = 2048


def row_variance(
    shards_dir: str | os.PathLike[str], split: str, kind: str, *, max_records: int = MAX_RECORDS
) -> np.ndarray | None:
    """Variance over all rows of `kind` (e.g. speech_content [T, D]) of the split's records, float64 [D];
    None when no record in the sample carries `kind`. A record whose rows have another width names itself."""
    moments = _row_moments(os.fspath(shards_dir), split, kind, max_records)
    return None if moments is None else moments[1].copy()


def row_mean(
    shards_dir: str | os.PathLike[str], split: str, kind: str, *, max_records: int = MAX_RECORDS
) -> np.ndarray | None:
    """Mean over the same rows as `row_variance`, float64 [D]; None when no record carries `kind`."""
    moments = _row_moments(os.fspath(shards_dir), split, kind, max_records)
    return None if moments is None else moments[0].copy()


@functools.lru_cache(maxsize=16)
def _row_moments(shards_dir: str, split: str, kind: str, max_records: int
                 ) -> tuple[np.ndarray, np.ndarray] | None:
    reader = ShardReader.for_split(shards_dir, split)
    n = len(reader)
    if n == 0:
        return None
    picks = np.unique(np.linspace(0, n - 1, num=min(n, max_records)).round().astype(int))
    total = total_sq = None
    rows = 0
    try:
        for where, rec in reader.read_located(picks.tolist()):
            x = rec["targets"].get(kind)
            if x is None:
                continue
            x = np.asarray(x, np.float64).reshape(-1, np.shape(x)[-1])
            if total is None:
                total, total_sq = np.zeros(x.shape[1]), np.zeros(x.shape[1])
            if x.shape[1] != total.size:
                raise ShardRecordError(f"{where}: targets[{kind!r}] rows have {x.shape[1]} dims, the split's "
                                       f"earlier records {total.size}")
            total += x.sum(0)
            total_sq += np.square(x).sum(0)
            rows += x.shape[0]
    finally:
        reader.close()
    if not rows:
        return None
    mean = total / rows
    return mean, np.maximum(total_sq / rows - np.square(mean), 0.0)
