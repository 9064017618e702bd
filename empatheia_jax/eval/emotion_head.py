"""The emotion head: a linear probe over how the fine-tuned LLM reads the dialogue; its vote with CoE step 2.

Why a probe: the ED systems that classify well (CASE, SEEK, ESCM) put a classifier over an encoding of the
dialogue. Here the encoding is the LoRA'd LLM's own reading of the prompt (`prompt_summaries`: the hidden
state where the reply starts, beside the mean over the prompt), frozen. A linear head on it is a convex fit
(scikit-learn's multinomial logistic regression: a well-kept solver, no training stage to write) that can
be fitted to any checkpoint after the fact and never changes what the LLM generates.

Why a product of experts: step 2 decoded freely, step 2 chosen by likelihood among the 32 labels
(`emotion_label_logprobs`) and the head err on different dialogues. The combined decision is

    argmax_k  head_weight * log p_head(k) + log softmax(label log-likelihoods)(k) + free_weight * [k == free]

with both weights chosen on the dev part (`choose_weights`) and kept in the head's file, so a test split
is scored with weights it never saw. The dev figure of the chosen weights is read on the records that
chose them; `cross_fitted_accuracy` (5 folds) is the one to expect elsewhere, and the card carries both. A
row with no step 2 to score (no CoE in its text) votes with the head and the free step alone.

Every name here is numpy and host-side: the features come from `generation_pass.dialogue_summaries`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from empatheia_jax.data import schema

FILE_NAME = "emotion_head.safetensors"  # beside an export's heads.safetensors
C_GRID = (0.003, 0.01, 0.03, 0.1, 0.3)  # inverse L2 strength of the probe; chosen on dev
HEAD_WEIGHT_GRID = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)
FREE_WEIGHT_GRID = (0.0, 0.5, 1.0, 2.0, 4.0)
CV_FOLDS = 5  # `cross_fitted_accuracy`: the combined figure on records that did not choose its weights
_TENSORS = ("mean", "scale", "coef", "intercept")
_UNSEEN = 30.0  # log-odds below the least likely seen label given to a label the train part never had


class EmotionHeadError(ValueError):
    """A head file that cannot be read or does not fit the model or the labels (a user error)."""


@dataclasses.dataclass(frozen=True)
class EmotionHead:
    """A fitted probe: standardisation (mean, scale [F]), then logits = x @ coef.T + intercept over the 32 ED
    labels (`schema.ED_EMOTIONS_32` order). `head_weight`/`free_weight` are the combination's weights
    (None until `choose_weights` set them); `c` is the probe's inverse regularisation."""

    mean: np.ndarray
    scale: np.ndarray
    coef: np.ndarray
    intercept: np.ndarray
    c: float
    head_weight: float | None = None
    free_weight: float | None = None

    @property
    def num_features(self) -> int:
        return int(self.coef.shape[1])

    def log_probs(self, features: Any) -> np.ndarray:
        """[N, 32] log-probabilities of the labels for features [N, F]."""
        x = np.asarray(features, np.float64)
        if x.ndim != 2 or x.shape[1] != self.num_features:
            raise EmotionHeadError(f"the emotion head reads {self.num_features} features per row, got shape "
                                   f"{tuple(x.shape)} (a head fitted to another model?)")
        logits = ((x - self.mean) / self.scale) @ self.coef.T + self.intercept
        return logits - _logsumexp(logits)

    def with_weights(self, head_weight: float, free_weight: float) -> EmotionHead:
        return dataclasses.replace(self, head_weight=float(head_weight), free_weight=float(free_weight))

    def save(self, path: str | os.PathLike) -> None:
        """safetensors (tensors float32) with the scalars and the label names in its metadata."""
        from safetensors.numpy import save_file

        meta = {"c": self.c, "head_weight": self.head_weight, "free_weight": self.free_weight,
                "labels": list(schema.ED_EMOTIONS_32)}
        tensors = {k: np.asarray(getattr(self, k), np.float32) for k in _TENSORS}
        save_file(tensors, os.fspath(path), metadata={"emotion_head": json.dumps(meta)})

    @classmethod
    def load(cls, path: str | os.PathLike) -> EmotionHead:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(os.fspath(path), "np") as f:
                raw = (f.metadata() or {}).get("emotion_head")
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        except (OSError, SafetensorError) as e:
            raise EmotionHeadError(f"{path}: not a readable safetensors file ({e})") from e
        if raw is None or set(tensors) != set(_TENSORS):
            raise EmotionHeadError(f"{path}: not an emotion head (want tensors mean, scale, coef, intercept "
                                   f"and 'emotion_head' metadata; has {sorted(tensors)})")
        meta = json.loads(raw)
        if meta.get("labels") != list(schema.ED_EMOTIONS_32):
            raise EmotionHeadError(f"{path}: its labels are not the 32 ED emotions in schema order")
        k, f_dim = tensors["coef"].shape
        if k != len(schema.ED_EMOTIONS_32) or any(tensors[n].shape != (f_dim,) for n in ("mean", "scale")):
            raise EmotionHeadError(f"{path}: tensor shapes do not agree (coef {tensors['coef'].shape})")
        return cls(**{n: tensors[n].astype(np.float64) for n in tensors}, c=float(meta["c"]),
                   head_weight=meta.get("head_weight"), free_weight=meta.get("free_weight"))


