#!/usr/bin/env bash
# Every GPU figure of issue 32 in ONE device call (budget: <= 8 min wall on one H100):
#   1. LoRA step, ours (bench/train_step.py --backbone-only) vs HF transformers + PEFT, T=512 and T=2048,
#      LORA_LAYERS (default 32) layers of the LLaMA-2-7B shape, batch 1, bf16, remat full on both sides;
#   2. the Empatheia stage-4 (overall) step vs the backbone-only LoRA step beside it, T=2048, STAGE_LAYERS
#      (default 8: the stage-4 step's compile grows with depth and must fit the budget; the ratio, not the
#      absolute depth, is the figure) layers; every step with model.llm.attention=auto (cuDNN's flash kernel
#      where it compiles: the rows name the kernel), and the backbone-only step once more with our einsum
#      attention forced, so the flash kernel's share is measured at the same shape;
#   3. decode, ours vs HF, batch 1 and 16 (bench/backbone.py --random-shape 7b: same random bf16 weights on
#      both sides, prompt 64, 128 new tokens), DECODE_LAYERS (default 32) layers.
# Writes $OUT/gpu_bench.json and $OUT/gpu_bench.md ($OUT if set, else bench_out/), with each piece's raw
# output beside them; prints nvidia-smi and the versions. Each piece has its own timeout (PIECE_S, 170 s),
# and a piece that fails or times out is recorded as such; the others still run.
#
#   bash bench/gpu.sh               # on the GPU machine (run tool: command "bash bench/gpu.sh",
#                                   #   carry ["bench/wheels"], timeout_s 560)
#   bash bench/gpu.sh --cpu-smoke   # the same sequence at --shape tiny on the CPU: proves it runs
#
# Wheels the device image may lack (it has no internet). Download them HERE first with
# `bash bench/gpu_wheels.sh` into bench/wheels/ (git-ignored) and name bench/wheels in the call's `carry`
# (64 MiB in all); this script then installs each missing one with `pip install --no-index --find-links
# bench/wheels --no-deps`:
#   - HF side: transformers 5.23.0, peft 0.21.2, tokenizers 0.23.3, safetensors 0.8.0, huggingface_hub 2.4.0,
#     accelerate 1.15.0 (~20 MB);
#   - our side (what the lent H200's image lacked, docs/benchmarks.md): ml_collections, grain 0.2.18,
#     array_record, orbax-checkpoint 0.12.8, tensorboardX, gguf, portpicker;
#   - torch (CUDA build, GBs with its nvidia-* wheels) cannot be carried: if the image lacks it, the
#     lora_vs_hf piece names the missing wheel (exit 3, "errors" in the JSON) and still gives our rows;
#   - jax/jaxlib/flax: the image's own CUDA jax (flax 0.12.8 does not import on jax 0.11.2: keep its flax).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=gpu
[[ "${1:-}" == "--cpu-smoke" ]] && MODE=cpu
OUTDIR="${OUT:-bench_out}"
mkdir -p "$OUTDIR"
PY="${PYTHON:-$(command -v python || command -v python3)}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # torch and jax share the GPU in the decode piece
PIECE_S="${PIECE_S:-170}"
T0=$(date +%s)

