"""Deterministic expressive speech for the AvaMERG-format sample: espeak-ng through ctypes.

The library and its data come from the `espeakng-loader` wheel, so nothing but pip is needed.
The speaker's profile (age, gender, timbre) picks a voice; the emotion sets pitch level, pitch
range, speaking rate, word gaps, loudness and a tremor, so that a cheap feature extractor (pitch,
log-mel statistics) can recover the emotion from the audio alone (see `EMOTION_PROSODY`).

Why a private espeak-ng data folder: stock espeak-ng output depends on what was synthesized
before in the same process (a never-reset static flutter index in wavegen.c and a static
cycle counter for "roughness"), so the same sentence gave a few samples' different length and
different bytes on every call. Our voice variants set `flutter 0` and `roughness 0`, and the
breath noise generator is re-seeded before each utterance (`espeak_ng_SetRandSeed`); with that,
equal inputs give byte-identical audio regardless of call order. The folder symlinks the
wheel's data and adds the variant files (`voices/!v/emp-*`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from empatheia_jax.assets import cache_root
from empatheia_jax.data.schema import AGES, EMOTIONS_7, GENDERS, TIMBRES

SAMPLE_RATE = 16000
"""Sample rate of the sample's wavs: what HuBERT / wav2vec2 take without resampling."""
ESPEAK_RATE = 22050
FRAME_RATE = 25
"""Video frame rate; speech is padded to whole 40 ms frames so audio and video durations agree."""

LISTENER_STYLE = "empathetic"
STYLES = (*EMOTIONS_7, "neutral", LISTENER_STYLE)
"""Every emotion/style the synthesizers accept: the 7 classes, neutral, and the listener's style."""

LISTENER_MIRRORS = frozenset({"happy", "surprised", "sad"})
"""Emotions the listener avatar shows back (shared joy, surprise, sadness: emotional mirroring); to anger,
fear, disgust and contempt it answers with its calm empathetic style, never the user's hostility or fear."""


def listener_style(emotion: str | None) -> str:
    """The style the listener avatar answers `emotion` (a class of EMOTIONS_7) with: voice and face."""
    return emotion if emotion in LISTENER_MIRRORS else LISTENER_STYLE


VOICE_VERSION = "1"  # bump when the voice files below change: the data folder is keyed on it


@dataclass(frozen=True)
class Prosody:
    """How one emotion is spoken: espeak pitch/range (0-100, 50 = voice default), rate factor,
    extra gap between words (10 ms units), target RMS loudness (dBFS) and amplitude tremor."""

    pitch: int
    pitch_range: int
    rate: float
    word_gap: int
    loudness_db: float
    tremor_hz: float = 0.0
    tremor_depth: float = 0.0


# The table the sample's audio follows (documented in docs/design.md). Classes differ on at least
# two of: pitch level, pitch range, rate, loudness, so none is a copy of another.
EMOTION_PROSODY: dict[str, Prosody] = {
    "happy": Prosody(pitch=72, pitch_range=85, rate=1.12, word_gap=0, loudness_db=-16.0),
    "surprised": Prosody(pitch=90, pitch_range=100, rate=1.00, word_gap=1, loudness_db=-15.0),
    "angry": Prosody(pitch=58, pitch_range=65, rate=1.25, word_gap=0, loudness_db=-11.0),
    "fear": Prosody(pitch=80, pitch_range=25, rate=1.30, word_gap=0, loudness_db=-22.0,
                    tremor_hz=7.0, tremor_depth=0.35),
    "sad": Prosody(pitch=22, pitch_range=15, rate=0.72, word_gap=4, loudness_db=-27.0),
    "disgusted": Prosody(pitch=32, pitch_range=60, rate=0.85, word_gap=2, loudness_db=-19.0),
    "contempt": Prosody(pitch=40, pitch_range=35, rate=0.92, word_gap=1, loudness_db=-20.0),
    "neutral": Prosody(pitch=50, pitch_range=50, rate=1.00, word_gap=0, loudness_db=-20.0),
    # The listener: calm, warm, a little slow and soft, moderate melody.
    "empathetic": Prosody(pitch=46, pitch_range=45, rate=0.90, word_gap=1, loudness_db=-21.0),
}

