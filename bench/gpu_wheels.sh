#!/usr/bin/env bash
# Pre-downloads, HERE (the device machine has no internet), the exact wheels bench/gpu.sh may have to
# install there, for linux x86_64 / CPython 3.11, into bench/wheels/ (git-ignored; name it in the device
# call's `carry`, which takes 64 MiB in all):
#
#   bash bench/gpu_wheels.sh            # the small wheels (~25 MB): HF side + what the lent H200's image
#                                       # lacked last time (docs/benchmarks.md, "Stage coe on a lent H200")
#   bash bench/gpu_wheels.sh --torch    # ALSO torch 2.13.0 with its CUDA (nvidia-*) wheels: several GB,
#                                       # too big for a carry: only for an image with room on a shared disk
#
# No dependencies are resolved (--no-deps): each pin below is what the project's venv runs (pip list,
# 2026-11-27), and numpy, regex, pyyaml, tqdm, packaging... are in every image with jax. jax/jaxlib/flax are
# NOT downloaded: the GPU image brings its own CUDA jax (0.11.2 with flax 0.12.10 last time; flax 0.12.8 does
# not import on jax 0.11.2), and a CUDA jaxlib is far beyond the carry.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=bench/wheels
PY="${PYTHON:-$(command -v python || command -v python3)}"
mkdir -p "$DEST"
SMALL=(
  transformers==5.23.0 peft==0.21.2 tokenizers==0.23.3 safetensors==0.8.0 huggingface_hub==2.4.0
  accelerate==1.15.0
  ml_collections==1.1.0 grain==0.2.18 array_record==0.8.6 orbax-checkpoint==0.12.8 tensorboardX==2.6.5
  gguf==0.19.0 portpicker==1.6.0
)
TARGET=(--only-binary=:all: --no-deps --python-version 3.11 --implementation cp --abi cp311 --abi none
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64
        --platform manylinux_2_28_x86_64 --platform any)
"$PY" -m pip download --dest "$DEST" "${TARGET[@]}" "${SMALL[@]}"
if [[ "${1:-}" == "--torch" ]]; then
  # The PyPI torch wheel for linux x86_64 is the CUDA build; its nvidia-* dependencies are resolved here.
  "$PY" -m pip download --dest "$DEST" --only-binary=:all: --python-version 3.11 --implementation cp \
    --abi cp311 --platform manylinux_2_28_x86_64 torch==2.13.0
fi
du -sh "$DEST"
ls "$DEST"
