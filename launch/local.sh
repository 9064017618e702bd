#!/usr/bin/env bash
# Trains the paper's stages in order on this machine, each starting from the previous one.
#
#   launch/local.sh CONFIG WORKDIR [--config.FIELD=VALUE ...]
#
#   CONFIG   an ml-collections config file, optionally with its argument: configs/smollm2_demo.py,
#            configs/vicuna7b.py:no_cs,no_sd (ablations), configs/X.py:pipeline (the Pipeline baseline)
#   WORKDIR  the run folder: stage S trains in WORKDIR/S (S = coe, ccl, sac, overall; or pipeline)
#   extra    any --config.* overrides, passed to every stage (e.g. --config.model.backbone=... and
#            --config.data.shards=...). This script sets --config.stage, --workdir and, from the second
#            stage on, --config.init_from=WORKDIR/<previous stage>.
#
# Stages the ablations leave empty (e.g. sac under no_media, ccl under no_cs) are skipped, and the next
# stage starts from the last one that ran. A stage whose final step is already checkpointed is skipped;
# an interrupted stage resumes from its last checkpoint (re-running the command is always safe).
# Exit status: 0 all stages trained; 3 a stage was preempted (checkpointed; re-run to resume); else the
# trainer's (1 a failed run, 2 a bad config).
#
# Environment: PY (python to run; default .venv/bin/python when it exists, else the `empatheia` command),
# and anything jax/XLA reads (JAX_PLATFORMS, XLA_FLAGS, JAX_COMPILATION_CACHE_DIR, ...).
# The same script runs every process of a multi-host job (launch/tpu_pod.sh, launch/slurm_gpu.sbatch,
# with --config.distributed.initialize=True): WORKDIR must then be one shared folder (NFS, gcsfuse).
set -euo pipefail

if [[ $# -lt 2 ]]; then
    sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
CONFIG=$1
WORKDIR=$2
shift 2
cd "$(dirname "$0")/.."

source launch/find_python.sh
TRAIN=("$PY" -m empatheia_jax.cli train)

# "stage final_step" per stage to train, resolved the way the trainer resolves them (config file, its
# argument and the --config.* overrides; stages.stage_plan drops the stages the ablations empty).
# JAX_PLATFORMS=cpu: listing stages must not claim an accelerator.
PLAN=$(JAX_PLATFORMS=cpu "$PY" - "$CONFIG" "$@" <<'EOF'
import sys

from absl import flags
from ml_collections import config_flags

config = config_flags.DEFINE_config_file("config", None, lock_config=True)
flags.FLAGS(["plan", "--config", *sys.argv[1:]], known_only=True)
c = config.value

from empatheia_jax.train import stages  # noqa: E402

names = ["pipeline"] if c.stage == "pipeline" else [s.name for s in stages.stage_plan(**dict(c.ablations))]
for name in names:
    print(name, int(c.schedule[name].steps))
EOF
)

# SIGTERM (scheduler preemption, scancel) also reaches the trainer, which checkpoints and exits 0: wait for it
# rather than dying first, then stop (below) instead of starting the next stage from a partial one.
trap 'echo "[local.sh] SIGTERM: waiting for the trainer to checkpoint" >&2' TERM

PREVIOUS=""
while read -r -u 3 STAGE STEPS; do
    RUN="$WORKDIR/$STAGE"
    INIT=()
    [[ -n "$PREVIOUS" ]] && INIT=("--config.init_from=$PREVIOUS")
    if [[ -d "$RUN/checkpoints/$STEPS" ]]; then
        echo "[local.sh] $STAGE: already trained ($RUN/checkpoints/$STEPS)"
    else
        echo "[local.sh] $STAGE: $STEPS steps -> $RUN${PREVIOUS:+ (from $PREVIOUS)}"
        start=$SECONDS
        "${TRAIN[@]}" --config "$CONFIG" --workdir "$RUN" "$@" "--config.stage=$STAGE" ${INIT[@]+"${INIT[@]}"}
        if [[ ! -d "$RUN/checkpoints/$STEPS" ]]; then
            echo "[local.sh] $STAGE: stopped before step $STEPS (preempted); re-run the same command to resume" >&2
            exit 3
        fi
        echo "[local.sh] $STAGE: done in $((SECONDS - start)) s"
    fi
    PREVIOUS=$RUN
done 3<<< "$PLAN"