# Voice per profile. Pitch (Hz, low..high of the intonation span) by age x gender, times a timbre
# factor; formant frequency scale (%) models vocal-tract length (children and women shorter).
_PITCH_HZ = {
    ("child", "male"): (215, 320), ("child", "female"): (230, 340),
    ("young", "male"): (98, 150), ("young", "female"): (180, 265),
    ("middle-aged", "male"): (90, 138), ("middle-aged", "female"): (165, 245),
    ("elderly", "male"): (84, 128), ("elderly", "female"): (150, 225),
}
_TIMBRE_PITCH = {"low": 0.84, "mid": 1.0, "high": 1.19}
_TIMBRE_FORMANT = {"low": -4, "mid": 0, "high": 4}  # brighter/darker voice, % of formant freq
_FORMANT_SCALE = {
    ("child", "male"): 118, ("child", "female"): 120,
    ("young", "male"): 100, ("young", "female"): 112,
    ("middle-aged", "male"): 98, ("middle-aged", "female"): 110,
    ("elderly", "male"): 97, ("elderly", "female"): 108,
}
_BASE_WPM = {"child": 160, "young": 175, "middle-aged": 165, "elderly": 145}
# Elderly voices: breathier and a slow amplitude tremor (flutter would be the natural choice, but
# espeak's flutter is not deterministic, see the module docstring).
_AGE_TREMOR = {"elderly": (5.0, 0.12)}


def check_profile(profile: dict) -> tuple[str, str, str]:
    """Return (age, gender, timbre) of a profile dict, or raise ValueError naming the bad field."""
    out = []
    for key, allowed in (("age", AGES), ("gender", GENDERS), ("timbre", TIMBRES)):
        value = str(profile.get(key, "")).strip().lower()
        if value not in allowed:
            raise ValueError(f"profile {key}={profile.get(key)!r} is not one of {allowed}")
        out.append(value)
    return out[0], out[1], out[2]


def voice_name(age: str, gender: str, timbre: str) -> str:
    """Name of our espeak variant file for a profile (ASCII, no spaces)."""
    return f"emp-{age}-{gender}-{timbre}".replace("middle-aged", "middle")


def _voice_file(age: str, gender: str, timbre: str) -> str:
    lo, hi = _PITCH_HZ[(age, gender)]
    f = _TIMBRE_PITCH[timbre]
    scale = _FORMANT_SCALE[(age, gender)] + _TIMBRE_FORMANT[timbre]
    lines = [
        "language variant",
        f"name {voice_name(age, gender, timbre)}",
        f"gender {gender}",
        f"pitch {round(lo * f)} {round(hi * f)}",
        "flutter 0",  # determinism: see module docstring
        "roughness 0",  # determinism: roughness uses a static cycle counter
    ]
    for k in range(9):
        fs = scale if k <= 5 else 100
        lines.append(f"formant {k} {fs} 100 {110 if gender == 'female' else 100}")
    if age == "elderly":
        lines.append("breath 0 3 5 5 4 4 3 2")
    elif gender == "female":
        lines.append("breath 0 1 2 2 2 2 2 1")
    return "\n".join(lines) + "\n"


def _all_voice_files() -> dict[str, str]:
    return {voice_name(a, g, t): _voice_file(a, g, t) for a in AGES for g in GENDERS for t in TIMBRES}


