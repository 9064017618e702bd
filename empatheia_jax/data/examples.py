"""Example building: one decoded shard record -> one unpadded example of a stage (`ExampleBuilder`).

Shards hold raw text (docs/design.md "Shard record"), so the stage template, tokenisation, truncation to
`max_len`, loss masks, feature rows and generator targets all happen here, per example: a template change
needs no re-preparation. Training (the grain pipeline's workers), evaluation and chat all build through
this one class, so they tokenise identically; `batching` then pads examples to static-shape batches.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from empatheia_jax.data import templates as tpl
from empatheia_jax.data.pipeline_config import PipelineConfig


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


def _count_built(counters: PipelineCounters, dropped: int, text_cut: bool) -> None:
    """Count one built example and what its history lost to the token budget."""
    counters["examples"] += 1
    counters["dropped_utterances"] += dropped
    counters["text_truncated"] += int(text_cut)
    counters["truncated_examples"] += int(dropped > 0 or text_cut)


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


def _bos_ids(hf: Any, chat: tpl.ChatFormat) -> list[int]:
    """[bos] where the tokenizer itself starts a sequence with it and the chat prefix does not already
    hold it; else [] (no bos, or the chat template writes it)."""
    bos = hf.bos_token_id
    with_special = hf("a", add_special_tokens=True)["input_ids"]
    without = hf("a", add_special_tokens=False)["input_ids"]
    if (
        bos is not None
        and with_special[:1] == [bos]
        and without[:1] != [bos]
        and not chat.prefix.startswith(hf.bos_token or "\x00")
    ):
        return [int(bos)]
    return []


class ExampleBuilder:
    """Template + tokenise + truncate + masks + features for one record (+ its generator targets,
    `_example_targets`, which need no tokenizer).

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
        self.bos_ids: list[int] = _bos_ids(hf, self.chat)
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
        generator_targets = _example_targets(rec, self.cfg, counters, where)
        dropped, text_cut = fit.start, fit.text_cut
        _count_built(counters, dropped, text_cut)
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


# --------------------------------------------------------------------------------------------------
# Generator targets: read from the record and the config alone (no tokenizer)
# --------------------------------------------------------------------------------------------------


def _example_targets(
    rec: Mapping[str, Any], cfg: PipelineConfig, counters: PipelineCounters, where: str
) -> dict[str, Any]:
    """Every generator target of an example: content and style, and the unit ids the config asks for."""
    out = _generator_targets(rec.get("targets") or {}, cfg, counters)
    if cfg.speech_units is not None:
        out["speech_units"] = _speech_units(rec, cfg, where)
    if cfg.video_units:
        out["video_units"] = _video_units(rec, cfg, where)
    return out


def _generator_targets(
    targets: Mapping[str, Any], cfg: PipelineConfig, counters: PipelineCounters
) -> dict[str, Any]:
    """Content and style targets with a fixed layout: an absent target is empty (content) or zeros
    with mask 0 (style), so every example has the same keys whatever its record carries."""
    speech_content = _content(targets, "speech_content", cfg.max_speech_len, cfg.speech_content_dim, counters)
    video_content = _content(targets, "video_content", cfg.max_video_len, cfg.video_content_dim, counters)
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


def _speech_units(rec: Mapping[str, Any], cfg: PipelineConfig, where: str) -> np.ndarray:
    """The reply's content-unit ids, checked row for row against its speech_content target: a count that
    differs (another phonemizer version than the targets were exported with) would misalign every row."""
    units = np.asarray(cfg.speech_units(str(rec.get("response") or "")), np.int32).reshape(-1)
    rows = (rec.get("targets") or {}).get("speech_content")
    if rows is not None and len(units) != len(rows):
        raise ValueError(f"{where}: the reply has {len(units)} content units but its speech_content "
                         f"target {len(rows)} rows (phonemized differently from the exported targets?)")
    return units[: cfg.max_speech_len]


def _video_units(rec: Mapping[str, Any], cfg: PipelineConfig, where: str) -> np.ndarray:
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
    return units[: cfg.max_video_len].astype(np.int32)


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


# --------------------------------------------------------------------------------------------------
# Standalone building (evaluation, chat, tests)
# --------------------------------------------------------------------------------------------------


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
    dims = record_dims(record)
    key = (id(tokenizer), cfg, *dims)
    hit = _BUILDERS.get(key)
    if hit is None or hit[0] is not tokenizer:  # the cache holds the tokenizer, so ids are not reused
        builder = ExampleBuilder(tokenizer, cfg, audio_dim=dims[0], video_dim=dims[1])
        hit = _BUILDERS[key] = (tokenizer, builder)
        while len(_BUILDERS) > 8:
            _BUILDERS.popitem(last=False)
    return hit[1](record, record_index=record_index, counters=counters)


def record_dims(rec: Mapping[str, Any]) -> tuple[int, int]:
    """(audio_dim, video_dim) of a record's feature arrays; 0 for a modality without an [n, k, dim] array."""
    dims = []
    for key in ("audio_feats", "video_feats"):
        x = rec.get(key)
        shape = np.shape(x) if x is not None else ()
        dims.append(int(shape[-1]) if len(shape) == 3 else 0)
    return dims[0], dims[1]


__all__ = [
    "COUNTER_NAMES",
    "ExampleBuilder",
    "ExampleTooLongError",
    "PipelineCounters",
    "build_example",
    "record_dims",
]
