"""Writing an evaluation down: metric tables, per-class reports and plots, predictions files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from empatheia_jax.data import schema
from empatheia_jax.eval.metrics.names import COUNT_METRICS, HIGHER_IS_BETTER, LABELS, LOWER_IS_BETTER, METRICS
from empatheia_jax.eval.metrics.text import per_class_accuracy


def plot_per_class(per_class: Mapping[str, Mapping[str, float]], title: str, path: str | os.PathLike) -> Path:
    """A horizontal bar chart (PNG) of `per_class_accuracy`, the count of each class beside its bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(per_class)
    acc = [per_class[n]["accuracy"] for n in names]
    fig, ax = plt.subplots(figsize=(6.4, 0.9 + 0.26 * max(len(names), 1)))
    ax.barh(range(len(names)), acc, color="#4c72b0")
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.08)
    ax.set_xlabel("accuracy")
    ax.set_title(title, fontsize=10)
    for i, n in enumerate(names):
        ax.text(min(acc[i], 1.0) + 0.01, i, f"n={int(per_class[n]['n'])}", va="center", fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def per_class_report(details: Mapping[str, Any], emotion_map: schema.EmotionMap
                     ) -> dict[str, dict[str, dict[str, float]]]:
    """The paper's Figure 6 for one run: {plot: `per_class_accuracy`} for every prediction it made.

    From the generations (`evaluate(details=...)["predictions"]`): emotion_text (CoE step 2 on the shards'
    emotion classes), emotion32_text (the 32 ED labels), emotion32_scored (step 2 chosen by likelihood, with
    `score_emotions`) and, for the Pipeline baseline,
    {age,gender,timbre}_text.
    From the teacher-forced SD classifiers ("classified"): {emotion,age,gender,timbre}_cls. Plots without a
    labelled example are left out.
    """
    vocab = {"emotion": emotion_map.classes, "age": schema.AGES, "gender": schema.GENDERS,
             "timbre": schema.TIMBRES}
    out: dict[str, dict[str, dict[str, float]]] = {}
    preds = details.get("predictions") or []
    if preds:
        out["emotion_text"] = per_class_accuracy(preds, "emotion", vocab["emotion"])
        out["emotion32_text"] = per_class_accuracy(preds, "emotion_fine", schema.ED_EMOTIONS_32)
        if any("emotion_fine_scored" in p for p in preds):
            out["emotion32_scored"] = per_class_accuracy(preds, "emotion_fine_scored", schema.ED_EMOTIONS_32,
                                                         gold_key="emotion_fine")
        for name in ("age", "gender", "timbre"):
            if any(name in p for p in preds):
                out[f"{name}_text"] = per_class_accuracy(preds, name, vocab[name])
    classified = list((details.get("classified") or {}).values())
    for name in LABELS:
        rows = [{"labels": c["labels"], name: c[f"{name}_cls"]} for c in classified if f"{name}_cls" in c]
        if rows:
            out[f"{name}_cls"] = per_class_accuracy(rows, name, vocab[name])
    return {k: v for k, v in out.items() if v}


def write_report(
    directory: str | os.PathLike,
    columns: Mapping[str, Mapping[str, float]],
    *,
    notes: Sequence[str] = (),
    per_class: Mapping[str, Mapping[str, Mapping[str, float]]] | None = None,
    predictions: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """An evaluation report folder: report.md (the notes, the metrics table, the per-class tables with
    their plots), metrics.json (the columns, the notes' `extra` fields), per_class.json and
    per_class_<plot>.png, and predictions_<voter>.jsonl per voter (`write_predictions`). Returns report.md.

    Markdown and PNG because that is what a reader opens; JSON because that is what a script compares.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    per_class = dict(per_class or {})
    lines = ["# Evaluation report", ""]
    lines += [f"- {n}" for n in notes]
    lines += ["", "## Metrics", "", format_table(columns).strip(), ""]
    if per_class:
        lines += ["## Per-class accuracy", ""]
    for plot, table in per_class.items():
        png = plot_per_class(table, plot.replace("_", " "), directory / f"per_class_{plot}.png")
        lines += [f"### {plot}", "", f"![{plot}]({png.name})", ""]
        lines += ["| class | accuracy | n |", "|---|---|---|"]
        lines += [f"| {c} | {v['accuracy']:.4f} | {int(v['n'])} |" for c, v in table.items()]
        lines.append("")
    for voter, preds in (predictions or {}).items():
        write_predictions(preds, directory / f"predictions_{voter}.jsonl")
    (directory / "metrics.json").write_text(json.dumps({**columns, **(extra or {})}, indent=1))
    (directory / "per_class.json").write_text(json.dumps(per_class, indent=1))
    report = directory / "report.md"
    report.write_text("\n".join(lines))
    return report


def write_predictions(predictions: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> Path:
    """One JSON object per line (record_index, uid, labels, text, coe, reply, emotion, ...)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for p in predictions:
            f.write(json.dumps(p, ensure_ascii=False) + "\n")
    return path


def metric_order(name: str) -> tuple[int, str]:
    return (METRICS.index(name), "") if name in METRICS else (len(METRICS), name)


def format_table(
    columns: Mapping[str, Mapping[str, float]],
    metrics: Sequence[str] | None = None,
    *,
    digits: int = 4,
) -> str:
    """A Markdown table: one row per metric, one column per model/baseline; "-" where a column lacks it.

    Default rows: every metric some column has, in `METRICS` order (others after, alphabetically). The
    "better" column says whether higher or lower is better.
    """
    if metrics is None:
        names = {k for col in columns.values() for k in col}
        metrics = sorted(names, key=metric_order)
    header = ["metric", "better", *columns]

    def cell(name: str, v: Any) -> str:
        if v is None:
            return "-"
        v = float(v)
        if name in COUNT_METRICS and v.is_integer():
            return str(int(v))
        return f"{v:.{digits}f}"

    rows = [header]
    for m in metrics:
        better = "higher" if m in HIGHER_IS_BETTER else "lower" if m in LOWER_IS_BETTER else ""
        rows.append([m, better, *(cell(m, col.get(m)) for col in columns.values())])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        values = [c.rjust(w) for c, w in zip(r[2:], widths[2:], strict=True)]
        cells = [r[0].ljust(widths[0]), r[1].ljust(widths[1]), *values]
        return "| " + " | ".join(cells) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths[:2]) + "|" + "|".join(
        "-" * (w + 1) + ":" for w in widths[2:]) + "|"
    return "\n".join([line(rows[0]), sep, *(line(r) for r in rows[1:])])
