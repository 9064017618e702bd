#!/usr/bin/env bash
# Trains the stages on a Cloud TPU pod slice: launch/local.sh on every worker at once, each stage one
# jax.distributed job, with the coordinator, process count and process id passed explicitly.
#
#   TPU=my-v5p-64 ZONE=us-east5-a launch/tpu_pod.sh CONFIG WORKDIR [--config.FIELD=VALUE ...]
#   DRY_RUN=1 TPU=my-tpu ZONE=z WORKERS="10.0.0.2 10.0.0.3" launch/tpu_pod.sh CONFIG WORKDIR ...
#
# Environment:
#   TPU, ZONE      the TPU VM name and zone (required); PROJECT (optional) the GCP project
#   REPO           this repository's path on the workers (default: ~/empatheia_jax), with its .venv built
#                  on every worker beforehand (e.g. `... ssh --worker=all --command "cd REPO && make install"`)
#   WORKERS        the workers' internal addresses, worker 0 first (default: asked from `gcloud compute tpus
#                  tpu-vm describe`); worker 0 is the coordinator
#   COORDINATOR_PORT  default 8482 (jax's own choice on TPU VMs)
#   DRY_RUN=1      print each worker's host, process id and count, coordinator, environment and exact
#                  command (and the gcloud line that starts it), then exit without running anything
# WORKDIR, the backbone and the shards must be the same paths on every worker: a shared mount (Filestore
# NFS or gcsfuse), since orbax writes one checkpoint from all processes and every process reads its own
# slice of the shards. Each worker reads train.batch_size / (number of workers) examples per step.
# Logs of all workers stream back here; Ctrl-C stops the local ssh sessions only (the job goes on): stop it
# with `... ssh --worker=all --command "pkill -TERM -f empatheia_jax.cli"`, which checkpoints and exits.
set -euo pipefail

if [[ $# -lt 2 || -z "${TPU:-}" || -z "${ZONE:-}" ]]; then
    sed -n '2,/^set /{/^#/p}' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
REPO=${REPO:-'~/empatheia_jax'}  # expanded by the worker's shell (`cd ~/...`), so not quoted below
PORT=${COORDINATOR_PORT:-8482}
case "${DRY_RUN:-0}" in "" | 0 | false | no) DRY=0 ;; *) DRY=1 ;; esac
GCLOUD=(gcloud compute tpus tpu-vm)
WHERE=(--zone "$ZONE")
[[ -n "${PROJECT:-}" ]] && WHERE+=(--project "$PROJECT")

# Shell words of the arguments, quoted only where needed (what is printed is what the worker's shell runs).
quote() {
    local out=() a q="'"
    for a in "$@"; do
        if [[ "$a" =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then
            out+=("$a")
        else
            out+=("$q${a//$q/$q\\$q$q}$q")
        fi
    done
    printf '%s' "${out[*]}"
}

if [[ -n "${WORKERS:-}" ]]; then
    read -r -a HOSTS <<< "${WORKERS//,/ }"
else
    found=$("${GCLOUD[@]}" describe "$TPU" "${WHERE[@]}" --flatten='networkEndpoints[]' \
        --format='value(networkEndpoints.ipAddress)')
    read -r -d '' -a HOSTS <<< "$found" || true
fi
if [[ ${#HOSTS[@]} -lt 1 ]]; then
    echo "tpu_pod.sh: no workers found for TPU $TPU (set WORKERS=\"ADDR0 ADDR1 ...\")" >&2
    exit 2
fi
COUNT=${#HOSTS[@]}
COORDINATOR=${HOSTS[0]}:$PORT
ENVS=(HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1)

# The one place a worker's command is built: the dry run prints it, the real run sends it.
worker_command() {  # $1 = worker index; then CONFIG WORKDIR overrides
    local id=$1
    shift
    printf 'cd %s && %s' "$REPO" "$(quote "${ENVS[@]}" launch/local.sh "$@" \
        --config.distributed.initialize=True \
        "--config.distributed.coordinator_address=$COORDINATOR" \
        "--config.distributed.num_processes=$COUNT" \
        "--config.distributed.process_id=$id")"
}

# One ssh per worker (not --worker=all): each gets its own process id. The first --worker=all call makes
# sure gcloud's ssh key exists on every worker before the parallel sessions, which could race to add it.
PREFLIGHT=("${GCLOUD[@]}" ssh "$TPU" "${WHERE[@]}" --worker=all --command true)
echo "[tpu_pod.sh] $COUNT processes on TPU $TPU, coordinator $COORDINATOR$([[ $DRY == 1 ]] && echo ' (dry run)')"
if [[ $DRY == 1 ]]; then
    echo "preflight: $(quote "${PREFLIGHT[@]}")"
    for ((i = 0; i < COUNT; i++)); do
        cmd=$(worker_command "$i" "$@")
        echo "process $i: host=${HOSTS[i]} process_id=$i process_count=$COUNT coordinator=$COORDINATOR"
        echo "  env: ${ENVS[*]}"
        echo "  command: $cmd"
        echo "  ssh: $(quote "${GCLOUD[@]}" ssh "$TPU" "${WHERE[@]}" "--worker=$i" --command "$cmd")"
    done
    exit 0
fi

"${PREFLIGHT[@]}"
pids=()
for ((i = 0; i < COUNT; i++)); do
    "${GCLOUD[@]}" ssh "$TPU" "${WHERE[@]}" "--worker=$i" --command "$(worker_command "$i" "$@")" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do  # all of them, then the first failed worker's status
    rc=0
    wait "$pid" || rc=$?
    if [[ $status == 0 ]]; then status=$rc; fi
done
exit "$status"
