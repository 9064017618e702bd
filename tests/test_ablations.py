"""launch/ablations.sh and empatheia_jax/eval/ablations.py: which runs are trained and evaluated, and the
tables.

The script runs with a stand-in interpreter (`PY`) that records the train/eval commands it is given, marks
the stage's final checkpoint as written and writes a report whose values name the run; everything else
(launch/local.sh's stage plan from the real configs, the table module) is the real code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from empatheia_jax.eval import ablations

ROOT = Path(__file__).resolve().parents[1]

STANDIN_PY = r'''#!/usr/bin/env bash
# Stands in for the python interpreter: records train/eval calls, passes anything else to the real one.
set -euo pipefail
if [[ "${1:-}" == "-m" && "${2:-}" == "empatheia_jax.cli" ]]; then
    echo "$*" >> "$CALLS"
    args=("$@")
    if [[ "$3" == "train" ]]; then
        for a in "${args[@]}"; do
            case $a in --config.stage=*) stage=${a#--config.stage=} ;; esac
        done
        for ((i = 0; i < ${#args[@]}; i++)); do
            [[ "${args[$i]}" == "--workdir" ]] && run=${args[$((i + 1))]}
        done
        mkdir -p "$run/checkpoints/6"  # configs/tiny.py: 6 steps a stage, which local.sh checks for
    else
        for ((i = 0; i < ${#args[@]}; i++)); do
            [[ "${args[$i]}" == "--ckpt" ]] && ckpt=${args[$((i + 1))]}
            [[ "${args[$i]}" == "--json" ]] && out=${args[$((i + 1))]}
        done
        "$REAL_PY" - "$ckpt" "$out" <<'EOF'
import json, sys
ckpt, out = sys.argv[1], sys.argv[2]
variant = ckpt.rstrip("/").split("/")[-2]
value = {"full": 0.5, "no_media": 0.4, "no_coe": 0.3, "no_cs": 0.45, "no_sd": 0.44, "pipeline": 0.2}[variant]
trained = {"emotion_acc_text": value, "dist1_corpus": value / 10, "speech_mcd": 7.0 + value,
           "video_ssim": value}
json.dump({"trained": trained, "baseline": {"emotion_acc_text": 0.25, "dist1_corpus": 0.09},
           "pipeline_tts": {"speech_mcd": 8.0, "video_ssim": 0.6}, "mean_style": {"speech_mcd": 7.9},
           "gold": {"video_age_acc": 0.95}, "targets": "targets: test"}, open(out, "w"))
EOF
    fi
else
    exec "$REAL_PY" "$@"
fi
'''


def test_the_script_trains_each_variant_evaluates_its_last_stage_and_writes_the_tables(tmp_path):
    py = tmp_path / "py"
    py.write_text(STANDIN_PY)
    py.chmod(0o755)
    calls = tmp_path / "calls.txt"
    work = tmp_path / "work"
    env = {**os.environ, "PY": str(py), "REAL_PY": sys.executable, "CALLS": str(calls),
           "EVAL_FLAGS": "--speech_examples 2 --nogenerate", "JAX_PLATFORMS": "cpu"}
    p = subprocess.run(["bash", "launch/ablations.sh", "configs/tiny.py", str(work), "--config.seed=3"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = calls.read_text().splitlines()
    evals = [x for x in lines if " eval " in x]
    trains = [x for x in lines if " train " in x]
    # each variant evaluated once, at the last stage it trained (ablations drop stages: no_cs has no ccl,
    # no_media no sac), with the extra eval flags
    want_final = {"full": "overall", "no_coe": "overall", "no_media": "overall", "no_cs": "overall",
                  "no_sd": "overall", "pipeline": "pipeline"}
    assert len(evals) == 6
    for variant, stage in want_final.items():
        (call,) = [e for e in evals if f"/work/{variant}/" in e]
        assert f"--ckpt {work}/{variant}/{stage} " in call and "--speech_examples 2 --nogenerate" in call
    for variant in ("no_coe", "no_media", "no_cs", "no_sd", "pipeline"):
        mine = [t for t in trains if f"/work/{variant}/" in t]
        assert mine and all(f"--config configs/tiny.py:{variant} " in t for t in mine), mine
        assert all("--config.seed=3" in t for t in mine)
    stages_of = {v: [t.split("--config.stage=")[1].split()[0] for t in trains if f"/work/{v}/" in t]
                 for v in want_final}
    assert stages_of["full"] == ["coe", "ccl", "sac", "overall"]
    assert stages_of["no_cs"] == [s for s in stages_of["full"] if s != "ccl"]
    assert stages_of["pipeline"] == ["pipeline"]
    tables = json.loads((work / "ablations.json").read_text())
    assert tables["text"]["Empatheia"]["emotion_acc_text"] == 0.5
    assert tables["text"]["w/o CoE"]["emotion_acc_text"] == 0.3
    assert tables["text"]["majority class"] == {"emotion_acc_text": 0.25}
    assert "w/o CS" not in tables["speech"] and tables["speech"]["Empatheia"]["speech_mcd"] == 7.5
    md = (work / "ablations.md").read_text()
    assert "| w/o speech & video | 0.4000 |" in md and "targets: test" in md

    # a second run keeps what exists: no training, no evaluation
    calls.unlink()
    p = subprocess.run(["bash", "launch/ablations.sh", "configs/tiny.py", str(work), "--config.seed=3"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and not calls.exists()


def test_tables_take_each_row_from_its_report_and_mark_what_is_missing(tmp_path):
    full = {"trained": {"emotion_acc_text": 0.4, "speech_mcd": 7.5, "video_ssim": 0.8, "video_lip_sync": 0.3},
            "baseline": {"emotion_acc_text": 0.2, "dist1_corpus": 0.1, "age_acc": 0.3},
            "pipeline_tts": {"speech_mcd": 8.1, "video_ssim": 0.7}, "mean_style": {"speech_mcd": 7.9},
            "gold": {"video_gender_acc": 1.0}}
    no_sd = {"trained": {"emotion_acc_text": 0.35, "speech_mcd": 9.0}}
    for variant, report in (("full", full), ("no_sd", no_sd)):
        (tmp_path / variant).mkdir()
        (tmp_path / variant / "eval.json").write_text(json.dumps(report))
    reports, notes = ablations.read_reports(tmp_path)
    assert set(reports) == {"full", "no_sd"} and len(notes) == 4
    t = ablations.paper_tables(reports)
    assert t["text"] == {"Empatheia": {"emotion_acc_text": 0.4}, "w/o SD": {"emotion_acc_text": 0.35},
                         "majority class": {"emotion_acc_text": 0.2, "age_acc": 0.3},
                         "gold replies": {"dist1_corpus": 0.1}}
    assert t["speech"] == {"Empatheia": {"speech_mcd": 7.5},  # w/o SD drives no generator
                           "Pipeline (fixed voice & avatar)": {"speech_mcd": 8.1},
                           "mean style": {"speech_mcd": 7.9}}
    assert t["video"]["gold (style-probe ceiling)"] == {"video_gender_acc": 1.0}
    md = ablations.format_tables(t)
    assert "| Empatheia | 0.8000 | 0.3000 | - |" in md
    assert "video_ssim ↑" in md and "speech_mcd ↓" in md
    assert ablations.main([str(tmp_path)]) == 0 and (tmp_path / "ablations.md").read_text() == md
    empty = tmp_path / "empty"
    empty.mkdir()
    assert ablations.main([str(empty)]) == 2
    (tmp_path / "no_cs").mkdir()
    (tmp_path / "no_cs" / "eval.json").write_text("{not json")
    with pytest.raises(ValueError, match="no_cs/eval.json"):
        ablations.read_reports(tmp_path)
