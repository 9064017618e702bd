"""The generation pass of an evaluation (DESIGN §7): the model writes its own reply to each prompt, and
what it wrote is parsed and scored.

Prompts are the eval stage's template without the target, tokenised exactly as in training; decoding is
greedy with the KV cache, the CoE parsed from the text. Emotion accuracy is CoE step 2 projected to the
classes of the shards' emotion map (avamerg7) against the gold label, unparseable = wrong; Dist-1/2 over
the replies. Two more readers of step 2 may add their fields: the label scored by likelihood after the
model's own step 1 (`score_emotions`), and the emotion head over the prompt's hidden states
(`eval/emotion_head.py`), which `dialogue_summaries` here reads the prompts for. It is apart from the
teacher-forced pass (`eval/teacher_forced.py`) because it shares nothing with it but the split: other
batches (prompts, length-sorted, left-padded), other programs (the decoders), a journal to resume from.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from empatheia_jax.data import schema
from empatheia_jax.data import templates as tpl
from empatheia_jax.data.examples import ExampleBuilder, ExampleTooLongError
from empatheia_jax.data.parse import emotion_class, parse_generation
from empatheia_jax.data.pipeline_config import PipelineConfig, pipeline_config_fields
from empatheia_jax.data.shard_reader import ShardReader
from empatheia_jax.data.splits import check_split, emotion_map_of
from empatheia_jax.eval import emotion_head as emotion_head_lib
from empatheia_jax.eval.emotion_head import EmotionHead
from empatheia_jax.eval.journal import Journal, fingerprint
from empatheia_jax.eval.metrics.names import LABELS
from empatheia_jax.eval.metrics.text import speaker_turn
from empatheia_jax.eval.pass_setup import check_model_and_data, progress_bar
from empatheia_jax.models.empatheia import Empatheia
from empatheia_jax.serve.decoding import Decoding
from empatheia_jax.serve.forward import embed_prompts
from empatheia_jax.serve.generation import (
    eos_token_ids,
    generate_tokens,
    left_pad,
    prompt_summaries,
    score_continuations,
)
from empatheia_jax.serve.reply_choice import redraw_replies
from empatheia_jax.train import stages
from empatheia_jax.train.stages import TemplateError, eval_stage


def generate_predictions(
    model: Empatheia,
    tokenizer: Any,
    shards_dir: str | os.PathLike,
    split: str = "test",
    *,
    batch_size: int = 8,
    max_len: int = 1024,
    decoding: Decoding = Decoding(),
    pipeline_overrides: Mapping[str, Any] | None = None,
    max_examples: int | None = None,
    progress: bool = True,
    compiler_options: Mapping[str, Any] | None = None,
    template: str | None = None,
    score_emotions: bool = False,
    emotion_head: EmotionHead | None = None,
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

    `decoding` (`serve.decoding.Decoding`): its budget and repetition controls; the decode is greedy (a
    sampled one, temperature > 0, is refused: the CoE steps and every emotion figure are the mode).
    `decoding.reply_sampling` draws each reply again after the greedy Chain of Empathy (`ReplySampling`): the
    CoE steps, hence every emotion field, are the greedy ones; "text_greedy" keeps the greedy text and
    "reply_candidates" the drawn replies the kept one was chosen among (where the text had a step-5 header).

    `journal` (a file, `eval.journal`) keeps each finished batch, so a killed run, started again alike,
    generates only the batches it lacks.
    """
    if not decoding.greedy:
        raise ValueError(f"generate_predictions: decoding temperature={decoding.temperature} must be 0: the "
                         "eval decodes the Chain of Empathy greedily (draw the replies with reply_sampling)")
    ps = _PromptSet.of(model, tokenizer, shards_dir, split, "generate_predictions", batch_size=batch_size,
                       max_len=max_len, template=template, pipeline_overrides=pipeline_overrides,
                       max_examples=max_examples)
    emap = emotion_map_of(ps.manifest)
    eos = eos_token_ids(model.llm, tokenizer)
    spec = ps.pcfg.template_spec()
    signal = set(model.config.signal_ids) if spec.has_signal else None  # signal_rate where targets have them
    _check_emotion_readers(model, spec, ps.stage.name, score_emotions, emotion_head)
    labels = label_continuations(tokenizer) if score_emotions else None
    kept = None if journal is None else _journal_of(journal, model, emotion_head, dict(
        shards=str(Path(shards_dir).resolve()), split=split, manifest=ps.manifest, template=ps.stage.name,
        batch_size=batch_size, max_len=max_len, **journal_decoding(decoding),
        pipeline_overrides=pipeline_overrides, max_examples=max_examples, score_emotions=score_emotions),
        ps.spliced)
    preds: dict[int, dict[str, Any]] = {}
    for chunk in ps.batches(f"eval {split} (generation)", progress):
        if kept is not None and kept.complete(e["record_index"] for e in chunk):
            preds.update({int(e["record_index"]): kept.done[int(e["record_index"])] for e in chunk})
            continue
        preds.update(_predict_batch(
            model, tokenizer, chunk, ps, emap=emap, signal=signal, eos=eos, labels=labels,
            emotion_head=emotion_head, decoding=decoding, compiler_options=compiler_options))
        if kept is not None:
            kept.append(preds[e["record_index"]] for e in chunk)
    return [preds[i] for i in sorted(preds)]


