"""The reference model's coe step on the CPU (configs/smollm2_ed.py): real (non-pad) tokens/s of today's step
beside the same step with target-only logits (`model.empatheia.ce_targets`) and with packing on top
(`data.pack_len`), in ONE process, interleaved.

    python bench/cpu_coe.py --backbone CONVERTED_SMOLLM2 [--shards ED_TEXT_SHARDS] [--steps 10]
        [--ce-targets 128] [--pack-len 512] [--pack-ce-targets 256] [--bucket-step 32] [--precision bfloat16]
        [--json OUT.jsonl]

`--bucket-step N` adds today's step, and today's with target-only logits, on each batch cut to the next
multiple of N above its longest row: the width `data.bucket_step=N` pads it to, on the same examples.
`--precision bfloat16` (with --bucket-step) adds all three levers: cut batches, target-only logits and
bf16 dot operands (`model.matmul_precision`, applied per variant: jit's cache key holds it).

What is timed: the trainer's own jitted step (`step.jit_step`, stage coe, AdamW over LoRA, the
non-finite guard; packed batches through `pipelines.pack_for_step`, as the trainer packs them) of
configs/smollm2_ed.py (SmolLM2-135M float32, LoRA r16, batch 8, max_len 320) on the trainer's own train
pipeline over text-only ED shards (`--shards`; made from the shipped csv with the importer's dev hold-out
when not given). Each variant has its own copy of the weights and optimizer state and runs the SAME
batches: step i runs batch i on every variant, the order alternating per step, so the machine's load
(other processes) hits all alike and the ratio survives it. A step whose shape (bucket length; packed: row
count) is new to a variant compiles; the figures count only the steps where no variant compiled. Printed:
each step's time and loss per variant (`*` = compiled; the losses must agree: same weights, same examples
per step), then per variant real tokens/s = Σ attention_mask / Σ step time, padded positions/s, the real
fraction and the ratio to today's step.

The coe step never reads the media features; text-only shards carry none, so the bench builds the model
with 16-dim audio/video projections instead of `data.features_like`'s (unused weights).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

ED_CSV = REPO / "data" / "ed" / "empathetic_dialogues_validation.csv"


def make_shards(out: Path) -> Path:
    """Text-only ED shards (train + a 15 % conversation-level dev hold-out) from the shipped csv, with the
    commands launch/ed_reference.py runs (less the reply targets, which stage coe does not read)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    for cmd in (
        [
            "data.import_ed",
            "--csv",
            str(ED_CSV),
            "--out",
            str(out / "raw"),
            "--split",
            "train",
            "--holdout",
            "dev:0.15",
        ],
        [
            "data.prepare",
            "--raw",
            str(out / "raw"),
            "--out",
            str(out / "shards"),
            "--text-only",
            "--no-progress",
        ],
    ):
        subprocess.run([sys.executable, "-m", *cmd], check=True, cwd=REPO, env=env)
    return out / "shards"


def run_config(args: argparse.Namespace, shards: Path, pack_len: int = 0, precision: str = "float32",
               **empatheia: Any):
    from configs import smollm2_ed

    c = smollm2_ed.get_config()
    c.model.backbone = args.backbone
    c.data.shards = str(shards)
    c.data.pack_len = pack_len
    c.data.bucket_step = 0  # the default buckets: the bench cuts batches itself (Variant.trim_to)
    c.model.matmul_precision = precision
    for k, v in empatheia.items():
        c.model.empatheia[k] = v
    return c


