"""The Empatheia objective: every loss term of a forward pass, and each stage's total (DESIGN §5).

The model (`models/empatheia.py`) computes outputs; this module turns outputs and a batch into the terms
that `losses.combine` weighs per stage: L_emp and the signal CE from the token NLL, L_ccl from the CS
content, L_sal and L_cls from the SD, and the KL of the VAE groups the stage trains. Every denominator can
come from `loss_counts` of the whole batch, so gradient accumulation over micro-batches is exact.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from empatheia_jax.models.empatheia import Empatheia
from empatheia_jax.models.empatheia_config import SD_VAES, EmpatheiaConfig
from empatheia_jax.models.heads import StyleDisentangler
from empatheia_jax.models.vae import VAEOutput
from empatheia_jax.train import losses
from empatheia_jax.train.stages import Stage


def token_nll(
    model: Empatheia, outputs: Mapping[str, Any], target_ids: jax.Array, mask: jax.Array
) -> jax.Array:
    """-log p(target) at every position [B, T] (float32; any value where mask is 0), from the forward's
    hidden states: with `config.ce_targets` > 0 only the masked positions are projected (at most
    ce_targets x B at once, else all: `Llama.target_nll`); otherwise in chunks of `config.ce_chunk`
    positions, or from the whole logits when both are 0. Under jit the whole logits of `__call__` are then
    never computed unless the loss reads them: nothing else does."""
    cfg = model.config
    if cfg.ce_targets:
        return model.llm.target_nll(outputs["hidden"], target_ids, mask,
                                    max_targets=cfg.ce_targets * target_ids.shape[0], chunk=cfg.ce_chunk)
    if model.config.ce_chunk:
        ids = jnp.where(mask, target_ids, 0)  # padding ids may be out of range; they are masked anyway
        return model.llm.token_nll(outputs["hidden"], ids, chunk=model.config.ce_chunk)
    return losses.token_nll(outputs["logits"], target_ids, mask)

def loss_terms(
    model: Empatheia,
    batch: Mapping[str, jax.Array],
    outputs: Mapping[str, Any],
    *,
    counts: Mapping[str, jax.Array] | None = None,
    weights: losses.LossWeights | None = None,
) -> dict[str, jax.Array]:
    """Every loss term (names from `losses`) that the outputs allow, plus extra metrics under other keys.

    emp: CE on loss_mask; signal_ce: the same CE restricted to targets that are <AUDi>/<VIDi>;
    ccl_*: masked row L2 against speech/video_content (+ *_mask), each dimension weighted by
    `weights.dim_weight(kind)` (none given: eq 9's plain sum); sal_*: L2 against speech/video_style,
    for examples with that style target (style_mask) and the modality's signal tokens present;
    cls_*: CE with -1 ignored (also ignored where no signal token is present). `counts` (from
    `loss_counts`) replaces every denominator, see `stage_loss`.
    """
    cfg = model.config
    count = _count_getter(counts)
    target_ids = batch["target_ids"]
    loss_mask = batch["loss_mask"].astype(bool)
    terms: dict[str, jax.Array] = {}
    extra: dict[str, jax.Array] = {}
    if "hidden" in outputs:  # the LLM ran (not `content_from_units`)
        nll = token_nll(model, outputs, target_ids, loss_mask)
        emp, n_tok = losses.masked_token_mean(nll, loss_mask, count=count("emp_tokens"))
        is_signal = _is_signal_target(cfg, target_ids)
        sig, n_sig = losses.masked_token_mean(nll, loss_mask & is_signal, count=count("signal_tokens"))
        terms[losses.EMP], terms[losses.SIGNAL_CE] = emp, sig
        extra = {"emp_tokens": n_tok, "signal_tokens": n_sig}
    if "speech_content" in outputs:
        for term, key in ((losses.CCL_SPEECH, "speech_content"), (losses.CCL_VIDEO, "video_content")):
            pred, target = outputs[key], batch[key]
            if pred.shape != target.shape:
                raise ValueError(
                    f"{key}: the CS predicts {pred.shape} but the batch holds {target.shape}; "
                    "max_speech_len/max_video_len/content dims must match the pipeline"
                )
            dim_weight = weights.dim_weight(key) if weights is not None else None
            terms[term] = losses.masked_squared_l2(pred, target, batch[f"{key}_mask"],
                                                   count=count(f"{key}_rows"), dim_weight=dim_weight)
    if "speech_style" in outputs:
        style, accuracy = style_terms(batch, outputs, count)
        terms.update(style)
        extra.update(accuracy)
    terms.update({f"_{k}": v for k, v in extra.items()})
    return terms

def kl_terms(
    batch: Mapping[str, jax.Array],
    outputs: Mapping[str, Any],
    *,
    counts: Mapping[str, jax.Array] | None = None,
) -> dict[str, jax.Array]:
    """KL of the VAE blocks that ran, summed per trainable group: {"cs": ..., "sd": ...}.

    CS blocks count the queries that have a target row (*_content_mask) and average over the examples
    having one (count `*_content_examples`); SD blocks average over the examples whose modality has its
    signal tokens (count `speech_signal_examples` / `video_signal_examples`).
    """
    count = _count_getter(counts)
    vae = outputs["vae"]
    out = {}
    if "cs_speech" in vae:
        out["cs"] = sum(
            losses.kl_term(vae[name].mu, vae[name].logvar, batch[f"{key}_mask"],
                           count=count(f"{key}_examples"))
            for name, key in (("cs_speech", "speech_content"), ("cs_video", "video_content"))
        )
    if "sd_speech_emotion" in vae:
        out["sd"] = sd_kl(vae, outputs["r_s_mask"], outputs["r_v_mask"], count)
    return out

def stage_loss(
    model: Empatheia,
    batch: Mapping[str, jax.Array],
    outputs: Mapping[str, Any],
    stage: Stage,
    weights: losses.LossWeights | None = None,
    *,
    counts: Mapping[str, jax.Array] | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(total, metrics) of `stage` (a `stages.Stage`) via `losses.combine`.

    Terms the stage's formula (`stage.loss_stage`) needs but the stage dropped (ablations) enter as 0;
    a term the stage keeps but the outputs cannot give raises (a head that did not run). KL = the KL of
    the VAE groups the stage trains. Metrics also hold kl_cs/kl_sd, token counts (emp_tokens,
    signal_tokens: this batch's own counts) and classifier accuracy (acc_*).

    counts=None: every term and acc_* is a mean over this batch's own valid items.
    counts=`loss_counts(whole batch)` (gradient accumulation): every term, kl_*, acc_* and the total use
    those counts as denominators, i.e. each is this micro-batch's SUM over the whole batch's count.
    Every metric is then additive: summed over the micro-batches of the whole batch (with the same
    counts), total, each term, ccl/sal/cls/sac, kl_*, acc_* and the token counts equal the values of
    one call on the whole batch with counts=None, and so do the summed gradients. A missing count
    raises KeyError.
    """
    all_terms = loss_terms(model, batch, outputs, counts=counts, weights=weights)
    extra = {k[1:]: v for k, v in all_terms.items() if k.startswith("_")}
    terms = {k: v for k, v in all_terms.items() if not k.startswith("_")}
    kls = kl_terms(batch, outputs, counts=counts)
    terms[losses.KL] = sum((kls[g] for g in sorted(kls) if g in stage.trainable_groups),
                           jnp.zeros((), jnp.float32))
    missing = [t for t in stage.loss_terms if t not in terms]
    if missing:
        raise KeyError(f"stage {stage.name!r} trains on {missing} but the outputs lack the head for it "
                       f"(run the model with heads={sorted(stage.heads)})")
    zero = jnp.zeros((), jnp.float32)
    for t in losses.STAGE_TERMS[stage.loss_stage]:
        if t not in stage.loss_terms:
            terms[t] = zero  # ablated: reported as 0, adds nothing
    total, metrics = losses.combine(terms, stage.loss_stage, weights)
    metrics.update({f"kl_{g}": v for g, v in kls.items()})
    metrics.update(extra)
    return total, metrics


COUNT_KEYS = (
    "emp_tokens", "signal_tokens",
    "speech_content_rows", "video_content_rows", "speech_content_examples", "video_content_examples",
    "speech_signal_examples", "video_signal_examples", "speech_style_examples", "video_style_examples",
    "emotion_labels", "age_labels", "gender_labels", "timbre_labels",
)


def _is_signal_target(cfg: EmpatheiaConfig, target_ids: jax.Array) -> jax.Array:
    return jnp.any(target_ids[..., None] == jnp.asarray(cfg.signal_ids, target_ids.dtype), axis=-1)


def signal_present(
    input_ids: jax.Array, attention_mask: jax.Array | None, ids: Sequence[int]
) -> jax.Array:
    """[...] bool: the example has at least one of `ids` among its attended input tokens (the rule of
    `Empatheia.gather_signal_states`: `any(r_s_mask, -1)` for the <AUDi> ids). input_ids [..., T]."""
    attended = jnp.ones(input_ids.shape, bool) if attention_mask is None else attention_mask.astype(bool)
    hit = jnp.any(input_ids[..., None] == jnp.asarray(ids, input_ids.dtype), axis=-1) & attended
    return jnp.any(hit, axis=-1)


def loss_counts(cfg: EmpatheiaConfig, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Every denominator of `stage_loss`, as int32 scalars computed from the batch alone (no forward).

    Each count is a total over all leading axes, so the leaves may be [B, ...] or [A, m, ...] (A
    micro-batches of m) and the counts are additive: the counts of a batch are the sums of the counts of
    any split of it. Keys (each only when the batch has the keys it needs):

        emp_tokens               Σ loss_mask                                        emp
        signal_tokens            Σ loss_mask ∧ target ∈ <AUDi>/<VIDi>               signal_ce
        {speech,video}_content_rows      Σ *_content_mask                           ccl_speech / ccl_video
        {speech,video}_content_examples  examples with a content row                KL of cs_speech / cs_video
        {speech,video}_signal_examples   examples with an attended <AUDi> / <VIDi>  KL of the SD blocks
        {speech,video}_style_examples    style_mask[:, j] ∧ that modality's signal  sal_speech / sal_video
        {emotion,age,gender,timbre}_labels  label >= 0 ∧ any signal token           cls_* and acc_*
    """
    out: dict[str, jax.Array] = {}
    if "loss_mask" in batch and "target_ids" in batch:
        lm = batch["loss_mask"].astype(bool)
        out["emp_tokens"] = losses.masked_count(lm)
        out["signal_tokens"] = losses.masked_count(lm & _is_signal_target(cfg, batch["target_ids"]))
    for key in ("speech_content", "video_content"):
        if f"{key}_mask" in batch:
            m = batch[f"{key}_mask"]
            out[f"{key}_rows"] = losses.masked_count(m)
            out[f"{key}_examples"] = losses.kl_count(m)
    ids, attn = batch["input_ids"], batch.get("attention_mask")
    has_s = signal_present(ids, attn, cfg.aud_signal_ids)
    has_v = signal_present(ids, attn, cfg.vid_signal_ids)
    out["speech_signal_examples"] = losses.masked_count(has_s)
    out["video_signal_examples"] = losses.masked_count(has_v)
    if "style_mask" in batch:
        style = batch["style_mask"].astype(bool)
        out["speech_style_examples"] = losses.masked_count(style[..., 0] & has_s)
        out["video_style_examples"] = losses.masked_count(style[..., 1] & has_v)
    for name in ("emotion", "age", "gender", "timbre"):
        if name in batch:
            out[f"{name}_labels"] = losses.label_count(jnp.where(has_s | has_v, batch[name], -1))
    return out


def _count_getter(counts: Mapping[str, jax.Array] | None):
    def get(name: str) -> jax.Array | None:
        if counts is None:
            return None
        if name not in counts:
            raise KeyError(f"counts lack {name!r} (got {sorted(counts)}); build them with "
                           "loss_counts(config, batch) of the whole batch")
        return counts[name]

    return get


def style_terms(
    batch: Mapping[str, jax.Array], outputs: Mapping[str, Any], count
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """(sal_* and cls_* terms, acc_* metrics) of the SD outputs; `count` is a `_count_getter`.

    sal_*: L2 against speech/video_style for examples with that style target (style_mask) and the modality's
    signal tokens present; cls_*: CE with -1 ignored, also where no signal token is present.
    """
    terms, extra = {}, {}
    style_mask = batch["style_mask"].astype(bool)
    has_s, has_v = jnp.any(outputs["r_s_mask"], -1), jnp.any(outputs["r_v_mask"], -1)
    sal = ((losses.SAL_SPEECH, "speech", has_s), (losses.SAL_VIDEO, "video", has_v))
    for j, (term, key, has) in enumerate(sal):
        terms[term] = losses.squared_l2(outputs[f"{key}_style"], batch[f"{key}_style"],
                                        style_mask[:, j] & has, count=count(f"{key}_style_examples"))
    has_any = has_s | has_v
    for term, name in ((losses.CLS_EMOTION, "emotion"), (losses.CLS_AGE, "age"),
                       (losses.CLS_GENDER, "gender"), (losses.CLS_TIMBRE, "timbre")):
        labels = jnp.where(has_any, batch[name], -1)
        lg = outputs[f"{name}_logits"]
        n_labels = count(f"{name}_labels")
        terms[term] = losses.classification_ce(lg, labels, count=n_labels)
        correct = jnp.sum((labels >= 0) & (jnp.argmax(lg, -1) == labels))
        n_labels = losses.label_count(labels) if n_labels is None else n_labels
        extra[f"acc_{name}"] = correct / jnp.maximum(n_labels, 1).astype(jnp.float32)
    return terms, extra


def sd_kl(vae: Mapping[str, VAEOutput], r_s_mask: jax.Array, r_v_mask: jax.Array, count) -> jax.Array:
    """KL of the four SD blocks, each averaged over the examples whose modality has its signal tokens."""
    total = jnp.zeros((), jnp.float32)
    for name in SD_VAES:
        modality = "speech" if "speech" in name else "video"
        present = jnp.any(r_s_mask if modality == "speech" else r_v_mask, -1)
        mu = vae[name].mu
        total = total + losses.kl_term(mu, vae[name].logvar, jnp.broadcast_to(present[:, None], mu.shape[:2]),
                                       count=count(f"{modality}_signal_examples"))
    return total


def sd_head_loss(
    sd: StyleDisentangler,
    inputs: Mapping[str, jax.Array],
    stage: Stage,
    weights: losses.LossWeights | None = None,
    *,
    rng: jax.Array,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(total, metrics) of the SD alone on cached inputs (`collect_sd_inputs`): the SD warm-up's objective.

    The "sac" formula L_sal + L_cls + kl·KL_sd with the terms and denominators of `stage_loss`. The
    signal CE needs the LLM and enters as 0, as does any term `stage` does not train (ablations).
    """
    out = dict(sd(inputs["r_s"], inputs["r_s_mask"], inputs["r_v"], inputs["r_v_mask"], sample=True, rng=rng))
    vae = out.pop("vae")
    outputs = {**out, "r_s_mask": inputs["r_s_mask"], "r_v_mask": inputs["r_v_mask"]}
    no_counts = _count_getter(None)
    terms, extra = style_terms(inputs, outputs, no_counts)
    terms[losses.KL] = sd_kl(vae, inputs["r_s_mask"], inputs["r_v_mask"], no_counts)
    zero = jnp.zeros((), jnp.float32)
    terms = {t: terms.get(t, zero) if t in stage.loss_terms else zero for t in losses.STAGE_TERMS["sac"]}
    total, metrics = losses.combine(terms, "sac", weights)
    return total, {**metrics, **extra}


def forward(model: Empatheia, batch: Mapping[str, jax.Array], stage: Stage, *, train: bool,
            rng: jax.Array | None = None) -> dict[str, Any]:
    """The outputs `stage`'s losses read: the model with only the stage's heads, or, for a stage that does
    not read the LLM (ccl_units), the CS from its units alone."""
    if not stage.reads_llm:
        return model.content_from_units(batch, train=train, rng=rng)
    return model(batch, train=train, rng=rng, heads=stage.heads)


def make_loss_fn(stage: Stage, weights: losses.LossWeights | None = None) -> Callable[..., Any]:
    """`loss_fn(params, model_graphdef, frozen, batch, rng, *, counts=None) -> (total, metrics)`,
    differentiable in params.

    The forward pass (`forward`) runs with train=True (sampled VAE latents from `rng`) and only the heads
    the stage's losses read. Exposed so a trainer can accumulate gradients over micro-batches before
    `apply_update`: with `rng` one key per example ([m], e.g. `fold_in(step_key, global example index)`) and
    `counts` = `loss_counts` of the WHOLE batch, the sums over the micro-batches of total, metrics and
    gradients equal one call on the whole batch (see `stage_loss`).
    """

    def loss_fn(params, graphdef, frozen, batch, rng, *, counts=None):
        model = nnx.merge(graphdef, params, frozen)
        outputs = forward(model, batch, stage, train=True, rng=rng)
        return stage_loss(model, batch, outputs, stage, weights, counts=counts)

    return loss_fn
