"""Empatheia's training losses (paper §5, eqs 8-13) as pure functions on arrays.

Every term is computed and returned separately (so metrics report each one), then `combine` sums the
terms a stage trains on:

    L_emp  token cross-entropy on target tokens only                  (eq 8)
    L_ccl  ||C^s - Ĉ^s||² + ||C^v - Ĉ^v||², masked mean over rows     (eq 9)
    L_sal  ||S^s - Ŝ^s||² + ||S^v - Ŝ^v||²                            (eq 10)
    L_cls  emotion + age + gender + timbre cross-entropy              (eq 11, minus sign restored)
    L_sac  L_sal + L_cls                                              (eq 12)
    L_oal  L_emp + α·L_ccl + β·L_sac                                  (eq 13)
    KL     the VAE blocks' KL to N(0, I), weighted from config         (not in the paper's equations)

Everything is float32, and a mean over an empty set is 0, never NaN (a batch without a valid target row
or label must not poison the step).

Gradient accumulation. Every mean function takes an optional `count=`: the denominator to use instead of
this call's own number of valid items. With `count` = the item count of the WHOLE batch (the `*_count`
helpers below, which are additive over any split of the batch), each micro-batch's value is its sum over
the whole batch's count, so summing the values (and their gradients) over micro-batches gives exactly the
full-batch mean (and gradient). An empty micro-batch then contributes 0 (its sum), and a whole batch
without items still gives 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from empatheia_jax.models.vae import kl_divergence

# Term names: the keys of `combine`'s input and of its metrics.
EMP = "emp"  # L_emp: CoE + reply (+ signal tokens in the overall stage)
SIGNAL_CE = "signal_ce"  # CE on the <AUDi>/<VIDi> signal tokens (stage 3)
CCL_SPEECH = "ccl_speech"
CCL_VIDEO = "ccl_video"
SAL_SPEECH = "sal_speech"
SAL_VIDEO = "sal_video"
CLS_EMOTION = "cls_emotion"
CLS_AGE = "cls_age"
CLS_GENDER = "cls_gender"
CLS_TIMBRE = "cls_timbre"
KL = "kl"  # sum of the KL terms of the VAE blocks that the stage trains

CCL_TERMS = (CCL_SPEECH, CCL_VIDEO)
SAL_TERMS = (SAL_SPEECH, SAL_VIDEO)
CLS_TERMS = (CLS_EMOTION, CLS_AGE, CLS_GENDER, CLS_TIMBRE)
TERMS = (EMP, SIGNAL_CE, *CCL_TERMS, *SAL_TERMS, *CLS_TERMS, KL)

# Names of the derived metrics that `combine` adds next to the terms.
CCL, SAL, CLS, SAC, TOTAL = "ccl", "sal", "cls", "sac", "total"

STAGES = ("coe", "ccl", "sac", "overall")
STAGE_TERMS: dict[str, tuple[str, ...]] = {
    "coe": (EMP,),
    "ccl": (*CCL_TERMS, KL),
    "sac": (*SAL_TERMS, *CLS_TERMS, SIGNAL_CE, KL),
    "overall": (EMP, *CCL_TERMS, *SAL_TERMS, *CLS_TERMS, KL),
}


# ----------------------------------------------------------------------------------------------------------
# Terms
# ----------------------------------------------------------------------------------------------------------


def _safe_mean(total: jax.Array, count: jax.Array) -> jax.Array:
    return total / jnp.maximum(count, 1).astype(jnp.float32)


def _mean(total: jax.Array, local: jax.Array, count: jax.Array | int | None) -> jax.Array:
    """total / count, or total / the local item count when count is None; 0 when the count is 0."""
    return _safe_mean(total, local if count is None else jnp.asarray(count))


# Item counts: the default denominators of the mean functions, as int32 totals over every axis of the mask
# (so they are additive over any split of the batch, and accept [B, ...] or [A, m, ...] leading axes).


def masked_count(mask: jax.Array) -> jax.Array:
    """Number of set entries: target tokens (token_cross_entropy), valid rows (masked_squared_l2), examples
    with a target (squared_l2)."""
    return jnp.sum(mask.astype(bool), dtype=jnp.int32)


def label_count(labels: jax.Array) -> jax.Array:
    """Number of labelled examples (label >= 0): classification_ce's denominator."""
    return jnp.sum(labels >= 0, dtype=jnp.int32)


def kl_count(mask: jax.Array) -> jax.Array:
    """Number of examples with at least one valid query (mask [..., Q]): kl_term's denominator."""
    return jnp.sum(jnp.any(mask.astype(bool), axis=-1), dtype=jnp.int32)


