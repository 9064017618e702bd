"""grain input pipeline: ArrayRecord shards -> static-shape stage batches for the model.

Shards hold raw text (docs/design.md "Shard record"); the stage template, tokenisation, loss masks,
signal-token targets and feature padding all happen here, per example, so a template change needs no
re-preparation. The batch layout is the contract with the model and is written down in docs/design.md
"## Batch layout and input pipeline".

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

import bisect
import collections
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import grain
import numpy as np
from absl import logging

from empatheia_jax.data import shard_format
from empatheia_jax.data import templates as tpl
from empatheia_jax.data.shard_format import ShardRecordError

# --------------------------------------------------------------------------------------------------
# Errors and counters
# --------------------------------------------------------------------------------------------------


class ExampleTooLongError(ValueError):
    """The target (plus the minimal prompt) does not fit in `max_len`; the example cannot be built."""


COUNTER_NAMES: tuple[str, ...] = (
    "examples",  # examples built
    "truncated_examples",  # examples that lost history (utterances or text)
    "dropped_utterances",  # whole history utterances dropped, oldest first
    "text_truncated",  # examples whose last remaining utterance was cut from the left
    "skipped_target_too_long",  # examples skipped: the target alone does not fit
    "speech_content_truncated",  # speech content targets longer than max_speech_len
    "video_content_truncated",  # video content targets longer than max_video_len
    "filler_rows",  # batch rows with no example (all masks 0, labels -1)
    "dropped_remainder",  # record slots dropped to keep the last batch full (drop_remainder)
)


class PipelineCounters(collections.Counter):
    """Counts of truncations, skips and filler rows (names in `COUNTER_NAMES`)."""

    def as_dict(self) -> dict[str, int]:
        return {k: int(self.get(k, 0)) for k in COUNTER_NAMES}


# --------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """What an example and a batch look like. Shapes derived from it are static per bucket.

    max_aud/max_vid: feature rows per example (= placeholders; k per utterance, see docs/design.md);
    histories with more are cut oldest-first. max_speech_len/max_video_len: rows of the content targets.
    buckets: sequence lengths a batch is padded to (default: 128, 256, 512, ... below max_len, and
    max_len). window_batches: batches per length-sorting window (1 keeps record order inside a batch).
    include_target: False builds prompts only (generation); loss masks are then all zero.
    speech_units: the speech generator's content units of a reply text, one id per content row
    (`generators.registry.content_units_fn`), for a unit-aligned Content Synchronizer: examples then carry
    `speech_units` [max_speech_len]. A function, not a name, because the generators sit above this layer.
    video_units: examples carry `video_units` [max_video_len], the record's stored per-frame unit ids
    (targets kind `video_units`, written with a phoneme mouth), for a unit-aligned video block
    (`EmpatheiaConfig.cv_units`); a record without them, or with a count other than its video_content
    rows, is refused by name. Stored, not computed from the text as speech units are: a frame's unit
    depends on the durations the gold clip was timed with.
    """

    stage: str = "overall"
    max_len: int = 1024
    n_signal: int = 16
    use_coe: bool = True
    media_input: bool = True
    pipeline_baseline: bool = False
    chat_format: str = "auto"
    max_aud: int = 32
    max_vid: int = 32
    max_speech_len: int = 256
    max_video_len: int = 256
    speech_content_dim: int = 1024
    video_content_dim: int = 256
    style_dim: int = 256
    buckets: tuple[int, ...] | None = None
    window_batches: int = 8
    include_target: bool = True
    speech_units: Callable[[str], np.ndarray] | None = None
    video_units: bool = False

    def __post_init__(self) -> None:
        self.template_spec()  # validates stage and flags
        if self.max_len < 16:
            raise ValueError(f"max_len must be >= 16, got {self.max_len}")
        if self.window_batches < 1:
            raise ValueError(f"window_batches must be >= 1, got {self.window_batches}")
        if self.buckets is not None:
            b = tuple(int(x) for x in self.buckets)
            if not b or list(b) != sorted(set(b)) or b[-1] != self.max_len or b[0] < 1:
                raise ValueError(f"buckets must be increasing and end at max_len={self.max_len}, got {b}")
            object.__setattr__(self, "buckets", b)

    def template_spec(self) -> tpl.TemplateSpec:
        return tpl.TemplateSpec(
            stage=self.stage,
            use_coe=self.use_coe,
            media_input=self.media_input,
            pipeline_baseline=self.pipeline_baseline,
            n_signal=self.n_signal,
        )

    def bucket_lengths(self) -> tuple[int, ...]:
        """Sequence lengths batches are padded to, ascending, the last one `max_len`."""
        if self.buckets is not None:
            return self.buckets
        out, b = [], 128
        while b < self.max_len:
            out.append(b)
            b *= 2
        return (*out, self.max_len)

    def bucket_for(self, length: int) -> int:
        buckets = self.bucket_lengths()
        i = bisect.bisect_left(buckets, length)
        if i == len(buckets):
            raise ValueError(f"length {length} exceeds max_len {self.max_len}")
        return buckets[i]


# --------------------------------------------------------------------------------------------------
# Shards
# --------------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------------
# Example building
# --------------------------------------------------------------------------------------------------


def _start(offset: tuple[int, int]) -> int:
    return offset[0]


def _end(offset: tuple[int, int]) -> int:
    return offset[1]


def _labels(rec: Mapping[str, Any]) -> tuple[int, int, int, int]:
    lab = rec.get("labels") or {}

    def get(k: str) -> int:
        v = lab.get(k)
        return -1 if v is None else int(v)

    return get("emotion"), get("age"), get("gender"), get("timbre")


def _features(rec: Mapping[str, Any], key: str, n_hist: int) -> np.ndarray:
    x = rec.get(key)
    if x is None:
        raise ValueError(f"record has no {key!r} (needed by a template with <Aud>/<Vid> placeholders)")
    x = np.asarray(x, np.float32)
    if x.ndim != 3 or x.shape[0] != n_hist or x.shape[1] < 1:
        raise ValueError(f"{key} has shape {x.shape}; expected [n_history={n_hist}, k>=1, dim]")
    return x


class _Fit(NamedTuple):
    """The tokenised prompt + target that fits `max_len` (or the shortest one, when none does)."""

    prompt: str
    enc: Any  # tokenizers.Encoding of prompt + target text
    n: int  # tokens with bos and eos
    start: int  # first kept history utterance
    text_cut: bool  # the last utterance lost text from the left


def _lines_to_drop(lines: Sequence[str], starts: Sequence[int], pos: int, over: int) -> int:
    """How many of `lines` (oldest first, starting at character `pos`) to drop to lose `over` tokens.

    Counts the tokens starting inside each line instead of re-tokenising per candidate cut, so one
    tokenizer call per round suffices (the next round checks the estimate)."""
    removed, drop = 0, 0
    for line in lines:
        end = pos + len(line)
        removed += bisect.bisect_left(starts, end) - bisect.bisect_left(starts, pos)
        pos, drop = end, drop + 1
        if removed >= over:
            break
    return drop


def _cut_text_left(text: str, starts: Sequence[int], lo: int, over: int) -> str:
    """`text` (at character `lo` of the encoded string) without its first `over` tokens; the end of the
    utterance is kept because it is what the response answers."""
    hi = lo + len(text)
    inside = starts[bisect.bisect_left(starts, lo) : bisect.bisect_left(starts, hi)]
    return text[inside[over] - lo :].lstrip() if len(inside) > over else ""


class ExampleBuilder:
    """Template + tokenise + truncate + masks + features for one record.

    Picklable (grain workers hold a copy): only the `tokenizers` backend and precomputed strings/ids
    are kept, not the transformers wrapper. The same object builds prompts for generation
    (`include_target=False`) so training and inference tokenise identically.
    """

    def __init__(self, tokenizer: Any, cfg: PipelineConfig, *, audio_dim: int, video_dim: int):
        hf = tpl.load_tokenizer(tokenizer)
        self.cfg = cfg
        self.spec = cfg.template_spec()
        self.audio_dim, self.video_dim = int(audio_dim), int(video_dim)
        self.token_ids = tpl.extend_tokenizer(hf, cfg.n_signal)
        self.aud_id = self.token_ids[tpl.AUD_PLACEHOLDER]
        self.vid_id = self.token_ids[tpl.VID_PLACEHOLDER]
        self.chat = tpl.chat_format(hf, cfg.chat_format)
        self.backend = hf.backend_tokenizer
        if hf.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token; targets end with eos")
        self.eos_id = int(hf.eos_token_id)
        self.eos_token = hf.eos_token
        self.pad_id = int(hf.pad_token_id) if hf.pad_token_id is not None else self.eos_id
        bos = hf.bos_token_id
        with_special = hf("a", add_special_tokens=True)["input_ids"]
        without = hf("a", add_special_tokens=False)["input_ids"]
        self.bos_ids: list[int] = []
        if (
            bos is not None
            and with_special[:1] == [bos]
            and without[:1] != [bos]
            and not self.chat.prefix.startswith(hf.bos_token or "\x00")
        ):
            self.bos_ids = [int(bos)]
        added = set(tpl.added_tokens(cfg.n_signal))
        self.forbidden = tuple(
            sorted((t for t in hf.all_special_tokens if t and t not in added), key=len, reverse=True)
        )

    # -- text ---------------------------------------------------------------------------------------

    def _clean(self, text: Any) -> str:
        return tpl.clean_text(text, self.forbidden)

    def target(self, rec: Mapping[str, Any]) -> tpl.Target:
        """The stage target for `rec` (text without eos)."""
        return tpl.format_target(
            self.spec,
            coe={k: self._clean(v) for k, v in (rec.get("coe") or {}).items()},
            response=self._clean(rec.get("response")),
            listener_profile=rec.get("listener_profile") or {},
        )

    def __call__(
        self,
        rec: Mapping[str, Any],
        *,
        record_index: int = -1,
        counters: PipelineCounters | None = None,
        where: str = "record",
    ) -> dict[str, Any]:
        """One unpadded example (token arrays of its own length n; see `collate` for the batch)."""
        counters = counters if counters is not None else PipelineCounters()
        hist = list(rec.get("history") or [])
        roles = [u["role"] for u in hist]
        texts = [self._clean(u.get("utterance")) for u in hist]
        aud, vid, start = self._history_features(rec, len(hist))
        target = self.target(rec) if self.cfg.include_target else None
        fit = self._fit_to_max_len(roles, texts, start, aud, vid, target)
        if fit.n > self.cfg.max_len:
            counters["skipped_target_too_long"] += 1
            raise ExampleTooLongError(
                f"{where}: {fit.n} tokens with the shortest prompt > max_len {self.cfg.max_len}"
            )
        ids = self._input_ids(fit, with_eos=target is not None)
        loss_mask, response_mask = self._masks(fit, target)
        target_ids = np.full(fit.n, self.pad_id, np.int32)
        target_ids[:-1] = ids[1:]
        aud_rows, vid_rows = self._feature_rows(ids, aud, vid, fit.start)
        generator_targets = self._generator_targets(rec.get("targets") or {}, counters)
        if self.cfg.speech_units is not None:
            generator_targets["speech_units"] = self._speech_units(rec, where)
        if self.cfg.video_units:
            generator_targets["video_units"] = self._video_units(rec, where)
        dropped, text_cut = fit.start, fit.text_cut
        counters["examples"] += 1
        counters["dropped_utterances"] += dropped
        counters["text_truncated"] += int(text_cut)
        counters["truncated_examples"] += int(dropped > 0 or text_cut)
        emotion, age, gender, timbre = _labels(rec)
        return {
            "input_ids": ids,
            "target_ids": target_ids,
            "loss_mask": loss_mask,
            "response_mask": response_mask,
            "aud_feats": aud_rows,
            "vid_feats": vid_rows,
            **generator_targets,
            "emotion": emotion,
            "age": age,
            "gender": gender,
            "timbre": timbre,
            "record_index": int(record_index),
            "dropped_utterances": dropped,
            "text_truncated": text_cut,
        }

    # -- steps of __call__ --------------------------------------------------------------------------

    def _history_features(
        self, rec: Mapping[str, Any], n_hist: int
    ) -> tuple[np.ndarray | None, np.ndarray | None, int]:
        """(audio, video, first kept utterance): the feature budget, not the token budget, may already
        cut the oldest utterances, since every kept utterance needs its k rows of both modalities."""
        if not (self.spec.has_media and n_hist):
            return None, None, 0
        cfg = self.cfg
        aud = _features(rec, "audio_feats", n_hist)
        vid = _features(rec, "video_feats", n_hist)
        k_a, k_v = aud.shape[1], vid.shape[1]
        keep = min(cfg.max_aud // k_a, cfg.max_vid // k_v)
        if keep < 1:
            raise ValueError(f"max_aud={cfg.max_aud}/max_vid={cfg.max_vid} < k={k_a}/{k_v} per utterance")
        return aud, vid, max(0, n_hist - keep)

    def _fit_to_max_len(
        self,
        roles: Sequence[str],
        texts: Sequence[str],
        start: int,
        aud: np.ndarray | None,
        vid: np.ndarray | None,
        target: tpl.Target | None,
    ) -> _Fit:
        """Tokenise prompt + target, shortening the history until it fits `max_len`.

        Whole utterances go first, oldest first, then the last utterance's text from the left (its end
        is what the response answers); the target is never cut. Every round re-tokenises the shortened
        prompt, so the fit is decided on real token counts, not estimates. A result with `n > max_len`
        means even the shortest prompt reachable does not fit.
        """
        k_a, k_v = (aud.shape[1], vid.shape[1]) if aud is not None else (1, 1)
        tgt_text = self.chat.target_prefix + target.text if target is not None else ""
        n_eos = int(target is not None)
        head = self.chat.prefix + tpl.prompt_head(self.spec)
        tail = tpl.PROMPT_TAIL + self.chat.suffix
        n_hist = len(texts)
        last_text = texts[-1] if n_hist else ""
        text_cut = False
        for _ in range(n_hist + 16):
            lines = [
                tpl.history_line(
                    roles[i], last_text if i == n_hist - 1 else texts[i], self.spec, k_aud=k_a, k_vid=k_v
                )
                for i in range(start, n_hist)
            ]
            prompt = head + "".join(lines) + tail
            enc = self.backend.encode(prompt + tgt_text, add_special_tokens=False)
            n = len(self.bos_ids) + len(enc.ids) + n_eos
            if n <= self.cfg.max_len:
                break
            over = n - self.cfg.max_len
            starts = [o[0] for o in enc.offsets]
            if start < n_hist - 1:
                start += _lines_to_drop(lines[:-1], starts, len(head), over)
                continue
            if self.spec.has_text and last_text:
                lo = len(head) + len(f"  {tpl.role_label(roles[-1])}:")
                last_text = _cut_text_left(last_text, starts, lo, over)
                text_cut = True
                continue
            break
        return _Fit(prompt=prompt, enc=enc, n=n, start=start, text_cut=text_cut)

    def _input_ids(self, fit: _Fit, *, with_eos: bool) -> np.ndarray:
        nb = len(self.bos_ids)
        ids = np.empty(fit.n, np.int32)
        ids[:nb] = self.bos_ids
        ids[nb : nb + len(fit.enc.ids)] = fit.enc.ids
        if with_eos:
            ids[-1] = self.eos_id
        return ids

    def _masks(self, fit: _Fit, target: tpl.Target | None) -> tuple[np.ndarray, np.ndarray]:
        """(loss_mask, response_mask) from character offsets, so masks follow the text exactly whatever
        the tokenizer merges across the prompt/target boundary."""
        n, nb = fit.n, len(self.bos_ids)
        # Offsets are non-decreasing, so the target is a suffix of the tokens and the response a range:
        # binary searches instead of a per-token pass.
        offsets = fit.enc.offsets
        loss_mask = np.zeros(n, np.int32)
        response_mask = np.zeros(n, np.int32)
        if target is None:
            return loss_mask, response_mask
        t0 = len(fit.prompt)
        # a token holding any target character is a target token (end offset past the prompt)
        first = nb + bisect.bisect_right(offsets, t0, key=_end)
        loss_mask[max(first - 1, 0) : n - 1] = 1  # aligned with target_ids: position t predicts token t+1
        if target.response_span is not None:
            lo = t0 + len(self.chat.target_prefix) + target.response_span[0]
            hi = t0 + len(self.chat.target_prefix) + target.response_span[1]
            r0 = bisect.bisect_right(offsets, lo, key=_end)
            r1 = bisect.bisect_left(offsets, hi, key=_start)
            response_mask[nb + r0 : nb + r1] = 1
        return loss_mask, response_mask

    def _feature_rows(
        self, ids: np.ndarray, aud: np.ndarray | None, vid: np.ndarray | None, start: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Feature rows of the kept utterances, checked against the placeholders actually in `ids`: the
        model scatters rows into placeholder positions, and a count mismatch would misalign them silently."""
        d_a, d_v = self.audio_dim, self.video_dim
        if aud is None or vid is None:
            return np.zeros((0, d_a), np.float32), np.zeros((0, d_v), np.float32)
        aud_rows = aud[start:].reshape(-1, aud.shape[-1])
        vid_rows = vid[start:].reshape(-1, vid.shape[-1])
        if aud_rows.shape[1] != d_a or vid_rows.shape[1] != d_v:
            got = f"{aud_rows.shape[1]}/{vid_rows.shape[1]}"
            raise ValueError(f"feature dims {got} differ from the split's {d_a}/{d_v}")
        n_aud, n_vid = int(np.sum(ids == self.aud_id)), int(np.sum(ids == self.vid_id))
        if n_aud != len(aud_rows) or n_vid != len(vid_rows):
            raise ValueError(
                f"{n_aud} <Aud> / {n_vid} <Vid> tokens but {len(aud_rows)} / {len(vid_rows)} feature rows"
            )
        return aud_rows, vid_rows

    def _generator_targets(self, targets: Mapping[str, Any], counters: PipelineCounters) -> dict[str, Any]:
        """Content and style targets with a fixed layout: an absent target is empty (content) or zeros
        with mask 0 (style), so every example has the same keys whatever its record carries."""
        cfg = self.cfg
        speech_content = self._content(
            targets, "speech_content", cfg.max_speech_len, cfg.speech_content_dim, counters
        )
        video_content = self._content(
            targets, "video_content", cfg.max_video_len, cfg.video_content_dim, counters
        )
        styles, style_mask = [], np.zeros(2, np.int32)
        for j, key in enumerate(("speech_style", "video_style")):
            s = targets.get(key)
            if s is None:
                styles.append(np.zeros(cfg.style_dim, np.float32))
            else:
                s = np.asarray(s, np.float32).reshape(-1)
                if s.shape[0] != cfg.style_dim:
                    raise ValueError(f"{key} has {s.shape[0]} dims, expected {cfg.style_dim}")
                styles.append(s)
                style_mask[j] = 1
        return {
            "speech_content": speech_content,
            "video_content": video_content,
            "speech_style": styles[0],
            "video_style": styles[1],
            "style_mask": style_mask,
        }

    def _speech_units(self, rec: Mapping[str, Any], where: str) -> np.ndarray:
        """The reply's content-unit ids, checked row for row against its speech_content target: a count that
        differs (another phonemizer version than the targets were exported with) would misalign every row."""
        units = np.asarray(self.cfg.speech_units(str(rec.get("response") or "")), np.int32).reshape(-1)
        rows = (rec.get("targets") or {}).get("speech_content")
        if rows is not None and len(units) != len(rows):
            raise ValueError(f"{where}: the reply has {len(units)} content units but its speech_content "
                             f"target {len(rows)} rows (phonemized differently from the exported targets?)")
        return units[: self.cfg.max_speech_len]

    def _video_units(self, rec: Mapping[str, Any], where: str) -> np.ndarray:
        """The record's stored per-frame unit ids [T] (int32), checked against its video_content rows: a
        unit-aligned video block told nothing, or told another clip's timing, would render wrong mouths."""
        targets = rec.get("targets") or {}
        units, rows = targets.get("video_units"), targets.get("video_content")
        if units is None and rows is None:  # no video target (a text-only record): no frame to align
            return np.zeros(0, np.int32)
        if units is None:
            raise ValueError(f"{where}: the video block is unit-aligned (cv_units) but the record has no "
                             "video_units (export the video targets with converters.face_targets "
                             "--mouth phonemes)")
        units = np.asarray(units, np.float32).reshape(-1)
        if rows is None or len(units) != len(rows):
            got = "no" if rows is None else len(rows)
            raise ValueError(f"{where}: {len(units)} video_units but {got} video_content rows (exported "
                             "separately?); every frame needs its unit")
        if not (np.all(units == np.round(units)) and np.all(units >= 0)):
            raise ValueError(f"{where}: video_units must be whole unit ids >= 0")
        return units[: self.cfg.max_video_len].astype(np.int32)

    @staticmethod
    def _content(
        targets: Mapping[str, Any], key: str, max_rows: int, dim: int, counters: PipelineCounters
    ) -> np.ndarray:
        x = targets.get(key)
        if x is None:
            return np.zeros((0, dim), np.float32)
        x = np.asarray(x, np.float32)
        if x.ndim != 2 or x.shape[1] != dim:
            raise ValueError(f"{key} has shape {x.shape}; expected [T, {dim}]")
        if x.shape[0] > max_rows:
            counters[f"{key}_truncated"] += 1
            x = x[:max_rows]
        return x


