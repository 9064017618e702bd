"""The reference points an evaluation is read against: gold-target and mean-target baselines, chance levels.
"""

from __future__ import annotations

import collections
import os

import numpy as np

from empatheia_jax.data import input_pipeline as ip
from empatheia_jax.data import templates as tpl
from empatheia_jax.data.splits import check_split
from empatheia_jax.data.targets import UNIT_KINDS
from empatheia_jax.eval.metrics.names import ACC_NAME, LABELS
from empatheia_jax.eval.metrics.text import Means, accuracy, feature_distances, reply_text_metrics
from empatheia_jax.eval.report import metric_order
from empatheia_jax.models.empatheia import EmpatheiaConfig


def baselines(
    shards_dir: str | os.PathLike,
    split: str = "test",
    *,
    train_split: str = "train",
    max_speech_len: int = 256,
    max_video_len: int = 256,
    max_examples: int | None = None,
) -> dict[str, float]:
    """Majority-class and mean-predictor baselines on `split`, fitted on `train_split`.

    Classes: the most frequent train label of each attribute (ties: the lower index) predicted for every
    example: emotion_acc_cls and emotion_acc_text (a text model that always names the majority emotion),
    age_acc, gender_acc, timbre_acc. Features: the mean of the train targets, scored with the same
    `feature_distances` as the model: content by row index (row i predicts the mean of the train rows i, i.e.
    the average position profile; rows no train target reaches get the mean of all rows), truncated to
    `max_speech_len`/`max_video_len` rows as the pipeline truncates (pass the model's values); style one mean
    vector. dist{1,2}_{corpus,reply} are those of the GOLD replies of `split`: a reference, not a predictor.
    """
    check_split(shards_dir, split)
    check_split(shards_dir, train_split)
    limits = {"speech_content": max_speech_len, "video_content": max_video_len}
    majority, mean_rows, mean_style = _fit(ip.ShardReader.for_split(shards_dir, train_split), limits)

    test = ip.ShardReader.for_split(shards_dir, split)
    means = Means()
    replies = []
    n = len(test) if max_examples is None else min(len(test), max_examples)
    for i in range(n):
        rec = test[i]
        replies.append(tpl.clean_text(rec.get("response")))
        lab = rec.get("labels") or {}
        for k, maj in majority.items():
            label = -1 if lab.get(k) is None else int(lab[k])
            correct, counted = accuracy([maj], [label])
            means.add(ACC_NAME[k], correct, counted)
            if k == "emotion":
                means.add("emotion_acc_text", correct, counted)
        for kind, x in (rec.get("targets") or {}).items():
            if kind in UNIT_KINDS:  # row labels, not a target to predict
                continue
            x = np.asarray(x, np.float64)
            if kind in mean_rows:
                x = x[: limits[kind]]
                pred = mean_rows[kind][: len(x)]
                l2, cos = feature_distances(pred, x, np.ones(len(x), bool))
            elif kind in mean_style:
                l2, cos = feature_distances(mean_style[kind][None], x.reshape(1, -1), np.ones(1, bool))
            else:
                continue
            means.add_values(f"{kind}_l2", l2)
            means.add_values(f"{kind}_cos", cos)
    out = means.result()
    out.update(reply_text_metrics(replies))
    out["num_examples"] = float(n)
    return {k: out[k] for k in sorted(out, key=metric_order)}


def _fit(train: ip.ShardReader, limits: dict[str, int]
         ) -> tuple[dict[str, int], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The predictors `baselines` scores, fitted on the train records in one pass (a split may be too large to
    hold): the majority class of each label, the mean content row at each row index, the mean style vector.
    Returns (majority, mean_rows, mean_style)."""
    counts = {k: collections.Counter() for k in LABELS}
    row_sum: dict[str, np.ndarray] = {}
    row_n: dict[str, np.ndarray] = {}
    style_sum: dict[str, np.ndarray] = {}
    style_n: dict[str, int] = collections.Counter()
    for i in range(len(train)):
        rec = train[i]
        lab = rec.get("labels") or {}
        for k in LABELS:
            if lab.get(k) is not None and int(lab[k]) >= 0:
                counts[k][int(lab[k])] += 1
        for kind, x in (rec.get("targets") or {}).items():
            if kind in UNIT_KINDS:
                continue
            x = np.asarray(x, np.float64)
            if kind in limits:
                x = x[: limits[kind]]
                if kind not in row_sum:
                    row_sum[kind] = np.zeros((limits[kind], x.shape[-1]))
                    row_n[kind] = np.zeros(limits[kind])
                row_sum[kind][: len(x)] += x
                row_n[kind][: len(x)] += 1
            else:
                style_sum[kind] = style_sum.get(kind, 0) + x.reshape(-1)
                style_n[kind] += 1
    majority = {k: min(c, key=lambda v, c=c: (-c[v], v)) for k, c in counts.items() if c}
    mean_rows = {}
    for kind, s in row_sum.items():
        n = row_n[kind]
        overall = s.sum(0) / max(n.sum(), 1)
        mean_rows[kind] = np.where(n[:, None] > 0, s / np.maximum(n, 1)[:, None], overall)
    mean_style = {kind: s / style_n[kind] for kind, s in style_sum.items()}
    return majority, mean_rows, mean_style


def chance_levels(cfg: EmpatheiaConfig | None = None) -> dict[str, float]:
    """1 / number of classes of every accuracy metric (the model's class counts, else the paper's 7/4/2/3)."""
    n = {"emotion": 7, "age": 4, "gender": 2, "timbre": 3}
    if cfg is not None:
        n = {"emotion": cfg.num_emotions, "age": cfg.num_ages, "gender": cfg.num_genders,
             "timbre": cfg.num_timbres}
    out = {ACC_NAME[k]: 1.0 / v for k, v in n.items()}
    out["emotion_acc_text"] = 1.0 / n["emotion"]
    for k in ("age", "gender", "timbre"):
        out[f"{k}_acc_text"] = 1.0 / n[k]
    return out
