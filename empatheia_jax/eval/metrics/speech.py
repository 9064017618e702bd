"""Speech metrics for `empatheia eval`: generated speech against the gold speech of the same reply, and probes
that ask whether a voice carries the listener's profile.

Why these metrics (each one blind to something the others see):
- **MCD** (`mcd`): spectral-envelope distance after DTW alignment; it needs the two wavs to say the same text,
  so it is meaningful for speech synthesized from content aligned to the gold reply (teacher-forced C^s), and
  a baseline that says other words must not be scored with it. Scale: Kubichek's MCD as the
  `mel-cepstral-distance` package computes it (alpha = 1, cepstra of the log10 mel power), NOT the
  10*sqrt(2)/ln(10)-scaled "dB" figure of the SPTK literature; only compare our numbers with each other.
- **Speaker similarity** (`speaker_similarity`): cosine of resemblyzer d-vectors; identity of the voice
  (gender, age, timbre), independent of the words.
- **F0** (`f0_stats`): median pitch and its spread, the cheapest check that two voices differ the way the
  style map says (female above male, emotions shifting pitch); reported in semitones so that a shift means
  the same for a child and a man.
- **Duration ratio**: speaking rate, which the style also drives (Kokoro's prosody predictor reads S^s).
- **WER / CER** (`intelligibility_rows`): does the speech carry the words? Whisper tiny.en
  (`data.encoders.asr`, a recogniser independent of Kokoro and of us) transcribes each wav; corpus-level
  word and character error rates against the reply text, after `asr.normalize`. Blind to voice and prosody,
  it sees what MCD cannot: speech with the right spectral envelope that says nothing.

Style probes: does the voice carry the right gender / age / timbre. Trained on GOLD features with the
listener's profile labels and applied to the features of each system, so every system is judged by the same
fixed probe: on style vectors (trained on the train split's gold speech_style targets, which ARE the voices
the style map picks for the labels, `empatheia_jax/generators/kokoro_voices.py`), "did the model pick the
right voice". Features are standardised per dimension (training mean/std) first. `StyleClassifier` is the
nearest class centroid (no hyperparameters, a handful of examples per class; it stays as the
interface and as the baseline the tests compare against); `LinearStyleProbe`, the probe eval uses, is a
shrinkage LDA on the same interface (why: its docstring). An attribute with one class in training cannot be
probed: it is still reported, flagged `single_class`.

Heavy libraries (librosa, resemblyzer/torch, mel_cepstral_distance, tqdm) are imported inside the functions:
this module is imported by evaluate.py, which must stay cheap to import.
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# MCD settings (mel-cepstral-distance 0.0.4; its defaults unless noted).
MCD_SAMPLE_RATE = 16000  # 32 ms = 512 samples (the package wants a power of two); mel band 0-8 kHz
MCD_N_FFT_MS = 32  # = window length; Hann window
MCD_HOP_MS = 8
MCD_MEL_BANDS = 20  # M
MCD_FIRST_COEFF = 1  # s: c0 (frame energy) excluded, so loudness differences do not count
MCD_COEFFS = 16  # D: coefficients 1..15 compared
MCD_DTW_RADIUS = 10  # fastdtw Sakoe-Chiba radius; alignment on the mel spectrogram (align_target="mel")
TRIM_TOP_DB = 40.0  # edge silence below peak-40 dB is cut before MCD and duration

SPEAKER_SAMPLE_RATE = 16000  # resemblyzer's rate
SPEAKER_TARGET_DBFS = -30.0  # resemblyzer's volume target, applied both ways (see SpeakerEncoder.embed)

F0_MIN_HZ = 50.0
F0_MAX_HZ = 600.0  # a child's voice from the style map stays below this
F0_GATE_DB = 30.0  # frames more than this below the loudest frame count as unvoiced


def _mono(wav: np.ndarray, what: str = "wav") -> np.ndarray:
    x = np.asarray(wav, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"{what} must be a 1-D mono waveform, got shape {x.shape}")
    if x.size == 0 or not np.any(x):
        raise ValueError(f"{what} is empty or silent")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{what} has non-finite samples")
    return x


def _resample(x: np.ndarray, sample_rate: int, target: int) -> np.ndarray:
    if sample_rate == target:
        return x
    import librosa

    return librosa.resample(x, orig_sr=sample_rate, target_sr=target)


def _trim(x: np.ndarray) -> np.ndarray:
    """Edge silence is the vocoder's padding, not speech: Kokoro ends utterances in ~-130 dB near-silence
    whose log spectrum is numerical noise, which would otherwise dominate MCD and skew the duration ratio."""
    import librosa

    return librosa.effects.trim(x, top_db=TRIM_TOP_DB)[0]


def speech_duration(wav: np.ndarray, sample_rate: int) -> float:
    """Seconds of speech between the first and last non-silent frame (edge silence trimmed, pauses kept)."""
    return len(_trim(_mono(wav))) / sample_rate


def mcd(ref: np.ndarray, gen: np.ndarray, sample_rate: int) -> float:
    """Mel-cepstral distance of `gen` from `ref` (same text), DTW-aligned; 0.0 exactly for identical wavs.

    Pipeline: both wavs resampled to 16 kHz, edge silence trimmed (top_db=40), peak-normalised (the package's
    norm_audio), Hann STFT with n_fft = window = 32 ms (512 samples) and hop 8 ms, 20 mel bands over 0-8 kHz,
    log10 mel power, DCT; frames aligned by fastdtw (radius 10) on the mel spectrogram; per-frame Euclidean
    distance over coefficients 1..15 (c0 excluded), averaged over the aligned frames. Pauses inside the
    utterance are kept (DTW aligns them); no threshold-based silence removal (the package's is absolute, and
    loudness differs between systems).
    """
    from mel_cepstral_distance import compare_amplitude_spectrograms
    from mel_cepstral_distance.computation import get_X_km
    from mel_cepstral_distance.helper import ms_to_samples, norm_audio_signal

    n_fft = ms_to_samples(MCD_N_FFT_MS, MCD_SAMPLE_RATE)
    hop = ms_to_samples(MCD_HOP_MS, MCD_SAMPLE_RATE)
    specs = []
    for name, wav in (("ref", ref), ("gen", gen)):
        x = _trim(_resample(_mono(wav, name), sample_rate, MCD_SAMPLE_RATE))
        if len(x) <= n_fft + hop:
            raise ValueError(f"{name} has {len(x)} samples of speech at 16 kHz, too short for MCD")
        # get_X_km is the STFT compare_audio_files runs; the public entry points only take file paths.
        specs.append(get_X_km(norm_audio_signal(x), n_fft, n_fft, hop, "hanning"))
    value, _penalty = compare_amplitude_spectrograms(
        specs[0], specs[1], MCD_SAMPLE_RATE, MCD_N_FFT_MS,
        M=MCD_MEL_BANDS, s=MCD_FIRST_COEFF, D=MCD_COEFFS,
        aligning="dtw", align_target="mel", remove_silence="no", dtw_radius=MCD_DTW_RADIUS,
    )
    return float(value)


class SpeakerEncoder:
    """resemblyzer's d-vector model (GE2E, 256-d), CPU; use `shared_speaker_encoder()` to load it once."""

    def __init__(self, device: str = "cpu"):
        # webrtcvad imports pkg_resources (deprecation UserWarning) and resemblyzer scipy.ndimage.morphology
        # (DeprecationWarning): neither is ours to fix, and eval output must stay clean.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from resemblyzer import VoiceEncoder, preprocess_wav
            from resemblyzer.audio import normalize_volume

            self._encoder = VoiceEncoder(device, verbose=False)
        self._preprocess = preprocess_wav
        self._normalize_volume = normalize_volume
        self._lock = threading.Lock()

    def embed(self, wav: np.ndarray, sample_rate: int) -> np.ndarray:
        """L2-normalised d-vector [256] float32.

        The volume is brought to resemblyzer's -30 dBFS target in both directions (resemblyzer itself only
        raises it), so similarity does not depend on loudness, and so no sample exceeds full scale in the
        int16 copy its VAD reads (Kokoro peaks above 1.0 for some voices, which would wrap around there).
        """
        x = _resample(_mono(wav), sample_rate, SPEAKER_SAMPLE_RATE).astype(np.float32)
        x = self._normalize_volume(x, SPEAKER_TARGET_DBFS)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            speech = self._preprocess(x)  # VAD: long silences cut; no source_sr, already at 16 kHz
            if len(speech) == 0:  # nothing the VAD calls speech: embed what there is rather than fail
                speech = x
            with self._lock:
                e = self._encoder.embed_utterance(speech)
        return np.asarray(e, dtype=np.float32)

    def similarity(self, a: np.ndarray, b: np.ndarray, sample_rate: int) -> float:
        """Cosine similarity of the two d-vectors (1 = same voice; ~0.55 female vs male Kokoro voices)."""
        return cosine(self.embed(a, sample_rate), self.embed(b, sample_rate))