_BUILDERS: collections.OrderedDict[tuple[Any, ...], tuple[Any, ExampleBuilder]] = collections.OrderedDict()


def build_example(
    record: Mapping[str, Any],
    stage: str,
    tokenizer: Any,
    cfg: PipelineConfig | None = None,
    *,
    counters: PipelineCounters | None = None,
    record_index: int = -1,
) -> dict[str, Any]:
    """One unpadded example of `stage` from a decoded shard record (standalone use: eval, generation).

    `tokenizer` is extended with the added tokens in place. Raises ExampleTooLongError when even the
    shortest prompt does not fit `cfg.max_len`.
    """
    cfg = dataclasses.replace(cfg or PipelineConfig(stage=stage), stage=stage)
    dims = _record_dims(record)
    key = (id(tokenizer), cfg, *dims)
    hit = _BUILDERS.get(key)
    if hit is None or hit[0] is not tokenizer:  # the cache holds the tokenizer, so ids are not reused
        builder = ExampleBuilder(tokenizer, cfg, audio_dim=dims[0], video_dim=dims[1])
        hit = _BUILDERS[key] = (tokenizer, builder)
        while len(_BUILDERS) > 8:
            _BUILDERS.popitem(last=False)
    return hit[1](record, record_index=record_index, counters=counters)


