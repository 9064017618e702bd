"""The avatar answers: chat's predicted features -> the spoken reply (wav) and the talking face (mp4).

Every generator is looked up by the target source the model was trained on (`generators.registry`), so
this module names none. The Content Synchronizer predicts a fixed number of rows
(config.data.max_speech_len); a speech generator reads the first T of them, T = the reply's content rows
(`registry.content_rows`, e.g. Kokoro's phoneme count plus two pads), which chat records as
`speech_content_units`. A video generator draws as many 25-fps frames as the speech lasts.

The listener avatar can be pinned (`chat --listener age,gender,timbre`), as E3RG's identity memory keeps
one avatar for a conversation: the predicted style vectors S^s/S^v are then replaced by the avatar map of
each generator (`Generator.avatar_style`) for that profile, in the style the predicted emotion calls for
(`speech_synth.listener_style`), so who speaks is the user's choice and how they feel stays the model's.
Unpinned, the face still shows the reply's emotion (`Generator.expressed`: the SD's predicted avatar with
that expression), so the expression follows the emotion the reply was written from in both cases.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from empatheia_jax.data import schema
from empatheia_jax.generators import registry
from empatheia_jax.generators.base import GeneratorError
from empatheia_jax.generators.kokoro_voices import to_pcm16
from empatheia_jax.generators.speech_synth import listener_style, write_wav
from empatheia_jax.serve.chat import pinned_style, reply_emotion
from empatheia_jax.serve.outputs import read_outputs

SPEECH_GENERATOR = "kokoro"
VIDEO_GENERATOR = "face_render"


def check_can_speak(speech_targets: str | None, video_targets: str | None = None, where: str = "features",
                    *, speech: str = SPEECH_GENERATOR, video: str | None = None) -> None:
    """Refuses a model whose targets the generators cannot read, before any reply is generated."""
    registry.check_trained_on(speech, speech_targets, where)
    if video is not None:
        registry.check_trained_on(video, video_targets, where)


def parse_listener(value: str, flag: str = "--listener") -> dict[str, str]:
    """`age,gender,timbre` (e.g. `young,female,mid`) -> the listener profile; ValueError naming `flag`."""
    parts = [p.strip().lower() for p in str(value).split(",")]
    vocabs = (("age", schema.AGES), ("gender", schema.GENDERS), ("timbre", schema.TIMBRES))
    if len(parts) != len(vocabs):
        raise ValueError(f"{flag} {value!r}: expected age,gender,timbre (e.g. young,female,mid)")
    for part, (name, vocab) in zip(parts, vocabs, strict=True):
        if part not in vocab:
            raise ValueError(f"{flag} {value!r}: {name} {part!r} is not one of {', '.join(vocab)}")
    return dict(zip((name for name, _ in vocabs), parts, strict=True))


def pinned_styles(generator: str, listeners: Mapping[int, Mapping[str, str]],
                  emotions: Mapping[int, str | None]) -> dict[int, np.ndarray]:
    """Per record, the style vector `chat --listener` would use: that record's listener profile as the pinned
    avatar, in the style its predicted emotion (a class or fine word, or None) calls for (eval's
    `*_pinned_*` rows ask whether the probes read the avatar the user chose)."""
    return {i: pinned_style(generator, dict(who), {"emotion": emotions.get(i)})[0]
            for i, who in listeners.items()}


def reply_rows(meta: dict[str, Any], available: int, where: str = "features",
               generator: str = SPEECH_GENERATOR) -> tuple[int, list[str]]:
    """(rows to read, notes) from chat's JSON (`speech_targets`, `speech_content_units`)."""
    registry.check_trained_on(generator, meta.get("speech_targets"), where)
    rows = meta.get("speech_content_units")
    if not isinstance(rows, int) or rows < 3:
        raise GeneratorError(f"{where}: speech_content_units={rows!r}; need the reply's content rows (>= 3)")
    notes = []
    if rows > available:
        notes.append(f"the reply has {rows} content rows but the model predicts {available} "
                     f"(config.data.max_speech_len); the speech stops after {available}")
        rows = available
    return rows, notes


def _features(features: str | Path, modality: str) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    stem = Path(features)
    try:
        arrays, meta = read_outputs(stem)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--features {features}: {e.strerror or e}: {e.filename}") from e
    for key in (f"{modality}_content", f"{modality}_style"):
        if key not in arrays:
            raise GeneratorError(f"{features}: no {key!r} array (the model has no {modality} heads)")
    return arrays[f"{modality}_content"], arrays[f"{modality}_style"], meta


def synthesize_reply(features: str | Path, out: str | Path, *, rows: int | None = None, speed: float = 1.0,
                     generator: str = SPEECH_GENERATOR, listener: dict[str, str] | None = None,
                     **options: Any) -> tuple[Path, float, list[str]]:
    """Speaks chat's output `features` (OUT.npz or its stem) into the wav `out`; (path, seconds, notes).

    `listener` (a profile, `parse_listener`) pins the voice: its style vector and speaking rate (times
    `speed`) replace the predicted S^s."""
    content, style, meta = _features(features, "speech")
    notes: list[str] = []
    if rows is None:
        rows, notes = reply_rows(meta, content.shape[0], str(features), generator)
    elif not 3 <= rows <= content.shape[0]:
        raise GeneratorError(f"--rows {rows}: must be in [3, {content.shape[0]}]")
    if listener is not None:
        style, rate, note = pinned_style(generator, listener, meta)
        speed, notes = speed * rate, [*notes, note]
    speaker = registry.get(generator, **options)
    audio = speaker.speak(content, style, rows, speed)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_wav(out, to_pcm16(audio), speaker.sample_rate)
    return out, len(audio) / speaker.sample_rate, notes


def render_avatar(features: str | Path, wav: str | Path, out: str | Path, *, generator: str = VIDEO_GENERATOR,
                  listener: dict[str, str] | None = None, **options: Any) -> tuple[Path, int, list[str]]:
    """The talking face: predicted C^v/S^v drawn by the video generator `generator` (built with `options`)
    for the speech in `wav`, that speech muxed in; (path, frames, notes). `listener` pins the face as in
    `synthesize_reply`; without it the predicted avatar shows the reply emotion's expression when the reply
    has one (`reply_emotion`, `Generator.expressed`)."""
    content, style, meta = _features(features, "video")
    registry.check_trained_on(generator, meta.get("video_targets"), str(features))
    pinned: list[str] = []
    if listener is not None:
        style, _, note = pinned_style(generator, listener, meta)
        pinned.append(note)
    elif (emotion := reply_emotion(meta)) is not None:
        style = registry.generator_class(generator).expressed(style, listener_style(emotion))
        pinned.append(f"the predicted avatar shows the {listener_style(emotion)} expression (reply emotion: "
                      f"{emotion})")
    drawer = registry.get(generator, **options)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    frames, notes = drawer.render(content, style, wav, out)
    return out, frames, [*pinned, *notes]