class Variant:
    """One step program with its own weights and optimizer state."""

    def __init__(self, name: str, config, manifest: dict, mesh, pad_id: int | None = None, trim_to: int = 0):
        import jax

        from empatheia_jax.train import config as config_lib
        from empatheia_jax.train import init, stages
        from empatheia_jax.train import step as step_lib

        self.name, self.config, self.mesh, self.pad_id, self.trim_to = name, config, mesh, pad_id, trim_to
        self.stage = config_lib.resolve_stage(config)
        self.model, self.tokenizer = init.build_model(config, manifest, mesh)
        tx, _ = init.make_tx(config, config_lib.stage_schedule(config),
                             stages.trainable_state(self.model, self.stage))
        with jax.set_mesh(mesh):
            opt = stages.make_optimizer(self.model, self.stage, tx)
        self.graphs, self.params, self.frozen, self.opt_state = stages.split_for_step(
            self.model, opt, self.stage
        )
        self.step_fn = step_lib.jit_step(self.stage, step_lib.loss_weights(config), self.params,
                                         self.opt_state)
        self.key = jax.random.key(config.seed)
        self.shapes: set[tuple[int, ...]] = set()
        self.records: list[tuple[float, int, int, bool]] = []  # per step: seconds, real, positions, compiled
        self.losses: list[float] = []

    def host(self, host: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The step's host batch: the pipeline's, packed (data.pack_len) as the trainer packs it, or (trim_to)
        cut to the next multiple of `trim_to` above its longest row: the batch `data.bucket_step` pads to."""
        from empatheia_jax.train import pipelines

        if self.trim_to:
            width = host["input_ids"].shape[1]
            longest = int(np.max(np.nonzero(host["attention_mask"].any(0))[0])) + 1
            keep = min(width, -(-longest // self.trim_to) * self.trim_to)
            return {k: v[:, :keep] if v.ndim >= 2 and v.shape[1] == width else v for k, v in host.items()}
        return pipelines.pack_for_step(self.config, host, self.pad_id, self.mesh)

    def run(self, host: dict[str, np.ndarray], step: int) -> float:
        """One real step; records (seconds, real tokens, positions, compiled) for it. A step whose shape
        this variant has not run before includes its compile."""
        import jax

        from empatheia_jax.train import pipelines

        host = self.host(host)
        shape = host["input_ids"].shape
        compiled = shape not in self.shapes
        self.shapes.add(shape)
        batch = pipelines.step_batch(host, self.mesh, 1)
        t0 = time.perf_counter()
        # the variant's own matmul precision: part of jit's cache key, so each variant keeps its program
        with jax.set_mesh(self.mesh), jax.default_matmul_precision(self.config.model.matmul_precision):
            self.params, self.opt_state, metrics = self.step_fn(
                self.graphs,
                self.params,
                self.frozen,
                self.opt_state,
                batch,
                jax.random.fold_in(self.key, step),
            )
        total = float(metrics["total"])  # waits for the step
        dt = time.perf_counter() - t0
        self.records.append(
            (dt, int(host["attention_mask"].sum()), int(host["attention_mask"].size), compiled)
        )
        self.losses.append(total)
        return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--backbone", required=True, help="converted SmolLM2-135M folder (make demo's work/smollm2)"
    )
    p.add_argument("--shards", default=None, help="text-only ED shards (default: made from the shipped csv)")
    p.add_argument("--steps", type=int, default=10, help="steps per variant (compiling ones are not timed)")
    p.add_argument("--ce-targets", type=int, default=128, help="model.empatheia.ce_targets of the new step")
    p.add_argument("--pack-len", type=int, default=512, help="data.pack_len of the packed variant (0: none)")
    p.add_argument("--pack-ce-targets", type=int, default=256, help="its ce_targets (per packed row)")
    p.add_argument("--bucket-step", type=int, default=0,
                   help="also time today's step on each batch cut to a multiple of this (data.bucket_step)")
    p.add_argument("--precision", default="",
                   help="also time bucket_step + target-only at this model.matmul_precision (e.g. bfloat16)")
    p.add_argument("--json", default=None, help="append the result (one JSON line) to this file")
    args = p.parse_args(argv)

    from empatheia_jax import host_memory

    host_memory.keep_freed_memory()  # as the trainer's process (cli.main) runs
    import jax

    from empatheia_jax import sharding
    from empatheia_jax.data.shard_format import load_manifest
    from empatheia_jax.train import config as config_lib
    from empatheia_jax.train import distributed, pipelines

    tmp = None
    shards = Path(args.shards) if args.shards else None
    if shards is None:
        tmp = tempfile.TemporaryDirectory(prefix="cpu_coe_")
        shards = make_shards(Path(tmp.name))
    manifest = load_manifest(shards)
    manifest = {
        **manifest,
        "features": {"k": 1, "audio_dim": 16, "video_dim": 16},
        "targets": manifest.get("targets") or {"kinds": {}},
    }
    base_config = run_config(args, shards)
    config_lib.set_matmul_precision(base_config)
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    variants = [
        Variant("whole logits (today)", base_config, manifest, mesh),
        Variant(
            f"target-only logits (ce_targets={args.ce_targets})",
            run_config(args, shards, ce_targets=args.ce_targets),
            manifest,
            mesh,
        ),
    ]
    pipe = pipelines.make_train_pipeline(
        base_config, variants[0].stage, variants[0].model, variants[0].tokenizer
    )
    if args.pack_len:
        packed = run_config(args, shards, pack_len=args.pack_len, ce_targets=args.pack_ce_targets)
        variants.append(
            Variant(
                f"packed {args.pack_len} + target-only (ce_targets={args.pack_ce_targets})",
                packed,
                manifest,
                mesh,
                pad_id=pipe.pad_id,
            )
        )
    if args.bucket_step:
        variants.append(Variant(f"bucket_step={args.bucket_step}", base_config, manifest, mesh,
                                trim_to=args.bucket_step))
        name = f"bucket_step={args.bucket_step} + target-only (ce_targets={args.ce_targets})"
        variants.append(Variant(name, run_config(args, shards, ce_targets=args.ce_targets), manifest, mesh,
                                trim_to=args.bucket_step))
        if args.precision:
            variants.append(Variant(
                f"all: {name} + matmul_precision={args.precision}",
                run_config(args, shards, precision=args.precision, ce_targets=args.ce_targets),
                manifest, mesh, trim_to=args.bucket_step,
            ))
    it = iter(pipe)
    batches = [distributed.agree_on_length(b, pipe.pad_id) for b in itertools.islice(it, args.steps)]
    lengths = sorted({b["input_ids"].shape[1] for b in batches})
    print(
        f"[cpu_coe] {len(batches)} batches of {batches[0]['input_ids'].shape[0]}, bucket lengths {lengths}; "
        f"devices {jax.devices()}, load {os.getloadavg()}",
        flush=True,
    )
    # Every variant runs step i on batch i, the order alternating per step. A step whose shape is new to a
    # variant compiles: the figures count only the steps where no variant compiled.
    for i, host in enumerate(batches):
        for v in variants if i % 2 == 0 else variants[::-1]:
            v.run(host, i)
        print(
            f"[cpu_coe] step {i} T={host['input_ids'].shape[1]} real={int(host['attention_mask'].sum())} "
            + " | ".join(
                f"{v.name.split()[0]}: {v.records[-1][0]:.2f}s{'*' if v.records[-1][3] else ''} "
                f"loss {v.losses[-1]:.5f}"
                for v in variants
            ),
            flush=True,
        )
    timed = [i for i in range(len(batches)) if not any(v.records[i][3] for v in variants)]
    if not timed:
        print("[cpu_coe] every step compiled in some variant: run more --steps")
        return 1
    rows = []
    for v in variants:
        seconds = sum(v.records[i][0] for i in timed)
        real = sum(v.records[i][1] for i in timed)
        positions = sum(v.records[i][2] for i in timed)
        rows.append(
            {
                "variant": v.name,
                "steps": len(timed),
                "step_s": seconds / len(timed),
                "real_tokens_per_s": real / seconds,
                "positions_per_s": positions / seconds,
                "real_fraction": real / positions,
                "losses": v.losses,
            }
        )
    for row in rows:
        row["ratio"] = row["real_tokens_per_s"] / rows[0]["real_tokens_per_s"]
        print(
            f"RESULT {row['variant']}: {row['step_s']:.2f} s/step over steps {timed}, "
            f"{row['real_tokens_per_s']:.1f} real tokens/s (x{row['ratio']:.2f}), "
            f"{row['positions_per_s']:.1f} positions/s, real fraction {row['real_fraction']:.3f}"
        )
    print(
        "[cpu_coe] losses equal across variants at every step: "
        + str(all(np.allclose(v.losses, variants[0].losses, rtol=1e-4) for v in variants))
    )
    result = {
        "bench": "cpu_coe",
        "load_after": os.getloadavg(),
        "rows": rows,
    }
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