def _record_dims(rec: Mapping[str, Any]) -> tuple[int, int]:
    dims = []
    for key in ("audio_feats", "video_feats"):
        x = rec.get(key)
        shape = np.shape(x) if x is not None else ()
        dims.append(int(shape[-1]) if len(shape) == 3 else 0)
    return dims[0], dims[1]


# --------------------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------------
# grain datasets
# --------------------------------------------------------------------------------------------------


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
    shuffle/seed: global shuffle, reshuffled every epoch; num_epochs=None repeats forever.
    drop_remainder (default: `shuffle`): training mode - every process gets floor(N/count) records per
        epoch and a final partial batch is dropped; otherwise nothing is dropped and short batches are
        completed with filler rows.
    process_index/process_count: default `jax.process_index()/process_count()`.
    worker_count: grain worker processes (0 = build in this process, in a background thread).
    feature_dims: (audio_dim, video_dim) of the batches' feature arrays, default the manifest's. Only a
        template without <Aud>/<Vid> may differ from the shards (its feature rows are all masked): evaluation
        passes the model's, so text-only shards (dims 0) feed a media model's program at its own shapes.
    config: further `PipelineConfig` fields (n_signal, use_coe, max_aud, buckets, window_batches, ...).

    A template with <Aud>/<Vid> on a split with text-only records raises `shard_format.MissingMediaError`
    (naming the folder, split and stage) before any record is read.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    process_index, process_count = _this_process(process_index, process_count)
    drop_remainder = shuffle if drop_remainder is None else drop_remainder
    cfg = PipelineConfig(stage=stage, max_len=max_len, **config)
    manifest = shard_format.load_manifest(shards_dir)
    needs_media = cfg.template_spec().has_media
    shard_format.check_media_for_template(manifest, shards_dir, split, stage=stage, needs_media=needs_media)
    reader = ShardReader.for_split(shards_dir, split)
    audio_dim, video_dim = _batch_feature_dims(
        manifest, reader, feature_dims, needs_media=needs_media, shards_dir=shards_dir, stage=stage
    )
    builder = ExampleBuilder(tokenizer, cfg, audio_dim=audio_dim, video_dim=video_dim)
    fingerprint = {
        "split": split,
        "num_records": len(reader),
        "config": json.dumps(_fingerprint_fields(cfg), sort_keys=True, default=_qualified_name),
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
        batch_size=batch_size,
        seed=seed,
        shuffle=shuffle,
        num_epochs=num_epochs,
        drop_remainder=drop_remainder,
        process_index=process_index,
        process_count=process_count,
        worker_count=worker_count,
        worker_buffer_size=worker_buffer_size,
        read_threads=read_threads,
        fingerprint=fingerprint,
    )


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
        audio_dim, video_dim = _record_dims(reader[0]) if len(reader) else (0, 0)
    if feature_dims is not None:
        if needs_media and tuple(feature_dims) != (audio_dim, video_dim):
            raise ValueError(f"feature_dims={tuple(feature_dims)} but {shards_dir} holds features of dims "
                             f"{(audio_dim, video_dim)}, which the {stage} template reads")
        audio_dim, video_dim = (int(d) for d in feature_dims)
    return audio_dim, video_dim


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




