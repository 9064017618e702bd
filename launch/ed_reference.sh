#!/usr/bin/env bash
# The reference model: stage coe on EmpatheticDialogues, stages ccl_units and ccl (the avatar's voice and
# face) on every ED reply's content targets, then the SD's stage sac on the sample.
#
#   bash launch/ed_reference.sh RUNDIR [--config.FIELD=VALUE ...]
#
#   RUNDIR   the run folder, best outside the work tree (e.g. ~/runs/ed_reference): RUNDIR/ed holds the
#            imported csv (train + a conversation-level dev hold-out), its reply targets (Kokoro speech
#            features, the face generator's mouth on Kokoro's timeline: no media needed) and its text-only
#            shards, RUNDIR/coe the ED stage, RUNDIR/ed_STAGE the CS on ED, RUNDIR/{sac,...} the sample stages,
#            RUNDIR/report the dev evaluation of the coe stage, RUNDIR/report_final that of the final
#            model, RUNDIR/export the final model (PEFT adapter + heads) with its model card
#   extra    --config.* overrides for the coe stage (e.g. --config.schedule.coe.steps=1000)
#
# Needs `make demo`'s converted backbone and sample shards (WORK=work by default: work/smollm2, work/shards;
# a re-measure, below, the backbone only). Every step skips what is done and training resumes from its last
# checkpoint, so re-running the command continues an interrupted run (a run longer than a session, on CPU).
# Environment:
# ED_CSV (default data/ed/empathetic_dialogues_validation.csv), HOLDOUT (dev:0.15), WORK (work), PY, ED_STAGES
# (default "ccl_units ccl": the avatar stages on ED after coe, the CS from its units alone then with r^t; 0 =
# none), SAMPLE_STAGES (default "sac": the stages on the sample, in order; 0 = none; "sac overall" adds the
# joint stage, whose LoRA steps at the demo's lr 1e-3 on 64 sample dialogues undo the ED training: 41 % of dev
# replies repeat a 4-gram, docs/benchmarks.md), COE_EVAL=0 to skip the coe stage's dev evaluation (a
# diagnostic: the card reports the final model's), EVAL_FLAGS (extra `empatheia eval` flags), SPEECH_EXAMPLES
# (dev replies spoken and heard by Whisper in the final evaluation, default 32), VIDEO_EXAMPLES (dev replies
# drawn, default 16), DEVICE (the card's device line), ED_CKPT_EVERY (the ED stages' checkpoint interval in
# steps, default 50: minutes on a CPU, where a step takes 5-15 s), COE_FROM (a finished coe stage to chain
# from instead of training one: a workdir or a PEFT export, e.g. the committed reference model, `python -m
# empatheia_jax.reference`; the ED stages train the CS only, so its LoRA reaches the new export unchanged, and
# a redesigned CS costs the ccl stage, not the hours of coe), HEAD_FROM (an emotion_head.safetensors fitted
# to the same LLM, e.g. the committed reference's, copied into the export instead of fitting one),
# TEXT_EVAL=1 (measure the text figures even when the export's adapter is COE_FROM's: by default they are
# then carried from COE_FROM's card, e.g. `COE_FROM=$(python -m empatheia_jax.reference) SAMPLE_STAGES=0`
# retrains the CS alone and re-measures only the avatar; with no stage after COE_FROM, `ED_STAGES=0
# SAMPLE_STAGES=0 TEXT_EVAL=1`, COE_FROM's export itself is measured again: its text figures with today's
# evaluation, the emotion head fitted to it, its avatar figures carried, `model_card --avatar_from`),
# REPLY_FLAGS (how the final dev evaluation decodes the reply after the greedy CoE; default the consensus of
# 16 replies drawn at T 0.7, top-p 0.95, seed 0: serve/reply_choice.py, chosen on dev; "" = greedy replies).
# Exit status: 0 done; 3 a stage stopped early (SIGTERM: checkpointed; re-run the same command to resume).
set -euo pipefail

