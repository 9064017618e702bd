"""Encoder throughput: clips per second of `encode_audio` (or, with --video, `encode_video`) for each named
encoder, on 5-s clips.

Audio clips are seeded synthetic voices (a gliding harmonic tone with a syllable-rate envelope and a little
noise): neither encoder's cost depends on what is said. Video clips are the procedural face
(`generators/face_render.py`, 25 fps, a seeded mouth track) written as h264 .mp4 files at each of `--sizes`,
so the timing includes decoding, as in shard preparation. Each encoder encodes one clip first (loading the
weights, compiling the jitted forward) outside the timing, then `--clips` clips, timed together.

    python bench/encoders.py                  # lite vs whisper_tiny_en vs whisper_base, 20 clips of 5 s
    python bench/encoders.py --encoders whisper_tiny_en+lite --clips 10 --seconds 5
    python bench/encoders.py --video                          # lite vs facemesh video at 128 and 256 px
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from empatheia_jax.data.encoders import get_encoder  # noqa: E402

SR = 16000


def voice(seed: int, seconds: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SR)) / SR
    f0 = rng.uniform(100, 250) * (1 + 0.1 * np.sin(2 * np.pi * rng.uniform(0.2, 0.6) * t))
    phase = 2 * np.pi * np.cumsum(f0) / SR
    env = 0.6 + 0.4 * np.sin(2 * np.pi * rng.uniform(3, 5) * t)
    x = env * sum(np.sin(h * phase) / h for h in range(1, 6)) + 0.02 * rng.standard_normal(len(t))
    return (0.2 * x / np.abs(x).max()).astype(np.float32)


def face_clips(folder: Path, n: int, seconds: float, size: int) -> list[Path]:
    from empatheia_jax.generators.face_render import FRAME_RATE, render_face_video

    out = []
    for i in range(n):
        rng = np.random.default_rng(i)
        env = np.clip(rng.uniform(-0.3, 1.0, int(seconds * FRAME_RATE)), 0, 1)
        path = folder / f"face{size}_{i}.mp4"
        render_face_video(env, {"ID": i % 8, "age": "young", "gender": "female", "timbre": "mid"}, "neutral",
                          path, size=size)
        out.append(path)
    return out


def bench_video(names: list[str], clips: int, seconds: float, sizes: list[int]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            paths = face_clips(Path(tmp), clips + 1, seconds, size)
            for name in names:
                t0 = time.perf_counter()
                enc = get_encoder(name)
                enc.encode_video(paths[0])
                first = time.perf_counter() - t0
                t0 = time.perf_counter()
                for p in paths[1:]:
                    enc.encode_video(p)
                dt = time.perf_counter() - t0
                print(f"{name:24s} {size}x{size}  {clips / dt:8.2f} clips/s  "
                      f"({1000 * dt / clips:.0f} ms/clip; load + first clip {first:.1f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--encoders", default=None,
                    help="comma-separated (default lite,whisper_tiny_en+lite,whisper_base+lite; "
                         "--video: lite,lite+facemesh)")
    ap.add_argument("--clips", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--video", action="store_true", help="time encode_video on rendered faces instead")
    ap.add_argument("--sizes", default="128,256", help="with --video: frame sizes (pixels, square)")
    args = ap.parse_args()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.1f}; {args.clips} clips of {args.seconds:g} s")
    if args.video:
        names = (args.encoders or "lite,lite+facemesh").split(",")
        bench_video(names, args.clips, args.seconds, [int(s) for s in args.sizes.split(",")])
        return
    clips = [voice(i, args.seconds) for i in range(args.clips + 1)]
    for name in (args.encoders or "lite,whisper_tiny_en+lite,whisper_base+lite").split(","):
        t0 = time.perf_counter()
        enc = get_encoder(name)
        enc.encode_audio((clips[0], SR))
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        for y in clips[1:]:
            enc.encode_audio((y, SR))
        dt = time.perf_counter() - t0
        print(f"{name:24s} {args.clips / dt:8.2f} clips/s  ({1000 * dt / args.clips:.0f} ms/clip; "
              f"load + first clip {first:.1f} s)")


if __name__ == "__main__":
    main()