_MODEL_FIELDS = ("n_signal", "max_speech_len", "max_video_len", "speech_content_dim", "video_content_dim",
                 "style_dim")


def pipeline_config_fields(
    cfg: Any, stage: Any, overrides: Mapping[str, Any] | None = None,
    speech_units: Callable[[str], np.ndarray] | None = None,
) -> dict[str, Any]:
    """`PipelineConfig` fields (without stage/max_len) that agree with the model; `overrides` may set the
    others (max_aud, max_vid, buckets, chat_format) but not contradict the model. `speech_units`: the
    speech generator's unit function for a unit-aligned CS (`generators.registry.units_for`);
    `video_units` follows the model (`cv_units` > 0: the batch carries the stored frame units).

    `cfg` is an `EmpatheiaConfig` and `stage` a `stages.Stage`, typed Any: the data layer sits below both."""
    fields = {k: v for k, v in stage.pipeline_fields().items() if k != "stage"}
    fields.update({k: getattr(cfg, k) for k in _MODEL_FIELDS})
    if speech_units is not None:
        fields["speech_units"] = speech_units
    if getattr(cfg, "cv_units", 0):
        fields["video_units"] = True
    for k, v in (overrides or {}).items():
        if k in ("stage", "max_len", "include_target", "window_batches"):
            raise ValueError(f"pipeline_overrides may not set {k!r} (evaluate sets it)")
        if k in fields and fields[k] != v:
            raise ValueError(f"pipeline_overrides[{k!r}]={v!r} contradicts the model ({fields[k]!r})")
        fields[k] = v
    return fields


__all__ = [
    "COUNTER_NAMES",
    "ExampleBuilder",
    "ExampleTooLongError",
    "InputPipeline",
    "PipelineConfig",
    "PipelineCounters",
    "PipelineIterator",
    "ShardRecordError",
    "ShardReader",
    "batch_spec",
    "build_example",
    "collate",
    "make_dataset",
    "make_global_batch",
]
