"""Batching: unpadded examples -> static-shape batches, text packing, and global jax.Arrays.

The batch layout is the contract with the model (docs/design.md "## Batch layout and input pipeline"):
`batch_spec` names every key's shape for a bucket length, `collate` pads examples to it (filler rows
contribute nothing to any loss), `pack_text_batch` packs the text stages' examples into fewer rows, and
`make_global_batch` assembles the processes' local batches into sharded global arrays. Kept apart from
example building (`examples`, which knows the tokenizer) and from the grain pipeline (`input_pipeline`,
which decides which examples share a batch): everything here is shape bookkeeping on numpy arrays.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from empatheia_jax.data.pipeline_config import PipelineConfig

TOKEN_KEYS = ("input_ids", "target_ids", "loss_mask", "response_mask", "positions", "attention_mask")
LABEL_KEYS = ("emotion", "age", "gender", "timbre")


def batch_spec(
    cfg: PipelineConfig, batch_size: int, length: int, *, audio_dim: int, video_dim: int
) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{key: (shape, dtype)} of a batch padded to sequence length `length` (one of the buckets)."""
    B, L = batch_size, length
    i32, f32 = np.dtype(np.int32), np.dtype(np.float32)
    spec: dict[str, tuple[tuple[int, ...], np.dtype]] = {k: ((B, L), i32) for k in TOKEN_KEYS}
    spec |= {
        "aud_feats": ((B, cfg.max_aud, audio_dim), f32),
        "aud_mask": ((B, cfg.max_aud), i32),
        "vid_feats": ((B, cfg.max_vid, video_dim), f32),
        "vid_mask": ((B, cfg.max_vid), i32),
        "speech_content": ((B, cfg.max_speech_len, cfg.speech_content_dim), f32),
        "speech_content_mask": ((B, cfg.max_speech_len), i32),
        "video_content": ((B, cfg.max_video_len, cfg.video_content_dim), f32),
        "video_content_mask": ((B, cfg.max_video_len), i32),
        "speech_style": ((B, cfg.style_dim), f32),
        "video_style": ((B, cfg.style_dim), f32),
        "style_mask": ((B, 2), i32),
        **{k: ((B,), i32) for k in LABEL_KEYS},
        "record_index": ((B,), i32),
    }
    if cfg.speech_units is not None:
        spec["speech_units"] = ((B, cfg.max_speech_len), i32)
    if cfg.video_units:
        spec["video_units"] = ((B, cfg.max_video_len), i32)
    return spec


def collate(
    examples: Sequence[Mapping[str, Any]],
    cfg: PipelineConfig,
    batch_size: int,
    *,
    audio_dim: int,
    video_dim: int,
    pad_id: int,
) -> dict[str, np.ndarray]:
    """Pad `examples` (at most `batch_size`) to one static-shape batch; missing rows are filler rows.

    The sequence axis is padded (right) to the smallest bucket length that fits the longest example.
    Filler rows have every mask 0, labels -1 and record_index -1, so they contribute nothing to losses.
    """
    if len(examples) > batch_size:
        raise ValueError(f"{len(examples)} examples for a batch of {batch_size}")
    longest = max((len(e["input_ids"]) for e in examples), default=1)
    L = cfg.bucket_for(longest)
    spec = batch_spec(cfg, batch_size, L, audio_dim=audio_dim, video_dim=video_dim)
    out = {k: np.zeros(shape, dtype) for k, (shape, dtype) in spec.items()}
    out["input_ids"].fill(pad_id)
    out["target_ids"].fill(pad_id)
    out["positions"][:] = np.arange(L, dtype=np.int32)
    for k in (*LABEL_KEYS, "record_index"):
        out[k].fill(-1)
    for b, e in enumerate(examples):
        n = len(e["input_ids"])
        for k in ("input_ids", "target_ids", "loss_mask", "response_mask"):
            out[k][b, :n] = e[k]
        out["attention_mask"][b, :n] = 1
        for feat, mask in (("aud_feats", "aud_mask"), ("vid_feats", "vid_mask")):
            p = len(e[feat])
            if p:
                out[feat][b, :p] = e[feat]
                out[mask][b, :p] = 1
        for feat in ("speech_content", "video_content"):
            t = len(e[feat])
            if t:
                out[feat][b, :t] = e[feat]
                out[f"{feat}_mask"][b, :t] = 1
        if "speech_units" in out:
            out["speech_units"][b, : len(e["speech_units"])] = e["speech_units"]
        if "video_units" in out:
            out["video_units"][b, : len(e["video_units"])] = e["video_units"]
        out["speech_style"][b] = e["speech_style"]
        out["video_style"][b] = e["video_style"]
        out["style_mask"][b] = e["style_mask"]
        for k in (*LABEL_KEYS, "record_index"):
            out[k][b] = e[k]
    return out


