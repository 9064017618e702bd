"""The teacher-forced pass of an evaluation (DESIGN §7): one forward pass over the split with the gold reply
in the input, and everything that is defined against that reply.

One pass over the split, under the eval stage's template (default: the overall stage of the model's
config), in record order, filler rows excluded: the loss terms; the SD classifier accuracies; and the
content (C) and style (S) features against the gold (stand-in) targets. Content targets are aligned row by
row with the GOLD reply (one row per phoneme / video frame of it), so comparing them with the content
predicted after a *different* generated reply measures nothing; C is therefore always read from r^t over
the gold reply (the teacher-forced span), and S and the classifiers from the signal tokens that follow it,
exactly where training reads them. Aggregation is over the whole split: each term is weighted by its own
item count (tokens, valid rows, labelled examples), never a mean of batch means.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from empatheia_jax.data import input_pipeline as ip
from empatheia_jax.data import shard_format
from empatheia_jax.data.pipeline_config import pipeline_config_fields
from empatheia_jax.data.splits import check_split
from empatheia_jax.eval.metrics.names import ACC_NAME, LABELS
from empatheia_jax.eval.metrics.text import Means, accuracy, feature_distances
from empatheia_jax.eval.pass_setup import check_model_and_data, progress_bar
from empatheia_jax.generators import registry
from empatheia_jax.models.empatheia import Empatheia
from empatheia_jax.serve.forward import KEEP, cached_jit
from empatheia_jax.train import losses, objective, stages
from empatheia_jax.train.stages import eval_stage


def teacher_forced_metrics(
    model: Empatheia,
    tokenizer: Any,
    shards_dir: str | os.PathLike,
    split: str = "test",
    *,
    batch_size: int = 8,
    max_len: int = 1024,
    pipeline_overrides: Mapping[str, Any] | None = None,
    weights: losses.LossWeights | None = None,
    max_examples: int | None = None,
    progress: bool = True,
    compiler_options: Mapping[str, Any] | None = None,
    collect: dict[int, dict[str, np.ndarray]] | None = None,
    collect_features: bool = True,
    template: str | None = None,
) -> dict[str, float]:
    """Loss terms, SD classifier accuracies and C/S feature metrics over `split`, teacher-forced.

    `template` picks the stage (`eval_stage`): its prompt, its loss formula and the heads it runs.

    `collect` (a dict) receives, per record index, the predicted {speech,video}_content rows over the gold
    reply (as many as its target has) and {speech,video}_style: what speech_eval.py / video_eval.py render;
    also the gold "labels" and each classifier's argmax "{emotion,age,gender,timbre}_cls" (reports).
    `collect_features=False` keeps only the labels and classes: a report of a large split would otherwise
    hold every record's predicted content rows in memory.

    Loss terms are the model's own (`Empatheia.loss` under `eval_stage`), aggregated over the split by their
    item counts (tokens for emp/signal_ce, valid rows for ccl_*, examples with the target for sal_*, labelled
    examples for cls_*, real examples for kl); eval_loss = the stage formula (`losses.combine`) of the
    aggregated terms; ppl = exp(emp). Feature metrics: `feature_distances` over the valid rows of the split
    (content: every target row, a long reply weighs more; style: every example with the target). Accuracies:
    argmax of the classifier logits over labelled examples. Filler rows (record_index -1) never count.
    """
    cfg = model.config
    manifest = check_split(shards_dir, split)
    stage = eval_stage(cfg, template)
    check_model_and_data(model, tokenizer, manifest, shards_dir, split, stage)
    pipe = _pipeline(model, tokenizer, manifest, shards_dir, split, stage, batch_size=batch_size,
                     max_len=max_len, pipeline_overrides=pipeline_overrides)
    graphdef, state = nnx.split(model)
    step = cached_jit("loss", lambda g, s, b, st=stage, w=weights: _loss_and_outputs(g, s, b, st, w),
                compiler_options, stage=stage, weights=weights)
    means = Means()
    n_real = 0
    # Terms of the stage (an ablated term would only show a 0), and the signal-token CE when there are any.
    reported = {*stage.loss_terms, *((losses.SIGNAL_CE,) if cfg.has_sd else ())}
    for batch, real in _real_batches(pipe, batch_size, max_examples, split=split, progress=progress):
        metrics, out = jax.device_get(step(graphdef, state, {k: jnp.asarray(v) for k, v in batch.items()}))
        if collect is not None:
            _collect_batch(collect, batch, out, real, collect_features)
        n = int(real.sum())
        n_real += n
        _accumulate_batch(means, metrics, batch, out, n, reported)
    result = _stage_result(means, stage, weights)
    result["num_examples"] = float(n_real)
    result["skipped_examples"] = float(pipe.counters.as_dict()["skipped_target_too_long"])
    return result


def _pipeline(model: Empatheia, tokenizer: Any, manifest: Mapping[str, Any], shards_dir: str | os.PathLike,
              split: str, stage: stages.Stage, *, batch_size: int, max_len: int,
              pipeline_overrides: Mapping[str, Any] | None) -> Any:
    """The split's batches as training builds them under the stage's template (with the target), in record
    order, once, the last batch completed with filler rows (record_index -1)."""
    cfg = model.config
    units = registry.units_for(cfg.cs_units, shard_format.target_source(manifest, "speech_content"))
    fields = pipeline_config_fields(cfg, stage, pipeline_overrides, speech_units=units)
    # the model's feature dims: equal to the shards' under a media template (checked), and the shapes its
    # program takes when the template reads no feature (text-only shards have dims 0)
    return ip.make_dataset(shards_dir, split, stage.template_stage, tokenizer, batch_size=batch_size,
                           max_len=max_len, shuffle=False, num_epochs=1, drop_remainder=False,
                           window_batches=1, process_index=0, process_count=1,
                           feature_dims=(cfg.audio_dim, cfg.video_dim), **fields)


def _real_batches(pipe: Any, batch_size: int, max_examples: int | None, *, split: str, progress: bool
                  ) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    """(batch, its real rows [B] bool) of each batch that holds a record to evaluate, with a progress bar;
    the rows that are not evaluated (filler, past `max_examples`) are dropped from the batch in place."""
    total = len(pipe) if max_examples is None else min(len(pipe), -(-max_examples // batch_size))
    for batch in progress_bar(pipe, total=total, desc=f"eval {split} (teacher-forced)", enabled=progress):
        real = batch["record_index"] >= 0
        if max_examples is not None:
            real &= batch["record_index"] < max_examples
            if not real.any():
                break
        _drop_filler_rows(batch, real)
        yield batch, real


def _loss_and_outputs(graphdef, state, batch, stage, weights):
    """The jitted step: (the stage's loss metrics and the gold reply's NLL, the outputs a report keeps)."""
    model = nnx.merge(graphdef, state)
    out = model(batch, train=False, heads=stage.heads)
    _, metrics = objective.stage_loss(model, batch, out, stage, weights)
    # the gold reply's own tokens (r^t inside the target): its perplexity, apart from the CoE steps around it
    reply = batch["loss_mask"].astype(bool) & batch["response_mask"].astype(bool)
    nll, n = losses.masked_token_mean(objective.token_nll(model, out, batch["target_ids"], reply), reply)
    return {**metrics, "reply_nll": nll, "reply_tokens": n}, {k: out[k] for k in KEEP if k in out}


_ROW_MASKS = ("loss_mask", "speech_content_mask", "video_content_mask", "style_mask")


def _rows(real: np.ndarray, v: np.ndarray) -> np.ndarray:
    return real.reshape(real.shape + (1,) * (v.ndim - 1))


def _drop_filler_rows(batch: dict[str, np.ndarray], real: np.ndarray) -> None:
    """Filler rows hold zero masks already; this also drops the rows past max_examples, so that no term,
    feature or label of a row that is not evaluated counts (in place: the batch is the pipeline's own)."""
    for k in _ROW_MASKS:
        batch[k] = np.where(_rows(real, batch[k]), batch[k], 0)
    for k in LABELS:
        batch[k] = np.where(real, batch[k], -1)


def _collect_batch(collect: dict[int, dict[str, Any]], batch: Mapping[str, np.ndarray],
                   out: Mapping[str, np.ndarray], real: np.ndarray, collect_features: bool) -> None:
    """Keeps, per real record, what is needed after the pass: the speech/video rows render whole records'
    predicted features, and reports break accuracies down by class; batch means would lose both."""
    for b in np.flatnonzero(real):
        got = collect.setdefault(int(batch["record_index"][b]), {})
        got["labels"] = {name: int(batch[name][b]) for name in LABELS}
        for name in LABELS:  # the SD classifiers' predictions: per-class accuracy in reports
            if f"{name}_logits" in out:
                got[f"{name}_cls"] = int(np.argmax(out[f"{name}_logits"][b]))
        for kind in ("speech", "video") if collect_features else ():
            if f"{kind}_content" in out:  # a stage without the SD has content only (SpeechEval.model_rows)
                rows = int(batch[f"{kind}_content_mask"][b].sum())
                got[f"{kind}_content"] = np.asarray(out[f"{kind}_content"][b, :rows], np.float32)
            if f"{kind}_style" in out:
                got[f"{kind}_style"] = np.asarray(out[f"{kind}_style"][b], np.float32)


def _accumulate_batch(means: Means, metrics: Mapping[str, Any], batch: Mapping[str, np.ndarray],
                      out: Mapping[str, np.ndarray], n_real: int, reported: set[str]) -> None:
    """Adds one batch to the split's sums, each term weighted by its own item count, so the result is the
    split's mean whatever the batch composition (never a mean of batch means)."""
    _add_loss_terms(means, metrics, batch, out, n_real, reported)
    _add_head_metrics(means, batch, out)
    means.add("reply_nll", float(metrics["reply_nll"]) * float(metrics["reply_tokens"]),
              float(metrics["reply_tokens"]))


def _stage_result(means: Means, stage: stages.Stage, weights: losses.LossWeights | None) -> dict[str, float]:
    """The split's means, with the stage formula applied to the aggregated terms (not averaged per batch),
    as training's `losses.combine` would weigh them; perplexities from the aggregated NLLs."""
    result = means.result()
    if "reply_nll" in result:
        result["reply_ppl"] = float(math.exp(min(result.pop("reply_nll"), 80.0)))
    terms = {t: result.get(t, 0.0) for t in losses.STAGE_TERMS[stage.loss_stage]}
    for t in losses.STAGE_TERMS[stage.loss_stage]:
        if t not in stage.loss_terms:
            terms[t] = 0.0  # ablated: enters the formula as 0, as in training
    total, _ = losses.combine({k: jnp.float32(v) for k, v in terms.items()}, stage.loss_stage,
                              weights or losses.LossWeights())
    result["eval_loss"] = float(total)
    if "emp" in result:
        result["ppl"] = float(math.exp(min(result["emp"], 80.0)))
    return result


def _add_loss_terms(means: Means, metrics: Mapping[str, Any], batch, out, n_real: int, reported) -> None:
    has_s, has_v = out["r_s_mask"].any(-1), out["r_v_mask"].any(-1)
    style = batch["style_mask"].astype(bool)
    counts = {
        "emp": float(metrics.get("emp_tokens", batch["loss_mask"].sum())),
        "signal_ce": float(metrics.get("signal_tokens", 0)),
        "ccl_speech": batch["speech_content_mask"].sum(),
        "ccl_video": batch["video_content_mask"].sum(),
        "sal_speech": np.sum(style[:, 0] & has_s),
        "sal_video": np.sum(style[:, 1] & has_v),
        "kl": n_real,
    }
    for name in LABELS:
        counts[f"cls_{name}"] = np.sum((batch[name] >= 0) & (has_s | has_v))
    for term, count in counts.items():
        if term in metrics and term in reported:
            means.add(term, float(metrics[term]) * float(count), float(count))


def _add_head_metrics(means: Means, batch, out) -> None:
    for key in ("speech_content", "video_content"):
        if key in out:
            l2, cos = feature_distances(out[key], batch[key], batch[f"{key}_mask"])
            means.add_values(f"{key}_l2", l2)
            means.add_values(f"{key}_cos", cos)
    for j, key in enumerate(("speech_style", "video_style")):
        if key in out:
            l2, cos = feature_distances(out[key], batch[key], batch["style_mask"][:, j])
            means.add_values(f"{key}_l2", l2)
            means.add_values(f"{key}_cos", cos)
    for name in LABELS:
        if f"{name}_logits" in out:
            correct, counted = accuracy(np.argmax(out[f"{name}_logits"], -1), batch[name])
            means.add(ACC_NAME[name], correct, counted)


__all__ = ["teacher_forced_metrics"]
