"""The paper's Tables 2-4 from the `empatheia eval --json` reports of the ablation runs.

    python -m empatheia_jax.eval.ablations WORKDIR      # after launch/ablations.sh trained and evaluated them

WORKDIR/{variant}/eval.json are the reports (`empatheia eval --json`); a variant without one is left out
with a note. Rows follow the paper's layout (systems as rows, metrics as columns), one table per modality:

- **Table 2, text** (AvaMERG's textual ERG): Empatheia, w/o speech & video, w/o CoE, w/o CS, w/o SD, the
  Pipeline baseline, and two references: the majority emotion class and the gold replies (Dist only).
- **Table 3, speech** and **Table 4, video**: Empatheia, w/o CoE, w/o speech & video, the Pipeline baseline
  (the `pipeline_tts` column of the full model's report: the gold content spoken / drawn with the majority
  listener's voice and avatar, which is what a text-only pipeline with a fixed TTS and avatar produces) and
  the mean-style reference; the video table also has the gold avatars' style-probe ceiling. w/o CS and
  w/o SD have no speech or video rows: without the CS there are no content features to drive a generator,
  without the SD no style, so their cells are "-" (the paper does not say what its generators read then).

Accuracies and Dist are fractions here (the paper prints percentages).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

VARIANTS: dict[str, str] = {
    "full": "Empatheia",
    "no_media": "w/o speech & video",
    "no_coe": "w/o CoE",
    "no_cs": "w/o CS",
    "no_sd": "w/o SD",
    "pipeline": "Pipeline",
}
"""Variant folder -> row name, in the paper's order."""

TEXT_COLUMNS = ("emotion_acc_text", "emotion32_acc_text", "dist1_corpus", "dist2_corpus", "dist1_reply",
                "dist2_reply", "repetition_rate", "reply_words", "reply_ppl", "emotion_acc_cls", "age_acc",
                "gender_acc", "timbre_acc")
SPEECH_COLUMNS = ("speech_mcd", "speech_spk_sim", "speech_f0_diff_st", "speech_dur_ratio", "speech_age_acc",
                  "speech_gender_acc", "speech_timbre_acc")
VIDEO_COLUMNS = ("video_ssim", "video_cpbd", "video_f_lmd", "video_m_lmd", "video_lip_sync", "video_age_acc",
                 "video_gender_acc", "video_timbre_acc", "video_emotion_acc")


def read_reports(workdir: str | Path) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """{variant: its eval.json} for the variants evaluated in `workdir`, and notes on the missing ones."""
    workdir = Path(workdir)
    reports, notes = {}, []
    for variant in VARIANTS:
        path = workdir / variant / "eval.json"
        if not path.is_file():
            notes.append(f"{variant}: no {path}")
            continue
        try:
            reports[variant] = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
    return reports, notes


def paper_tables(reports: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """{"text" | "speech" | "video": {row name: {metric: value}}} in the module docstring's layout."""

    def pick(column: Mapping[str, Any] | None, names: Sequence[str]) -> dict[str, float]:
        return {k: float(column[k]) for k in names if column and column.get(k) is not None}

    text, speech, video = {}, {}, {}
    for variant, row in VARIANTS.items():
        report = reports.get(variant)
        if report is None:
            continue
        text[row] = pick(report.get("trained"), TEXT_COLUMNS)
        if variant not in ("no_cs", "no_sd", "pipeline"):
            speech[row] = pick(report.get("trained"), SPEECH_COLUMNS)
            video[row] = pick(report.get("trained"), VIDEO_COLUMNS)
    full = reports.get("full") or next(iter(reports.values()), {})
    baseline = full.get("baseline") or {}
    text["majority class"] = pick(baseline, ("emotion_acc_text", "emotion_acc_cls", "age_acc", "gender_acc",
                                             "timbre_acc"))
    text["gold replies"] = pick(baseline, ("dist1_corpus", "dist2_corpus", "dist1_reply", "dist2_reply"))
    for name, column in (("Pipeline (fixed voice & avatar)", "pipeline_tts"), ("mean style", "mean_style")):
        speech[name] = pick(full.get(column), SPEECH_COLUMNS)
        video[name] = pick(full.get(column), VIDEO_COLUMNS)
    video["gold (style-probe ceiling)"] = pick(full.get("gold"), VIDEO_COLUMNS)
    tables = {"text": text, "speech": speech, "video": video}
    return {name: {r: v for r, v in rows.items() if v} for name, rows in tables.items()}


def format_tables(tables: Mapping[str, Mapping[str, Mapping[str, float]]], digits: int = 4) -> str:
    """Markdown, one table per modality; "-" where a row lacks a metric."""
    from empatheia_jax.eval.metrics.names import HIGHER_IS_BETTER, LOWER_IS_BETTER

    titles = {"text": "Table 2: textual ERG", "speech": "Table 3: speech generation",
              "video": "Table 4: talking-head generation"}
    columns = {"text": TEXT_COLUMNS, "speech": SPEECH_COLUMNS, "video": VIDEO_COLUMNS}
    out = []
    for name, rows in tables.items():
        if not rows:
            continue
        cols = [c for c in columns[name] if any(c in r for r in rows.values())]
        arrow = {c: " ↑" if c in HIGHER_IS_BETTER else " ↓" if c in LOWER_IS_BETTER else "" for c in cols}
        lines = [f"### {titles[name]}", "", "| system | " + " | ".join(c + arrow[c] for c in cols) + " |",
                 "|---|" + "---:|" * len(cols)]
        for row, values in rows.items():
            cells = [f"{values[c]:.{digits}f}" if c in values else "-" for c in cols]
            lines.append(f"| {row} | " + " | ".join(cells) + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m empatheia_jax.eval.ablations WORKDIR", file=sys.stderr)
        return 2
    workdir = Path(argv[0])
    try:
        reports, notes = read_reports(workdir)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    if not reports:
        print(f"error: no variant of {workdir} has an eval.json (run launch/ablations.sh first)",
              file=sys.stderr)
        return 2
    tables = paper_tables(reports)
    text = format_tables(tables)
    targets = next((r["targets"] for r in reports.values() if r.get("targets")), None)
    if targets:
        text += f"\n{targets}\n"
    (workdir / "ablations.md").write_text(text, encoding="utf-8")
    (workdir / "ablations.json").write_text(json.dumps(tables, indent=1), encoding="utf-8")
    print(text, end="")
    print(f"tables -> {workdir / 'ablations.md'}, {workdir / 'ablations.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
