"""grain input pipeline: ArrayRecord shards -> static-shape stage batches for the model.

This module is the pipeline itself (record order, windows, grain workers, a checkpointable iterator,
`make_dataset`); each step it runs has its own module: `shard_reader` reads records, `examples` builds one
example per record (template, tokenisation, truncation, masks, targets) and `batching` pads examples to
static-shape batches, all under one `pipeline_config.PipelineConfig`. Shards hold raw text (docs/design.md
"Shard record"), so a template change needs no re-preparation. The batch layout is the contract with the
model and is written down in docs/design.md "## Batch layout and input pipeline".

Pipeline (one process of `process_count`):

    record order (global seeded shuffle per epoch, then this process's slice, epochs concatenated)
      -> windows of `window_batches * batch_size` record indices
      -> per window (in grain worker processes): read + decode, template + tokenise + truncate,
         sort by length, cut into batches, pad each batch to the smallest bucket length that fits
      -> mp_prefetch -> batches, with a checkpointable iterator (window, batch-in-window).

Length bucketing, not packing: every `<Aud>`/`<Vid>` placeholder has its own feature rows and every
example its own content/style targets and labels, so packing several dialogues into one row would need
per-segment feature tables, segment ids in attention and per-segment heads; sorting a window by
length and padding to a few fixed bucket lengths keeps shapes static (one compile per bucket) and
wastes little.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np
from absl import logging

from empatheia_jax.data import shard_format
from empatheia_jax.data.batching import batch_spec, collate
from empatheia_jax.data.examples import ExampleBuilder, ExampleTooLongError, PipelineCounters, record_dims
from empatheia_jax.data.pipeline_config import PipelineConfig
from empatheia_jax.data.shard_format import ShardRecordError
from empatheia_jax.data.shard_reader import ShardReader


class _RecordOrder(grain.MapDataset):
    """Record index of each slot of this process's stream: epoch e's global shuffle, sliced.

    Slot j of epoch e is record perm_e(process_index + j * process_count); with `even` every process
    gets floor(N / count) slots per epoch (training: equal step counts across hosts), otherwise
    ceil(N / count) with -1 (a filler slot) past the end (evaluation: nothing is lost and every host
    still runs the same number of steps).
    """

    def __init__(
        self, n: int, *, seed: int, shuffle: bool, index: int, count: int, even: bool, num_epochs: int | None
    ):
        super().__init__()
        if n <= 0:
            raise ValueError("the split has no records")
        self._n, self._seed, self._shuffle = n, int(seed) % 2**32, shuffle
        self._index, self._count = index, count
        self._per_epoch = n // count if even else -(-n // count)
        if self._per_epoch == 0:
            raise ValueError(f"{n} records cannot give every one of {count} processes an example")
        self._epochs = num_epochs
        self._len = sys.maxsize if num_epochs is None else self._per_epoch * num_epochs

    def __len__(self) -> int:
        return self._len

    def __str__(self) -> str:
        return f"_RecordOrder(n={self._n}, process={self._index}/{self._count})"

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        epoch, j = divmod(int(index), self._per_epoch)
        g = self._index + j * self._count
        if g >= self._n:
            return -1
        if not self._shuffle:
            return g
        seed = (self._seed + epoch) % 2**32
        return int(grain.experimental.index_shuffle(g, max_index=self._n - 1, seed=seed, rounds=4))


class _BuildWindow:
    """Window of record indices -> list of padded batches (+ counters); runs in grain workers."""

    def __init__(
        self,
        reader: ShardReader,
        builder: ExampleBuilder,
        *,
        batch_size: int,
        drop_remainder: bool,
        shuffle: bool,
        seed: int,
        process_index: int,
    ):
        self.reader, self.builder = reader, builder
        self.batch_size, self.drop_remainder = batch_size, drop_remainder
        self.shuffle, self.seed, self.process_index = shuffle, seed, process_index

    def __call__(self, window_index: int, slots: Sequence[int]) -> dict[str, Any]:
        B, cfg = self.batch_size, self.builder.cfg
        counters = PipelineCounters()
        slots = [int(s) for s in slots]
        n_batches = -(-len(slots) // B)
        if self.drop_remainder and len(slots) % B:
            n_batches = len(slots) // B
            counters["dropped_remainder"] += len(slots) - n_batches * B
            slots = slots[: n_batches * B]
        real = [s for s in slots if s >= 0]
        records = self.reader.read_located(real) if real else []
        examples = []
        for gi, (where, rec) in zip(real, records, strict=True):
            try:
                examples.append(self.builder(rec, record_index=gi, counters=counters, where=where))
            except ExampleTooLongError as e:
                logging.warning("skipping example: %s", e)
            except (KeyError, TypeError, ValueError) as e:
                raise ShardRecordError(f"{where}: cannot build a {cfg.stage} example: {e!r}") from e
        if cfg.window_batches > 1:
            examples.sort(key=lambda e: len(e["input_ids"]))
        chunks = [examples[i * B : (i + 1) * B] for i in range(n_batches)]
        if self.shuffle and n_batches > 1:
            rng = np.random.default_rng([self.seed % 2**32, self.process_index, window_index])
            chunks = [chunks[i] for i in rng.permutation(n_batches)]
        batches = []
        for chunk in chunks:
            counters["filler_rows"] += B - len(chunk)
            batches.append(
                collate(
                    chunk,
                    cfg,
                    B,
                    audio_dim=self.builder.audio_dim,
                    video_dim=self.builder.video_dim,
                    pad_id=self.builder.pad_id,
                )
            )
        return {"batches": batches, "counters": dict(counters)}


def _ensure_absl_flags_parsed() -> None:
    """grain reads its absl flags in the main process and in workers; unparsed flags raise there.

    A program started with `absl.app.run` has parsed them already; anything else (pytest, notebooks,
    plain scripts) gets the flag defaults.
    """
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def _init_grain_worker(worker_index: int, worker_count: int) -> None:
    """grain worker start-up hook (top-level, so it pickles)."""
    del worker_index, worker_count
    _ensure_absl_flags_parsed()


class InputPipeline:
    """Batches of one split and stage for this process; iterate for a checkpointable iterator.

    Attributes: `config`, `batch_size`, `audio_dim`, `video_dim`, `num_records` (the split),
    `num_batches` (this process's stream; None when repeating forever), `counters` (updated as
    windows arrive in this process), `pad_id`, `token_ids` (added token -> id).
    """

    def __init__(
        self,
        reader: ShardReader,
        builder: ExampleBuilder,
        *,
        batch_size: int,
        seed: int,
        shuffle: bool,
        num_epochs: int | None,
        drop_remainder: bool,
        process_index: int,
        process_count: int,
        worker_count: int,
        worker_buffer_size: int,
        read_threads: int,
        fingerprint: Mapping[str, Any],
    ):
        self.reader, self.builder, self.config = reader, builder, builder.cfg
        self.batch_size = batch_size
        self.audio_dim, self.video_dim = builder.audio_dim, builder.video_dim
        self.pad_id, self.token_ids = builder.pad_id, builder.token_ids
        self.num_records = len(reader)
        self.worker_count, self.worker_buffer_size, self.read_threads = (
            worker_count,
            worker_buffer_size,
            read_threads,
        )
        self.fingerprint = dict(fingerprint)
        self.counters = PipelineCounters()
        order = _RecordOrder(
            len(reader),
            seed=seed,
            shuffle=shuffle,
            index=process_index,
            count=process_count,
            even=drop_remainder,
            num_epochs=num_epochs,
        )
        window = self.config.window_batches * batch_size
        self.windows = order.batch(window, batch_fn=list).map_with_index(
            _BuildWindow(
                reader,
                builder,
                batch_size=batch_size,
                drop_remainder=drop_remainder,
                shuffle=shuffle,
                seed=seed,
                process_index=process_index,
            )
        )
        if num_epochs is None:
            self.num_batches = None
        else:
            slots = len(order)
            full, rest = divmod(slots, window)
            last = rest // batch_size if drop_remainder else -(-rest // batch_size)
            self.num_batches = full * self.config.window_batches + last

    def window_dataset(self, start_window: int = 0) -> grain.IterDataset:
        """grain IterDataset of built windows from `start_window` on, with multiprocess prefetch."""
        ds = self.windows[start_window:].to_iter_dataset(
            grain.ReadOptions(num_threads=self.read_threads, prefetch_buffer_size=max(2, self.read_threads))
        )
        if self.worker_count > 0:
            _ensure_absl_flags_parsed()
            # small arrays (ids, masks, labels) travel pickled; one shared-memory segment each costs more
            ds = grain.experimental.WithOptionsIterDataset(
                ds, grain.experimental.DatasetOptions(min_shm_size=1 << 16)
            )
            ds = ds.mp_prefetch(
                grain.MultiprocessingOptions(
                    num_workers=self.worker_count, per_worker_buffer_size=self.worker_buffer_size
                ),
                worker_init_fn=_init_grain_worker,
            )
        return ds

    def batch_spec(self, length: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return batch_spec(
            self.config, self.batch_size, length, audio_dim=self.audio_dim, video_dim=self.video_dim
        )

    def __iter__(self) -> PipelineIterator:
        return PipelineIterator(self)

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("the pipeline repeats forever (num_epochs=None)")
        return self.num_batches


class PipelineIterator(grain.DatasetIterator):
    """Batches with a small, worker-count-independent state: {window, batch_in_window, fingerprint}.

    `set_state` (also in a new process) rebuilds the grain pipeline from that window and skips the
    batches of it already delivered, so the next batches equal those of an uninterrupted run.
    """

    def __init__(self, pipeline: InputPipeline):
        super().__init__()
        self._p = pipeline
        self._inner: Any = None
        self._window = 0  # index of the window in `_buffer` (or the next one to fetch)
        self._buffer: list[dict[str, np.ndarray]] = []
        self._pos = 0
        self._open(0)

    def _open(self, window: int) -> None:
        if self._inner is not None:
            self._inner.close()
        self._inner = iter(self._p.window_dataset(window))
        self._window, self._buffer, self._pos = window, [], 0
        self._fetched = False

    def _fetch(self, *, count: bool = True) -> None:
        if self._fetched:
            self._window += 1
        out = next(self._inner)
        self._fetched = True
        self._buffer, self._pos = out["batches"], 0
        if count:
            self._p.counters.update(out["counters"])

    def __next__(self) -> dict[str, np.ndarray]:
        while self._pos >= len(self._buffer):
            self._fetch()
        b = self._buffer[self._pos]
        self._pos += 1
        return b

    def get_state(self) -> dict[str, Any]:
        window, pos = self._window, self._pos
        if self._fetched and pos >= len(self._buffer):
            window, pos = window + 1, 0
        fingerprint = json.dumps(self._p.fingerprint, sort_keys=True)
        return {"window": int(window), "batch_in_window": int(pos), "fingerprint": fingerprint}

    def set_state(self, state: Mapping[str, Any]) -> None:
        theirs = json.loads(state["fingerprint"])
        if theirs != self._p.fingerprint:
            diff = {k: (theirs.get(k), v) for k, v in self._p.fingerprint.items() if theirs.get(k) != v}
            raise ValueError(f"iterator state is from a different pipeline (saved, current): {diff}")
        self._open(int(state["window"]))
        pos = int(state["batch_in_window"])
        if pos:
            self._fetch(count=False)
            self._pos = pos

    def start_prefetch(self) -> None:
        self._inner.start_prefetch()

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()
            self._inner = None
        super().close()

    def __str__(self) -> str:
        return f"PipelineIterator(window={self._window}, batch_in_window={self._pos})"


def make_dataset(
    shards_dir: str | os.PathLike[str],
    split: str,
    stage: str,
    tokenizer: Any,
    *,
    batch_size: int,
    max_len: int = 1024,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = None,
    drop_remainder: bool | None = None,
    process_index: int | None = None,
    process_count: int | None = None,
    worker_count: int = 0,
    worker_buffer_size: int = 2,
    read_threads: int = 1,
    feature_dims: tuple[int, int] | None = None,
    **config: Any,
) -> InputPipeline:
    """The input pipeline of one split and stage for this process.

    tokenizer: HF tokenizer or a folder holding one (extended with the added tokens in place).
    shuffle: global, reshuffled every epoch (num_epochs=None repeats forever).
    drop_remainder (default: `shuffle`): training mode - every process gets floor(N/count) records per
        epoch and a final partial batch is dropped; otherwise short batches are completed with filler rows.
    worker_count: grain worker processes (0 = build in this process, in a background thread).
    feature_dims: (audio_dim, video_dim), default the manifest's; only a template without <Aud>/<Vid> may
        differ (its feature rows are all masked): evaluation passes the model's, so text-only shards feed a
        media model's program at its own shapes. A template with <Aud>/<Vid> on text-only records raises
        `shard_format.MissingMediaError` before any record is read.
    config: further `PipelineConfig` fields (n_signal, use_coe, max_aud, buckets, window_batches, ...).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    process_index, process_count = _this_process(process_index, process_count)
    drop_remainder = shuffle if drop_remainder is None else drop_remainder
    cfg = PipelineConfig(stage=stage, max_len=max_len, **config)
    reader, builder = _open_split(shards_dir, split, tokenizer, cfg, feature_dims)
    stream = {
        "batch_size": batch_size,
        "seed": seed,
        "shuffle": shuffle,
        "num_epochs": num_epochs,
        "drop_remainder": drop_remainder,
        "process_index": process_index,
        "process_count": process_count,
    }
    return InputPipeline(
        reader,
        builder,
        **stream,
        worker_count=worker_count,
        worker_buffer_size=worker_buffer_size,
        read_threads=read_threads,
        fingerprint=_fingerprint(split, reader, cfg, stream),
    )


