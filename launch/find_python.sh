#!/usr/bin/env bash
# Sourced by the launch scripts (from the repo root): sets and exports PY, the Python that runs the project.
# PY from the environment wins; else the repo's .venv (`make install`); else the interpreter of the
# installed `empatheia` command (its shebang), so that scripts import what that command imports.
# Also exports GLIBC_TUNABLES with glibc.malloc.hugetlb=1 (added to a user's own tunables, unless they set
# it): glibc then asks for transparent huge pages on the memory it maps, so XLA:CPU's multi-GB step buffers
# fault in 2 MB at a time and its kernels miss the TLB less (the coe step 1.1x on top of
# `empatheia_jax/host_memory.py`: docs/benchmarks.md "The allocator: ..."). glibc reads it only at start-up,
# hence here and not in Python; glibc < 2.35 and other C libraries ignore it.
set -euo pipefail

if [[ -z "${PY:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then
        PY=.venv/bin/python
    else
        PY=$(sed -n '1s/^#! *//p' "$(command -v empatheia)")
    fi
fi
export PY

case ":${GLIBC_TUNABLES:-}:" in
    *:glibc.malloc.hugetlb=*) ;;
    *) export GLIBC_TUNABLES="${GLIBC_TUNABLES:+$GLIBC_TUNABLES:}glibc.malloc.hugetlb=1" ;;
esac