def _logsumexp(x: np.ndarray) -> np.ndarray:
    top = np.max(x, axis=-1, keepdims=True)
    return top + np.log(np.sum(np.exp(x - top), axis=-1, keepdims=True))


def fit_probe(features: Any, labels: Any, c: float, *, max_iter: int = 2000) -> EmotionHead:
    """The multinomial logistic regression of the 32 ED labels (ints, schema order) on standardised features.
    Labels the rows never have get a logit `_UNSEEN` below the least likely seen one."""
    from sklearn.linear_model import LogisticRegression

    x = np.asarray(features, np.float64)
    y = np.asarray(labels, np.int64)
    if x.ndim != 2 or len(x) != len(y) or len(x) == 0:
        raise ValueError(f"fit_probe: features {x.shape} and labels {y.shape} do not pair up")
    if y.min() < 0 or y.max() >= len(schema.ED_EMOTIONS_32):
        raise ValueError("fit_probe: every label must be an ED emotion index (0-31)")
    seen = np.unique(y)
    if len(seen) < 2:
        raise ValueError("fit_probe: the rows have a single label; there is nothing to separate")
    mean = x.mean(0)
    scale = np.where(x.std(0) > 1e-6, x.std(0), 1.0)
    clf = LogisticRegression(C=c, max_iter=max_iter).fit((x - mean) / scale, y)
    k = len(schema.ED_EMOTIONS_32)
    coef = np.zeros((k, x.shape[1]))
    intercept = np.full(k, 0.0)
    coef[clf.classes_] = clf.coef_ if len(seen) > 2 else np.stack([-clf.coef_[0], clf.coef_[0]]) / 2
    fitted = clf.intercept_ if len(seen) > 2 else np.array([-clf.intercept_[0], clf.intercept_[0]]) / 2
    intercept[:] = fitted.min() - _UNSEEN
    intercept[clf.classes_] = fitted
    return EmotionHead(mean=mean, scale=scale, coef=coef, intercept=intercept, c=float(c))


def fit_head(train_features: Any, train_labels: Any, dev_features: Any, dev_labels: Any,
             grid: Sequence[float] = C_GRID) -> tuple[EmotionHead, dict[float, float]]:
    """The probe fitted on the train part for each C of `grid`, kept at the C with the best dev accuracy
    (ties: the stronger regularisation); returns (head, {C: dev accuracy})."""
    dev_y = np.asarray(dev_labels)
    scores, heads = {}, {}
    for c in sorted(grid):
        heads[c] = fit_probe(train_features, train_labels, c)
        scores[c] = float(np.mean(heads[c].log_probs(dev_features).argmax(-1) == dev_y))
    best = max(sorted(grid), key=lambda c: scores[c])  # max keeps the first (smallest C) of equals
    return heads[best], scores