def _open_split(
    shards_dir: str | os.PathLike[str],
    split: str,
    tokenizer: Any,
    cfg: PipelineConfig,
    feature_dims: tuple[int, int] | None,
) -> tuple[ShardReader, ExampleBuilder]:
    """The split's reader and an example builder at the batches' feature dims. A template with <Aud>/<Vid>
    on text-only records is refused from the manifest, before any record is read."""
    manifest = shard_format.load_manifest(shards_dir)
    needs_media = cfg.template_spec().has_media
    shard_format.check_media_for_template(
        manifest, shards_dir, split, stage=cfg.stage, needs_media=needs_media
    )
    reader = ShardReader.for_split(shards_dir, split)
    audio_dim, video_dim = _batch_feature_dims(
        manifest, reader, feature_dims, needs_media=needs_media, shards_dir=shards_dir, stage=cfg.stage
    )
    return reader, ExampleBuilder(tokenizer, cfg, audio_dim=audio_dim, video_dim=video_dim)


def _fingerprint(
    split: str, reader: ShardReader, cfg: PipelineConfig, stream: Mapping[str, Any]
) -> dict[str, Any]:
    """What an iterator state must agree with to resume: the split, the config and this process's stream
    (`stream`: batch size, seed, shuffle, epochs, drop_remainder, process index and count)."""
    return {
        "split": split,
        "num_records": len(reader),
        "config": json.dumps(_fingerprint_fields(cfg), sort_keys=True, default=_qualified_name),
        **stream,
    }