def espeak_data_dir() -> Path:
    """Our espeak-ng data folder (wheel data + deterministic voice variants), built once, atomically."""
    import espeakng_loader

    src = Path(espeakng_loader.get_data_path())
    voices = _all_voice_files()
    key = hashlib.sha256((str(src) + VOICE_VERSION + repr(sorted(voices.items()))).encode()).hexdigest()[:12]
    dst = cache_root() / f"espeak-ng-data-{key}"
    if (dst / "COMPLETE").exists():
        return dst
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # read-only home: fall back to the temp folder
        dst = Path(tempfile.gettempdir()) / "empatheia_jax" / dst.name
        if (dst / "COMPLETE").exists():
            return dst
        dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".espeak-", dir=dst.parent))
    try:
        (tmp / "voices" / "!v").mkdir(parents=True)
        for entry in src.iterdir():
            if entry.name != "voices":
                _link_or_copy(entry, tmp / entry.name)
        for entry in (src / "voices").iterdir():
            if entry.name != "!v":
                _link_or_copy(entry, tmp / "voices" / entry.name)
        for entry in (src / "voices" / "!v").iterdir():
            _link_or_copy(entry, tmp / "voices" / "!v" / entry.name)
        for name, text in voices.items():
            (tmp / "voices" / "!v" / name).write_text(text)
        (tmp / "COMPLETE").write_text(str(src) + "\n")
        try:
            os.rename(tmp, dst)
        except OSError:  # another process won the race; its folder is equivalent
            if not (dst / "COMPLETE").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dst


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.symlink(src, dst)
    except OSError:
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copy2(src, dst)


_SYNTH_CB = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)
_ESPEAK_SYNCHRONOUS = 2
_ESPEAK_CHARS_UTF8 = 1
_PARAM_RATE, _PARAM_VOLUME, _PARAM_PITCH, _PARAM_RANGE, _PARAM_WORDGAP = 1, 2, 3, 4, 7


class _Espeak:
    """One espeak-ng instance per process (the library is a process-wide singleton)."""

    def __init__(self) -> None:
        import espeakng_loader

        self.lib = ctypes.CDLL(espeakng_loader.get_library_path())
        self.lib.espeak_ng_SetRandSeed.argtypes = [ctypes.c_long]
        self.lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        self.lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self.lib.espeak_Synth.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int,
                                          ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
        rate = self.lib.espeak_Initialize(_ESPEAK_SYNCHRONOUS, 0, str(espeak_data_dir()).encode(), 0)
        if rate != ESPEAK_RATE:
            raise RuntimeError(f"espeak_Initialize returned {rate}, expected sample rate {ESPEAK_RATE}")
        self.chunks: list[np.ndarray] = []
        self.callback = _SYNTH_CB(self._collect)  # keep a reference: ctypes does not
        self.lib.espeak_SetSynthCallback(self.callback)
        self.lock = threading.Lock()

    def _collect(self, wav, n, _events) -> int:
        if n > 0:
            self.chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
        return 0

    def synth(self, text: str, voice: str, pitch: int, pitch_range: int, wpm: int,
              word_gap: int) -> np.ndarray:
        with self.lock:
            self.chunks = []
            self.lib.espeak_ng_SetRandSeed(0)
            if self.lib.espeak_SetVoiceByName(f"en-us+{voice}".encode()) != 0:
                raise RuntimeError(f"espeak-ng could not load voice en-us+{voice}")
            for param, value in ((_PARAM_PITCH, pitch), (_PARAM_RANGE, pitch_range), (_PARAM_RATE, wpm),
                                 (_PARAM_VOLUME, 60), (_PARAM_WORDGAP, word_gap)):
                self.lib.espeak_SetParameter(param, int(value), 0)
            data = text.encode("utf-8") + b"\0"
            buf = ctypes.create_string_buffer(data, len(data))
            status = self.lib.espeak_Synth(buf, len(data), 0, 0, 0, _ESPEAK_CHARS_UTF8, None, None)
            if status != 0:
                raise RuntimeError(f"espeak_Synth failed with status {status}")
            chunks, self.chunks = self.chunks, []
        return np.concatenate(chunks) if chunks else np.zeros(0, np.int16)


_ENGINE: _Espeak | None = None


def _engine() -> _Espeak:
    global _ENGINE
    if _ENGINE is None:
        _ENGINE = _Espeak()
    return _ENGINE


