"""The chat prompt: token ids and the feature rows of its media placeholders, exactly as training built them.

Why it is built this way:

- The prompt is the model's evaluation template (overall stage, or the Pipeline baseline), tokenised by the
  same `examples.ExampleBuilder` attributes training used, so chat and training read identical token
  ids (tested against `build_example`).
- An utterance with both media gets the template's `<Aud> <Vid>.`; without media its line is plain text
  (no placeholder without a feature); with only one of them only that placeholder is written (`<Aud>.` /
  `<Vid>.`), which training never showed, and the prompt's notes say so.
- Features come from the same encoder that prepared the training shards (`encoder_from_manifest`), run on
  the files; features of another encoder would not be the ones the model learnt to read.
- The oldest utterances are dropped while the prompt and the reply's budget exceed `max_len`; the latest
  utterance is never cut (`PromptTooLongError` when it alone does not fit).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from empatheia_jax.data import encoders as enc_lib
from empatheia_jax.data import shard_format
from empatheia_jax.data import templates as tpl
from empatheia_jax.data.examples import ExampleBuilder
from empatheia_jax.data.pipeline_config import PipelineConfig, pipeline_config_fields
from empatheia_jax.models.empatheia_config import EmpatheiaConfig
from empatheia_jax.serve.history import ChatInputError
from empatheia_jax.train import stages

_Features = Sequence[tuple[np.ndarray | None, np.ndarray | None]]  # (audio | None, video | None) each


class EncoderManifestError(ValueError):
    """A manifest "encoder" entry that cannot rebuild the training shards' encoder (malformed, or today's
    encoder code would compute other features); chat features would not match training."""


class PromptTooLongError(ChatInputError):
    """The latest utterance alone does not fit: `prompt_tokens` + `reserve` (reply budget) > `max_len`."""

    def __init__(self, message: str, *, prompt_tokens: int, reserve: int, max_len: int):
        super().__init__(message)
        self.prompt_tokens, self.reserve, self.max_len = prompt_tokens, reserve, max_len


def encoder_from_manifest(source: str | os.PathLike | Mapping[str, Any], **overrides: Any) -> enc_lib.Encoder:
    """The encoder that prepared a shard folder, rebuilt from its manifest's {"name", "config"} entry.

    `source`: a shards folder, a manifest dict, or the manifest's "encoder" entry. Constructor arguments are
    recovered from the stored config (e.g. lite's n_mels/grid/mouth_box, hubert's path and layer);
    `overrides` replace some (e.g. `hubert_path=` when the weights moved). The rebuilt encoder's config must
    equal the stored one (paths excepted), so chat features are computed exactly as the training features.
    Anything else is an `EncoderManifestError`.
    """
    if isinstance(source, str | os.PathLike):
        source = shard_format.load_manifest(source)
    entry = source.get("encoder", source) if isinstance(source, Mapping) else source
    if not isinstance(entry, Mapping) or "name" not in entry:
        raise EncoderManifestError(f"not a manifest encoder entry: {entry!r}")
    stored = dict(entry.get("config") or {})
    name, kwargs = enc_lib.kwargs_from_config(entry)
    kwargs.update(overrides)
    try:
        encoder = enc_lib.get_encoder(name, **kwargs)
    except (KeyError, ValueError) as e:  # an unknown encoder name, or a one-modality one
        raise EncoderManifestError(f"cannot rebuild encoder {name!r} from the manifest entry: {e}") from e
    diff = enc_lib.config_diff(stored, encoder.config()) if stored else []
    if diff:
        raise EncoderManifestError(f"encoder {name!r} rebuilt from the manifest differs from the one that "
                                   f"prepared the shards in {diff}; features would not match training")
    return encoder


def _encode(encoder: enc_lib.Encoder, kind: str, path: str | os.PathLike, expected_dim: int) -> np.ndarray:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{kind} file {p} does not exist")
    try:
        x = encoder.encode_audio(p) if kind == "audio" else encoder.encode_video(p)
    except Exception as e:
        raise ChatInputError(f"cannot read {kind} file {p} with encoder {encoder.name!r}: {e}") from e
    x = np.asarray(x, np.float32)
    if x.ndim != 2 or x.shape[1] != expected_dim:
        raise ChatInputError(f"{kind} file {p}: encoder {encoder.name!r} gave features of shape {x.shape}; "
                             f"the model expects [k, {expected_dim}] (use the training shards' encoder)")
    return x


@dataclasses.dataclass
class ChatPrompt:
    """Token ids of a chat prompt and the feature rows of its placeholders (row i = i-th <Aud> / <Vid>)."""

    ids: list[int]
    aud_feats: np.ndarray  # [n_aud, d_a]
    vid_feats: np.ndarray  # [n_vid, d_v]
    dropped_utterances: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)


def build_prompt(
    model_cfg: EmpatheiaConfig,
    tokenizer: Any,
    utterances: Sequence[Mapping[str, Any]],
    *,
    encoder: enc_lib.Encoder | None = None,
    features: _Features | None = None,
    max_len: int = 1024,
    reserve: int = 0,
    chat_format: str = "auto",
) -> ChatPrompt:
    """The prompt for `utterances` (oldest first; dicts with role, utterance, audio, video).

    Features come from `features` ((audio [k, d_a] | None, video [k, d_v] | None) per utterance) or from
    `encoder` run on the media paths. The oldest utterances are dropped while prompt + `reserve` tokens
    exceed `max_len`; the latest one is never cut.
    """
    builder = _example_builder(model_cfg, tokenizer, max_len, chat_format)
    spec = builder.spec
    notes: list[str] = []
    if features is None:
        features = _encode_media(model_cfg, encoder if spec.has_media else None, utterances)
    if not spec.has_media and any(u.get("audio") or u.get("video") for u in utterances):
        notes.append("this model takes no speech/video input (w/o-media ablation or Pipeline baseline): "
                     "media ignored")
    lines = _utterance_lines(builder, utterances, features, notes)
    ids, start = _fit(builder, lines, max_len=max_len, reserve=reserve)
    if start:
        notes.append(f"history too long for max_len={max_len}: dropped the {start} oldest utterance(s)")
    aud_feats, vid_feats = _placeholder_rows(model_cfg, features[start:], spec.has_media)
    return ChatPrompt(ids=ids, aud_feats=aud_feats, vid_feats=vid_feats, dropped_utterances=start,
                      notes=notes)


def _example_builder(model_cfg: EmpatheiaConfig, tokenizer: Any, max_len: int, chat_format: str
                     ) -> ExampleBuilder:
    """Training's example builder for the model's evaluation stage: its template, tokeniser set-up and chat
    format, so the prompt's ids are the ones training read."""
    stage = stages.eval_stage(model_cfg)
    pcfg = PipelineConfig(stage=stage.template_stage, max_len=max(max_len, 16), include_target=False,
                          chat_format=chat_format,
                          **pipeline_config_fields(model_cfg, stage))
    return ExampleBuilder(tokenizer, pcfg, audio_dim=model_cfg.audio_dim, video_dim=model_cfg.video_dim)


