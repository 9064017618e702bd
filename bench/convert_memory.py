"""Peak host memory of `empatheia_jax.weights.hf_to_flax.convert` on a 7B-shaped checkpoint with fewer layers.

    python bench/convert_memory.py [--layers 2] [--disk-dtype float16] [--dtype float32] [--extra-vocab 0]
                                   [--old] [--workdir DIR] [--keep] [--json OUT]

Writes a random safetensors checkpoint with LLaMA-7B's shapes (hidden 4096, intermediate 11008, 32 heads,
vocab 32000, untied LM head, float16 on disk as Vicuna ships) but only --layers layers, converts it in a
fresh subprocess and reports that process's peak resident set (VmHWM: anonymous memory and mapped file
pages alike). Each conversion runs in its own process:

- overhead: a tiny model of the same form (hidden 64, 2 layers, vocab 256), same dtypes, same code. Its
  peak is the "fixed overhead": Python + jax + orbax + tensorstore + transformers' tokenizer imports, the
  XLA CPU client, one conversion through every code path. Nothing in it scales with the model.
- streaming: the 7B-shaped checkpoint through `convert` (what the CLI runs).
- old (--old): the same checkpoint the way `convert` worked before streaming: `load_hf_model_into_flax`
  (safe_open + the whole model built) then `save_checkpoint` (orbax from the model in memory).

Printed: each peak, the largest tensor (embedding / LM head, 32000 x 4096) in the output and in the
on-disk dtype, and ratio = (peak - overhead) / largest tensor in the output dtype. Issue 19 asks for
ratio < 1.2; the script exits 1 when it is not. Temporary checkpoints are deleted unless --keep.
tests/test_convert_streaming.py runs the same measurement on a small model with a loose bound.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

SHAPE_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                num_key_value_heads=32, head_dim=128)
SHAPE_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=4, head_dim=16)
_ST = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def child_env() -> dict[str, str]:
    """The environment of a measured conversion: CPU, one device (as a user's conversion runs), offline."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.pop("XLA_FLAGS", None)
    return env


def write_random_checkpoint(folder: Path, *, layers: int, disk_dtype: str = "float16", seed: int = 0,
                            **shape: int) -> dict[str, tuple[int, ...]]:
    """An HF LLaMA folder (config.json + model.safetensors) with random weights, written one tensor at a
    time (this process never holds more than one). Returns {tensor name: shape as stored}."""
    import ml_dtypes

    from empatheia_jax.models.llama import LlamaConfig
    from empatheia_jax.weights.checkpoint_io import abstract_model
    from empatheia_jax.weights.hf_names import param_names, variable

    cfg = LlamaConfig(num_hidden_layers=layers, tie_word_embeddings=False, **shape)
    model = abstract_model(cfg)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({**cfg.to_hf(), "torch_dtype": disk_dtype}, indent=1))
    np_dtype = np.dtype(ml_dtypes.bfloat16 if disk_dtype == "bfloat16" else disk_dtype)
    shapes, header, offset = {}, {}, 0
    for name in param_names(cfg):
        ours = tuple(variable(model, name.path).shape)
        shapes[name.hf] = ours[::-1] if name.transpose else ours
        size = math.prod(shapes[name.hf]) * np_dtype.itemsize
        header[name.hf] = {"dtype": _ST[disk_dtype], "shape": list(shapes[name.hf]),
                           "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps({"__metadata__": {"format": "pt"}, **header}).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
    rng = np.random.default_rng(seed)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for hf_name, hf_shape in shapes.items():
            if hf_name.endswith("norm.weight"):
                value = rng.uniform(0.5, 1.5, hf_shape).astype(np.float32)
            else:
                value = rng.standard_normal(hf_shape, dtype=np.float32) * np.float32(0.02)
            f.write(value.astype(np_dtype).tobytes())
            del value
    return shapes


def measure(mode: str, src: Path, out: Path, *, dtype: str, extra_vocab: int) -> dict:
    """Converts `src` into `out` in a fresh process ("streaming" or "old" path); returns its
    {"peak_rss": bytes, "seconds": conversion wall time}."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--src", str(src),
           "--out", str(out), "--dtype", dtype, "--extra-vocab", str(extra_vocab)]
    done = subprocess.run(cmd, env=child_env(), stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _child(mode: str, src: str, out: str, dtype: str, extra_vocab: int) -> None:
    from empatheia_jax.weights import hf_to_flax
    from empatheia_jax.weights.checkpoint_io import save_checkpoint

    t0 = time.perf_counter()
    if mode == "streaming":
        hf_to_flax.convert(src, out, dtype=dtype, extra_vocab=extra_vocab)
    else:  # `convert` before streaming: the whole model in memory, then orbax
        model = hf_to_flax.load_hf_model_into_flax(src, dtype=dtype, extra_vocab=extra_vocab)
        save_checkpoint(out, model, source=str(Path(src).absolute()))
    seconds = time.perf_counter() - t0
    print(json.dumps({"peak_rss": peak_rss(), "seconds": seconds}))


def peak_rss() -> int:
    """This process's peak resident set in bytes: VmHWM of its own address space. Not
    getrusage().ru_maxrss, which Linux carries over fork and exec (a child started by a big parent
    reports the parent's peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--disk-dtype", default="float16", choices=sorted(_ST))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="output dtype")
    parser.add_argument("--extra-vocab", type=int, default=0)
    parser.add_argument("--old", action="store_true", help="also measure the in-memory path (slow, big)")
    parser.add_argument("--workdir", default=None, help="temporary checkpoints go here (default: TMPDIR)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary checkpoints")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--src", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child, args.src, args.out, args.dtype, args.extra_vocab)
        return 0

    sys.path.insert(0, str(REPO))
    work = Path(tempfile.mkdtemp(prefix="convert_memory-", dir=args.workdir))
    try:
        t0 = time.perf_counter()
        shapes = write_random_checkpoint(work / "hf", layers=args.layers, disk_dtype=args.disk_dtype,
                                         **SHAPE_7B)
        write_random_checkpoint(work / "tiny", layers=2, disk_dtype=args.disk_dtype, **SHAPE_TINY)
        disk_item = 4 if args.disk_dtype == "float32" else 2
        out_item = 4 if args.dtype == "float32" else 2
        values = sum(math.prod(s) for s in shapes.values())
        largest = max(math.prod(s) for s in shapes.values())
        print(f"wrote {_mib(values * disk_item)} of {args.disk_dtype} ({len(shapes)} tensors) "
              f"in {time.perf_counter() - t0:.0f} s")
        kw = dict(dtype=args.dtype, extra_vocab=args.extra_vocab)
        overhead = measure("streaming", work / "tiny", work / "tiny_out", **kw)
        streaming = measure("streaming", work / "hf", work / "out", **kw)
        shutil.rmtree(work / "out")
        old = measure("old", work / "hf", work / "out_old", **kw) if args.old else None
        largest_out, largest_disk = largest * out_item, largest * disk_item
        ratio = (streaming["peak_rss"] - overhead["peak_rss"]) / largest_out
        figures = {
            "layers": args.layers, "disk_dtype": args.disk_dtype, "dtype": args.dtype,
            "extra_vocab": args.extra_vocab, "model_bytes_disk": values * disk_item,
            "model_bytes_out": values * out_item, "largest_tensor_bytes_out": largest_out,
            "largest_tensor_bytes_disk": largest_disk, "overhead_peak_rss": overhead["peak_rss"],
            "streaming_peak_rss": streaming["peak_rss"], "streaming_seconds": streaming["seconds"],
            "ratio": ratio,
        }
        print(f"model: {args.layers} layers, {_mib(values * disk_item)} {args.disk_dtype} on disk, "
              f"{_mib(values * out_item)} {args.dtype} converted")
        print(f"largest tensor: {_mib(largest_out)} {args.dtype} ({_mib(largest_disk)} {args.disk_dtype})")
        print(f"fixed overhead (tiny model, same code): peak {_mib(overhead['peak_rss'])}")
        print(f"streaming convert: peak {_mib(streaming['peak_rss'])}, {streaming['seconds']:.1f} s")
        if old is not None:
            figures.update(old_peak_rss=old["peak_rss"], old_seconds=old["seconds"],
                           old_ratio=(old["peak_rss"] - overhead["peak_rss"]) / largest_out)
            print(f"old in-memory path: peak {_mib(old['peak_rss'])}, {old['seconds']:.1f} s, "
                  f"(peak - overhead) / largest = {figures['old_ratio']:.2f}")
        verdict = "OK" if ratio < 1.2 else "OVER"
        print(f"(peak - overhead) / largest tensor = {ratio:.2f} ({verdict}: issue 19 asks for < 1.2)")
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
        return 0 if ratio < 1.2 else 1
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
