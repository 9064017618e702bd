"""The reference points an evaluation is read against: gold-target and mean-target baselines, chance levels.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from empatheia_jax.data import templates as tpl
from empatheia_jax.data.shard_reader import ShardReader
from empatheia_jax.data.splits import check_split
from empatheia_jax.data.targets import UNIT_KINDS
from empatheia_jax.eval.metrics.names import ACC_NAME, LABELS
from empatheia_jax.eval.metrics.text import (
    Means,
    accuracy,
    feature_distances,
    reply_engagement,
    reply_text_metrics,
    speaker_turn,
)
from empatheia_jax.eval.report import metric_order
from empatheia_jax.models.empatheia_config import EmpatheiaConfig


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
    vector. dist{1,2}_{corpus,reply}, question_rate, reuse_rate and duplicate_rate are those of the GOLD
    replies of `split`: a reference, not a predictor.
    """
    column, _, _ = _baseline_pass(shards_dir, split, train_split, max_speech_len, max_video_len, max_examples)
    return column


def baseline_columns(
    shards_dir: str | os.PathLike,
    split: str = "test",
    *,
    train_split: str = "train",
    max_speech_len: int = 256,
    max_video_len: int = 256,
) -> dict[str, dict[str, float]]:
    """The `baselines` column and the `bag_of_words` column, from one read of each split (an eval's split
    may be large, and every record is decoded from its shard)."""
    column, train_texts, test_texts = _baseline_pass(
        shards_dir, split, train_split, max_speech_len, max_video_len, None)
    return {"baseline": column, "bag_of_words": bag_of_words(train_texts, test_texts)}


def _baseline_pass(shards_dir, split, train_split, max_speech_len, max_video_len, max_examples
                   ) -> tuple[dict[str, float], list[dict[str, Any]], list[dict[str, Any]]]:
    """`baselines`' column, and the text and labels of every train and scored record (what `bag_of_words`
    reads), from one pass over each split."""
    check_split(shards_dir, split)
    check_split(shards_dir, train_split)
    limits = {"speech_content": max_speech_len, "video_content": max_video_len}
    train = ShardReader.for_split(shards_dir, train_split)
    majority, mean_rows, mean_style, train_texts = _fit(train, limits)

    test = ShardReader.for_split(shards_dir, split)
    means = Means()
    replies, turns, test_texts = [], [], []
    n = len(test) if max_examples is None else min(len(test), max_examples)
    for i in range(n):
        rec = test[i]
        test_texts.append(_text_and_labels(rec))
        replies.append(tpl.clean_text(rec.get("response")))
        turns.append(tpl.clean_text(speaker_turn(rec)))
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
    out.update(reply_engagement(replies, turns))
    out["num_examples"] = float(n)
    return {k: out[k] for k in sorted(out, key=metric_order)}, train_texts, test_texts


def _text_and_labels(rec: Mapping[str, Any]) -> dict[str, Any]:
    """What `bag_of_words` reads of a record: kept instead of the record, whose media may not fit in
    memory."""
    return {"history": rec.get("history"), "labels": rec.get("labels")}


def _fit(train: ShardReader, limits: dict[str, int]
         ) -> tuple[dict[str, int], dict[str, np.ndarray], dict[str, np.ndarray], list[dict[str, Any]]]:
    """The predictors `baselines` scores, fitted on the train records in one pass (a split may be too large to
    hold): the majority class of each label, the mean content row at each row index, the mean style vector.
    Returns (majority, mean_rows, mean_style, the records' `_text_and_labels`)."""
    counts = {k: collections.Counter() for k in LABELS}
    row_sum: dict[str, np.ndarray] = {}
    row_n: dict[str, np.ndarray] = {}
    style_sum: dict[str, np.ndarray] = {}
    style_n: dict[str, int] = collections.Counter()
    texts = []
    for i in range(len(train)):
        rec = train[i]
        texts.append(_text_and_labels(rec))
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
    return majority, mean_rows, mean_style, texts


def dialogue_text(record: Mapping[str, Any]) -> str:
    """What a text classifier of the dialogue reads: every history utterance, in order (the dialogue alone,
    as the model reads it; no situation text)."""
    return " ".join(tpl.clean_text(h.get("utterance")) for h in record.get("history") or ())


def bag_of_words(train: Sequence[Mapping[str, Any]], test: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The bag-of-words floor of the emotion rows: TF-IDF of `dialogue_text` (words and word pairs,
    sublinear tf) and a logistic regression per label, both fitted on the `train` records only, scored on
    `test` as emotion_acc_text (the shards' classes) and emotion32_acc_text (the 32 ED labels). An LLM that
    does not beat it has learnt no more than which words go with which emotion. Labels < 0 are left out of
    the fit and the score; a label with one train class is skipped."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    def label(rec, key):
        value = (rec.get("labels") or {}).get(key)
        return -1 if value is None else int(value)

    vectorizer = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True)
    x_train = vectorizer.fit_transform([dialogue_text(r) for r in train])
    x_test = vectorizer.transform([dialogue_text(r) for r in test])
    out = {}
    for key, name in (("emotion", "emotion_acc_text"), ("emotion_fine", "emotion32_acc_text")):
        y_train = np.array([label(r, key) for r in train])
        y_test = np.array([label(r, key) for r in test])
        seen, scored = y_train >= 0, y_test >= 0
        if len(set(y_train[seen])) < 2 or not scored.any():
            continue
        clf = LogisticRegression(max_iter=2000).fit(x_train[seen], y_train[seen])
        out[name] = float(np.mean(clf.predict(x_test[scored]) == y_test[scored]))
    out["num_examples"] = float(len(test))
    return out


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
