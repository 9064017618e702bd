"""Turn latency of `empatheia serve`: p50/p95 of decode, speech, video and the client's wall time.

    python bench/serve.py --ckpt work/run/overall [--backbone DIR] [--turns 12] [--render avatar] [--json OUT]
    python bench/serve.py --ckpt empatheia_jax/resources/reference --backbone work/smollm2   # the reference
    python bench/serve.py --tiny /tmp/bench_serve [--turns 12]   # trains the tests' tiny run (1 step) first

Starts `empatheia serve` as a subprocess on a free loopback port, sends one warm-up turn (compilation), then
--turns turns over HTTP (POST /api/turn with a pinned listener avatar; a new conversation every 4 turns, so
the prompt stays the size of a short dialogue), one at a time, and reports the server's own timings and the
client's wall time per turn. Each part is also set against its own rate, to say which part bounds a turn
and how far it is from its floor: decode tokens/s, the speech generator's real-time factor (compute seconds
per second of audio), the face renderer's frames/s. The server warms up at start (every prompt length
compiled) unless --nowarmup.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
TEXTS = ("I failed my exam today.", "My dog is sick and I am scared.", "I got the job I wanted!",
         "Nobody came to my birthday party.")


def tiny_run(root: Path) -> Path:
    """The tests' tiny trained run (stage coe, 1 step, real Kokoro/face targets), built once under `root`."""
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import make_tiny_shards, saved_smollm2_tokenizer

    workdir = root / "run" / "coe"
    if (workdir / "checkpoints").is_dir():
        return workdir

    class Factory:  # what saved_smollm2_tokenizer needs of pytest's tmp_path_factory
        @staticmethod
        def getbasetemp() -> Path:
            return root

    root.mkdir(parents=True, exist_ok=True)
    tok = saved_smollm2_tokenizer(Factory)
    shards = make_tiny_shards(root / "data", real_targets=True)
    subprocess.run([sys.executable, "-m", "empatheia_jax.cli", "train", "--config",
                    str(REPO / "configs/tiny.py"), f"--config.model.tokenizer={tok}",
                    f"--config.data.shards={shards}", f"--workdir={workdir}", "--config.stage=coe",
                    "--config.schedule.coe.steps=1", "--config.optim.warmup_steps=0"],
                   check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    return workdir


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt")
    ap.add_argument("--backbone", help="serve --backbone: the converted backbone of an export")
    ap.add_argument("--nowarmup", action="store_true", help="serve --nowarmup: compile on the first turns")
    ap.add_argument("--tiny", type=Path, help="build and use the tests' tiny run under this folder")
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--render", default="avatar", choices=("text", "speech", "avatar"))
    ap.add_argument("--max_new_tokens", type=int, default=24)
    ap.add_argument("--json")
    args = ap.parse_args()
    ckpt = args.ckpt or (tiny_run(args.tiny) if args.tiny else ap.error("--ckpt or --tiny"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "empatheia_jax.cli", "serve", "--ckpt", str(ckpt), "--port", str(port),
               "--max_new_tokens", str(args.max_new_tokens)]
        cmd += ["--backbone", args.backbone] if args.backbone else []
        cmd += ["--nowarmup"] if args.nowarmup else []
        proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": tmp})
        try:
            while True:
                try:
                    urllib.request.urlopen(url + "/api/health", timeout=2)
                    break
                except OSError:
                    if proc.poll() is not None:
                        raise SystemExit("serve exited") from None
                    time.sleep(0.2)
            startup = time.monotonic() - t0
            listener = {"age": "young", "gender": "female", "timbre": "mid"}
            first = post(url + "/api/turn", {"text": TEXTS[0], "render": args.render, "listener": listener})
            rows, conv = [], None
            for i in range(args.turns):
                if i % 4 == 0:
                    conv = None
                t = time.perf_counter()
                r = post(url + "/api/turn", {"conversation": conv, "text": TEXTS[i % len(TEXTS)],
                                             "render": args.render, "listener": listener})
                rows.append({**r["timings"], "wall": time.perf_counter() - t, "new_tokens": r["new_tokens"],
                             "audio_seconds": r["speech_seconds"], "frames": r["frames"],
                             "prompt_length": r["prompt_length"]})
                conv = r["conversation"]
        finally:
            proc.terminate()
            proc.wait(60)
    keys = [k for k in ("decode", "speech", "video", "queue", "total", "wall") if k in rows[0]]
    summary = {k: {"p50": float(np.percentile([r[k] for r in rows], 50)),
                   "p95": float(np.percentile([r[k] for r in rows], 95))} for k in keys}
    print(f"serve start-up (import + load) {startup:.1f} s; first turn (compiles) "
          f"{first['timings']['total']:.2f} s")
    print(f"{args.turns} turns, render={args.render}, max_new_tokens={args.max_new_tokens}:")
    for k in keys:
        print(f"  {k:7s} p50 {summary[k]['p50']:.3f} s   p95 {summary[k]['p95']:.3f} s")
    rates = {"decode tokens/s": ("new_tokens", "decode"),
             "speech real-time factor": ("speech", "audio_seconds"), "video frames/s": ("frames", "video")}
    for name, (num, den) in rates.items():
        if num in rows[0] and den in rows[0] and sum(r[den] for r in rows) > 0:
            summary[name] = sum(r[num] for r in rows) / sum(r[den] for r in rows)
            print(f"  {name}: {summary[name]:.2f}")
    print(f"  prompt tokens {min(r['prompt_length'] for r in rows)}-{max(r['prompt_length'] for r in rows)}, "
          f"new tokens p50 {np.percentile([r['new_tokens'] for r in rows], 50):.0f}")
    if args.json:
        out = {"startup": startup, "first_turn": first["timings"], "turns": rows, "summary": summary,
               "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
