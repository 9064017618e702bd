"""Does a checkpoint compute the same function on this device, jax and matmul precision as where it trained?

    python bench/device_parity.py CKPT [--shards DIR] [--split dev] [--batches 15]
                                  [--precision float32,default] [--emulate-tf32] [--json OUT]

Prints one row per setting: the backend (JAX_PLATFORMS picks it), jax and flax versions, the matmul
precision, and the teacher-forced loss of CKPT (a workdir, step folder or export) over the first --batches
batches of --split. Run it where the checkpoint trained and where it will be served, with the same
arguments, and compare the rows: equal losses (to ~1e-4) mean the same function.

Why it exists (docs/design.md "The GGUF tokenizer check"): a float32 coe run trained on a lent H200
(jax 0.11.2, flax 0.12.10) reached dev loss 1.2023 there, and the same checkpoint gives 1.2638 on the 2-core
CPU (jax 0.10.2).
`--emulate-tf32` rounds the inputs of every float32 dot to TF32 (10-bit mantissa, round to nearest even;
float32 accumulation, as cuBLAS does) on any backend: on the CPU it moves that checkpoint's loss by 3e-5,
so TF32 did not explain the gap (the GPU image's transformers had converted the tokenizer with another eos
token). On a GPU machine run it under both `JAX_PLATFORMS=cpu` and `JAX_PLATFORMS=cuda`: rows that agree
there but not with this CPU's point at the software, not the device.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def round_to_tf32(x):
    """float32 -> the nearest TF32 value (10 explicit mantissa bits), kept in float32; other dtypes as is."""
    import jax
    import jax.numpy as jnp

    if x.dtype != jnp.float32:
        return x
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    bits = (bits + jnp.uint32(0x0FFF) + ((bits >> 13) & 1)) & jnp.uint32(0xFFFFE000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def emulate_tf32() -> None:
    """Every dot traced from now on rounds its float32 inputs to TF32 (jax.lax and jnp share this entry)."""
    import jax
    from jax._src.lax import lax as lax_impl

    dot = lax_impl.dot_general

    def dot_general(lhs, rhs, *args, **kwargs):
        return dot(round_to_tf32(lhs), round_to_tf32(rhs), *args, **kwargs)

    lax_impl.dot_general = jax.lax.dot_general = dot_general


def measure(ckpt: str, shards: str | None, split: str, batches: int, precision: str) -> dict:
    import flax
    import jax
    import ml_collections

    from empatheia_jax import sharding
    from empatheia_jax.serve.load import load_trained
    from empatheia_jax.train import config as config_lib
    from empatheia_jax.train import step as step_lib

    model, tokenizer, config, _ = load_trained(ckpt)
    config = ml_collections.ConfigDict(config.to_dict())
    config.model.matmul_precision = precision
    config_lib.set_matmul_precision(config)  # after load_trained, which set the run's own
    if shards:
        config.data.shards = shards
    mesh = sharding.make_mesh(1, 1, 1)
    sharding.shard_model(model, mesh)
    stage = config_lib.resolve_stage(config)
    got = step_lib.evaluate_loss(config, stage, model, tokenizer, mesh, split=split, max_batches=batches)
    return {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "flax": flax.__version__, "precision": precision, "loss": float(got["total"]),
            "tokens": float(got.get("emp_tokens", 0.0))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ckpt")
    parser.add_argument("--shards", default=None, help="default: the run's data.shards")
    parser.add_argument("--split", default="dev")
    parser.add_argument("--batches", type=int, default=15)
    parser.add_argument("--precision", default="float32,default", help="comma-separated matmul precisions")
    parser.add_argument("--emulate-tf32", action="store_true", help="round float32 dot inputs to TF32")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.emulate_tf32:
        emulate_tf32()
    rows = [measure(args.ckpt, args.shards, args.split, args.batches, p) for p in args.precision.split(",")]
    for r in rows:
        r["emulated_tf32"] = args.emulate_tf32
        print(f"{r['backend']:5s} {r['device']:24s} jax {r['jax']:8s} flax {r['flax']:8s} precision "
              f"{r['precision']:14s} tf32-emulated {str(r['emulated_tf32']):5s} loss {r['loss']:.6f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