def journal_decoding(decoding: Decoding) -> dict[str, Any]:
    """The decoding settings a generation journal's fingerprint holds (`eval.journal`): the budget, the
    repetition controls and the drawn replies (a dict, None for greedy replies). Keys and values are those the
    journal has always recorded, so a journal written before `Decoding` existed still resumes; the greedy
    decode's temperature, top_p and seed are not among them (the pass refuses any other)."""
    sampling = decoding.reply_sampling
    return dict(max_new_tokens=decoding.max_new_tokens, repetition_penalty=decoding.repetition_penalty,
                no_repeat_ngram_size=decoding.no_repeat_ngram_size,
                reply_sampling=sampling and dataclasses.asdict(sampling))


def _predict_batch(
    model: Empatheia,
    tokenizer: Any,
    chunk: Sequence[Mapping[str, Any]],
    ps: _PromptSet,
    *,
    emap: schema.EmotionMap,
    signal: set[int] | None,
    eos: Sequence[int],
    labels: list[list[int]] | None,
    emotion_head: EmotionHead | None,
    decoding: Decoding,
    compiler_options: Mapping[str, Any] | None,
) -> dict[int, dict[str, Any]]:
    """One batch of `generate_predictions` by record index: the parsed generations (`_generate_batch`), then
    the step-2 readers' fields: the scored label (with `labels`) and the emotion head's."""
    builder, pcfg, spliced, batch_size = ps.builder, ps.pcfg, ps.spliced, ps.batch_size
    prompts, preds = _generate_batch(
        model, tokenizer, chunk, batch_size=batch_size, builder=builder, pcfg=pcfg, spliced=spliced,
        emap=emap, pipeline_baseline=ps.stage.pipeline_baseline, signal=signal, eos=eos, decoding=decoding,
        compiler_options=compiler_options)
    if labels is not None:
        _add_scored_emotions(model, tokenizer, chunk, prompts, preds, labels, emap, builder, pcfg,
                             spliced, compiler_options)
    if emotion_head is not None:
        _add_head_emotions(model, emotion_head, chunk, batch_size, preds, emap, builder, pcfg,
                           spliced, compiler_options)
    return preds


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
    pcfg: PipelineConfig
    spliced: bool  # the template has media placeholders and the model reads features into them
    reader: ShardReader
    builder: ExampleBuilder
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
        check_model_and_data(model, tokenizer, manifest, shards_dir, split, stage)
        fields = pipeline_config_fields(cfg, stage, pipeline_overrides)
        pcfg = PipelineConfig(stage=stage.template_stage, max_len=max_len, include_target=False, **fields)
        reader = ShardReader.for_split(shards_dir, split)
        n = len(reader) if max_examples is None else min(len(reader), max_examples)
        builder = ExampleBuilder(tokenizer, pcfg, audio_dim=cfg.audio_dim, video_dim=cfg.video_dim)
        return cls(manifest=manifest, stage=stage, pcfg=pcfg,
                   spliced=cfg.has_media and pcfg.template_spec().has_media, reader=reader, builder=builder,
                   batch_size=batch_size, num_records=n)

    def batches(self, desc: str, progress: bool) -> Iterator[list[dict[str, Any]]]:
        """The batches of prompts (`_window_prompts` dicts), one window at a time, with a progress bar."""
        n, size = self.num_records, self.batch_size
        window = size * _SORT_WINDOW_BATCHES
        bar = progress_bar(None, total=-(-n // size), desc=desc, enabled=progress)
        for w0 in range(0, n, window):
            kept = _window_prompts(self.reader, self.builder, w0, min(w0 + window, n))
            for b0 in range(0, len(kept), size):
                yield kept[b0 : b0 + size]
                bar.update(1)
        bar.close()


def _window_prompts(reader: ShardReader, builder: ExampleBuilder, start: int, stop: int
                    ) -> list[dict[str, Any]]:
    """The prompts of records [start, stop), sorted by length: batches of similar lengths waste little on
    left padding. A record whose prompt does not fit max_len is left out (it could not be generated for)."""
    kept = []
    for i, (where, rec) in enumerate(reader.read_located(range(start, stop)), start):
        try:
            ex = builder(rec, record_index=i, where=where)
        except ExampleTooLongError:
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
                   examples: Sequence[Mapping[str, Any]], builder: ExampleBuilder,
                   pcfg: PipelineConfig, spliced: bool, compiler_options: Mapping[str, Any] | None) -> Any:
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
    builder: ExampleBuilder,
    pcfg: PipelineConfig,
    spliced: bool,
    emap: schema.EmotionMap,
    pipeline_baseline: bool,
    signal: set[int] | None,
    eos: Sequence[int],
    decoding: Decoding,
    compiler_options: Mapping[str, Any] | None,
) -> tuple[list[list[int]], dict[int, dict[str, Any]]]:
    """One batch of `generate_predictions`: (the prompts as generated, padding copies included, for the label
    scoring that conditions on them; the parsed predictions of `chunk` by record index). A short batch is
    completed with copies of its last prompt so the batch size, hence the compiled program, never changes.
    `signal`: the signal token ids where the template's target has them (signal_complete), else None."""
    rows = list(chunk) + [chunk[-1]] * (batch_size - len(chunk))  # constant batch size: one program
    prompts = [e["input_ids"].tolist() for e in rows]
    embeds = _prompt_embeds(model, prompts, rows, builder, pcfg, spliced, compiler_options)
    gen = generate_tokens(model.llm, prompts, decoding.max_new_tokens, eos_ids=eos,
                          pad_token_id=builder.pad_id, inputs_embeds=embeds,
                          repetition_penalty=decoding.repetition_penalty,
                          no_repeat_ngram_size=decoding.no_repeat_ngram_size)
    news = [gen.new_tokens[r, : gen.num_new[r]].tolist() for r in range(len(rows))]
    greedy, candidates = news, [None] * len(rows)
    reply_sampling = decoding.reply_sampling
    if reply_sampling is not None:
        news, candidates = redraw_replies(
            model.llm, tokenizer, prompts, news, decoding, seed=_batch_seed(reply_sampling.seed, rows),
            eos=eos, pad_token_id=builder.pad_id,
            embed=lambda prefixes: _prompt_embeds(model, prefixes, rows, builder, pcfg, spliced,
                                                  compiler_options))
    preds = {}
    for r, e in enumerate(chunk):
        preds[e["record_index"]] = _prediction(
            tokenizer, e, prompts[r], news[r], emap=emap, pipeline_baseline=pipeline_baseline, signal=signal,
            greedy=None if reply_sampling is None else greedy[r], candidates=candidates[r])
    return prompts, preds


