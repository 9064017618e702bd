"""Evaluation of an Empatheia model on a held-out split (DESIGN §7), and the baselines it is compared with.

Why it is split in two passes:

- **Teacher-forced pass** (one pass over the split, the overall-stage template of the model's config, record
  order, filler rows excluded): everything that is defined against the gold reply. The loss terms; the SD
  classifier accuracies; and the content (C) and style (S) features against the gold (stand-in) targets.
  Content targets are aligned row by row with the GOLD reply (one row per phoneme / video frame of it), so
  comparing them with the content predicted after a *different* generated reply measures nothing; C is
  therefore always read from r^t over the gold reply (the teacher-forced span), and S and the classifiers
  from the signal tokens that follow it, exactly where training reads them.
- **Generation pass** (`generate_text=True`): prompts without the target, greedy decoding with the KV cache,
  the CoE parsed from the text. Emotion accuracy is CoE step 2 projected to the classes of the shards'
  emotion map (avamerg7) against the gold label, unparseable = wrong; Dist-1/2 over the replies.

One implementation of each metric (`feature_distances`, `accuracy`, `distinct_n`) serves the model and the
baselines alike, so their numbers are comparable by construction. Every number is computed in float32/float64
numpy on the host after the jitted forward, so no metric depends on the device or on batch composition.
Aggregation is over the whole split: each term is weighted by its own item count (tokens, valid rows,
labelled examples), never a mean of batch means.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from empatheia_jax.data import input_pipeline as ip
from empatheia_jax.data import schema, shard_format
from empatheia_jax.data import templates as tpl
from empatheia_jax.data.input_pipeline import pipeline_config_fields
from empatheia_jax.data.parse import emotion_class, parse_generation
from empatheia_jax.data.splits import ShardsError, check_split, emotion_map_of
from empatheia_jax.eval import baselines as eval_baselines
from empatheia_jax.eval import emotion_head as emotion_head_lib
from empatheia_jax.eval import speech as speech_eval
from empatheia_jax.eval import video as video_eval
from empatheia_jax.eval.emotion_head import EmotionHead
from empatheia_jax.eval.journal import Journal, fingerprint
from empatheia_jax.eval.metrics.names import ACC_NAME, LABELS
from empatheia_jax.eval.metrics.text import Means, accuracy, feature_distances, speaker_turn, text_metrics
from empatheia_jax.eval.report import metric_order, write_predictions
from empatheia_jax.generators import registry
from empatheia_jax.models.empatheia import Empatheia, EmpatheiaConfig
from empatheia_jax.serve.forward import KEEP, cached_jit, embed_prompts
from empatheia_jax.serve.generation import (
    eos_token_ids,
    generate_tokens,
    left_pad,
    prompt_summaries,
    score_continuations,
)
from empatheia_jax.serve.reply_choice import ReplySampling, redraw_replies
from empatheia_jax.train import losses, objective, stages
from empatheia_jax.train.stages import TemplateError, eval_stage

# ----------------------------------------------------------------------------------------------------------
# Metric functions (used for the model and for the baselines)
# ----------------------------------------------------------------------------------------------------------


"""`repetition_rate` counts replies in which some word 4-gram occurs twice: a sentence said again (the
demo's failure, one sentence eight times) always does; ordinary replies of a few sentences almost never."""


# ----------------------------------------------------------------------------------------------------------
# Parsing generated text
# ----------------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------------
# Jitted programs (shared with chat.py)
# ----------------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------------
# Setup helpers
# ----------------------------------------------------------------------------------------------------------


def _check_model_and_data(
    model: Empatheia, tokenizer: Any, manifest: Mapping[str, Any], shards_dir, split: str, stage: stages.Stage
) -> None:
    """Refuses data the stage's template cannot read, before any batch: text-only records under a template
    with <Aud>/<Vid> (`shard_format.MissingMediaError`), features of another encoder than the model's. A
    template without media reads no feature, so then neither matters (text-only shards evaluate)."""
    cfg = model.config
    feats = manifest.get("features") or {}
    needs_media = stage.template_spec(cfg.n_signal).has_media
    shard_format.check_media_for_template(manifest, shards_dir, split, stage=stage.name,
                                          needs_media=needs_media,
                                          hint="the coe template (empatheia eval --template coe)")
    if needs_media:
        for key in ("audio_dim", "video_dim"):
            if feats.get(key) is not None and int(feats[key]) != getattr(cfg, key):
                raise ShardsError(f"{shards_dir}: features {key}={feats[key]} but the model was built for "
                                 f"{getattr(cfg, key)} (shards from another encoder?)")
    ids = tpl.extend_tokenizer(tokenizer, cfg.n_signal)
    if ids != cfg.token_ids:
        raise ValueError(f"the tokenizer's added-token ids {ids} differ from the model's {cfg.token_ids}")


def _progress(iterable: Iterable | None, *, total: int | None, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit="batch", disable=not enabled, leave=False)


# ----------------------------------------------------------------------------------------------------------
# The teacher-forced pass
# ----------------------------------------------------------------------------------------------------------


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
    _check_model_and_data(model, tokenizer, manifest, shards_dir, split, stage)
    units = registry.units_for(cfg.cs_units, shard_format.target_source(manifest, "speech_content"))
    fields = pipeline_config_fields(cfg, stage, pipeline_overrides, speech_units=units)
    # the model's feature dims: equal to the shards' under a media template (checked), and the shapes its
    # program takes when the template reads no feature (text-only shards have dims 0)
    pipe = ip.make_dataset(shards_dir, split, stage.template_stage, tokenizer, batch_size=batch_size,
                           max_len=max_len, shuffle=False, num_epochs=1, drop_remainder=False,
                           window_batches=1, process_index=0, process_count=1,
                           feature_dims=(cfg.audio_dim, cfg.video_dim), **fields)
    graphdef, state = nnx.split(model)
    step = cached_jit("loss", lambda g, s, b, st=stage, w=weights: _loss_and_outputs(g, s, b, st, w),
                compiler_options, stage=stage, weights=weights)
    means = Means()
    n_real = 0
    # Terms of the stage (an ablated term would only show a 0), and the signal-token CE when there are any.
    reported = {*stage.loss_terms, *((losses.SIGNAL_CE,) if cfg.has_sd else ())}
    total = len(pipe) if max_examples is None else min(len(pipe), -(-max_examples // batch_size))
    for batch in _progress(pipe, total=total, desc=f"eval {split} (teacher-forced)", enabled=progress):
        real = batch["record_index"] >= 0
        if max_examples is not None:
            real &= batch["record_index"] < max_examples
            if not real.any():
                break
        _drop_filler_rows(batch, real)
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


# ----------------------------------------------------------------------------------------------------------
# The generation pass
# ----------------------------------------------------------------------------------------------------------


def generate_predictions(
    model: Empatheia,
    tokenizer: Any,
    shards_dir: str | os.PathLike,
    split: str = "test",
    *,
    batch_size: int = 8,
    max_len: int = 1024,
    max_new_tokens: int = 160,
    repetition_penalty: float = 1.0,
    no_repeat_ngram_size: int = 0,
    pipeline_overrides: Mapping[str, Any] | None = None,
    max_examples: int | None = None,
    progress: bool = True,
    compiler_options: Mapping[str, Any] | None = None,
    template: str | None = None,
    score_emotions: bool = False,
    emotion_head: EmotionHead | None = None,
    reply_sampling: ReplySampling | None = None,
    journal: str | os.PathLike | None = None,
) -> list[dict[str, Any]]:
    """Greedy generations for the records of `split`, parsed (`parse_generation`), in record order.

    Prompts are batched as `_PromptSet` reads them (left-padded; a short batch is completed with copies so
    the batch size, hence the program, never changes); media features are spliced through `inputs_embeds`.
    Each dict: record_index, uid, labels, gold_reply (the record's response), speaker_turn (the speaker's last
    utterance in the history, "" if none), prompt_tokens, num_new, text (the new tokens decoded with special
    tokens, up to the end token), signal_complete, and the fields of `parse_generation`.

    `score_emotions` (CoE templates) also chooses CoE step 2 among the 32 ED labels by likelihood after the
    model's own step 1 (`label_continuations`, `score_continuations`): "emotion_word_scored",
    "emotion_fine_scored" (index in `schema.ED_EMOTIONS_32`, -1 when the text had no CoE to condition on),
    "emotion_scored" (its class) and
    "emotion_label_logprobs" (the 32 log-likelihoods, in label order; absent when unscored).

    `emotion_head` (`eval.emotion_head`) also reads each prompt (`prompt_summaries`) and adds
    "emotion_head_logprobs" (32), "emotion_fine_head" and "emotion_head" (its class); with `score_emotions`
    and a head whose weights are chosen, "emotion_fine_combined" and "emotion_combined" (`combine`).

    `reply_sampling` draws each reply again after the greedy Chain of Empathy (`ReplySampling`): the CoE
    steps, hence every emotion field, are the greedy ones; "text_greedy" keeps the greedy text and
    "reply_candidates" the drawn replies the kept one was chosen among (where the text had a step-5 header).

    `journal` (a file, `eval.journal`) keeps each finished batch, so a killed run, started again alike,
    generates only the batches it lacks.
    """
    ps = _PromptSet.of(model, tokenizer, shards_dir, split, "generate_predictions", batch_size=batch_size,
                       max_len=max_len, template=template, pipeline_overrides=pipeline_overrides,
                       max_examples=max_examples)
    cfg, stage, pcfg, builder, spliced = model.config, ps.stage, ps.pcfg, ps.builder, ps.spliced
    emap = emotion_map_of(ps.manifest)
    eos = eos_token_ids(model.llm, tokenizer)
    spec = pcfg.template_spec()
    signal = set(cfg.signal_ids) if spec.has_signal else None  # signal_rate only where the target has them
    _check_emotion_readers(model, spec, stage.name, score_emotions, emotion_head)
    labels = label_continuations(tokenizer) if score_emotions else None
    kept = None if journal is None else _journal_of(journal, model, emotion_head, dict(
        shards=str(Path(shards_dir).resolve()), split=split, manifest=ps.manifest, template=stage.name,
        batch_size=batch_size, max_len=max_len, max_new_tokens=max_new_tokens,
        repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
        pipeline_overrides=pipeline_overrides, max_examples=max_examples, score_emotions=score_emotions,
        reply_sampling=reply_sampling and dataclasses.asdict(reply_sampling)), spliced)
    preds: dict[int, dict[str, Any]] = {}
    for chunk in ps.batches(f"eval {split} (generation)", progress):
        if kept is not None and kept.complete(e["record_index"] for e in chunk):
            preds.update({int(e["record_index"]): kept.done[int(e["record_index"])] for e in chunk})
            continue
        prompts, batch_preds = _generate_batch(
            model, tokenizer, chunk, batch_size=batch_size, builder=builder, pcfg=pcfg, spliced=spliced,
            emap=emap, pipeline_baseline=stage.pipeline_baseline, signal=signal, eos=eos,
            max_new_tokens=max_new_tokens, repetition_penalty=repetition_penalty,
            no_repeat_ngram_size=no_repeat_ngram_size, compiler_options=compiler_options,
            reply_sampling=reply_sampling)
        preds.update(batch_preds)
        if labels is not None:
            _add_scored_emotions(model, tokenizer, chunk, prompts, preds, labels, emap, builder, pcfg,
                                 spliced, compiler_options)
        if emotion_head is not None:
            _add_head_emotions(model, emotion_head, chunk, batch_size, preds, emap, builder, pcfg,
                               spliced, compiler_options)
        if kept is not None:
            kept.append(preds[e["record_index"]] for e in chunk)
    return [preds[i] for i in sorted(preds)]


def _check_emotion_readers(model: Empatheia, spec: Any, template: str, score_emotions: bool,
                           emotion_head: EmotionHead | None) -> None:
    """Fails before any generation when a requested emotion reader cannot read this model's prompts."""
    if score_emotions and not (spec.use_coe and spec.has_response and not spec.pipeline_baseline):
        raise TemplateError(f"score_emotions needs a Chain-of-Empathy target; template {template!r} has none")
    if emotion_head is not None and emotion_head.num_features != 2 * model.llm.config.hidden_size:
        raise emotion_head_lib.EmotionHeadError(
            f"the emotion head reads {emotion_head.num_features} features, this model gives "
            f"{2 * model.llm.config.hidden_size}: it was fitted to another backbone")


def _journal_of(path: str | os.PathLike, model: Empatheia, emotion_head: EmotionHead | None,
                settings: Mapping[str, Any], spliced: bool) -> Journal:
    """The journal of a generation pass, keyed by everything its predictions depend on: the weights it
    reads, the emotion head (its tensors and choices, whole) and the settings. The weights are the LLM's
    (backbone, LoRA, added rows) when the template splices no media, every parameter otherwise: the
    decoding never reads the CS or the SD, so models that differ only there (a retrained avatar on the same
    LoRA) share one text evaluation, hours on a CPU."""
    weights = nnx.state(model if spliced else model.llm, nnx.Param)
    return Journal(path, fingerprint([weights, emotion_head and dataclasses.astuple(emotion_head)], settings))


@dataclasses.dataclass(frozen=True)
class _PromptSet:
    """The prompts of one split as generation reads them: the eval stage's template without the target
    (`include_target=False`), tokenised exactly as in training, in batches of `batch_size` sorted by length
    within windows of `_SORT_WINDOW_BATCHES` batches (bounded memory, little left padding). Records whose
    prompt does not fit `max_len` are left out. What `generate_predictions` and `dialogue_summaries` share."""

    manifest: Mapping[str, Any]
    stage: stages.Stage
    pcfg: ip.PipelineConfig
    spliced: bool  # the template has media placeholders and the model reads features into them
    reader: ip.ShardReader
    builder: ip.ExampleBuilder
    batch_size: int
    num_records: int

    @classmethod
    def of(cls, model: Empatheia, tokenizer: Any, shards_dir: str | os.PathLike, split: str, caller: str, *,
           batch_size: int, max_len: int, template: str | None,
           pipeline_overrides: Mapping[str, Any] | None = None, max_examples: int | None = None
           ) -> _PromptSet:
        if batch_size < 1:  # a negative size would make the batching loop empty: no output, no error
            raise ValueError(f"{caller}: batch_size must be >= 1, got {batch_size}")
        cfg = model.config
        manifest = check_split(shards_dir, split)
        stage = eval_stage(cfg, template)
        _check_model_and_data(model, tokenizer, manifest, shards_dir, split, stage)
        fields = pipeline_config_fields(cfg, stage, pipeline_overrides)
        pcfg = ip.PipelineConfig(stage=stage.template_stage, max_len=max_len, include_target=False, **fields)
        reader = ip.ShardReader.for_split(shards_dir, split)
        n = len(reader) if max_examples is None else min(len(reader), max_examples)
        builder = ip.ExampleBuilder(tokenizer, pcfg, audio_dim=cfg.audio_dim, video_dim=cfg.video_dim)
        return cls(manifest=manifest, stage=stage, pcfg=pcfg,
                   spliced=cfg.has_media and pcfg.template_spec().has_media, reader=reader, builder=builder,
                   batch_size=batch_size, num_records=n)

    def batches(self, desc: str, progress: bool) -> Iterator[list[dict[str, Any]]]:
        """The batches of prompts (`_window_prompts` dicts), one window at a time, with a progress bar."""
        n, size = self.num_records, self.batch_size
        window = size * _SORT_WINDOW_BATCHES
        bar = _progress(None, total=-(-n // size), desc=desc, enabled=progress)
        for w0 in range(0, n, window):
            kept = _window_prompts(self.reader, self.builder, w0, min(w0 + window, n))
            for b0 in range(0, len(kept), size):
                yield kept[b0 : b0 + size]
                bar.update(1)
        bar.close()


def _window_prompts(reader: ip.ShardReader, builder: ip.ExampleBuilder, start: int, stop: int
                    ) -> list[dict[str, Any]]:
    """The prompts of records [start, stop), sorted by length: batches of similar lengths waste little on
    left padding. A record whose prompt does not fit max_len is left out (it could not be generated for)."""
    kept = []
    for i, (where, rec) in enumerate(reader.read_located(range(start, stop)), start):
        try:
            ex = builder(rec, record_index=i, where=where)
        except ip.ExampleTooLongError:
            continue
        lab = rec.get("labels") or {}
        kept.append({"input_ids": ex["input_ids"], "aud_feats": ex["aud_feats"],
                     "vid_feats": ex["vid_feats"], "record_index": i, "uid": rec.get("uid"),
                     "labels": {k: -1 if lab.get(k) is None else int(lab[k])
                                for k in (*LABELS, "emotion_fine")},
                     "gold_reply": tpl.clean_text(rec.get("response")),
                     "speaker_turn": tpl.clean_text(speaker_turn(rec))})
    kept.sort(key=lambda e: len(e["input_ids"]))
    return kept


def _prompt_embeds(model: Empatheia, prompts: Sequence[Sequence[int]],
                   examples: Sequence[Mapping[str, Any]], builder: ip.ExampleBuilder,
                   pcfg: ip.PipelineConfig, spliced: bool, compiler_options: Mapping[str, Any] | None) -> Any:
    """The input embeddings of `prompts` left-padded as the decoders pad them, with the media features of
    `examples` spliced in; None when the template splices nothing (the decoders embed the ids). Feature rows
    are padded to the config's maxima, so every batch has one shape and the embedding program compiles
    once."""
    if not spliced:
        return None
    ids, _ = left_pad(prompts, builder.pad_id)
    af, am = _pad_rows([e["aud_feats"] for e in examples], pcfg.max_aud, builder.audio_dim)
    vf, vm = _pad_rows([e["vid_feats"] for e in examples], pcfg.max_vid, builder.video_dim)
    return embed_prompts(model, ids, af, am, vf, vm, compiler_options=compiler_options)


def _generate_batch(
    model: Empatheia,
    tokenizer: Any,
    chunk: Sequence[Mapping[str, Any]],
    *,
    batch_size: int,
    builder: ip.ExampleBuilder,
    pcfg: ip.PipelineConfig,
    spliced: bool,
    emap: schema.EmotionMap,
    pipeline_baseline: bool,
    signal: set[int] | None,
    eos: Sequence[int],
    max_new_tokens: int,
    repetition_penalty: float,
    no_repeat_ngram_size: int,
    compiler_options: Mapping[str, Any] | None,
    reply_sampling: ReplySampling | None = None,
) -> tuple[list[list[int]], dict[int, dict[str, Any]]]:
    """One batch of `generate_predictions`: (the prompts as generated, padding copies included, for the label
    scoring that conditions on them; the parsed predictions of `chunk` by record index). A short batch is
    completed with copies of its last prompt so the batch size, hence the compiled program, never changes.
    `signal`: the signal token ids where the template's target has them (signal_complete), else None."""
    rows = list(chunk) + [chunk[-1]] * (batch_size - len(chunk))  # constant batch size: one program
    prompts = [e["input_ids"].tolist() for e in rows]
    embeds = _prompt_embeds(model, prompts, rows, builder, pcfg, spliced, compiler_options)
    gen = generate_tokens(model.llm, prompts, max_new_tokens, eos_ids=eos,
                          pad_token_id=builder.pad_id, inputs_embeds=embeds,
                          repetition_penalty=repetition_penalty,
                          no_repeat_ngram_size=no_repeat_ngram_size)
    news = [gen.new_tokens[r, : gen.num_new[r]].tolist() for r in range(len(rows))]
    greedy, candidates = news, [None] * len(rows)
    if reply_sampling is not None:
        # Seeded per batch from (seed, the batch's first record index): a run repeats at the same batch size.
        seed = int(np.random.SeedSequence([reply_sampling.seed, int(rows[0]["record_index"])]
                                          ).generate_state(1)[0])
        news, candidates = redraw_replies(
            model.llm, tokenizer, prompts, news, reply_sampling, seed=seed, eos=eos,
            pad_token_id=builder.pad_id,
            embed=lambda prefixes: _prompt_embeds(model, prefixes, rows, builder, pcfg, spliced,
                                                  compiler_options),
            max_new_tokens=max_new_tokens, repetition_penalty=repetition_penalty,
            no_repeat_ngram_size=no_repeat_ngram_size)
    preds = {}
    for r, e in enumerate(chunk):
        new = news[r]
        text = tokenizer.decode(new, skip_special_tokens=False)
        pred = parse_generation(text, emap, pipeline_baseline=pipeline_baseline)
        if reply_sampling is not None:
            pred["text_greedy"] = tokenizer.decode(greedy[r], skip_special_tokens=False)
            if candidates[r] is not None:
                pred["reply_candidates"] = candidates[r]
        pred.update(record_index=e["record_index"], uid=e["uid"], labels=e["labels"],
                    gold_reply=e["gold_reply"], speaker_turn=e["speaker_turn"],
                    prompt_tokens=len(prompts[r]), num_new=len(new), text=text)
        if signal is not None:  # signal_rate only where the target has them
            pred["signal_complete"] = signal <= set(new)
        preds[e["record_index"]] = pred
    return prompts, preds


_SORT_WINDOW_BATCHES = 16  # prompts are length-sorted within windows of this many batches
_SCORE_ROWS = 2  # prefixes per label-scoring call: its KV cache is repeated once per label (32x)


def label_continuations(tokenizer: Any, labels: Sequence[str] = schema.ED_EMOTIONS_32) -> list[list[int]]:
    """Token ids of each label as it follows a CoE step-2 header in a target (`format_coe`: "is: sad\\n\\n"):
    the word with its leading space and the step separator, so a label that is a prefix of a longer word
    is not favoured and every label is scored to the end of its step."""
    return [list(tokenizer(f" {w}\n\n", add_special_tokens=False)["input_ids"]) for w in labels]


def _add_scored_emotions(model, tokenizer, chunk, prompts, preds, labels, emap, builder, pcfg, spliced,
                         compiler_options) -> None:
    """Sets the *_scored fields of this batch's predictions (`generate_predictions(score_emotions=True)`):
    rank classification of CoE step 2 by `score_continuations`. A prefix is the prompt plus the model's own
    generated text through the step-2 header (`templates.emotion_step_prefix`), so the label is chosen after
    the model's own step 1, never after the gold event scenario (ED's situation text, which often names the
    emotion)."""
    todo = []
    for r, e in enumerate(chunk):
        pred = preds[e["record_index"]]
        head = tpl.emotion_step_prefix(tpl.strip_signal_tokens(pred["text"]))
        pred.update(emotion_word_scored="", emotion_fine_scored=-1, emotion_scored=-1)
        if head is not None:
            todo.append((pred, e, prompts[r] + list(tokenizer(head, add_special_tokens=False)["input_ids"])))
    for g in range(0, len(todo), _SCORE_ROWS):
        group = todo[g : g + _SCORE_ROWS]
        rows = group + [group[-1]] * (_SCORE_ROWS - len(group))  # one program shape
        prefixes = [p for _, _, p in rows]
        embeds = _prompt_embeds(model, prefixes, [e for _, e, _ in rows], builder, pcfg, spliced,
                                compiler_options)
        scores = score_continuations(model.llm, prefixes, labels, pad_token_id=builder.pad_id,
                                     inputs_embeds=embeds)
        for (pred, _, _), row in zip(group, scores[: len(group)], strict=True):
            fine = int(np.argmax(row))
            pred.update(emotion_word_scored=schema.ED_EMOTIONS_32[fine],
                        **_label_fields("scored", fine, emap),
                        emotion_label_logprobs=[round(float(x), 4) for x in row])


def _summaries(model: Empatheia, chunk: Sequence[Mapping[str, Any]], batch_size: int,
               builder: ip.ExampleBuilder, pcfg: ip.PipelineConfig, spliced: bool,
               compiler_options: Mapping[str, Any] | None) -> np.ndarray:
    """`prompt_summaries` of `chunk`'s prompts [len(chunk), 2D], in a batch completed with copies (one
    program per prompt bucket)."""
    rows = list(chunk) + [chunk[-1]] * (batch_size - len(chunk))
    prompts = [e["input_ids"].tolist() for e in rows]
    embeds = _prompt_embeds(model, prompts, rows, builder, pcfg, spliced, compiler_options)
    read = prompt_summaries(model.llm, prompts, pad_token_id=builder.pad_id, inputs_embeds=embeds)
    return read[: len(chunk)]


def _add_head_emotions(model, head, chunk, batch_size, preds, emap, builder, pcfg, spliced, compiler_options
                       ) -> None:
    """Sets the emotion head's fields of this batch's predictions (`generate_predictions(emotion_head=)`),
    and the combined decision where the step was scored and the head's weights are chosen."""
    logp = head.log_probs(_summaries(model, chunk, batch_size, builder, pcfg, spliced, compiler_options))
    for e, row in zip(chunk, logp, strict=True):
        pred = preds[e["record_index"]]
        pred.update(emotion_head_logprobs=[round(float(x), 4) for x in row],
                    **_label_fields("head", int(np.argmax(row)), emap))
        if head.head_weight is not None and "emotion_fine_scored" in pred:
            arrays = emotion_head_lib.prediction_arrays([pred])
            fine = emotion_head_lib.combine(arrays["head"], arrays["scored"], arrays["free"],
                                            head.head_weight, head.free_weight)[0]
            pred.update(_label_fields("combined", int(fine), emap))


def _label_fields(name: str, fine: int, emap: schema.EmotionMap) -> dict[str, int]:
    """{emotion_fine_<name>: the ED label index, emotion_<name>: its class under the shards' map or -1}."""
    coarse = emotion_class(schema.ED_EMOTIONS_32[fine], emap)
    return {f"emotion_fine_{name}": fine, f"emotion_{name}": -1 if coarse is None else int(coarse)}


def dialogue_summaries(
    model: Empatheia,
    tokenizer: Any,
    shards_dir: str | os.PathLike,
    split: str,
    *,
    template: str | None = None,
    batch_size: int = 8,
    max_len: int = 1024,
    max_examples: int | None = None,
    progress: bool = True,
    compiler_options: Mapping[str, Any] | None = None,
) -> dict[str, np.ndarray]:
    """How the model reads each record's prompt (the eval template without the target, as
    `generate_predictions` builds it): {"record_index" [N], "features" [N, 2D] (`prompt_summaries`),
    "emotion_fine" [N] (the gold ED label, -1 where none)}, in record order; prompts longer than `max_len`
    are left out. What the emotion head is fitted on (`eval.emotion_head`)."""
    ps = _PromptSet.of(model, tokenizer, shards_dir, split, "dialogue_summaries", batch_size=batch_size,
                       max_len=max_len, template=template, max_examples=max_examples)
    index, feats, gold = [], [], []
    for chunk in ps.batches(f"read {split} (prompts)", progress):
        feats.append(_summaries(model, chunk, batch_size, ps.builder, ps.pcfg, ps.spliced, compiler_options))
        index += [e["record_index"] for e in chunk]
        gold += [e["labels"]["emotion_fine"] for e in chunk]
    order = np.argsort(index, kind="stable")
    dim = 2 * model.llm.config.hidden_size
    features = np.concatenate(feats) if feats else np.zeros((0, dim), np.float32)
    return {"record_index": np.asarray(index, np.int64)[order], "features": features[order],
            "emotion_fine": np.asarray(gold, np.int64)[order]}


def _pad_rows(rows: Sequence[np.ndarray], max_rows: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    feats = np.zeros((len(rows), max(max_rows, 1), dim), np.float32)
    mask = np.zeros((len(rows), max(max_rows, 1)), np.int32)
    for b, r in enumerate(rows):
        feats[b, : len(r)] = r
        mask[b, : len(r)] = 1
    return feats, mask


# ----------------------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------------------


def evaluate(
    model: Empatheia,
    tokenizer: Any,
    shards_dir: str | os.PathLike,
    split: str = "test",
    *,
    batch_size: int = 8,
    max_len: int = 1024,
    max_new_tokens: int = 160,
    generate_text: bool = True,
    generate_batch_size: int | None = None,
    repetition_penalty: float = 1.0,
    no_repeat_ngram_size: int = 0,
    pipeline_overrides: Mapping[str, Any] | None = None,
    weights: losses.LossWeights | None = None,
    max_examples: int | None = None,
    predictions_path: str | os.PathLike | None = None,
    progress: bool = True,
    compiler_options: Mapping[str, Any] | None = None,
    speech: speech_eval.SpeechEval | None = None,
    video: video_eval.VideoEval | None = None,
    name: str = "trained",
    template: str | None = None,
    details: dict[str, Any] | None = None,
    score_emotions: bool = False,
    emotion_head: EmotionHead | None = None,
    reply_sampling: ReplySampling | None = None,
    journal: str | os.PathLike | None = None,
) -> dict[str, float]:
    """All metrics of `model` on `split` of `shards_dir` (see the module docstring for the definitions).

    `details` (a dict) receives what a report draws besides the metrics: "predictions" (the parsed
    generations, `generate_predictions`) and "classified" ({record_index: {"labels", "<label>_cls"}}, the
    teacher-forced classifier predictions); `per_class_report` turns them into Figure 6's accuracies.

    `template` (`eval_stage`; default: overall under the model's ablations, or the Pipeline baseline) sets
    the prompt, the loss formula and the heads both passes run: a template whose stage runs neither CS nor
    SD (coe) has no feature, classifier, speech or video rows.

    teacher-forced: eval_loss, emp, ppl, reply_ppl (the gold reply's tokens only), signal_ce, ccl_*, sal_*,
    cls_*, kl; emotion_acc_cls, age_acc,
    gender_acc, timbre_acc; {speech,video}_{content,style}_{l2,cos}; num_examples, skipped_examples.
    generate_text: `text_metrics` (emotion_acc_text, emotion32_acc_text, parse rates, signal_rate, Dist-1/2 in
    both conventions, repetition_rate, reply_words),
    num_generated (Pipeline baseline: also age/gender/timbre_acc_text); with `score_emotions` (CoE templates)
    also emotion_acc_scored / emotion32_acc_scored / emotion_scored_rate: step 2 chosen among the 32 ED
    labels by likelihood after the model's own step 1 (`generation.score_continuations`); with an
    `emotion_head`, emotion*_acc_head and (scored, the head's weights chosen) emotion*_acc_combined;
    `reply_sampling` (`ReplySampling`) draws the replies after the greedy CoE; `journal` keeps the finished
    generation batches (`generate_predictions`), so a killed eval run again alike resumes.
    `generate_batch_size` (default
    `batch_size`) batches the generation apart from the teacher-forced pass: decoding holds a KV cache, not
    [B, T, vocab] logits, so it affords more rows per step, and each decode step reads every weight once
    whatever the batch. `repetition_penalty`/`no_repeat_ngram_size` are HF's (generation.generate_tokens).
    `predictions_path` writes one JSON
    line per generation. `max_examples` evaluates the first N records only. `compiler_options` go to the
    jitted forward passes (tests turn XLA optimisation off). `speech` (a `speech_eval.SpeechEval` of these
    shards) adds the speech rows: the predicted C^s/S^s spoken by Kokoro against the gold speech; `video` (a
    `video_eval.VideoEval`) the video rows: C^v/S^v drawn by the face generator against the gold video
    (`name` labels the progress bars).
    """
    common = dict(batch_size=batch_size, max_len=max_len, pipeline_overrides=pipeline_overrides,
                  max_examples=max_examples, progress=progress, compiler_options=compiler_options,
                  template=template)
    can_speak, can_draw = media_rows_of(eval_stage(model.config, template))
    speech, video = (speech if can_speak else None), (video if can_draw else None)
    collected: dict[int, dict[str, Any]] | None = {} if speech or video or details is not None else None
    result = teacher_forced_metrics(model, tokenizer, shards_dir, split, weights=weights, collect=collected,
                                    collect_features=bool(speech or video), **common)
    if details is not None:
        details["classified"] = {i: {k: v for k, v in c.items() if k == "labels" or k.endswith("_cls")}
                                 for i, c in (collected or {}).items()}
    if generate_text:
        preds = generate_predictions(model, tokenizer, shards_dir, split, max_new_tokens=max_new_tokens,
                                     repetition_penalty=repetition_penalty,
                                     no_repeat_ngram_size=no_repeat_ngram_size, score_emotions=score_emotions,
                                     emotion_head=emotion_head, reply_sampling=reply_sampling,
                                     journal=journal,
                                     **{**common, "batch_size": generate_batch_size or batch_size})
        result.update(text_metrics(preds))
        if details is not None:
            details["predictions"] = preds
        if predictions_path is not None:
            write_predictions(preds, predictions_path)
        for p in preds:  # the avatar shows the emotion the reply was written from, as in chat
            if collected is not None and p["record_index"] in collected and p.get("emotion", -1) >= 0:
                collected[p["record_index"]]["emotion_coe"] = int(p["emotion"])
    for rows in (speech, video):
        if rows is not None and collected:
            result.update(rows.model_rows(name, collected))
    return {k: result[k] for k in sorted(result, key=metric_order)}


def media_rows_of(stage: stages.Stage) -> tuple[bool, bool]:
    """(speech rows, video rows) a stage's forward can feed: each needs the CS's content; without the SD the
    gold voice speaks C^s and the gold avatar shows C^v (`SpeechEval.model_rows`, `VideoEval.model_rows`)."""
    return "cs" in stage.heads, "cs" in stage.heads


def media_evals(
    shards_dir: str | os.PathLike,
    split: str,
    stage: stages.Stage,
    *,
    train_split: str,
    speech_examples: int,
    video_examples: int,
    gold_speech: str | os.PathLike | None = None,
) -> tuple[speech_eval.SpeechEval | None, video_eval.VideoEval | None]:
    """The speech and video evaluations `evaluate` renders rows with, or None each. They are rendered from C
    and S: each needs a stage that runs the CS (without the SD the gold voice and avatar render the
    predicted content, `media_rows_of`); data without what they need (gold speech, faces) is a note on
    stderr and no rows, except gold speech asked for explicitly (`gold_speech`): that is
    a user error and raises."""
    can_speak, can_draw = media_rows_of(stage)
    speech = None
    if speech_examples and can_speak:
        try:
            speech = speech_eval.SpeechEval(shards_dir, split, train_split=train_split, gold_dir=gold_speech,
                                            examples=speech_examples)
        except speech_eval.SpeechEvalUnavailable as e:
            if gold_speech:  # asked for explicitly: a user error
                raise
            print(f"note: no speech rows: {e}", file=sys.stderr)
    video = None
    if video_examples and can_draw:
        try:
            video = video_eval.VideoEval(shards_dir, split, train_split=train_split, examples=video_examples)
        except video_eval.VideoEvalUnavailable as e:
            print(f"note: no video rows: {e}", file=sys.stderr)
    return speech, video


def reference_columns(
    model_cfg: EmpatheiaConfig,
    shards_dir: str | os.PathLike,
    split: str,
    manifest: Mapping[str, Any],
    *,
    train_split: str,
    speech: speech_eval.SpeechEval | None = None,
    video: video_eval.VideoEval | None = None,
) -> dict[str, dict[str, float]]:
    """The columns a model's are read against, in table order: the baselines (the majority class and mean
    targets, then the bag-of-words emotion floor; fitted on `train_split`, so absent, with a note on stderr,
    where the shards have none), the speech/video references, chance."""
    columns: dict[str, dict[str, float]] = {}
    if train_split in (manifest.get("splits") or {}):
        columns.update(eval_baselines.baseline_columns(
            shards_dir,
            split,
            train_split=train_split,
            max_speech_len=model_cfg.max_speech_len,
            max_video_len=model_cfg.max_video_len,
        ))
    else:  # e.g. one imported csv: the majority and mean predictors need a train split to be fitted on
        print(f"note: no baseline column: {shards_dir} has no split {train_split!r} "
              "(config.data.train_split) to fit it on", file=sys.stderr)
    for rows in (speech, video):
        if rows is not None:
            for name, values in rows.reference_columns().items():
                columns.setdefault(name, {}).update(values)
    columns["chance"] = eval_baselines.chance_levels(model_cfg)
    return columns


def _loss_and_outputs(graphdef, state, batch, stage, weights):
    model = nnx.merge(graphdef, state)
    out = model(batch, train=False, heads=stage.heads)
    _, metrics = objective.stage_loss(model, batch, out, stage, weights)
    # the gold reply's own tokens (r^t inside the target): its perplexity, apart from the CoE steps around it
    reply = batch["loss_mask"].astype(bool) & batch["response_mask"].astype(bool)
    nll, n = losses.masked_token_mean(objective.token_nll(model, out, batch["target_ids"], reply), reply)
    return {**metrics, "reply_nll": nll, "reply_tokens": n}, {k: out[k] for k in KEEP if k in out}


__all__ = [
    "evaluate",
    "generate_predictions",
    "media_evals",
    "reference_columns",
    "teacher_forced_metrics",
]
