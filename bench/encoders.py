"""Audio-encoder throughput: clips per second of `encode_audio` for each named encoder, on 5-s clips.

The clips are seeded synthetic voices (a gliding harmonic tone with a syllable-rate envelope and a little
noise): neither encoder's cost depends on what is said. Each encoder encodes one clip first (loading the
weights, compiling the jitted forward) outside the timing, then `--clips` clips, timed together.

    python bench/encoders.py                                  # lite vs whisper_tiny_en, 20 clips of 5 s
    python bench/encoders.py --encoders whisper_tiny_en+lite --clips 10 --seconds 5
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--encoders", default="lite,whisper_tiny_en+lite", help="comma-separated names")
    ap.add_argument("--clips", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args()
    clips = [voice(i, args.seconds) for i in range(args.clips + 1)]
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.1f}; {args.clips} clips of {args.seconds:g} s")
    for name in args.encoders.split(","):
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