def _fingerprint_fields(cfg: PipelineConfig) -> dict[str, Any]:
    """The config as a fingerprint reads it: fields added later with their default left out, so an iterator
    state saved before they existed still resumes (`video_units`)."""
    fields = dataclasses.asdict(cfg)
    if not fields["video_units"]:
        del fields["video_units"]
    return fields


def _qualified_name(fn: Any) -> str:
    """A function in a pipeline fingerprint (`speech_units`) by its importable name: same in every process."""
    if not callable(fn):
        raise TypeError(f"cannot fingerprint {type(fn).__name__} {fn!r}")
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _this_process(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    """(index, count) of this process; jax is asked only when one is missing, so a caller that names
    both (tests, data tools) never initialises a jax backend."""
    if process_index is None or process_count is None:
        import jax

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    return process_index, process_count


def _batch_feature_dims(
    manifest: Mapping[str, Any],
    reader: ShardReader,
    feature_dims: tuple[int, int] | None,
    *,
    needs_media: bool,
    shards_dir: str | os.PathLike[str],
    stage: str,
) -> tuple[int, int]:
    """(audio_dim, video_dim) of the batches: the shards' (from the manifest, else the first record), or
    `feature_dims`, which may differ from them only where the template reads no features."""
    feats = manifest.get("features") or {}
    if feats.get("audio_dim") is not None and feats.get("video_dim") is not None:
        audio_dim, video_dim = int(feats["audio_dim"]), int(feats["video_dim"])
    else:
        audio_dim, video_dim = record_dims(reader[0]) if len(reader) else (0, 0)
    if feature_dims is not None:
        if needs_media and tuple(feature_dims) != (audio_dim, video_dim):
            raise ValueError(f"feature_dims={tuple(feature_dims)} but {shards_dir} holds features of dims "
                             f"{(audio_dim, video_dim)}, which the {stage} template reads")
        audio_dim, video_dim = (int(d) for d in feature_dims)
    return audio_dim, video_dim


__all__ = ["InputPipeline", "PipelineIterator", "make_dataset"]