def _batch_seed(seed: int, rows: Sequence[Mapping[str, Any]]) -> int:
    """The seed of a batch's drawn replies, from (the reply sampling's seed, the batch's first record index):
    a run repeats at the same batch size."""
    return int(np.random.SeedSequence([seed, int(rows[0]["record_index"])]).generate_state(1)[0])


def _prediction(tokenizer: Any, e: Mapping[str, Any], prompt: Sequence[int], new: list[int], *,
                emap: schema.EmotionMap, pipeline_baseline: bool, signal: set[int] | None,
                greedy: list[int] | None, candidates: Any) -> dict[str, Any]:
    """One record's parsed generation (`parse_generation`) with its record fields; `greedy` (the greedy
    reply, when the reply was drawn again) adds "text_greedy" and the `candidates` drawn, if any."""
    text = tokenizer.decode(new, skip_special_tokens=False)
    pred = parse_generation(text, emap, pipeline_baseline=pipeline_baseline)
    if greedy is not None:
        pred["text_greedy"] = tokenizer.decode(greedy, skip_special_tokens=False)
        if candidates is not None:
            pred["reply_candidates"] = candidates
    pred.update(record_index=e["record_index"], uid=e["uid"], labels=e["labels"],
                gold_reply=e["gold_reply"], speaker_turn=e["speaker_turn"],
                prompt_tokens=len(prompt), num_new=len(new), text=text)
    if signal is not None:  # signal_rate only where the target has them
        pred["signal_complete"] = signal <= set(new)
    return pred


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
               builder: ExampleBuilder, pcfg: PipelineConfig, spliced: bool,
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


__all__ = ["dialogue_summaries", "generate_predictions", "journal_decoding", "label_continuations"]
