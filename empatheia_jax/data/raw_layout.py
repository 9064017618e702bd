"""The AvaMERG RAW folder on disk: `{split}.json` files, `media/{utterance_id}.wav|.mp4`, the utterance-id
file stems, which splits a folder holds, and whether a media file decodes.

Below the record schema (`schema.py`), because the names must be formed and parsed the same way by the
validator, the importers, preparation, the target exporters and the sample builder, none of which should
need the record dataclasses to find a file.
"""

from __future__ import annotations

import os
import re
import wave
from pathlib import Path
from typing import Any

MEDIA_EXTENSIONS: tuple[str, ...] = (".wav", ".mp4")


def split_json_path(raw_dir: str | os.PathLike[str], split: str) -> str:
    """`RAW/{split}.json`, the dialogue list of one split."""
    return os.path.join(os.fspath(raw_dir), f"{split}.json")


def media_dir_of(raw_dir: str | os.PathLike[str]) -> str:
    """`RAW/media`, the flat folder holding `{utterance_id}.wav|.mp4` for all splits."""
    return os.path.join(os.fspath(raw_dir), "media")


STANDARD_SPLITS = ("train", "valid", "validation", "dev", "test")


def discover_splits(raw: str | os.PathLike) -> list[str]:
    """Split names of a RAW folder: the standard ones present (train, valid, validation, dev, test, in that
    order), else every ``*.json`` whose name does not contain "meta" (sample_meta.json is no split)."""
    raw = Path(raw)
    present = [s for s in STANDARD_SPLITS if (raw / f"{s}.json").is_file()]
    if not present:
        present = sorted(p.stem for p in raw.glob("*.json") if "meta" not in p.stem.lower())
    if not present:
        raise FileNotFoundError(f"{raw}: no {{split}}.json files (expected e.g. train.json, valid.json)")
    return present


_CID_RE = re.compile(r"[A-Za-z0-9-]+")
_UTT_ID_RE = re.compile(r"^dia([A-Za-z0-9-]+?)utt(0|[1-9][0-9]*)_(0|[1-9][0-9]*)$")


def check_conversation_id(conversation_id: Any) -> str | None:
    """Why `conversation_id` cannot name media files, or None when it can.

    Ids end up inside file names `dia{cid}utt{k}_{pid}`, so they must be filename-safe and must not
    contain "utt" (any case), which would make the file name ambiguous to parse.
    """
    if not isinstance(conversation_id, str):
        return f"must be a string, got {type(conversation_id).__name__}"
    if not _CID_RE.fullmatch(conversation_id):
        return f"{conversation_id!r} must match [A-Za-z0-9-]+"
    if "utt" in conversation_id.lower():
        return f"{conversation_id!r} must not contain 'utt'"
    return None


def utterance_id(conversation_id: str, k: int, profile_id: int) -> str:
    """Media stem `dia{cid}utt{k}_{pid}` of utterance k (0-based) spoken by profile `profile_id`."""
    why = check_conversation_id(conversation_id)
    if why:
        raise ValueError(f"bad conversation id: {why}")
    for name, v in (("k", k), ("profile_id", profile_id)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    return f"dia{conversation_id}utt{k}_{profile_id}"


def parse_utterance_id(stem: str) -> tuple[str, int, int]:
    """Inverse of `utterance_id`: (conversation_id, k, profile_id) for any k.

    Anchored and strict (no extension, no leading zeros) so that parse and format are exact inverses
    and a media file either matches one utterance or is reported.
    """
    m = _UTT_ID_RE.match(stem) if isinstance(stem, str) else None
    if m is None or check_conversation_id(m.group(1)) is not None:
        raise ValueError(f"not an utterance id (dia{{cid}}utt{{k}}_{{profileID}}): {stem!r}")
    return m.group(1), int(m.group(2)), int(m.group(3))



def _check_wav(path: str) -> str | None:
    """Header-only check that a .wav decodes; soundfile when present (float wavs), else stdlib wave."""
    try:
        import soundfile

        try:
            info = soundfile.info(path)
        except Exception as e:  # any decoder error means unreadable
            return f"does not decode as audio: {e}"
        frames, rate, channels = info.frames, info.samplerate, info.channels
    except ImportError:
        try:
            with wave.open(path, "rb") as w:
                frames, rate, channels = w.getnframes(), w.getframerate(), w.getnchannels()
        except (wave.Error, EOFError, OSError) as e:
            return f"does not decode as wav: {e}"
    if frames <= 0 or rate <= 0 or channels <= 0:
        return f"empty audio ({frames} frames, {rate} Hz, {channels} channels)"
    return None


def _check_mp4(path: str) -> str | None:
    """Open with PyAV and decode the first video frame only."""
    try:
        import av
    except ImportError:
        return None  # readability cannot be checked without PyAV; existence was checked already
    try:
        with av.open(path) as container:
            if not container.streams.video:
                return "has no video stream"
            for _ in container.decode(video=0):
                return None
            return "video stream has no decodable frame"
    except Exception as e:  # PyAV raises many FFmpeg error types
        return f"cannot be opened as video: {e}"



_MEDIA_CHECKS = {".wav": _check_wav, ".mp4": _check_mp4}


def media_unreadable(path: str, ext: str) -> str | None:
    """Why the media file `path` (extension `ext`, one of MEDIA_EXTENSIONS) does not decode, or None when it
    does; cheap: the .wav header, the .mp4's first video frame."""
    return _MEDIA_CHECKS[ext](path)


__all__ = [
    "MEDIA_EXTENSIONS",
    "STANDARD_SPLITS",
    "check_conversation_id",
    "discover_splits",
    "media_dir_of",
    "media_unreadable",
    "parse_utterance_id",
    "split_json_path",
    "utterance_id",
]
