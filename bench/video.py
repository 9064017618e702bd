"""Video-out benchmark: the face generator's rendering and encoding rate, and the video metrics' cost.

    python bench/video.py [--frames 500] [--repeats 3] [--json OUT]

Measured on one clip of --frames frames (a speech-like envelope, one avatar): render_controls (frames/s),
h264 encoding with the speech muxed in (frames/s), the sample's own path (face_controls + render), and the
video rows' metrics on gold vs a generated clip (ms per frame: FaceMesh landmarks twice, SSIM, PSNR, CPBD
on every 5th frame, lip sync). There is no reference implementation to run beside it: DreamTalk's weights
are not obtainable here. Median of --repeats runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frames", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from empatheia_jax.eval.metrics.video import video_rows
    from empatheia_jax.generators.face_render import encode_mp4, face_controls, render_controls

    n = args.frames
    env = np.clip(np.abs(np.sin(np.arange(n) / 3.0)) * (np.arange(n) % 50 < 40), 0, 1)
    profile = {"age": "young", "gender": "female", "timbre": "mid", "ID": 7}
    content, style = face_controls(env, profile, "empathetic")
    render_controls(content, style)  # warm-up: the avatar's parts are drawn once and cached
    t_render = timed(lambda: render_controls(content, style), args.repeats)
    t_sample = timed(lambda: render_controls(*face_controls(env, profile, "empathetic")), args.repeats)
    frames = render_controls(content, style)
    speech = (np.sin(np.arange(n * 640) / 7.0) * 3000).astype(np.int16)
    with tempfile.TemporaryDirectory() as tmp:
        t_encode = timed(lambda: encode_mp4(frames, Path(tmp) / "a.mp4", audio=(speech, 16000)), args.repeats)
    other = render_controls(np.roll(content, 3, axis=0), style)
    clip = slice(0, min(n, 150))
    video_rows({"warm": [other[:10]]}, [frames[:10]], [env[:10]], progress=False)
    t_metrics = timed(lambda: video_rows({"gen": [other[clip]]}, [frames[clip]], [env[clip]], progress=False),
                      1)
    result = {
        "device": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), one thread",
        "frames": n,
        "render_controls_fps": round(n / t_render, 1),
        "face_controls_plus_render_fps": round(n / t_sample, 1),
        "encode_h264_with_audio_fps": round(n / t_encode, 1),
        "video_rows_ms_per_frame": round(1000 * t_metrics / len(frames[clip]), 2),
    }
    for k, v in result.items():
        print(f"{k}: {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