def _resample(x: np.ndarray, sr_in: int, sr_out: int) -> np.ndarray:
    if sr_in == sr_out:
        return x
    from math import gcd

    from scipy.signal import resample_poly

    g = gcd(sr_in, sr_out)
    return resample_poly(x, sr_out // g, sr_in // g)


def synthesize_speech(text: str, profile: dict, emotion: str, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Speak `text` as `profile` with `emotion`; mono int16 at `sample_rate`.

    The result has 120 ms of silence at each end and is zero-padded to a whole number of 40 ms
    video frames, so `len(wav) / sample_rate * 25` is the exact frame count of its face video.
    Deterministic: equal arguments give equal arrays, independent of earlier calls.
    """
    age, gender, timbre = check_profile(profile)
    if emotion not in EMOTION_PROSODY:
        raise ValueError(f"emotion {emotion!r} is not one of {STYLES}")
    if sample_rate % FRAME_RATE:
        raise ValueError(f"sample_rate must be a multiple of {FRAME_RATE}")
    pros = EMOTION_PROSODY[emotion]
    # printable text only: control characters would reach espeak's embedded-command parser
    text = " ".join("".join(c if c.isprintable() else " " for c in str(text)).split())
    raw = np.zeros(0, np.int16)
    if text:
        wpm = round(_BASE_WPM[age] * pros.rate)
        raw = _engine().synth(text, voice_name(age, gender, timbre), pros.pitch, pros.pitch_range, wpm,
                              pros.word_gap)
    x = _resample(raw.astype(np.float64) / 32768.0, ESPEAK_RATE, sample_rate)
    # Trim espeak's own leading/trailing silence so every clip has the same margins.
    voiced = np.flatnonzero(np.abs(x) > 1e-3)
    x = x[voiced[0]: voiced[-1] + 1] if voiced.size else np.zeros(0)
    if x.size:
        t = np.arange(x.size) / sample_rate
        for hz, depth in ((pros.tremor_hz, pros.tremor_depth), _AGE_TREMOR.get(age, (0.0, 0.0))):
            if depth:
                x = x * (1.0 - depth * 0.5 * (1.0 + np.sin(2 * np.pi * hz * t)))
        rms = float(np.sqrt(np.mean(x**2)))
        if rms > 0:
            x = x * (10 ** (pros.loudness_db / 20) / rms)
        fade = min(x.size // 2, int(0.005 * sample_rate))
        if fade:
            ramp = np.linspace(0.0, 1.0, fade)
            x[:fade] *= ramp
            x[-fade:] *= ramp[::-1]
    margin = int(0.12 * sample_rate)
    per_frame = sample_rate // FRAME_RATE
    total = x.size + 2 * margin
    total = max(per_frame * 10, -(-total // per_frame) * per_frame)  # at least 0.4 s, whole frames
    out = np.zeros(total, np.float64)
    out[margin: margin + x.size] = x
    return np.round(np.clip(out, -1.0, 32767 / 32768) * 32768).astype(np.int16)


def speech_envelope(wav: np.ndarray, sample_rate: int = SAMPLE_RATE, fps: int = FRAME_RATE) -> np.ndarray:
    """RMS per video frame, scaled to [0, 1] by the clip's own 95th-percentile loud frame.

    Scaling per clip makes the mouth open fully in quiet (sad) and loud (angry) speech alike;
    the emotion shows in the expression, not in how wide the mouth opens.
    """
    hop = sample_rate // fps
    n = -(-len(wav) // hop)
    x = np.zeros(n * hop, np.float64)
    x[: len(wav)] = np.asarray(wav, np.float64) / 32768.0
    rms = np.sqrt(np.mean(x.reshape(n, hop) ** 2, axis=1))
    ref = max(float(np.percentile(rms, 95)) if n else 0.0, 1e-3)
    return np.clip(rms / ref, 0.0, 1.0)


def write_wav(path: str | os.PathLike, wav: np.ndarray, sample_rate: int = SAMPLE_RATE) -> None:
    """Write mono int16 PCM with the stdlib `wave` module (no timestamps, so bytes are reproducible)."""
    import wave

    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(np.asarray(wav, dtype="<i2").tobytes())


def read_wav(path: str | os.PathLike) -> tuple[int, np.ndarray]:
    """(sample rate, int16 samples) of a mono int16 PCM wav, the format `write_wav` writes."""
    import wave

    with wave.open(str(path), "rb") as w:
        if w.getnchannels() != 1 or w.getsampwidth() != 2:
            raise ValueError(f"{path}: expected mono 16-bit PCM, got {w.getnchannels()} channel(s) of "
                             f"{8 * w.getsampwidth()} bit")
        return w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.int16)