def combine(head_logprobs: Any, label_logprobs: Any, free: Any, head_weight: float, free_weight: float
            ) -> np.ndarray:
    """The combined step-2 label of each row (module docstring): head_logprobs [N, 32]; label_logprobs
    [N, 32] raw log-likelihoods of the labels after the model's step-2 header, a row of NaN where the row
    had none to score; free [N] the freely decoded step 2 (label index, -1 when it named no ED label)."""
    head = np.asarray(head_logprobs, np.float64)
    scored = np.asarray(label_logprobs, np.float64)
    free = np.asarray(free, np.int64)
    if head.shape != scored.shape or head.shape[:1] != free.shape:
        raise ValueError(f"combine: head {head.shape}, scored {scored.shape} and free {free.shape} differ")
    scored = scored - _logsumexp(np.nan_to_num(scored, nan=0.0))
    total = head_weight * head + np.nan_to_num(scored, nan=0.0)
    rows = np.flatnonzero(free >= 0)
    total[rows, free[rows]] += free_weight
    return total.argmax(-1)


def choose_weights(head_logprobs: Any, label_logprobs: Any, free: Any, gold: Any,
                   head_grid: Sequence[float] = HEAD_WEIGHT_GRID,
                   free_grid: Sequence[float] = FREE_WEIGHT_GRID) -> tuple[tuple[float, float], dict]:
    """The (head_weight, free_weight) of the grids whose `combine` is most often the gold label (ties: the
    smaller weights, in grid order); returns (weights, {(hw, fw): accuracy})."""
    gold = np.asarray(gold)
    table = {(hw, fw): float(np.mean(combine(head_logprobs, label_logprobs, free, hw, fw) == gold))
             for hw, fw in itertools.product(head_grid, free_grid)}
    best = max(table, key=lambda w: table[w])
    return best, table


def cross_fitted_accuracy(head_logprobs: Any, label_logprobs: Any, free: Any, gold: Any,
                          folds: int = CV_FOLDS) -> float:
    """The combined decision's accuracy with every record judged by the weights `choose_weights` picks on the
    other folds (record i in fold i % folds), pooled over the records. Why: the weights chosen on the dev
    part and read on it are read on the records that chose them; this is the figure to expect on records
    the choice never saw."""
    head, scored = np.asarray(head_logprobs, np.float64), np.asarray(label_logprobs, np.float64)
    free, gold = np.asarray(free, np.int64), np.asarray(gold, np.int64)
    if len(gold) < folds:
        raise ValueError(f"cross_fitted_accuracy: {len(gold)} records are fewer than {folds} folds")
    fold = np.arange(len(gold)) % folds
    right = 0
    for f in range(folds):
        fit, held = fold != f, fold == f
        (hw, fw), _ = choose_weights(head[fit], scored[fit], free[fit], gold[fit])
        right += int(np.sum(combine(head[held], scored[held], free[held], hw, fw) == gold[held]))
    return right / len(gold)


def prediction_arrays(predictions: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """What `combine` reads, from `generate_predictions` dicts that carry `emotion_head_logprobs` (an eval
    with a head): head [N, 32], scored [N, 32] (NaN rows where unscored), free [N], gold [N] (-1: none)."""
    missing = [p.get("record_index") for p in predictions if "emotion_head_logprobs" not in p]
    if missing:
        raise EmotionHeadError(f"{len(missing)} predictions have no emotion_head_logprobs (records "
                               f"{missing[:5]}...): evaluate with the head first")
    k = len(schema.ED_EMOTIONS_32)
    return {
        "head": np.asarray([p["emotion_head_logprobs"] for p in predictions], np.float64),
        "scored": np.asarray([p.get("emotion_label_logprobs") or [np.nan] * k for p in predictions],
                             np.float64),
        "free": np.asarray([p.get("emotion_fine", -1) for p in predictions], np.int64),
        "gold": np.asarray([p.get("labels", {}).get("emotion_fine", -1) for p in predictions], np.int64),
    }
