#!/usr/bin/env bash
# Sourced by the launch scripts (from the repo root): sets and exports PY, the Python that runs the project.
# PY from the environment wins; else the repo's .venv (`make install`); else the interpreter of the
# installed `empatheia` command (its shebang), so that scripts import what that command imports.
set -euo pipefail

if [[ -z "${PY:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then
        PY=.venv/bin/python
    else
        PY=$(sed -n '1s/^#! *//p' "$(command -v empatheia)")
    fi
fi
export PY
