#!/usr/bin/env bash
# The paper's Tables 2-4 on one dataset: trains and evaluates the full model, its four ablations and the
# Pipeline baseline, then writes one table.
#
#   bash launch/ablations.sh CONFIG WORKDIR [--config.FIELD=VALUE ...]
#
#   CONFIG   an ml-collections config file (e.g. configs/smollm2_demo.py); an argument it already has
#            (configs/X.py:no_cs) is kept and each variant's is appended to it
#   WORKDIR  variant V trains its stages in WORKDIR/V (launch/local.sh) and is evaluated into
#            WORKDIR/V/eval.json; the tables go to WORKDIR/ablations.md and WORKDIR/ablations.json
#   extra    --config.* overrides passed to every stage of every variant (shards, backbone, schedule)
#
# Variants (the paper's rows): full, no_coe (w/o CoE), no_media (w/o speech & video input), no_cs (w/o CS),
# no_sd (w/o SD), pipeline (the Pipeline baseline). VARIANTS="full no_coe" picks some; EVAL_FLAGS adds
# flags to every `empatheia eval` (e.g. "--speech_examples 8 --video_examples 4"). Re-running is safe:
# trained stages are skipped, an interrupted one resumes, an existing eval.json is kept (delete it to
# re-evaluate). Exit status: the first failing step's (3: a stage was preempted; re-run to resume).
set -euo pipefail

if [[ $# -lt 2 ]]; then
    sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
CONFIG=$1
WORKDIR=$2
shift 2
cd "$(dirname "$0")/.."

source launch/find_python.sh
read -r -a VARIANT_LIST <<< "${VARIANTS:-full no_coe no_media no_cs no_sd pipeline}"
read -r -a EXTRA_EVAL <<< "${EVAL_FLAGS:-}"

for variant in "${VARIANT_LIST[@]}"; do
    case $variant in
        full) config=$CONFIG ;;
        no_coe | no_media | no_cs | no_sd | pipeline)
            if [[ $CONFIG == *:* ]]; then config="$CONFIG,$variant"; else config="$CONFIG:$variant"; fi ;;
        *) echo "[ablations] unknown variant '$variant' (full no_coe no_media no_cs no_sd pipeline)" >&2
           exit 2 ;;
    esac
    run="$WORKDIR/$variant"
    echo "[ablations] $variant: training ($config) -> $run"
    bash launch/local.sh "$config" "$run" "$@"
    # the stages chain coe -> ccl -> sac -> overall, so the last one present is the model to evaluate
    final=""
    for stage in pipeline coe ccl sac overall; do
        [[ -d "$run/$stage/checkpoints" ]] && final="$run/$stage"
    done
    if [[ -z "$final" ]]; then
        echo "[ablations] $variant: no trained stage in $run" >&2
        exit 1
    fi
    if [[ -f "$run/eval.json" ]]; then
        echo "[ablations] $variant: kept $run/eval.json"
    else
        echo "[ablations] $variant: evaluating $final"
        "$PY" -m empatheia_jax.cli eval --ckpt "$final" --json "$run/eval.json.partial" \
            ${EXTRA_EVAL[@]+"${EXTRA_EVAL[@]}"} > "$run/eval.txt"
        mv "$run/eval.json.partial" "$run/eval.json"
    fi
done
"$PY" -m empatheia_jax.eval.ablations "$WORKDIR"