if [[ $# -lt 1 ]]; then
    sed -n '2,39p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
RUN=$1
shift
cd "$(dirname "$0")/.."
source launch/find_python.sh
WORK=${WORK:-work}
ED_CSV=${ED_CSV:-data/ed/empathetic_dialogues_validation.csv}
HOLDOUT=${HOLDOUT:-dev:0.15}
read -r -a EXTRA_EVAL <<< "${EVAL_FLAGS:-}"
read -r -a REPLY <<< "${REPLY_FLAGS---reply_temperature 0.7 --reply_top_p 0.95 --reply_candidates 16 --seed 0}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$RUN/jax_cache}

ED_STAGES_SET=${ED_STAGES:-}  # the card's command names a non-default choice
ED_STAGES=${ED_STAGES:-ccl_units ccl}
STAGES=${SAMPLE_STAGES:-sac}
# No stage after COE_FROM and TEXT_EVAL=1: COE_FROM's export is measured again as it is (REMEASURE: the same
# weights, so the avatar figures and the training rows of its card carry, and no reply targets are needed).
REMEASURE=
if [[ -n ${COE_FROM:-} && -z ${ED_STAGES/#0/} && -z ${STAGES/#0/} && ${TEXT_EVAL:-0} == 1
      && -f $COE_FROM/empatheia_config.json ]]; then
    REMEASURE=1
fi

NEEDS=("$WORK/smollm2/COMPLETE")
if [[ -z $REMEASURE ]]; then NEEDS+=("$WORK/shards/manifest.json"); fi  # the sample: its features, its stages
for need in "${NEEDS[@]}"; do
    if [[ ! -f $need ]]; then
        echo "[ed_reference] $need is missing: run \`make demo\` first (or set WORK)" >&2
        exit 2
    fi
done
COMMON=(--config.model.backbone="$WORK/smollm2" --config.data.features_like="$WORK/shards")

# SIGTERM (a session's end, a scheduler) also reaches the trainer, which checkpoints and exits 0: wait for it
# rather than dying first, then stop (`finished`) instead of exporting a partial stage or starting the next.
trap 'echo "[ed_reference] SIGTERM: waiting for the trainer to checkpoint" >&2' TERM
finished() {  # finished WORKDIR STAGE: exits 3 (re-run to resume) unless the stage reached its last step
    if ! "$PY" - "$1" "$2" <<'EOF'
import json, sys
from pathlib import Path
run, stage = Path(sys.argv[1]), sys.argv[2]
steps = json.loads((run / "config.json").read_text())["schedule"][stage]["steps"]
saved = [int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()]
sys.exit(0 if saved and max(saved) >= steps else 1)
EOF
    then
        echo "[ed_reference] $2 stopped before its last step (preempted): re-run the same command to resume" >&2
        exit 3
    fi
}

mkdir -p "$RUN/ed"
if [[ ! -f "$RUN/ed/raw/dev.json" ]]; then
    echo "[ed_reference] importing $ED_CSV (train + $HOLDOUT, whole conversations)"
    "$PY" -m data.import_ed --csv "$ED_CSV" --out "$RUN/ed/raw" --split train --holdout "$HOLDOUT"
fi
# Targets are (re)made when missing, incomplete or made with another voice map (the listener's style rule and
# voices live there: kokoro_voices.MAP_VERSION) or mouth rule (visemes.MOUTH_VERSION); the shards that embed
# them are then prepared again.
if [[ -z $REMEASURE ]] && ! "$PY" - "$RUN/ed/targets/meta.json" <<'EOF'
import json, sys
from empatheia_jax.generators.kokoro_voices import MAP_VERSION
from empatheia_jax.generators.visemes import MOUTH_VERSION
try:
    meta = json.load(open(sys.argv[1]))
except OSError:
    sys.exit(1)
sys.exit(0 if all(meta.get(k, {}).get("voice_map_version") == MAP_VERSION
                  for k in ("speech_style", "video_content", "video_style"))
         and meta.get("video_content", {}).get("mouth_version") == MOUTH_VERSION else 1)
EOF
then
    echo "[ed_reference] reply targets: Kokoro speech features, the face generator's mouth on Kokoro's timeline"
    rm -f "$RUN/ed/shards/manifest.json"
    "$PY" -m converters.styletts2_targets --raw "$RUN/ed/raw" --out "$RUN/ed/targets" --responses-only \
        --workers 2 --quiet
    "$PY" -m converters.face_targets --raw "$RUN/ed/raw" --out "$RUN/ed/targets" --mouth phonemes \
        --responses-only --workers 2 --quiet
fi
if [[ ! -f "$RUN/ed/shards/manifest.json" ]]; then
    if [[ -n $REMEASURE ]]; then
        echo "[ed_reference] preparing text-only shards (no reply targets: the text evaluation reads none)"
        TARGETS=()
    else
        echo "[ed_reference] preparing text-only shards with the reply targets"
        TARGETS=(--targets "$RUN/ed/targets")
    fi
    "$PY" -m data.prepare --raw "$RUN/ed/raw" --out "$RUN/ed/shards" --text-only ${TARGETS[@]+"${TARGETS[@]}"} \
        --overwrite
fi

if [[ -n ${COE_FROM:-} ]]; then
    echo "[ed_reference] the coe stage is $COE_FROM (COE_FROM)"
    prev=$COE_FROM
    WORKDIRS=()
else
    echo "[ed_reference] stage coe on EmpatheticDialogues -> $RUN/coe"
    "$PY" -m empatheia_jax.cli train --config configs/smollm2_ed.py --workdir "$RUN/coe" \
        "${COMMON[@]}" --config.data.shards="$RUN/ed/shards" "$@"
    finished "$RUN/coe" coe
    if [[ ${COE_EVAL:-1} != 0 ]]; then
        echo "[ed_reference] dev evaluation of the coe stage -> $RUN/report"
        "$PY" -m empatheia_jax.cli eval --ckpt "$RUN/coe" --data "$RUN/ed/shards" --split dev \
            --report "$RUN/report" --no_repeat_ngram_size 4 --score_emotions ${EXTRA_EVAL[@]+"${EXTRA_EVAL[@]}"}
    fi
    prev=$RUN/coe
    WORKDIRS=(--workdir "$RUN/coe")
fi
for stage in ${ED_STAGES/#0/}; do
    echo "[ed_reference] stage $stage on the ED replies' targets -> $RUN/ed_$stage"
    "$PY" -m empatheia_jax.cli train --config configs/smollm2_ed_avatar.py --config.stage="$stage" \
        --config.init_from="$prev" --workdir "$RUN/ed_$stage" "${COMMON[@]}" --config.data.shards="$RUN/ed/shards" \
        --config.checkpoint.every="${ED_CKPT_EVERY:-50}"
    finished "$RUN/ed_$stage" "$stage"
    prev=$RUN/ed_$stage
    WORKDIRS+=(--workdir "$RUN/ed_$stage")
done
for stage in ${STAGES/#0/}; do
    echo "[ed_reference] stage $stage on the sample -> $RUN/$stage"
    # the demo's config with the CS of the ED stages (configs/smollm2_ed_sample.py)
    "$PY" -m empatheia_jax.cli train --config configs/smollm2_ed_sample.py --config.stage="$stage" \
        --config.init_from="$prev" --workdir "$RUN/$stage" --config.model.backbone="$WORK/smollm2" \
        --config.data.shards="$WORK/shards"
    finished "$RUN/$stage" "$stage"
    prev=$RUN/$stage
    WORKDIRS+=(--workdir "$RUN/$stage")
done
# No stage after COE_FROM (unless REMEASURE) or the coe stage alone: nothing to export.
if [[ $prev == "$RUN/coe" || ($prev == "${COE_FROM:-}" && -z $REMEASURE) ]]; then
    exit 0
fi
# The export is what gets evaluated, so the card's figures are those of the weights it ships: EXPORT_DTYPE
# (default bfloat16, half the files of float32) is the stored dtype of the adapter and heads.
# Each step below is skipped when its output is newer than the export it reads (a resumed run).
# With COE_FROM, the text model is COE_FROM's (the ED stages train the CS only), so the export serves at its
# prompt budget (data.max_len: the committed reference's is 256, the ED config's 320), at which its text
# figures were measured.
SERVE_LEN=()
if [[ -n ${COE_FROM:-} ]]; then
    SERVE_LEN=(--max_len "$("$PY" - "$COE_FROM" <<'EOF'
import json, sys
from pathlib import Path
src = Path(sys.argv[1])
meta = src / "empatheia_config.json"  # an export; else a training workdir
config = json.loads(meta.read_text())["config"] if meta.is_file() else json.loads((src / "config.json").read_text())
print(config["data"]["max_len"])
EOF
)")
fi
EXPORTED=$RUN/export/heads.safetensors
BACKBONE=()
if [[ -n $REMEASURE ]]; then
    # the export is COE_FROM's files (a head it carries is fitted again unless HEAD_FROM); its recorded
    # backbone path is the machine's it was exported on
    BACKBONE=(--backbone "$WORK/smollm2")
    if ! cmp -s "$COE_FROM/heads.safetensors" "$EXPORTED" \
        || ! cmp -s "$COE_FROM/adapter_model.safetensors" "$RUN/export/adapter_model.safetensors"; then
        echo "[ed_reference] no stage after COE_FROM (TEXT_EVAL=1): its export is measured again -> $RUN/export"
        rm -rf "$RUN/export"
        cp -r "$COE_FROM" "$RUN/export"
        rm -f "$RUN/export/emotion_head.safetensors"
    fi
elif [[ ! $EXPORTED -nt $prev/checkpoints ]]; then
    echo "[ed_reference] export of $prev (${EXPORT_DTYPE:-bfloat16}) -> $RUN/export"
    "$PY" -m empatheia_jax.cli export --ckpt "$prev" --out "$RUN/export" --dtype "${EXPORT_DTYPE:-bfloat16}" \
        ${SERVE_LEN[@]+"${SERVE_LEN[@]}"} --overwrite
fi
# Every text figure is a function of the PEFT adapter (the LoRA and the added token rows). When the export's
# adapter holds COE_FROM's values exactly (the ED stages train the CS only; SAMPLE_STAGES=0 keeps the sample
# stages from touching the added rows), COE_FROM's card already measured them on these weights: the card
# carries them (`model_card --text_from`) and the head, dev and subset evaluations below are skipped.
# TEXT_EVAL=1 measures them anyway.
TEXT_FROM=
if [[ -n ${COE_FROM:-} && -f $COE_FROM/card.json && ${TEXT_EVAL:-0} != 1 ]] && "$PY" - "$RUN/export" "$COE_FROM" <<'EOF'
import sys
from empatheia_jax.eval.model_card import CardError, text_figures_from
try:
    text_figures_from(sys.argv[1], sys.argv[2])
except CardError as e:
    print(f"[ed_reference] the text figures are measured again: {e}", file=sys.stderr)
    sys.exit(1)
EOF
then
    TEXT_FROM=$COE_FROM
    echo "[ed_reference] the export's adapter is COE_FROM's: its card's text figures are carried ($COE_FROM)"
fi
# The emotion head (empatheia_jax/eval/emotion_head.py): a probe over the model's reading of the dialogue,
# fitted on the train part with its C chosen on dev; HEAD_FROM reuses a head fitted to the same LLM (the
# ED stages train the CS only, so the coe stage's head still reads the same states).
if [[ -n $TEXT_FROM ]]; then
    :  # the head is read only by the text evaluation
elif [[ -n ${HEAD_FROM:-} ]]; then
    cp "$HEAD_FROM" "$RUN/export/emotion_head.safetensors"
elif [[ ! $RUN/export/emotion_head.safetensors -nt $EXPORTED ]]; then
    echo "[ed_reference] emotion head of the export (train part; C on dev) -> $RUN/export/emotion_head.safetensors"
    "$PY" -m empatheia_jax.eval.fit_emotion_head probe --ckpt "$RUN/export" --shards "$RUN/ed/shards" \
        --json "$RUN/emotion_head_probe.json" ${BACKBONE[@]+"${BACKBONE[@]}"}
fi
if [[ -z $REMEASURE && ! $RUN/report_avatar.json -nt $EXPORTED ]]; then
    echo "[ed_reference] the avatar on dev replies: the CS's content spoken and heard (ccl template)" \
        "-> $RUN/report_avatar.json"
    "$PY" -m empatheia_jax.cli eval --ckpt "$RUN/export" --data "$RUN/ed/shards" --split dev --template ccl \
        --nogenerate --speech_examples "${SPEECH_EXAMPLES:-32}" --video_examples "${VIDEO_EXAMPLES:-16}" \
        --json "$RUN/report_avatar.json"
fi
if [[ -z $TEXT_FROM ]]; then
    # the longest step (hours on a CPU with drawn replies) after the avatar's: it keeps a journal of its finished
    # batches in the report folder, so re-running the command after a kill resumes it (eval/journal.py)
    if [[ ! $RUN/report_final/metrics.json -nt $EXPORTED ]]; then
        echo "[ed_reference] dev evaluation of the export (CoE prompt) -> $RUN/report_final"
        "$PY" -m empatheia_jax.cli eval --ckpt "$RUN/export" --data "$RUN/ed/shards" --split dev --template coe \
            --report "$RUN/report_final" --no_repeat_ngram_size 4 --score_emotions ${REPLY[@]+"${REPLY[@]}"} \
            ${BACKBONE[@]+"${BACKBONE[@]}"} ${EXTRA_EVAL[@]+"${EXTRA_EVAL[@]}"}
    fi
    echo "[ed_reference] the head's combination with step 2, chosen on those dev predictions"
    "$PY" -m empatheia_jax.eval.fit_emotion_head weights --head "$RUN/export/emotion_head.safetensors" \
        --predictions "$RUN/report_final/predictions_coe.jsonl" --shards "$RUN/ed/shards" \
        --json "$RUN/emotion_head_weights.json"
    # the figure the project's test re-measures in CI time: the first CI_SUBSET dev records
    CI_SUBSET=16  # tests/test_reference_model.py SUBSET
    "$PY" -m empatheia_jax.cli eval --ckpt "$RUN/export" --data "$RUN/ed/shards" --split dev --template coe \
        --max_examples $CI_SUBSET --json "$RUN/report_final/subset.json" --no_repeat_ngram_size 4 --score_emotions \
        ${BACKBONE[@]+"${BACKBONE[@]}"} ${EXTRA_EVAL[@]+"${EXTRA_EVAL[@]}"}
fi
echo "[ed_reference] model card -> $RUN/export"
if [[ -n $TEXT_FROM ]]; then
    TEXT=(--text_from "$TEXT_FROM")
else
    TEXT=(--metrics "$RUN/report_final/metrics.json" --subset_metrics "$RUN/report_final/subset.json"
          --subset_examples $CI_SUBSET --emotion_head_weights "$RUN/emotion_head_weights.json")
    # the stages that made COE_FROM's adapter are this export's history too (its card's rows)
    if [[ -z $REMEASURE && -n ${COE_FROM:-} && -f $COE_FROM/card.json ]]; then
        TEXT+=(--chained_from "$COE_FROM")
    fi
fi
if [[ -n $REMEASURE ]]; then
    AVATAR=(--avatar_from "$COE_FROM")  # the same weights: its card's avatar figures and training rows
else
    AVATAR=(--avatar_metrics "$RUN/report_avatar.json")
fi
"$PY" -m empatheia_jax.eval.model_card "$RUN/export" "${TEXT[@]}" ${WORKDIRS[@]+"${WORKDIRS[@]}"} "${AVATAR[@]}" \
    --command "${COE_FROM:+COE_FROM=$COE_FROM }${ED_STAGES_SET:+ED_STAGES=\"$ED_STAGES\" }${SAMPLE_STAGES:+SAMPLE_STAGES=$SAMPLE_STAGES }${REMEASURE:+TEXT_EVAL=1 }bash launch/ed_reference.sh $RUN${*:+ $*}" \
    --device "${DEVICE:-$(nproc)-core CPU}"
echo "[ed_reference] done: $RUN/export (chat: empatheia chat --ckpt $RUN/export --text ...)"