def _encode_media(model_cfg: EmpatheiaConfig, encoder: enc_lib.Encoder | None,
                  utterances: Sequence[Mapping[str, Any]]) -> _Features:
    """(audio features | None, video features | None) per utterance, `encoder` run on its files; none
    without an encoder (a model that reads no media is given none)."""
    features = []
    for u in utterances:
        use = encoder is not None
        a = _encode(encoder, "audio", u["audio"], model_cfg.audio_dim) if use and u.get("audio") else None
        v = _encode(encoder, "video", u["video"], model_cfg.video_dim) if use and u.get("video") else None
        features.append((a, v))
    return features


def _utterance_lines(builder: ExampleBuilder, utterances: Sequence[Mapping[str, Any]],
                     features: _Features, notes: list[str]) -> list[str]:
    """One template line per utterance: with both media `<Aud>... <Vid>...`, with one only its placeholders
    (and a note: training always had both), without media the plain text line."""
    spec = builder.spec
    text_only = dataclasses.replace(spec, media_input=False)  # the same line without placeholders
    lines = []
    partial = False
    for u, (a, v) in zip(utterances, features, strict=True):
        text = tpl.clean_text(u.get("utterance"), builder.forbidden)
        if spec.has_media and a is not None and v is not None:
            lines.append(tpl.history_line(u["role"], text, spec, k_aud=len(a), k_vid=len(v)))
            continue
        line = tpl.history_line(u["role"], text, text_only)
        if spec.has_media and (a is not None or v is not None):
            one = tpl.AUD_PLACEHOLDER * len(a) if a is not None else tpl.VID_PLACEHOLDER * len(v)
            line = line[:-1] + one + ".\n"
            partial = True
        lines.append(line)
    if partial:
        notes.append("an utterance has only one of speech/video: only its placeholder was written (training "
                     "always had both)")
    return lines


def _fit(builder: ExampleBuilder, lines: Sequence[str], *, max_len: int, reserve: int
         ) -> tuple[list[int], int]:
    """(the prompt's token ids, how many of the oldest lines were dropped so that ids + `reserve` fit in
    `max_len`); `PromptTooLongError` when the latest line alone does not fit."""
    head = builder.chat.prefix + tpl.prompt_head(builder.spec)
    tail = tpl.PROMPT_TAIL + builder.chat.suffix
    start = 0
    while True:
        prompt = head + "".join(lines[start:]) + tail
        ids = builder.bos_ids + list(builder.backend.encode(prompt, add_special_tokens=False).ids)
        if len(ids) + reserve <= max_len or start >= len(lines) - 1:
            break
        start += 1
    if len(ids) + reserve > max_len:
        raise PromptTooLongError(
            f"the latest utterance alone makes a {len(ids)}-token prompt; with {reserve} tokens reserved for "
            f"the reply that exceeds max_len={max_len}",
            prompt_tokens=len(ids), reserve=reserve, max_len=max_len,
        )
    return ids, start


def _placeholder_rows(model_cfg: EmpatheiaConfig, kept: _Features, has_media: bool
                      ) -> tuple[np.ndarray, np.ndarray]:
    """(audio rows [n_aud, d_a], video rows [n_vid, d_v]) of the kept utterances' placeholders, in order;
    empty for a model that reads no media."""
    aud = [a for a, v in kept if a is not None and has_media]
    vid = [v for a, v in kept if v is not None and has_media]
    aud_feats = np.concatenate(aud) if aud else np.zeros((0, model_cfg.audio_dim), np.float32)
    vid_feats = np.concatenate(vid) if vid else np.zeros((0, model_cfg.video_dim), np.float32)
    return aud_feats, vid_feats


__all__ = [
    "ChatPrompt",
    "EncoderManifestError",
    "PromptTooLongError",
    "build_prompt",
    "encoder_from_manifest",
]