def token_cross_entropy(
    logits: jax.Array, target_ids: jax.Array, loss_mask: jax.Array, *, count: jax.Array | int | None = None
) -> tuple[jax.Array, jax.Array]:
    """L_emp (eq 8): mean CE over the tokens where loss_mask is set, and their (local) count.

    logits [B, T, V] are already aligned with target_ids [B, T] (the input pipeline shifts: position t
    predicts target_ids[t]); prompt/history/padding positions have loss_mask 0. Computed in float32 with
    log-sum-exp, so bf16 logits are fine. `count` (default: the local count) is the denominator; the
    returned count is always this call's own `masked_count(loss_mask)`.
    """
    return masked_token_mean(token_nll(logits, target_ids, loss_mask), loss_mask, count=count)


def token_nll(logits: jax.Array, target_ids: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """-log softmax(logits)[target] at every position, float32 [B, T]; positions outside loss_mask score
    id 0 (their padding ids may be out of range) and are for the caller to mask."""
    ids = jnp.where(loss_mask.astype(bool), target_ids, 0)
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), ids)


def masked_token_mean(
    nll: jax.Array, loss_mask: jax.Array, *, count: jax.Array | int | None = None
) -> tuple[jax.Array, jax.Array]:
    """`token_cross_entropy` from per-token negative log-likelihoods [B, T] (e.g. `Llama.token_nll`, which
    never holds the whole logits): the mean over loss_mask (denominator `count`) and the local count."""
    m = loss_mask.astype(bool)
    n = masked_count(m)
    return _mean(jnp.sum(jnp.where(m, nll, 0.0)), n, count), n


def masked_squared_l2(
    pred: jax.Array, target: jax.Array, mask: jax.Array, *, count: jax.Array | int | None = None,
    dim_weight: Sequence[float] | np.ndarray | None = None,
) -> jax.Array:
    """L_ccl for one modality (eq 9): ||pred_row - target_row||² summed over D, mean over valid rows.

    pred/target [B, L, D], mask [B, L]. The mean is over all valid rows of the batch (a long utterance
    weighs more than a short one, as every phoneme / frame counts once); 0 when no row is valid. Masked
    rows do not enter the value or the gradient, whatever they hold (inf/NaN padding included).
    `count` replaces the denominator `masked_count(mask)` (gradient accumulation). `dim_weight` [D]
    weighs each dimension's squared error (None: all 1, eq 9; `balanced_dim_weights`).
    """
    m = mask.astype(bool)
    diff = pred.astype(jnp.float32) - target.astype(jnp.float32)
    diff = jnp.where(m[..., None], diff, 0.0)
    sq = jnp.square(diff)
    if dim_weight is not None:
        sq = sq * jnp.asarray(dim_weight, jnp.float32)
    per_row = jnp.sum(sq, axis=-1)
    return _mean(jnp.sum(per_row), masked_count(m), count)


BALANCE_FLOOR = 1e-2


def balanced_dim_weights(variance: np.ndarray) -> np.ndarray:
    """Per-dimension weights [D] of a content kind's squared error that give every dimension the same share
    of the mean predictor's loss, which stays what eq 9 gives it (sum of the variances).

    Why: the rows a generator reads are not equally spread. Kokoro's rows are t_en (512, an LSTM's output
    in [-1, 1], 6 % of the row variance) ++ d_en (512, PL-BERT's projection, 94 %), and what a listener
    hears is in t_en (docs/benchmarks.md "The avatar's words"): eq 9 spends the CS on d_en. Weight
    w_d = (V / D) / max(var_d, BALANCE_FLOOR * V / D), V = the summed variance: a dimension of average
    spread weighs 1, a quieter one more (up to 1 / BALANCE_FLOOR, so a constant dimension, e.g. an unused
    face control, cannot dominate), and sum_d w_d var_d = V while no dimension is floored.
    """
    var = np.asarray(variance, np.float64)
    if var.ndim != 1 or not var.size or not np.all(np.isfinite(var)) or np.any(var < 0):
        raise ValueError(f"variance must be a finite non-negative vector [D], got shape {var.shape}")
    mean = var.sum() / var.size
    if mean <= 0:
        return np.ones(var.size, np.float32)
    return (mean / np.maximum(var, BALANCE_FLOOR * mean)).astype(np.float32)


def squared_l2(
    pred: jax.Array, target: jax.Array, mask: jax.Array, *, count: jax.Array | int | None = None
) -> jax.Array:
    """L_sal for one modality (eq 10): ||pred - target||² over D, mean over examples whose mask is set.

    pred/target [B, D], mask [B] (e.g. the pipeline's style_mask column: the example has that target).
    `count` replaces the denominator `masked_count(mask)`.
    """
    return masked_squared_l2(pred[:, None, :], target[:, None, :], mask[:, None], count=count)