if [[ $MODE == gpu ]]; then
  export JAX_PLATFORMS=""  # jax's own choice (the bench scripts default to cpu otherwise)
  LORA=(--shape 7b --layers "${LORA_LAYERS:-32}" --batch 1 --seq 512,2048 --steps 5 --warmup 2)
  STAGE=(--shape 7b --layers "${STAGE_LAYERS:-8}" --batch 1 --seq 2048 --steps 5 --warmup 2)
  DECODE=(--random-shape 7b --layers "${DECODE_LAYERS:-32}" --dtype bfloat16 --repeats 3 --batches 1,16)
  echo "== nvidia-smi"
  nvidia-smi || echo "nvidia-smi: not available"
  # Missing wheels: install the carried ones (module -> distribution).
  if [[ -d bench/wheels ]]; then
    for pair in transformers:transformers peft:peft tokenizers:tokenizers safetensors:safetensors \
                huggingface_hub:huggingface_hub accelerate:accelerate ml_collections:ml_collections \
                grain:grain array_record:array_record orbax.checkpoint:orbax-checkpoint \
                tensorboardX:tensorboardX gguf:gguf portpicker:portpicker; do
      mod=${pair%%:*} dist=${pair#*:}
      if ! "$PY" -c "import $mod" 2>/dev/null; then
        echo "installing $dist from bench/wheels"
        "$PY" -m pip install -q --no-index --find-links bench/wheels --no-deps "$dist" || echo "FAILED: $dist"
      fi
    done
  else
    echo "no bench/wheels folder (bash bench/gpu_wheels.sh here, then carry it): using the image as it is"
  fi
else
  export JAX_PLATFORMS=cpu
  LORA=(--shape tiny --batch 2 --seq 32,64 --steps 2 --warmup 1)
  STAGE=(--shape tiny --batch 2 --seq 64 --steps 2 --warmup 1)
  DECODE=(--random-shape tiny --dtype float32 --repeats 1 --batches 1,16 --prompt-len 8 --new-tokens 8
          --threads 2)
fi

echo "== versions ($MODE)"
"$PY" - <<'PYEOF' | tee "$OUTDIR/versions.json"
import importlib, json
out = {}
for name in ("jax", "jaxlib", "flax", "optax", "torch", "transformers", "peft"):
    try:
        out[name] = importlib.import_module(name).__version__
    except Exception as e:  # noqa: BLE001
        out[name] = f"MISSING ({type(e).__name__}: {e})"
try:
    import jax
    out["jax_devices"] = [f"{d.platform}: {d.device_kind}" for d in jax.devices()]
except Exception as e:  # noqa: BLE001
    out["jax_devices"] = f"error: {e}"
try:
    import torch
    out["torch_cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
except Exception:  # noqa: BLE001
    pass
print(json.dumps(out))
PYEOF

rm -f "$OUTDIR/train_step.jsonl" "$OUTDIR/decode.json" "$OUTDIR/pieces.txt"
piece() {  # name, command...: runs it with the piece timeout, logs to $OUTDIR/<name>.log, records the status
  local name=$1; shift
  local t=$(date +%s)
  echo "== $name: $*"
  timeout "$PIECE_S" "$@" > "$OUTDIR/$name.log" 2>&1
  local rc=$?
  tail -n 8 "$OUTDIR/$name.log"
  echo "$name rc=$rc wall_s=$(( $(date +%s) - t ))" | tee -a "$OUTDIR/pieces.txt"
}
piece lora_vs_hf "$PY" bench/train_step.py "${LORA[@]}" --backbone-only --hf --json "$OUTDIR/train_step.jsonl"
piece stage4 "$PY" bench/train_step.py "${STAGE[@]}" --json "$OUTDIR/train_step.jsonl"
piece stage4_backbone "$PY" bench/train_step.py "${STAGE[@]}" --backbone-only --json "$OUTDIR/train_step.jsonl"
piece backbone_einsum "$PY" bench/train_step.py "${STAGE[@]}" --backbone-only --attention einsum \
  --json "$OUTDIR/train_step.jsonl"
piece decode "$PY" -u bench/backbone.py "${DECODE[@]}" --skip-train --json "$OUTDIR/decode.json"

echo "== combining"
MODE=$MODE OUTDIR=$OUTDIR WALL=$(( $(date +%s) - T0 )) "$PY" - <<'PYEOF'
import json, os
from pathlib import Path

out = Path(os.environ["OUTDIR"])
rows = [json.loads(x) for x in (out / "train_step.jsonl").read_text().splitlines()] if (
    out / "train_step.jsonl").exists() else []
decode = json.loads((out / "decode.json").read_text())["rows"] if (out / "decode.json").exists() else []
pieces = (out / "pieces.txt").read_text().splitlines() if (out / "pieces.txt").exists() else []
stage = [r for r in rows if r["side"] == "ours" and r["what"].startswith("Empatheia")]
lm = [r for r in rows if r["side"] == "ours" and r["what"] == "LoRA LM step"]
pairs = []


def key(r):  # a stage-4 row's backbone row: same depth, shape and attention kernel
    return r["layers"], r["seq"], r["batch"], r.get("attention")


for s in stage:
    b = next((r for r in reversed(lm) if key(r) == key(s)), None)
    if b:
        pairs.append({"layers": s["layers"], "seq": s["seq"], "batch": s["batch"],
                      "stage4_tokens_per_s": s["tokens_per_s"], "backbone_tokens_per_s": b["tokens_per_s"],
                      "stage4_over_backbone": s["tokens_per_s"] / b["tokens_per_s"]})
result = {"mode": os.environ["MODE"], "wall_s": int(os.environ["WALL"]),
          "versions": json.loads((out / "versions.json").read_text()), "pieces": pieces,
          "train_step": rows, "stage4_vs_backbone": pairs, "decode": decode,
          "errors": sorted({r["hf_error"] for r in rows if r.get("hf_error")}),
          "note": ("CPU smoke (--shape tiny): proves the sequence runs; not a performance figure"
                   if os.environ["MODE"] == "cpu" else "one GPU")}
(out / "gpu_bench.json").write_text(json.dumps(result, indent=1) + "\n")
md = [f"# bench/gpu.sh ({result['note']}), wall {result['wall_s']} s", "",
      "versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()), "",
      "pieces: " + "; ".join(pieces), ""] + [f"error: {e}" for e in result["errors"]] + [
      "", "## Training steps", "",
      "| side | step | shape (layers) | B x T | remat | attention | tokens/s | step s | compile s | MFU 4N+attn "
      "| MFU 6N | peak mem GiB | ours/HF | device |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
for r in rows:
    mem = "null" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.2f}"
    ratio = f"{r['ratio_ours_hf']:.2f}x" if r.get("ratio_ours_hf") else "-"
    md.append(f"| {r['side']} | {r['what']} | {r['shape']} ({r['layers']}) | {r['batch']} x {r['seq']} | "
              f"{r['remat']} | {r.get('attention', '-')} | {r['tokens_per_s']:.1f} | {r['step_s']:.4f} | {r['compile_s']:.1f} | "
              f"{100 * r['mfu_4n']:.2f} % | {100 * r['mfu_6n']:.2f} % | {mem} | {ratio} | {r['device']} |")
md += ["", "## Stage-4 step vs the backbone-only LoRA step", "",
       "| layers | B x T | stage-4 tokens/s | backbone tokens/s | stage-4 / backbone |", "|---|---|---|---|---|"]
md += [f"| {p['layers']} | {p['batch']} x {p['seq']} | {p['stage4_tokens_per_s']:.1f} | "
       f"{p['backbone_tokens_per_s']:.1f} | {p['stage4_over_backbone']:.2f}x |" for p in pairs]
md += ["", "## Decode (prompt + new tokens, greedy)", "", "| what | HF tok/s | ours tok/s | ours/HF | check |",
       "|---|---|---|---|---|"]
md += [f"| {d['what']} | {d['ref']:.1f} | {d['ours']:.1f} | {d['ours'] / d['ref']:.2f}x | {d['check'].replace('|', chr(92) + '|')} |"
       for d in decode]
(out / "gpu_bench.md").write_text("\n".join(md) + "\n")
print("\n".join(md))
PYEOF
echo "== done in $(( $(date +%s) - T0 )) s: $OUTDIR/gpu_bench.json, $OUTDIR/gpu_bench.md"
