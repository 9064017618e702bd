"""A chat reply on disk and on screen: OUT.npz / OUT.json, what is added to them later, and its text lines.

`empatheia chat` and the server write a turn's `ChatResult` here (`write_outputs`); the speech and face
generators read it back (`read_outputs`, `serve.avatar`), and what is done with the reply afterwards (the
pinned listener, what Whisper tiny.en hears in the spoken reply: `hear_reply`) is added to the same JSON
(`update_outputs`). Why two files: the arrays (generator features, class probabilities, the sequence the
heads read) are numpy's, the text and its provenance JSON a person can read; the JSON names its npz and
carries a format tag, so only a file this module wrote is read back.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from empatheia_jax.data import schema
from empatheia_jax.data import templates as tpl
from empatheia_jax.serve.chat import ChatResult

OUTPUT_FORMAT = "empatheia-chat/1"
_VOCABS = {"age": schema.AGES, "gender": schema.GENDERS, "timbre": schema.TIMBRES}


def _stem(out: str | os.PathLike) -> Path:
    p = Path(out)
    return p.with_suffix("") if p.suffix in (".npz", ".json") else p


def write_outputs(result: ChatResult, out: str | os.PathLike) -> tuple[Path, Path]:
    """Writes OUT.npz and OUT.json (OUT may end in .npz/.json; parent folders are created).

    OUT.npz: the features (speech_content, video_content, speech_style, video_style, float32), emotion_id +
    emotion_probs, age/gender/timbre _id + _probs (ids -1 without SD), input_ids, response_mask.
    OUT.json: format, text, coe, reply, emotion, emotion_text, emotion_classes, profile names, the class
    vocabularies, signal_tokens_forced, speech_content_units, notes, input_transcripts (the utterances whose
    text Whisper transcribed from their audio) and the npz file name.
    """
    stem = _stem(out)
    stem.parent.mkdir(parents=True, exist_ok=True)
    npz, js = stem.with_name(stem.name + ".npz"), stem.with_name(stem.name + ".json")
    np.savez(npz, **_output_arrays(result))
    js.write_text(json.dumps(_output_meta(result, npz.name), indent=1, ensure_ascii=False) + "\n")
    return npz, js


def _output_arrays(result: ChatResult) -> dict[str, np.ndarray]:
    """OUT.npz's arrays: the features, the class ids (-1 where not predicted) and probabilities, the
    sequence the heads read and its r^t mask."""
    arrays: dict[str, np.ndarray] = {k: np.asarray(v, np.float32) for k, v in result.features.items()}
    classes = list(result.emotion_classes)
    arrays["emotion_id"] = np.int32(classes.index(result.emotion) if result.emotion in classes else -1)
    arrays["emotion_probs"] = np.asarray(result.emotion_probs, np.float32)
    for name, vocab in _VOCABS.items():
        label = result.profile.get(name, "")
        arrays[f"{name}_id"] = np.int32(vocab.index(label) if label in vocab else -1)
        arrays[f"{name}_probs"] = np.asarray(result.profile.get(f"{name}_probs", np.zeros(0)), np.float32)
    arrays["input_ids"] = np.asarray(result.input_ids, np.int32)
    arrays["response_mask"] = np.asarray(result.response_mask, np.int32)
    return arrays


def _output_meta(result: ChatResult, npz_name: str) -> dict[str, Any]:
    """OUT.json's contents: the text, its readings and provenance, and the name of its npz."""
    return {
        "format": OUTPUT_FORMAT,
        "text": result.text,
        "coe": result.coe,
        "reply": result.reply,
        "emotion": result.emotion,
        "emotion_text": result.emotion_text,
        "emotion_classes": list(result.emotion_classes),
        "profile": {k: result.profile.get(k, "") for k in _VOCABS},
        "profile_classes": {k: list(v) for k, v in _VOCABS.items()},
        "signal_tokens_forced": result.signal_tokens_forced,
        "speech_content_units": result.speech_content_units,
        "speech_targets": result.speech_targets,
        "video_targets": result.video_targets,
        "prompt_length": result.prompt_length,
        "notes": list(result.notes),
        "input_transcripts": list(result.input_transcripts),
        "features": {k: list(np.shape(v)) for k, v in result.features.items()},
        "npz": npz_name,
    }


def _read_meta(out: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """(path of OUT.json, its contents), refused unless `write_outputs` wrote it."""
    stem = _stem(out)
    js_path = stem.with_name(stem.name + ".json")
    js = json.loads(js_path.read_text())
    if js.get("format") != OUTPUT_FORMAT:
        raise ValueError(f"{js_path}: not a {OUTPUT_FORMAT} file (format={js.get('format')!r})")
    return js_path, js


def read_outputs(out: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(arrays of OUT.npz, contents of OUT.json) as `write_outputs` wrote them."""
    js_path, js = _read_meta(out)
    with np.load(js_path.with_name(js["npz"])) as z:
        arrays = {k: z[k] for k in z.files}
    return arrays, js


def hear_reply(out: str | os.PathLike, wav: str | os.PathLike, *, threads: int = 2) -> dict[str, Any]:
    """What an independent listener (Whisper tiny.en, `asr`) hears in the spoken reply `wav`, recorded in
    OUT.json and returned: `speech_transcript`, `speech_transcript_confidence` and `speech_wer` against the
    reply text (None when the reply has no word to score). The check that the predicted speech features
    still say the reply, not only sound like a voice."""
    from empatheia_jax.data.encoders import asr
    from empatheia_jax.generators.speech_synth import read_wav

    _, meta = _read_meta(out)  # the reply text only: the features are not needed
    sr, audio = read_wav(wav)
    heard = asr.shared(threads).transcribe(audio, sr)
    reply = meta.get("reply") or ""
    wer = asr.word_error_rate([reply], [heard.text]) if asr.normalize(reply) else None
    fields = {"speech_transcript": heard.text, "speech_transcript_confidence": heard.confidence,
              "speech_wer": wer}
    update_outputs(out, fields)
    return fields


def update_outputs(out: str | os.PathLike, fields: Mapping[str, Any]) -> None:
    """Adds `fields` to OUT.json (what was done with the reply after `write_outputs`: heard, pinned)."""
    js_path, meta = _read_meta(out)
    meta.update(fields)
    js_path.write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")


def format_result(result: ChatResult) -> str:
    """Human-readable lines: the CoE steps, the reply, the SD emotion/profile and any notes."""
    lines = [f"heard (Whisper tiny.en, utterance {t['utterance_index']}): {t['transcript']!r} "
             f"(confidence {t['confidence']:.2f})" for t in result.input_transcripts]
    for fld, ordinal, phrase in tpl.COE_STEPS[:-1]:
        if result.coe.get(fld):
            lines.append(f"{ordinal}, {phrase}: {result.coe[fld]}")
    lines.append(f"Reply: {result.reply}")
    if result.emotion:
        p = float(np.max(result.emotion_probs)) if result.emotion_probs.size else 0.0
        prof = ", ".join(result.profile.get(k, "") for k in ("age", "gender", "timbre"))
        lines.append(f"SD emotion: {result.emotion} ({p:.2f}) | profile: {prof}")
    if result.emotion_text is not None:
        lines.append(f"CoE emotion class: {result.emotion_text}")
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)


__all__ = ["OUTPUT_FORMAT", "format_result", "hear_reply", "read_outputs", "update_outputs", "write_outputs"]
