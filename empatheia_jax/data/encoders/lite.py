"""The `lite` encoder: cheap deterministic statistics of speech and face video, the embedded default (a few
ms per utterance, no weights).

Why it exists: shard preparation, the tests and the demo need an encoder that runs anywhere in
milliseconds and still carries the emotion and profile signal (pitch, energy, rate; mouth motion, face
colour), so that nothing in the pipeline waits for pretrained weights. Its DSP is `dsp`'s numpy (held to
librosa), its media reading `media`'s.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from empatheia_jax.data.encoders.dsp import frame_signal, mel_centers, mel_filterbank, stft_power, yin
from empatheia_jax.data.encoders.media import AudioInput, VideoInput, chunks, load_audio, read_video_ycbcr
from empatheia_jax.data.encoders.registry import Encoder, register_encoder

AUDIO_SCALAR_NAMES = (
    "f0_mean",
    "f0_std",
    "f0_p10",
    "f0_p50",
    "f0_p90",
    "voiced_frac",
    "f0_slope",
    "energy_mean",
    "energy_std",
    "energy_max",
    "peak_rate",
    "vuv_rate",
    "log_duration",
    "centroid_mean",
    "centroid_std",
    "zcr_mean",
)
VIDEO_SCALAR_NAMES = (
    "mouth_motion_mean",
    "mouth_motion_std",
    "mouth_motion_max",
    "motion_mean",
    "motion_std",
    "mouth_dark_mean",
    "mouth_dark_std",
    "log_duration",
)


@register_encoder("lite")
class LiteEncoder(Encoder):
    """Cheap deterministic statistics that carry the emotion/profile signal of speech and face video.

    Audio [k, 2*n_mels + 16]: per chunk, the mean and std over time of the normalised log-mel
    ((log(1e-5+mel)+4)/4, StyleTTS2's normalisation), then `AUDIO_SCALAR_NAMES`: pitch (YIN, in
    octaves relative to 150 Hz, over voiced frames), voicing, energy (dB/20), rate proxies (energy
    peaks and voicing changes per second / 5), log duration, spectral centroid (/4 kHz), zero-crossing rate.
    Video [k, 2*grid^2 + 6 + 8]: per chunk, the mean and std over frames of a grid x grid luma
    thumbnail in [0,1] and of the frame's mean (Y, Cb, Cr) / 255, then `VIDEO_SCALAR_NAMES`: motion
    energy (mean |frame difference| x 10) in the mouth box (full resolution) and over the thumbnail,
    mouth darkness (open mouth), log duration. The mouth box is the lower-middle of the frame
    (`mouth_box`, fractions of height/width), where a centred face puts it.
    """

    modalities = ("audio", "video")
    VERSION = 2  # 2: YIN = librosa 0.11's (whole-frame difference function); 1 had 0.10's integration window

    def __init__(
        self,
        k: int = 1,
        sample_rate: int = 16000,
        n_mels: int = 40,
        grid: int = 16,
        fmin: float = 60.0,
        fmax: float = 500.0,
        mouth_box: tuple[float, float, float, float] = (0.56, 0.82, 0.30, 0.70),
    ):
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k, self.sample_rate, self.n_mels, self.grid = int(k), int(sample_rate), int(n_mels), int(grid)
        self.fmin, self.fmax, self.mouth_box = float(fmin), float(fmax), tuple(float(v) for v in mouth_box)
        self.hop = self.sample_rate // 100  # 10 ms frames
        self.n_fft = 1 << int(math.ceil(math.log2(self.sample_rate * 0.025)))  # >= 25 ms window
        self.audio_dim = 2 * self.n_mels + len(AUDIO_SCALAR_NAMES)
        self.video_dim = 2 * (self.grid * self.grid + 3) + len(VIDEO_SCALAR_NAMES)
        self._mel_fb: np.ndarray | None = None

    def config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.VERSION,
            "k": self.k,
            "sample_rate": self.sample_rate,
            "n_mels": self.n_mels,
            "grid": self.grid,
            "fmin": self.fmin,
            "fmax": self.fmax,
            "mouth_box": list(self.mouth_box),
            "audio_dim": self.audio_dim,
            "video_dim": self.video_dim,
            "audio_scalars": list(AUDIO_SCALAR_NAMES),
            "video_scalars": list(VIDEO_SCALAR_NAMES),
        }

    # -- audio ----------------------------------------------------------------------------------
    def audio_frames(self, audio: AudioInput) -> dict[str, np.ndarray]:
        """Per-10ms-frame tracks (log-mel [n,M], f0 [n], voiced [n], energy dB/20 [n], centroid, zcr)."""
        y = load_audio(audio, self.sample_rate)
        if len(y) < self.n_fft:
            y = np.pad(y, (0, self.n_fft - len(y)))
        if self._mel_fb is None:
            self._mel_fb = mel_filterbank(
                self.sample_rate, self.n_fft, self.n_mels, 50.0, self.sample_rate / 2
            )
            self._mel_hz = mel_centers(self.sample_rate, self.n_mels, 50.0, self.sample_rate / 2)
        frames = frame_signal(y, self.n_fft, self.hop)  # [n, n_fft]
        mel = stft_power(frames) @ self._mel_fb.T  # [n, M]
        logmel = (np.log(1e-5 + mel) + 4.0) / 4.0
        rms = np.sqrt(np.mean(frames**2, axis=1) + 1e-12)
        energy = 20 * np.log10(rms + 1e-5) / 20.0
        f0, aperiodicity = yin(y, self.sample_rate, self.fmin, self.fmax, self.hop)
        n = len(frames)
        f0, aperiodicity = f0[:n], aperiodicity[:n]
        loud = rms > max(rms.max() * 10 ** (-35 / 20), 1e-4)
        voiced = loud & (aperiodicity < 0.35) & (f0 > self.fmin * 1.05) & (f0 < self.fmax * 0.95)
        w = mel / (mel.sum(axis=1, keepdims=True) + 1e-10)
        centroid = (w @ self._mel_hz) / 4000.0
        zcr = np.mean(np.abs(np.diff(np.signbit(frames).astype(np.int8), axis=1)), axis=1)
        return {
            "logmel": logmel.astype(np.float32),
            "f0": f0,
            "voiced": voiced,
            "energy": energy,
            "centroid": centroid,
            "zcr": zcr,
        }

    def encode_audio(self, audio: AudioInput) -> np.ndarray:
        tr = self.audio_frames(audio)
        n = len(tr["f0"])
        out = np.empty((self.k, self.audio_dim), np.float32)
        for i, sl in enumerate(chunks(n, self.k)):
            lm = tr["logmel"][sl]
            out[i, : self.n_mels] = lm.mean(0)
            out[i, self.n_mels : 2 * self.n_mels] = lm.std(0)
            out[i, 2 * self.n_mels :] = self._audio_scalars({key: v[sl] for key, v in tr.items()})
        return out

    def _audio_scalars(self, tr: dict[str, np.ndarray]) -> np.ndarray:
        n = len(tr["f0"])
        seconds = n * self.hop / self.sample_rate
        v = tr["voiced"]
        s = np.zeros(len(AUDIO_SCALAR_NAMES), np.float64)
        if v.sum() >= 2:
            lf0 = np.log2(tr["f0"][v] / 150.0)
            s[0], s[1] = lf0.mean(), lf0.std()
            s[2], s[3], s[4] = np.percentile(lf0, [10, 50, 90])
            t = np.nonzero(v)[0] * (self.hop / self.sample_rate)
            s[6] = np.polyfit(t, lf0, 1)[0] if np.ptp(t) > 0 else 0.0
        s[5] = v.mean()
        e = tr["energy"]
        s[7], s[8], s[9] = e.mean(), e.std(), e.max()
        # syllable-rate proxy: local energy maxima above the chunk mean, at least 30 ms apart
        if n >= 3:
            pk = (e[1:-1] > e[:-2]) & (e[1:-1] >= e[2:]) & (e[1:-1] > e.mean())
            idx = np.nonzero(pk)[0]
            if len(idx):
                keep = [idx[0]]
                for j in idx[1:]:
                    if j - keep[-1] >= 3:
                        keep.append(j)
                s[10] = len(keep) / seconds / 5.0
        s[11] = np.count_nonzero(np.diff(v.astype(np.int8))) / seconds / 5.0
        s[12] = math.log(seconds)
        s[13], s[14] = tr["centroid"].mean(), tr["centroid"].std()
        s[15] = tr["zcr"].mean()
        return s.astype(np.float32)

    # -- video ----------------------------------------------------------------------------------
    def encode_video(self, video: VideoInput) -> np.ndarray:
        luma, ycc, fps, (y_off, y_scale) = read_video_ycbcr(video)
        t, h, w = luma.shape
        g = self.grid
        # the range map is affine, so it is applied after the (linear) reductions: cheaper, same result
        thumb = ((_area_resize(luma, g, g) - y_off) * (y_scale / 255.0)).reshape(t, g * g)
        r0, r1, c0, c1 = self.mouth_box
        rows = slice(int(r0 * h), max(int(r1 * h), int(r0 * h) + 1))
        cols = slice(int(c0 * w), max(int(c1 * w), int(c0 * w) + 1))
        mouth = (luma[:, rows, cols].astype(np.float32) - y_off) * (y_scale / 255.0)
        if t > 1:
            m_motion = np.abs(np.diff(mouth, axis=0)).mean((1, 2)) * 10.0
            g_motion = np.abs(np.diff(thumb, axis=0)).mean(1) * 10.0
            m_motion = np.concatenate([m_motion[:1], m_motion])  # align: frame i's change from i-1
            g_motion = np.concatenate([g_motion[:1], g_motion])
        else:
            m_motion = g_motion = np.zeros(1, np.float32)
        dark = 1.0 - mouth.mean((1, 2))
        ycc = ycc / 255.0
        out = np.empty((self.k, self.video_dim), np.float32)
        gg = g * g
        for i, sl in enumerate(chunks(t, self.k)):
            out[i, :gg] = thumb[sl].mean(0)
            out[i, gg : 2 * gg] = thumb[sl].std(0)
            out[i, 2 * gg : 2 * gg + 3] = ycc[sl].mean(0)
            out[i, 2 * gg + 3 : 2 * gg + 6] = ycc[sl].std(0)
            mm, gm, dk = m_motion[sl], g_motion[sl], dark[sl]
            n_sl = sl.stop - sl.start
            out[i, 2 * gg + 6 :] = (
                mm.mean(),
                mm.std(),
                mm.max(),
                gm.mean(),
                gm.std(),
                dk.mean(),
                dk.std(),
                math.log(max(n_sl, 1) / fps),
            )
        return out


def _area_resize(x: np.ndarray, oh: int, ow: int) -> np.ndarray:
    """Box-filter downsample of [T,H,W] to [T,oh,ow] (bins of near-equal size; exact area mean)."""
    t, h, w = x.shape
    if h % oh == 0 and w % ow == 0:  # two 1-axis sums over contiguous blocks: ~5x faster than mean((2, 4))
        acc = np.uint32 if x.dtype == np.uint8 else np.float64
        s = x.reshape(t, oh, h // oh, w).sum(2, dtype=acc).reshape(t, oh, ow, w // ow).sum(3)
        return (s / ((h // oh) * (w // ow))).astype(np.float32)
    x = x.astype(np.float32)
    rows = np.linspace(0, h, oh + 1).astype(np.int64)[:-1]
    cols = np.linspace(0, w, ow + 1).astype(np.int64)[:-1]
    if h < oh or w < ow:  # upsample tiny frames by repetition first
        x = np.repeat(np.repeat(x, -(-oh // h), axis=1), -(-ow // w), axis=2)
        return _area_resize(x, oh, ow)
    s = np.add.reduceat(np.add.reduceat(x, rows, axis=1), cols, axis=2)
    rc = np.diff(np.append(rows, h))
    cc = np.diff(np.append(cols, w))
    return s / (rc[None, :, None] * cc[None, None, :])
