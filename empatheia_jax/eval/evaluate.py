"""Evaluation of an Empatheia model on a held-out split (DESIGN §7): the two passes, the speech and video rows
rendered from them, and the columns they are read against.

Why it is split in two passes:

- **Teacher-forced pass** (`eval/teacher_forced.py`): everything that is defined against the gold reply:
  the loss terms, the SD classifier accuracies, and the content (C) and style (S) features against the gold
  (stand-in) targets, read exactly where training reads them.
- **Generation pass** (`eval/generation_pass.py`, `generate_text=True`): prompts without the target, greedy
  decoding with the KV cache, the CoE parsed from the text: emotion accuracy from CoE step 2, Dist-1/2.

This module only orchestrates them: which rows a stage can render (`media_rows_of`, `media_evals`), the
teacher-forced predictions the speech and video rows speak and draw, and the reference columns.

One implementation of each metric (`feature_distances`, `accuracy`, `distinct_n`) serves the model and the
baselines alike, so their numbers are comparable by construction. Every number is computed in float32/float64
numpy on the host after the jitted forward, so no metric depends on the device or on batch composition.
Aggregation is over the whole split: each term is weighted by its own item count (tokens, valid rows,
labelled examples), never a mean of batch means.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from empatheia_jax.eval import baselines as eval_baselines
from empatheia_jax.eval import speech as speech_eval
from empatheia_jax.eval import video as video_eval
from empatheia_jax.eval.emotion_head import EmotionHead
from empatheia_jax.eval.generation_pass import generate_predictions
from empatheia_jax.eval.metrics.text import text_metrics
from empatheia_jax.eval.report import metric_order, write_predictions
from empatheia_jax.eval.teacher_forced import teacher_forced_metrics
from empatheia_jax.models.empatheia import Empatheia
from empatheia_jax.models.empatheia_config import EmpatheiaConfig
from empatheia_jax.serve.decoding import Decoding
from empatheia_jax.train import losses, stages
from empatheia_jax.train.stages import eval_stage


def evaluate(
    model: Empatheia,
    tokenizer: Any,
    shards_dir: str | os.PathLike,
    split: str = "test",
    *,
    batch_size: int = 8,
    max_len: int = 1024,
    decoding: Decoding = Decoding(),
    generate_text: bool = True,
    generate_batch_size: int | None = None,
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
    `decoding` (`serve.decoding.Decoding`, greedy): the budget, HF's repetition controls
    (generation.generate_tokens) and `reply_sampling`, the replies drawn after the greedy CoE; `journal` keeps
    the finished generation batches (`generate_predictions`), so a killed eval run again alike resumes.
    `generate_batch_size` (default
    `batch_size`) batches the generation apart from the teacher-forced pass: decoding holds a KV cache, not
    [B, T, vocab] logits, so it affords more rows per step, and each decode step reads every weight once
    whatever the batch. `predictions_path` writes one JSON
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
        details["classified"] = _classified(collected)
    if generate_text:
        preds = generate_predictions(model, tokenizer, shards_dir, split, decoding=decoding,
                                     score_emotions=score_emotions, emotion_head=emotion_head,
                                     journal=journal,
                                     **{**common, "batch_size": generate_batch_size or batch_size})
        result.update(text_metrics(preds))
        _keep_predictions(preds, details, predictions_path, collected)
    for rows in (speech, video):
        if rows is not None and collected:
            result.update(rows.model_rows(name, collected))
    return {k: result[k] for k in sorted(result, key=metric_order)}


def _classified(collected: Mapping[int, Mapping[str, Any]] | None) -> dict[int, dict[str, Any]]:
    """The teacher-forced classifier predictions a report breaks accuracies down by class with:
    {record_index: {"labels", "<label>_cls"}}."""
    return {i: {k: v for k, v in c.items() if k == "labels" or k.endswith("_cls")}
            for i, c in (collected or {}).items()}


def _keep_predictions(preds: Sequence[dict[str, Any]], details: dict[str, Any] | None,
                      predictions_path: str | os.PathLike | None,
                      collected: dict[int, dict[str, Any]] | None) -> None:
    """Where the parsed generations go besides their metrics: the report's `details`, the predictions file,
    and each collected record's CoE emotion, which its speech and video rows render."""
    if details is not None:
        details["predictions"] = preds
    if predictions_path is not None:
        write_predictions(preds, predictions_path)
    for p in preds:  # the avatar shows the emotion the reply was written from, as in chat
        if collected is not None and p["record_index"] in collected and p.get("emotion", -1) >= 0:
            collected[p["record_index"]]["emotion_coe"] = int(p["emotion"])


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


__all__ = [
    "evaluate",
    "media_evals",
    "media_rows_of",
    "reference_columns",
]
