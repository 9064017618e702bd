"""numpy DSP: librosa's definitions (librosa.filters.mel, librosa.stft, librosa.yin of librosa >= 0.11),
held to librosa by tests/test_encoders.py, and Whisper's log-mel (held to faster-whisper by
tests/test_whisper_encoder.py).

Why not librosa itself: its first call costs seconds per process (scipy.signal, numba compilation), paid by
every test process and every prepare/targets pool worker. `lite`, the Whisper encoders and the stand-in
targets (`data/targets.py`) share these functions.
"""

from __future__ import annotations

import math

import numpy as np


def _hz_to_mel(f: np.ndarray | float) -> np.ndarray:
    """Slaney mel scale (librosa's default): linear below 1 kHz, logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    logstep = math.log(6.4) / 27.0
    return np.where(f >= 1000.0, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / logstep, f / (200.0 / 3))


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    logstep = math.log(6.4) / 27.0
    return np.where(m >= 15.0, 1000.0 * np.exp(logstep * (m - 15.0)), (200.0 / 3) * m)


def mel_centers(sr: int, n_mels: int, fmin: float, fmax: float) -> np.ndarray:
    """Centre frequencies (Hz) of the `mel_filterbank` bands."""
    return _mel_to_hz(np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), n_mels + 2))[1:-1]


def mel_filterbank(sr: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> np.ndarray:
    """Slaney-normalised triangular mel filters [n_mels, n_fft//2+1] (= librosa.filters.mel defaults)."""
    fft_f = np.linspace(0, sr / 2, 1 + n_fft // 2)
    mel_f = _mel_to_hz(np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), n_mels + 2))
    fdiff = np.diff(mel_f)
    ramps = mel_f[:, None] - fft_f[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    w = np.maximum(0, np.minimum(lower, upper)) * (2.0 / (mel_f[2:] - mel_f[:-2]))[:, None]
    return w.astype(np.float32)


def frame_signal(y: np.ndarray, frame_length: int, hop: int) -> np.ndarray:
    """Centred frames [n, frame_length] (zero padding of frame_length//2 each side), n = 1 + len(y)//hop."""
    pad = frame_length // 2
    yp = np.pad(y, (pad, pad + frame_length))
    n = 1 + len(y) // hop
    return np.lib.stride_tricks.sliding_window_view(yp, frame_length)[: n * hop : hop]


def stft_power(frames: np.ndarray) -> np.ndarray:
    """|rfft(hann * frame)|^2 per frame: [n, frame_length//2+1]."""
    n = frames.shape[1]
    win = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / n)).astype(np.float32)  # periodic Hann
    return np.abs(np.fft.rfft(frames * win, axis=1)) ** 2


def whisper_log_mel(
    y: np.ndarray, sr: int = 16000, n_fft: int = 400, hop: int = 160, n_mels: int = 80
) -> np.ndarray:
    """Whisper's normalised log-mel [n_mels, len(y)//hop + 1] of 16-kHz samples, as faster-whisper's
    `FeatureExtractor()(y)` computes it (held to it within 1e-4 by tests/test_whisper_encoder.py).

    `hop` zero samples are appended, the signal is reflect-padded by n_fft/2 each side, framed every `hop`
    samples and the last frame dropped; power spectrum (periodic Hann, float32) -> Slaney mel filters over
    0..sr/2 -> log10 (floor 1e-10) -> clamped to (its maximum - 8) -> (x + 4) / 4. `stft_power` and
    `mel_filterbank` are the ones `lite` uses (the same definitions as Whisper's); `frame_signal` is not:
    Whisper pads by reflection, `lite` (librosa's pad_mode="constant") with zeros, and the frame counts
    differ. The 30-s padding is not here: like faster-whisper, the caller takes the first len(y)//hop
    frames (the audio's) and pads the mel with zeros to 3000 frames (`WhisperTinyEnEncoder`).
    """
    x = np.pad(np.asarray(y, np.float32), (0, hop))
    x = np.pad(x, (n_fft // 2, n_fft // 2), mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(x, n_fft)[::hop][:-1]
    fb = mel_filterbank(sr, n_fft, n_mels, 0.0, sr / 2)
    log_spec = np.log10(np.maximum(stft_power(frames) @ fb.T, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).T.astype(np.float32)


def yin(
    y: np.ndarray, sr: int, fmin: float, fmax: float, hop: int, threshold: float = 0.1
) -> tuple[np.ndarray, np.ndarray]:
    """YIN f0 per centred frame, vectorised; returns (f0 Hz, aperiodicity).

    Exactly `librosa.yin(y, fmin=, fmax=, sr=, frame_length=2*ceil(sr/fmin)+2, hop_length=hop,
    trough_threshold=threshold, center=True, pad_mode="constant")` of librosa >= 0.11: its difference
    function d(k) = 2 (r(0) - r(k)) - sum_{m<k} y(m)^2 over the whole frame (0.11 dropped 0.10's
    integration window, which lite v1 followed), the cumulative-mean normalisation, the first trough below
    `threshold` (else the global minimum, with librosa's edge conventions) and its parabolic refinement.
    tests/test_encoders.py holds it to librosa within 1e-6 relative (the troughs are differences of
    near-equal sums, which another FFT size rounds differently). The frame is two periods of fmin, as
    librosa advises. Aperiodicity (ours) is the normalised difference at the chosen lag (low = voiced).
    """
    min_p = int(math.floor(sr / fmax))
    max_p = int(math.ceil(sr / fmin))
    length = 2 * max_p + 2
    frames = frame_signal(y.astype(np.float64), length, hop)
    nfft = 1 << int(math.ceil(math.log2(2 * length - 1)))  # linear (not circular) autocorrelation
    spec = np.fft.rfft(frames, nfft)
    r = np.fft.irfft(spec.real**2 + spec.imag**2, nfft)[:, : max_p + 1]
    energy = np.cumsum(frames[:, :max_p] ** 2, axis=1)  # energy[:, k-1] = sum_{m<k} y(m)^2
    d = 2 * (r[:, :1] - r[:, 1:]) - energy  # d[:, k-1] = d(k), k = 1..max_p
    mean = np.cumsum(d, axis=1) / np.arange(1, max_p + 1)
    seg = d[:, min_p - 1 :] / (mean[:, min_p - 1 :] + np.finfo(np.float64).tiny)  # lags min_p..max_p
    trough = np.zeros_like(seg, dtype=bool)
    trough[:, 1:-1] = (seg[:, 1:-1] < seg[:, :-2]) & (seg[:, 1:-1] <= seg[:, 2:])
    trough[:, 0] = seg[:, 0] < seg[:, 1]
    trough[:, -1] = seg[:, -1] < seg[:, -2]  # librosa.util.localmin pads by the edge value
    good = trough & (seg < threshold)
    idx = np.where(good.any(axis=1), good.argmax(axis=1), seg.argmin(axis=1))
    rows = np.arange(len(frames))
    inner = np.clip(idx, 1, seg.shape[1] - 2)
    a = seg[rows, inner + 1] + seg[rows, inner - 1] - 2 * seg[rows, inner]
    b = (seg[rows, inner + 1] - seg[rows, inner - 1]) / 2
    edge = (idx == 0) | (idx == seg.shape[1] - 1) | (np.abs(b) >= np.abs(a))  # no shift (librosa's rule)
    shift = np.where(edge, 0.0, -b / np.where(edge, 1.0, a))
    return sr / (min_p + idx + shift), seg[rows, idx]
