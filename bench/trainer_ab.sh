#!/usr/bin/env bash
# Issue 32's CPU measure: the ED reference training (configs/smollm2_ed.py, stage coe) as whole `empatheia
# train` runs, one variant after the other on the same batches, and the real (non-pad) tokens/s of each over
# the windows after the warm-up (`perf/tokens_per_s` counts attention_mask tokens; windows whose step
# compiled a new shape are left out and counted).
#
#   bash bench/trainer_ab.sh OUT [STEPS] [VARIANTS]      # STEPS 60, VARIANTS "issue today today_f32"
#
# Variants:
#   issue      the step the issue measured: whole-vocabulary logits (ce_targets=0), every batch padded to
#              the static max_len (bucket_step=0), float32 dot operands, glibc's default allocator
#              (EMPATHEIA_KEEP_FREED_MEMORY=0, no huge pages);
#   today      the config as shipped, launched as launch/*.sh launch it (find_python.sh's huge pages; the
#              command keeps freed memory, empatheia_jax/host_memory.py);
#   today_f32  today with float32 dot operands (what a CPU without AVX512-BF16 is told to use).
# Dev loss on DEV_BATCHES (2) batches at the end of each run; FROM (default 40) is the last warm-up step.
# Needs make demo's work/smollm2 and work/shards (the config's backbone and features_like); the text-only ED
# shards are ED_SHARDS, else made in OUT/ed as launch/ed_reference.py makes them. Prints one table.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/find_python.sh
OUT=${1:?usage: bash bench/trainer_ab.sh OUT [STEPS] [VARIANTS]}
STEPS=${2:-60}
VARIANTS=${3:-issue today today_f32}
FROM=${FROM:-40}
DEV_BATCHES=${DEV_BATCHES:-2}
ED_SHARDS=${ED_SHARDS:-$OUT/ed/shards}
if (( STEPS < FROM + 10 )); then  # at least one 10-step window after the warm-up
    echo "trainer_ab: STEPS=$STEPS leaves no window after FROM=$FROM (need STEPS >= FROM + 10)" >&2; exit 2
fi
mkdir -p "$OUT"
if [[ ! -f $ED_SHARDS/manifest.json ]]; then
    "$PY" -m data.import_ed --csv data/ed/empathetic_dialogues_validation.csv --out "$OUT/ed/raw" \
        --split train --holdout dev:0.15
    "$PY" -m data.prepare --raw "$OUT/ed/raw" --out "$ED_SHARDS" --text-only --overwrite
fi

for v in $VARIANTS; do
    ENV=()
    case $v in
        issue) ENV=(EMPATHEIA_KEEP_FREED_MEMORY=0 GLIBC_TUNABLES=)
               FLAGS=(--config.model.empatheia.ce_targets=0 --config.data.bucket_step=0
                      --config.model.matmul_precision=float32) ;;
        today) FLAGS=() ;;
        today_f32) FLAGS=(--config.model.matmul_precision=float32) ;;
        *) echo "unknown variant $v (issue, today, today_f32)" >&2; exit 2 ;;
    esac
    rm -rf "${OUT:?}/$v"
    echo "[trainer_ab] $v: $STEPS steps -> $OUT/$v" >&2
    /usr/bin/env ${ENV[@]+"${ENV[@]}"} /usr/bin/time -v -o "$OUT/$v.time" "$PY" -m empatheia_jax.cli train \
        --config configs/smollm2_ed.py --workdir "$OUT/$v" --config.data.shards="$ED_SHARDS" \
        --config.schedule.coe.steps="$STEPS" --config.train.eval_every="$STEPS" --config.train.log_every=10 \
        --config.train.eval_batches="$DEV_BATCHES" --config.checkpoint.every="$STEPS" ${FLAGS[@]+"${FLAGS[@]}"} \
        > "$OUT/$v.log" 2>&1
done

"$PY" - "$OUT" "$FROM" $VARIANTS <<'EOF'
import json, re, sys
from pathlib import Path

out, start, variants = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
print(f"| variant | real tokens/s, steps {start + 1}+ | s/step | windows kept (compiled) | train loss by window "
      "| dev loss | system / user CPU s | peak RSS GB |")
print("|---|---|---|---|---|---|---|---|")
base = None
for v in variants:
    rows = [json.loads(line) for line in (out / v / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "perf/tokens_per_s" in r]
    windows = [(r, r["step"] - p["step"]) for p, r in zip(train, train[1:]) if r["step"] > start]
    kept = [(r, n) for r, n in windows if not r.get("perf/compile_s")]
    seconds = sum(r["perf/step_time_s"] * n for r, n in kept)
    tps = sum(r["perf/tokens_per_s"] * r["perf/step_time_s"] * n for r, n in kept) / seconds
    base = base or tps
    losses = " / ".join(f"{r['train/total']:.4f}" for r in train)
    dev = [r["eval/total"] for r in rows if "eval/total" in r]
    t = (out / f"{v}.time").read_text()
    sys_s, user_s = (float(re.search(rf"{k} time \(seconds\): ([\d.]+)", t).group(1)) for k in ("System", "User"))
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", t).group(1)) / 2**20
    print(f"| {v} | {tps:.1f} ({tps / base:.2f}x) | {seconds / sum(n for _, n in kept):.2f} | {len(kept)} "
          f"({len(windows) - len(kept)}) | {losses} | {dev[-1]:.5f} | {sys_s:.0f} / {user_s:.0f} | {rss:.1f} |")
EOF
