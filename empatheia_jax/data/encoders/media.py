"""Media reading for the encoders: audio to mono samples at a rate, video to luma/YCbCr or RGB frames, frame
sampling at a rate, and the k equal time chunks every encoder pools over.

Why apart from the encoders: every encoder reads its media the same way (the same resampling, the same
range mapping, the same chunk edges), and `data/targets.py` and the DreamTalk converters read audio with
`load_audio` too. PyAV, soundfile and soxr are imported inside the functions: importing this module stays
cheap.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

AudioInput = str | os.PathLike | tuple[np.ndarray, int]
VideoInput = str | os.PathLike | np.ndarray


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


def chunks(n: int, k: int) -> list[slice]:
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