# The keys of a packed text batch: [R, L] each; every per-example key (labels, targets, features) is dropped.
PACKED_KEYS = ("input_ids", "target_ids", "loss_mask", "response_mask", "positions", "attention_mask",
               "segment_ids")


def pack_text_batch(
    batch: Mapping[str, np.ndarray], length: int, *, pad_id: int, row_multiple: int = 1
) -> dict[str, np.ndarray]:
    """The examples of a collated text batch (one per row, right-padded) packed into rows of `length`.

    First-fit decreasing by real length; the row count is what it needs, rounded up to `row_multiple`
    (empty rows: every mask 0), so it varies by batch (one compile per row count). Each example keeps its
    tokens, masks and positions (0.. per example, so positions restart at every turn) and gets
    `segment_ids` 1, 2, ... within its row (0 on padding): `Llama.decode` lets a token attend only to its
    own segment. The loss positions are the same tokens as unpacked, so the per-token mean (the count
    `emp_tokens`) and its gradient are unchanged. Only the token keys (`PACKED_KEYS`, and `record_index` [B]
    for logs) are kept: packing is
    for the text stages (coe), whose loss reads nothing else; a batch with media rows (`aud_mask`/`vid_mask`)
    or an example longer than `length` raises ValueError.
    """
    attn = np.asarray(batch["attention_mask"]).astype(bool)
    for key in ("aud_mask", "vid_mask"):
        if key in batch and np.asarray(batch[key]).any():
            raise ValueError(f"pack_text_batch packs text-only batches; this one has {key} rows (media)")
    n = attn.sum(1)
    if not (attn == (np.arange(attn.shape[1]) < n[:, None])).all():
        raise ValueError("pack_text_batch needs right-padded rows (attention_mask a prefix of ones)")
    if n.max(initial=0) > length:
        raise ValueError(f"an example of {int(n.max())} tokens does not fit a packed row of {length}")
    bins: list[list[int]] = []
    free: list[int] = []
    for b in sorted(np.flatnonzero(n), key=lambda b: (-n[b], b)):
        r = next((i for i, f in enumerate(free) if f >= n[b]), None)
        if r is None:
            bins.append([])
            free.append(length)
            r = len(bins) - 1
        bins[r].append(int(b))
        free[r] -= int(n[b])
    rows = max(-(-len(bins) // row_multiple), 1) * row_multiple
    out = {k: np.zeros((rows, length), np.int32) for k in PACKED_KEYS}
    out["input_ids"].fill(pad_id)
    out["target_ids"].fill(pad_id)
    for r, members in enumerate(bins):
        at = 0
        for segment, b in enumerate(members, start=1):
            m = int(n[b])
            for k in PACKED_KEYS[:-1]:
                out[k][r, at:at + m] = batch[k][b, :m]
            out["segment_ids"][r, at:at + m] = segment
            at += m
    if "record_index" in batch:  # per example [B], for the trainer's logs (the model never reads it)
        out["record_index"] = np.asarray(batch["record_index"]).copy()
    return out


def make_global_batch(
    batch: Mapping[str, np.ndarray], sharding: Any, *, batch_axis: int = 0
) -> dict[str, Any]:
    """Assemble each process's local batch into global jax.Arrays sharded along the batch axis.

    `sharding` is a jax.sharding.Sharding whose spec entry at `batch_axis` shards the examples (e.g.
    NamedSharding(mesh, P(("data", "fsdp"))), or P(None, ("data", "fsdp")) with batch_axis=1 for the
    trainer's [grad_accum, micro_batch, ...] layout); trailing axes are replicated. The global batch axis is
    process_count times the local one, the processes' slices in process order.
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    out = {}
    for k, v in batch.items():
        s = sharding
        if isinstance(sharding, NamedSharding):
            lead = tuple(sharding.spec[: batch_axis + 1])
            s = NamedSharding(sharding.mesh, PartitionSpec(*lead, *([None] * (v.ndim - len(lead)))))
        shape = list(v.shape)
        shape[batch_axis] *= jax.process_count()
        out[k] = jax.make_array_from_process_local_data(s, v, tuple(shape))
    return out


__all__ = [
    "LABEL_KEYS",
    "PACKED_KEYS",
    "TOKEN_KEYS",
    "batch_spec",
    "collate",
    "make_global_batch",
    "pack_text_batch",
]
