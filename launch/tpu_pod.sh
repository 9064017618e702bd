#!/usr/bin/env bash
# Trains the stages on a Cloud TPU pod slice: launch/local.sh on every worker at once, as one
# jax.distributed job per stage (jax finds the coordinator, process count and ids on TPU VMs itself).
#
#   TPU=my-v5p-64 ZONE=us-east5-a launch/tpu_pod.sh CONFIG WORKDIR [--config.FIELD=VALUE ...]
#
# Environment:
#   TPU, ZONE      the TPU VM name and zone (required); PROJECT (optional) the GCP project
#   REPO           this repository's path on the workers (default: ~/empatheia_jax), with its .venv built
#                  on every worker beforehand (e.g. `... ssh --worker=all --command "cd REPO && make install"`)
# WORKDIR, the backbone and the shards must be the same paths on every worker: a shared mount (Filestore
# NFS or gcsfuse), since orbax writes one checkpoint from all processes and every process reads its own
# slice of the shards. Each worker reads train.batch_size / (number of workers) examples per step.
# Logs of all workers stream back here; Ctrl-C stops the local ssh only (the job goes on): stop it with
# `... ssh --worker=all --command "pkill -TERM -f empatheia_jax.cli"`, which checkpoints and exits cleanly.
set -euo pipefail

if [[ $# -lt 2 || -z "${TPU:-}" || -z "${ZONE:-}" ]]; then
    sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
REPO=${REPO:-'~/empatheia_jax'}

args=$(printf ' %q' "$@" --config.distributed.initialize=True)
gcloud compute tpus tpu-vm ssh "$TPU" --zone "$ZONE" ${PROJECT:+--project "$PROJECT"} --worker=all \
    --command "cd $REPO && HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 launch/local.sh$args"