def classification_ce(
    logits: jax.Array, labels: jax.Array, *, count: jax.Array | int | None = None
) -> jax.Array:
    """L_cls for one attribute (eq 11): mean of -log p(label) over the examples with a label.

    logits [B, C], labels [B] int, -1 (any negative) = unknown and ignored; 0 when nothing is labelled.
    This is the real cross-entropy -Σ y log p (eq 11 as printed lacks the minus sign and would be
    minimised by making the right class *less* likely). `count` replaces the denominator
    `label_count(labels)`.
    """
    valid = labels >= 0
    ce = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), jnp.where(valid, labels, 0)
    )
    return _mean(jnp.sum(jnp.where(valid, ce, 0.0)), label_count(labels), count)


def kl_term(
    mu: jax.Array,
    logvar: jax.Array,
    mask: jax.Array | None = None,
    *,
    count: jax.Array | int | None = None,
) -> jax.Array:
    """KL of one VAE block as a scalar: `vae.kl_divergence` per example, mean over the batch.

    mask [B, Q] marks valid queries (None = all). Examples without any valid query are left out of the
    batch mean (they carry no information), and the result is 0 if none has one. `count` replaces the
    denominator: `kl_count(mask)`, or the number of examples B when mask is None.
    """
    per_example = kl_divergence(mu, logvar, mask)
    if mask is None:
        if count is None:
            return jnp.mean(per_example)
        return _mean(jnp.sum(per_example), per_example.shape[0], count)
    has = jnp.any(mask.astype(bool), axis=-1)
    return _mean(jnp.sum(jnp.where(has, per_example, 0.0)), kl_count(mask), count)


# ----------------------------------------------------------------------------------------------------------
# Stage totals
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LossWeights:
    """alpha, beta: eq 13's weights of L_ccl and L_sac (paper: 0.2, 0.3); kl: weight of the VAE KL.

    ccl_dims: per content kind (speech_content, video_content), the weight of each dimension's squared
    error in L_ccl, as ((kind, (w_0, ..., w_D-1)), ...); a kind not listed weighs every dimension 1 (eq 9).
    Tuples, so the weights stay hashable (a jit cache key).
    """

    alpha: float = 0.2
    beta: float = 0.3
    kl: float = 1e-3
    ccl_dims: tuple[tuple[str, tuple[float, ...]], ...] = ()

    def dim_weight(self, kind: str) -> tuple[float, ...] | None:
        """The per-dimension weights of `kind`'s rows, None = all 1."""
        return dict(self.ccl_dims).get(kind)


def combine(
    terms: Mapping[str, jax.Array], stage: str, weights: LossWeights | None = None
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The stage's total loss and a metrics dict holding every given term plus ccl/sal/cls/sac/total.

    coe:     L_emp
    ccl:     L_ccl + kl·KL
    sac:     L_sal + L_cls + signal_ce + kl·KL
    overall: L_emp + α·L_ccl + β·(L_sal + L_cls) + kl·KL

    A term the stage needs but `terms` lacks raises KeyError (a forgotten head must not train silently
    as 0; an ablation passes an explicit 0). Known terms the stage does not use are reported, not added;
    unknown names raise (typos). weights=None means `LossWeights()` (the paper's α, β).
    """
    weights = weights or LossWeights()
    if stage not in STAGE_TERMS:
        raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
    unknown = sorted(set(terms) - set(TERMS))
    if unknown:
        raise KeyError(f"unknown loss terms {unknown}; known terms are {TERMS}")
    missing = [t for t in STAGE_TERMS[stage] if t not in terms]
    if missing:
        raise KeyError(f"stage {stage!r} needs loss terms {missing}; got {sorted(terms)}")

    t = {k: jnp.asarray(v, jnp.float32) for k, v in terms.items()}
    metrics = dict(t)

    def group(names: tuple[str, ...]) -> jax.Array | None:
        return sum((t[n] for n in names), jnp.zeros((), jnp.float32)) if all(n in t for n in names) else None

    ccl, sal, cls = group(CCL_TERMS), group(SAL_TERMS), group(CLS_TERMS)
    for name, value in ((CCL, ccl), (SAL, sal), (CLS, cls)):
        if value is not None:
            metrics[name] = value
    if sal is not None and cls is not None:
        metrics[SAC] = sal + cls

    if stage == "coe":
        total = t[EMP]
    elif stage == "ccl":
        total = ccl + weights.kl * t[KL]
    elif stage == "sac":
        total = sal + cls + t[SIGNAL_CE] + weights.kl * t[KL]
    else:
        total = t[EMP] + weights.alpha * ccl + weights.beta * (sal + cls) + weights.kl * t[KL]
    metrics[TOTAL] = total
    return total, metrics