_SPEAKER_LOCK = threading.Lock()


@functools.cache
def _shared_speaker_encoder() -> SpeakerEncoder:
    return SpeakerEncoder("cpu")


def shared_speaker_encoder() -> SpeakerEncoder:
    """The process-wide SpeakerEncoder, loaded on first use (~2 s: torch and the weights)."""
    with _SPEAKER_LOCK:
        return _shared_speaker_encoder()


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def embed(wav: np.ndarray, sample_rate: int) -> np.ndarray:
    """d-vector [256] of `wav` with the shared encoder."""
    return shared_speaker_encoder().embed(wav, sample_rate)


def speaker_similarity(a: np.ndarray, b: np.ndarray, sample_rate: int, *,
                       speaker: SpeakerEncoder | None = None) -> float:
    """Cosine similarity of the d-vectors of `a` and `b`."""
    return (speaker or shared_speaker_encoder()).similarity(a, b, sample_rate)


def f0_stats(wav: np.ndarray, sample_rate: int) -> dict[str, float]:
    """Median F0 (Hz) over voiced frames, std of natural-log F0 (intonation range), and the voiced fraction.

    YIN (librosa.yin, 50-600 Hz, 10 ms hop) returns a pitch for every frame, silence included, so frames
    more than 30 dB below the loudest frame (RMS over the same frames) are dropped as unvoiced; unvoiced
    consonants that pass the gate barely move a median. They and YIN's octave errors do inflate a std
    (0.37 instead of pYIN's 0.16 on a Kokoro sentence), so the std is taken over the frames within an octave
    of the median (0.18). NaN statistics when fewer than 2 frames pass.
    """
    import librosa

    x = _mono(wav)
    frame = int(2 ** math.ceil(math.log2(2 * sample_rate / F0_MIN_HZ)))
    hop = max(1, sample_rate // 100)
    f0 = librosa.yin(x, fmin=F0_MIN_HZ, fmax=F0_MAX_HZ, sr=sample_rate, frame_length=frame, hop_length=hop)
    rms = librosa.feature.rms(y=x, frame_length=frame, hop_length=hop)[0]
    n = min(len(f0), len(rms))
    f0, rms = f0[:n], rms[:n]
    db = 20 * np.log10(np.maximum(rms, 1e-12))
    voiced = f0[db > db.max() - F0_GATE_DB]
    if len(voiced) < 2:
        return {"f0_median_hz": math.nan, "log_f0_std": math.nan, "voiced_fraction": len(voiced) / max(n, 1)}
    median = float(np.median(voiced))
    in_octave = voiced[np.abs(np.log2(voiced / median)) < 1.0]
    return {
        "f0_median_hz": median,
        "log_f0_std": float(np.std(np.log(in_octave))),
        "voiced_fraction": float(len(voiced) / n),
    }


def semitones(f_a: float, f_b: float) -> float:
    """Pitch interval from f_b to f_a in semitones (NaN if either is NaN)."""
    return float(12 * math.log2(f_a / f_b)) if f_a > 0 and f_b > 0 else math.nan


class StyleClassifier:
    """Nearest class centroid per attribute on per-dimension standardised features (see the module docstring).

    After `fit`: `classes[attr]` (sorted), `single_class` (attributes with one training class, flagged in
    `report`). Labels may be None (unlabelled): ignored in fit and in scoring.
    """

    def __init__(self, eps: float = 1e-6):
        self.eps = eps
        self.mean: np.ndarray | None = None
        self.std: np.ndarray | None = None
        self.classes: dict[str, list[str]] = {}
        self.centroids: dict[str, np.ndarray] = {}
        self.majority: dict[str, str] = {}

    @property
    def single_class(self) -> frozenset[str]:
        return frozenset(a for a, c in self.classes.items() if len(c) == 1)

    @staticmethod
    def _features(features: Any) -> np.ndarray:
        x = np.asarray(features, dtype=np.float64)
        if x.ndim != 2 or x.shape[0] == 0:
            raise ValueError(f"features must be [N, D] with N > 0, got shape {x.shape}")
        if not np.all(np.isfinite(x)):
            raise ValueError("features have non-finite values")
        return x

    @staticmethod
    def _check_labels(labels: Mapping[str, Sequence[str | None]], n: int) -> None:
        for attr, values in labels.items():
            if len(values) != n:
                raise ValueError(f"labels[{attr!r}] has {len(values)} entries for {n} feature rows")

    def fit(self, features: Any, labels: Mapping[str, Sequence[str | None]]) -> StyleClassifier:
        x = self._features(features)
        self._check_labels(labels, len(x))
        self.mean = x.mean(axis=0)
        std = x.std(axis=0)
        self.std = np.where(std > self.eps, std, 1.0)  # constant dims: centred, not blown up
        z = (x - self.mean) / self.std
        self.classes, self.centroids, self.majority = {}, {}, {}
        for attr, values in labels.items():
            known = [i for i, v in enumerate(values) if v is not None]
            if not known:
                raise ValueError(f"labels[{attr!r}] has no labelled example")
            classes = sorted({str(values[i]) for i in known})
            self.classes[attr] = classes
            self.centroids[attr] = np.stack(
                [z[[i for i in known if str(values[i]) == c]].mean(axis=0) for c in classes])
            counts = [sum(str(values[i]) == c for i in known) for c in classes]
            self.majority[attr] = classes[int(np.argmax(counts))]
        return self

    def _standardised(self, features: Any) -> np.ndarray:
        if self.mean is None or self.std is None:
            raise RuntimeError(f"{type(self).__name__}.predict before fit")
        x = self._features(features)
        if x.shape[1] != self.mean.shape[0]:
            raise ValueError(f"features have {x.shape[1]} dims, the classifier has {self.mean.shape[0]}")
        return (x - self.mean) / self.std

    def predict(self, features: Any) -> dict[str, list[str]]:
        z = self._standardised(features)
        out = {}
        for attr, centroids in self.centroids.items():
            d2 = ((z[:, None, :] - centroids[None, :, :]) ** 2).sum(axis=-1)  # [N, C]
            out[attr] = [self.classes[attr][k] for k in np.argmin(d2, axis=1)]
        return out

    def _scored(self, labels: Mapping[str, Sequence[str | None]], n: int):
        self._check_labels(labels, n)
        for attr, values in labels.items():
            if attr not in self.classes:
                raise ValueError(f"attribute {attr!r} was not in the training labels {sorted(self.classes)}")
            yield attr, [(i, str(v)) for i, v in enumerate(values) if v is not None]

    def accuracy(self, features: Any, labels: Mapping[str, Sequence[str | None]]) -> dict[str, float]:
        """Fraction of labelled rows predicted right, per attribute (NaN with none labelled)."""
        x = self._features(features)
        pred = self.predict(x)
        return {attr: (float(np.mean([pred[attr][i] == v for i, v in known])) if known else math.nan)
                for attr, known in self._scored(labels, len(x))}

    def report(self, features: Any, labels: Mapping[str, Sequence[str | None]]) -> dict[str, dict[str, Any]]:
        """Per attribute: accuracy, the majority-class baseline on these labels (the training majority class
        predicted for every row), n labelled, n_classes in training, and the single_class flag."""
        acc = self.accuracy(features, labels)
        out = {}
        for attr, known in self._scored(labels, len(np.asarray(features))):
            hits = [v == self.majority[attr] for _, v in known]
            out[attr] = {
                "accuracy": acc[attr],
                "majority": float(np.mean(hits)) if known else math.nan,
                "n": len(known),
                "n_classes": len(self.classes[attr]),
                "single_class": len(self.classes[attr]) == 1,
            }
        return out


def speech_rows(systems: Mapping[str, Sequence[np.ndarray]], gold: Sequence[np.ndarray], sample_rate: int, *,
                speaker: SpeakerEncoder | None = None, progress: bool = True) -> dict[str, dict[str, float]]:
    """Per system, means over the aligned pairs (i-th generated wav vs i-th gold wav, same text):

    - `mcd` (see `mcd`; lower is better),
    - `speaker_similarity` (d-vector cosine with the gold wav; higher is better),
    - `f0_semitones`: |median F0 difference| in semitones (pairs where either pitch is undefined are left
      out; `f0_pairs` counts the rest),
    - `duration_ratio`: generated / gold speech duration (edge silence trimmed; 1 is best),
    - `n`: number of pairs scored; `unusable`: generated wavs with too little speech to score (left out).
    Gold d-vectors, pitches and durations are computed once and shared by all systems.
    """
    from tqdm import tqdm

    for name, wavs in systems.items():
        if len(wavs) != len(gold):
            raise ValueError(f"system {name!r} has {len(wavs)} wavs for {len(gold)} gold wavs")
    speaker = speaker or shared_speaker_encoder()
    gold_ref = [
        (speaker.embed(w, sample_rate), f0_stats(w, sample_rate)["f0_median_hz"],
         speech_duration(w, sample_rate))
        for w in tqdm(gold, desc="speech metrics: gold", unit="wav", disable=not progress, leave=False)
    ]
    rows: dict[str, dict[str, float]] = {}
    for name, wavs in systems.items():
        mcds, sims, f0s, ratios = [], [], [], []
        pairs = zip(wavs, gold, gold_ref, strict=True)
        bar = tqdm(pairs, total=len(gold), desc=f"speech metrics: {name}", unit="wav", disable=not progress,
                   leave=False)
        unusable = 0
        for w, g, (g_emb, g_f0, g_dur) in bar:
            try:  # a generated wav with (almost) no speech cannot be scored: counted, not fatal
                m, e = mcd(g, w, sample_rate), speaker.embed(w, sample_rate)
            except ValueError:
                unusable += 1
                continue
            mcds.append(m)
            sims.append(cosine(e, g_emb))
            f0 = semitones(f0_stats(w, sample_rate)["f0_median_hz"], g_f0)
            if not math.isnan(f0):
                f0s.append(abs(f0))
            ratios.append(speech_duration(w, sample_rate) / g_dur)
        rows[name] = {
            "mcd": float(np.mean(mcds)) if mcds else math.nan,
            "speaker_similarity": float(np.mean(sims)) if sims else math.nan,
            "f0_semitones": float(np.mean(f0s)) if f0s else math.nan,
            "f0_pairs": float(len(f0s)),
            "duration_ratio": float(np.mean(ratios)) if ratios else math.nan,
            "n": float(len(mcds)),
            "unusable": float(unusable),
        }
    return rows


def intelligibility_rows(replies: Sequence[str], transcripts: Sequence[str]) -> dict[str, float]:
    """`wer` and `cer`: corpus-level error rates of what the recogniser heard against the reply texts (pair i
    = reply i and the transcript of its wav; `asr.word_error_rate` / `asr.char_error_rate`, lower is better).
    Every reply counts, including speech too short for MCD (`unusable` in `speech_rows`): a reply that cannot
    be heard loses all its words."""
    from empatheia_jax.data.encoders import asr

    return {"wer": asr.word_error_rate(replies, transcripts),
            "cer": asr.char_error_rate(replies, transcripts)}


class LinearStyleProbe(StyleClassifier):
    """Per attribute, scikit-learn's linear discriminant analysis with Ledoit-Wolf shrinkage on the
    standardised features; `StyleClassifier`'s fit / predict / accuracy / report otherwise. The probe of
    every style row of eval: the predicted speech style vectors (eval/speech.py) and the rendered avatars
    (`video_metrics.video_style_features`, eval/video.py).

    Why not the nearest centroid: it weighs every direction equally, and the directions that tell one
    attribute vary inside the classes of another, so a subtle attribute drowns. On the voice map's own gold
    vectors (every profile in each listener style) the centroid probe read timbre right 0.42 of the time and
    age 0.66 (version 2 of the map, docs/benchmarks.md); on the rendered avatars it told the listener's
    empathetic face from a neutral one at chance (gold test clips: emotion 0.50, timbre 0.85), the LDA at
    1.00 (age 0.95, gender and timbre 1.00). The pooled covariance learns which directions vary within a
    class; shrinkage keeps it invertible with fewer examples than features per class.
    """

    def fit(self, features: Any, labels: Mapping[str, Sequence[str | None]]) -> LinearStyleProbe:
        from sklearn.discriminant_analysis import LinearDiscriminantAnalysis

        super().fit(features, labels)  # classes, majority class, standardisation
        z = self._standardised(features)
        self.models = {}
        for attr, values in labels.items():
            if len(self.classes[attr]) > 1:
                known = [i for i, v in enumerate(values) if v is not None]
                self.models[attr] = LinearDiscriminantAnalysis(solver="lsqr", shrinkage="auto").fit(
                    z[known], [str(values[i]) for i in known])
        return self

    def predict(self, features: Any) -> dict[str, list[str]]:
        z = self._standardised(features)
        return {attr: ([classes[0]] * len(z) if attr not in self.models
                       else [str(c) for c in self.models[attr].predict(z)])
                for attr, classes in self.classes.items()}
