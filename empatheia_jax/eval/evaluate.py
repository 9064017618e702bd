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

import collections
import json
import math
import os
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from empatheia_jax.data import input_pipeline as ip
from empatheia_jax.data import schema, shard_format
from empatheia_jax.data import templates as tpl
from empatheia_jax.eval import speech as speech_eval
from empatheia_jax.eval import video as video_eval
from empatheia_jax.models.empatheia import Empatheia, EmpatheiaConfig
from empatheia_jax.serve.generation import eos_token_ids, generate_tokens, left_pad, score_continuations
from empatheia_jax.train import losses, stages

# Metric names, in the order tables show them.
LOSS_METRICS = ("eval_loss", "emp", "ppl", "reply_ppl", "signal_ce", "ccl_speech", "ccl_video", "sal_speech",
                "sal_video", "cls_emotion", "cls_age", "cls_gender", "cls_timbre", "kl")
TEXT_METRICS = ("emotion_acc_text", "emotion32_acc_text", "emotion_acc_vote", "emotion32_acc_vote",
                "emotion_acc_scored", "emotion32_acc_scored", "coe_parse_rate", "emotion_scored_rate",
                "emotion_parse_rate", "emotion32_parse_rate", "signal_rate", "dist1_corpus",
                "dist2_corpus", "dist1_reply", "dist2_reply", "repetition_rate", "reply_words",
                "age_acc_text", "gender_acc_text", "timbre_acc_text")
CLASS_METRICS = ("emotion_acc_cls", "age_acc", "gender_acc", "timbre_acc")
FEATURE_METRICS = ("speech_content_l2", "video_content_l2", "speech_style_l2", "video_style_l2",
                   "speech_content_cos", "video_content_cos", "speech_style_cos", "video_style_cos")
COUNT_METRICS = ("num_examples", "num_generated", "skipped_examples")
METRICS = (*TEXT_METRICS[:6], *CLASS_METRICS, *FEATURE_METRICS, *speech_eval.SPEECH_METRICS,
           *video_eval.VIDEO_METRICS, *TEXT_METRICS[6:], *LOSS_METRICS, *COUNT_METRICS)
HIGHER_IS_BETTER = frozenset({*CLASS_METRICS, *(set(TEXT_METRICS) - {"repetition_rate", "reply_words"}),
                              "speech_content_cos", "video_content_cos",
                              "speech_style_cos", "video_style_cos", *speech_eval.HIGHER_IS_BETTER,
                              *video_eval.HIGHER_IS_BETTER})
LOWER_IS_BETTER = frozenset({*LOSS_METRICS, "speech_content_l2", "video_content_l2", "speech_style_l2",
                             "video_style_l2", *speech_eval.LOWER_IS_BETTER, *video_eval.LOWER_IS_BETTER})

LABELS = ("emotion", "age", "gender", "timbre")
_ACC_NAME = {"emotion": "emotion_acc_cls", "age": "age_acc", "gender": "gender_acc", "timbre": "timbre_acc"}
# Outputs the host needs from the forward pass (logits and hidden states stay on the device).
_KEEP = ("speech_content", "video_content", "speech_style", "video_style", "emotion_logits", "age_logits",
         "gender_logits", "timbre_logits", "r_s_mask", "r_v_mask", "r_s_positions", "r_v_positions")

# ----------------------------------------------------------------------------------------------------------
# Metric functions (used for the model and for the baselines)
# ----------------------------------------------------------------------------------------------------------


def feature_distances(pred: Any, target: Any, mask: Any, eps: float = 1e-8) -> tuple[np.ndarray, np.ndarray]:
    """Per valid row: (Euclidean distance ||p - t||_2, cosine similarity) as float64 arrays [n_valid].

    pred/target [..., D] (a content row or a style vector), mask [...] (the leading axes). This is
    NExT-GPT's per-token L2 (a distance, not its square; the training loss L_ccl is the square). A zero
    vector has cosine 0.
    """
    p = np.asarray(pred, np.float64)
    t = np.asarray(target, np.float64)
    m = np.asarray(mask).astype(bool)
    if p.shape != t.shape or p.shape[:-1] != m.shape:
        raise ValueError(f"shapes differ: pred {p.shape}, target {t.shape}, mask {m.shape}")
    p, t = p[m], t[m]
    l2 = np.linalg.norm(p - t, axis=-1)
    pn, tn = np.linalg.norm(p, axis=-1), np.linalg.norm(t, axis=-1)
    cos = np.sum(p * t, axis=-1) / np.maximum(pn * tn, eps)
    return l2, cos


def accuracy(pred: Any, labels: Any) -> tuple[int, int]:
    """(correct, counted) over the examples with a label (label >= 0); `pred` are class ids."""
    pred, labels = np.asarray(pred), np.asarray(labels)
    valid = labels >= 0
    return int(np.sum(valid & (pred == labels))), int(np.sum(valid))


_WORD_RE = re.compile(r"[a-z0-9]+(?:'[a-z0-9]+)*|[^\sa-z0-9]")


def words(text: str) -> list[str]:
    """Lower-cased word tokens of a reply: letter/digit runs (inner apostrophes kept), single punctuation."""
    return _WORD_RE.findall(text.lower())


def _ngrams(text: str, n: int) -> list[tuple[str, ...]]:
    w = words(text)
    return [tuple(w[i : i + n]) for i in range(len(w) - n + 1)]


def distinct_n(texts: Iterable[str], n: int) -> float:
    """Dist-n, corpus level (Li et al., 2016; the ED literature and the Empatheia paper): distinct n-grams /
    all n-grams over all texts (n-grams never cross texts)."""
    grams: collections.Counter = collections.Counter()
    for text in texts:
        grams.update(_ngrams(text, n))
    total = sum(grams.values())
    return len(grams) / total if total else 0.0


def distinct_n_per_reply(texts: Iterable[str], n: int) -> float:
    """Dist-n as E3RG reports it: each reply's distinct n-grams / its n-grams, averaged over the replies
    that have an n-gram (a reply shorter than n has no ratio). Higher than the corpus figure: a reply that
    repeats the words of other replies loses nothing here."""
    ratios = [len(set(g)) / len(g) for g in (_ngrams(t, n) for t in texts) if g]
    return float(np.mean(ratios)) if ratios else 0.0


REPEAT_N = 4
"""`repetition_rate` counts replies in which some word 4-gram occurs twice: a sentence said again (the
demo's failure, one sentence eight times) always does; ordinary replies of a few sentences almost never."""


def has_repeated_ngram(text: str, n: int = REPEAT_N) -> bool:
    grams = _ngrams(text, n)
    return len(set(grams)) < len(grams)


def reply_length(text: str) -> int:
    """Words of a reply (letter/digit runs; punctuation does not count)."""
    return sum(1 for w in words(text) if w[0].isalnum())


class _Means:
    """Running (sum, count) per metric name; `result()` gives sum / count for names with count > 0."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = collections.defaultdict(float)
        self.counts: dict[str, float] = collections.defaultdict(float)

    def add(self, name: str, total: float, count: float) -> None:
        self.sums[name] += float(total)
        self.counts[name] += float(count)

    def add_values(self, name: str, values: np.ndarray) -> None:
        self.add(name, float(np.sum(values)), values.size)

    def result(self) -> dict[str, float]:
        return {k: self.sums[k] / c for k, c in self.counts.items() if c > 0}


# ----------------------------------------------------------------------------------------------------------
# Parsing generated text
# ----------------------------------------------------------------------------------------------------------


def emotion_class(word: str, emotion_map: schema.EmotionMap) -> int | None:
    """Class index of a generated emotion phrase: the whole phrase, else its first word that resolves.

    Gold step-2 values are one word ("terrified"); a model may write "terrified and alone" or "feeling sad".
    """
    return _first_resolving(word, emotion_map.project)


def emotion_fine_class(word: str, emotion_map: schema.EmotionMap) -> int | None:
    """Index among the 32 ED labels (`schema.ED_EMOTIONS_32`) of a generated emotion phrase, resolved like
    `emotion_class`: ED labels are themselves, free words go through the organisers' alias table."""
    return _first_resolving(word, lambda w: None if (i := emotion_map.fine_index(w)) < 0 else i)


def _first_resolving(phrase: str, resolve) -> int | None:
    idx = resolve(phrase)
    if idx is not None:
        return idx
    for w in words(phrase or ""):
        idx = resolve(w)
        if idx is not None:
            return idx
    return None


def parse_generation(
    text: str, emotion_map: schema.EmotionMap | None = None, *, pipeline_baseline: bool = False
) -> dict[str, Any]:
    """What evaluation reads from one generated text.

    Returns {"coe": the five CoE fields (parse_coe; the Pipeline baseline's fields are mapped onto them),
    "reply", "emotion_word" (CoE step 2), "emotion" (class index or -1), "emotion_fine" (index among the 32
    ED labels or -1), and for the Pipeline baseline "age"/"gender"/"timbre" (index or -1)}.
    """
    emotion_map = emotion_map or schema.EmotionMap.load("avamerg7")
    out: dict[str, Any] = {}
    if pipeline_baseline:
        p = tpl.parse_pipeline_output(text)
        coe = dict.fromkeys(tpl.COE_FIELDS, "")
        coe["speaker_emotion"], coe["response"] = p["emotion"], p["response"]
        if not any(p.values()):  # none of the three lines: the whole text is the reply, as parse_coe does
            coe["response"] = tpl.parse_coe(text)["response"]
        for name, vocab in (("age", schema.AGES), ("gender", schema.GENDERS), ("timbre", schema.TIMBRES)):
            w = schema.normalize_word(p[name])
            out[name] = vocab.index(w) if w in vocab else -1
    else:
        coe = tpl.parse_coe(text)
    word = coe["speaker_emotion"]
    idx = emotion_class(word, emotion_map) if word else None
    fine = emotion_fine_class(word, emotion_map) if word else None
    out.update(coe=coe, reply=coe["response"], emotion_word=word, emotion=-1 if idx is None else int(idx),
               emotion_fine=-1 if fine is None else int(fine))
    return out


def text_metrics(predictions: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Text metrics over parsed generations (dicts of `parse_generation` plus gold "labels").

    emotion_acc_text: CoE step-2 class (the shards' emotion map, 7 coarse classes for AvaMERG) == gold
    emotion, over predictions with a gold emotion (unparseable counts as wrong); emotion32_acc_text: the same
    on the 32 ED labels against gold `emotion_fine`. coe_parse_rate: share with a step-2 emotion found;
    emotion_parse_rate / emotion32_parse_rate: share whose step 2 maps to a class / an ED label;
    signal_rate: share holding all signal tokens (when "signal_complete" is given); dist{1,2}_corpus
    (`distinct_n`) and dist{1,2}_reply (`distinct_n_per_reply`) over the replies; repetition_rate: share
    of replies with a repeated word 4-gram (`has_repeated_ngram`); reply_words: mean reply length in words
    (`reply_length`); *_acc_text for the Pipeline baseline's profile line. Predictions with the *_scored
    fields of `generate_predictions(score_emotions=True)` add emotion_acc_scored / emotion32_acc_scored
    (unscored = wrong) and emotion_scored_rate (share with a CoE to score after).
    """
    if not predictions:
        return {}
    m = _Means()
    for p in predictions:
        gold = p.get("labels", {})
        m.add("coe_parse_rate", bool(p["emotion_word"]), 1)
        m.add("emotion_parse_rate", p["emotion"] >= 0, 1)
        m.add("emotion32_parse_rate", p.get("emotion_fine", -1) >= 0, 1)
        if gold.get("emotion", -1) >= 0:
            m.add("emotion_acc_text", p["emotion"] == gold["emotion"], 1)
        if gold.get("emotion_fine", -1) >= 0:
            m.add("emotion32_acc_text", p.get("emotion_fine", -1) == gold["emotion_fine"], 1)
        if "emotion_fine_scored" in p:  # generate_predictions(score_emotions=True)
            m.add("emotion_scored_rate", p["emotion_fine_scored"] >= 0, 1)
            if gold.get("emotion", -1) >= 0:
                m.add("emotion_acc_scored", p["emotion_scored"] == gold["emotion"], 1)
            if gold.get("emotion_fine", -1) >= 0:
                m.add("emotion32_acc_scored", p["emotion_fine_scored"] == gold["emotion_fine"], 1)
        if "signal_complete" in p:
            m.add("signal_rate", bool(p["signal_complete"]), 1)
        for name in ("age", "gender", "timbre"):
            if name in p and gold.get(name, -1) >= 0:
                m.add(f"{name}_acc_text", p[name] == gold[name], 1)
        m.add("repetition_rate", has_repeated_ngram(p["reply"]), 1)
        m.add("reply_words", reply_length(p["reply"]), 1)
    out = m.result()
    out.update(reply_text_metrics([p["reply"] for p in predictions]))
    out["num_generated"] = float(len(predictions))
    return out


def reply_text_metrics(replies: Sequence[str]) -> dict[str, float]:
    """Dist-1/2 in both conventions over `replies` (the model's, or the gold ones as a reference)."""
    return {"dist1_corpus": distinct_n(replies, 1), "dist2_corpus": distinct_n(replies, 2),
            "dist1_reply": distinct_n_per_reply(replies, 1), "dist2_reply": distinct_n_per_reply(replies, 2)}


def vote_emotions(votes: Sequence[Sequence[Mapping[str, Any]]], key: str = "emotion") -> dict[int, int]:
    """Emotion voting as E3RG does it: several voters (prompts or checkpoints) each predict the emotion of
    every record (`generate_predictions` lists), and the majority decides, per record_index. Unparsed votes
    (-1) abstain; a tie goes to the class voted by the earliest voter among the tied (list the strongest
    voter first); a record no voter parsed gets -1."""
    ballots: dict[int, list[int]] = collections.defaultdict(list)
    for voter in votes:
        for p in voter:
            ballots[int(p["record_index"])].append(int(p.get(key, -1)))
    out = {}
    for idx, cast in ballots.items():
        valid = [c for c in cast if c >= 0]
        if not valid:
            out[idx] = -1
            continue
        counts = collections.Counter(valid)
        top = max(counts.values())
        out[idx] = next(c for c in valid if counts[c] == top)
    return out


def vote_metrics(votes: Sequence[Sequence[Mapping[str, Any]]]) -> dict[str, float]:
    """emotion_acc_vote / emotion32_acc_vote: accuracy of `vote_emotions` against the gold labels of the
    first voter's records (the 7 coarse classes and the 32 ED labels), unparsed = wrong."""
    if not votes or not votes[0]:
        return {}
    gold = {int(p["record_index"]): p.get("labels", {}) for p in votes[0]}
    m = _Means()
    for key, row, gold_key in (("emotion", "emotion_acc_vote", "emotion"),
                               ("emotion_fine", "emotion32_acc_vote", "emotion_fine")):
        decided = vote_emotions(votes, key)
        for idx, lab in gold.items():
            if lab.get(gold_key, -1) >= 0:
                m.add(row, decided.get(idx, -1) == lab[gold_key], 1)
    return m.result()


def per_class_accuracy(predictions: Sequence[Mapping[str, Any]], key: str, classes: Sequence[str],
                       gold_key: str | None = None) -> dict[str, dict[str, float]]:
    """{class: {"accuracy", "n"}} of the prediction `key` against gold `labels[gold_key or key]`, per gold
    class (the paper's Figure 6); classes with no gold example are left out."""
    gold_key = gold_key or key
    hits: dict[int, list[bool]] = collections.defaultdict(list)
    for p in predictions:
        g = p.get("labels", {}).get(gold_key, -1)
        if g is not None and g >= 0:
            hits[int(g)].append(p.get(key, -1) == g)
    return {classes[c]: {"accuracy": float(np.mean(h)), "n": float(len(h))} for c, h in sorted(hits.items())}


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


# ----------------------------------------------------------------------------------------------------------
# Jitted programs (shared with chat.py)
# ----------------------------------------------------------------------------------------------------------

_JITS: dict[tuple, Any] = {}
_LOCK = threading.Lock()


def _options_key(options: Mapping[str, Any] | None) -> tuple:
    return tuple(sorted((options or {}).items()))


def _jit(name: str, fn, options: Mapping[str, Any] | None, **static):
    key = (name, _options_key(options), tuple(sorted(static.items())))
    with _LOCK:
        f = _JITS.get(key)
        if f is None:
            opts = dict(options) if options else None
            f = _JITS[key] = jax.jit(fn, static_argnums=0, compiler_options=opts)
    return f


def _loss_and_outputs(graphdef, state, batch, stage, weights):
    model = nnx.merge(graphdef, state)
    out = model(batch, train=False, heads=stage.heads)
    _, metrics = model.loss(batch, out, stage, weights)
    # the gold reply's own tokens (r^t inside the target): its perplexity, apart from the CoE steps around it
    reply = batch["loss_mask"].astype(bool) & batch["response_mask"].astype(bool)
    nll, n = losses.masked_token_mean(model.token_nll(out, batch["target_ids"], reply), reply)
    return {**metrics, "reply_nll": nll, "reply_tokens": n}, {k: out[k] for k in _KEEP if k in out}


def _outputs(graphdef, state, batch, heads):
    out = nnx.merge(graphdef, state)(batch, train=False, heads=heads)
    return {k: out[k] for k in _KEEP if k in out}


def _embed(graphdef, state, ids, aud_feats, aud_mask, vid_feats, vid_mask):
    return nnx.merge(graphdef, state).embed_inputs(ids, aud_feats, aud_mask, vid_feats, vid_mask)


def model_outputs(
    model: Empatheia,
    batch: Mapping[str, np.ndarray],
    *,
    heads: Iterable[str] | None = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> dict[str, np.ndarray]:
    """Deterministic (z = mu) forward of `batch`; the head outputs and signal masks as numpy (no logits)."""
    heads = model.config.heads if heads is None else frozenset(heads)
    graphdef, state = nnx.split(model)
    fn = _jit("outputs", lambda g, s, b, h=heads: _outputs(g, s, b, h), compiler_options, heads=heads)
    out = fn(graphdef, state, {k: jnp.asarray(v) for k, v in batch.items()})
    return {k: np.asarray(v) for k, v in jax.device_get(out).items()}


def embed_prompts(
    model: Empatheia,
    ids: np.ndarray,
    aud_feats: np.ndarray,
    aud_mask: np.ndarray,
    vid_feats: np.ndarray,
    vid_mask: np.ndarray,
    *,
    compiler_options: Mapping[str, Any] | None = None,
) -> jax.Array:
    """`model.embed_inputs` jitted: the spliced prompt embeddings for `generate_tokens(inputs_embeds=)`."""
    graphdef, state = nnx.split(model)
    fn = _jit("embed", _embed, compiler_options)
    return fn(graphdef, state, *(jnp.asarray(x) for x in (ids, aud_feats, aud_mask, vid_feats, vid_mask)))


# ----------------------------------------------------------------------------------------------------------
# Setup helpers
# ----------------------------------------------------------------------------------------------------------


# What `eval_stage(cfg, template)` accepts: the four stages and the Pipeline baseline.
TEMPLATES: tuple[str, ...] = (*stages.STAGE_ORDER, stages.PIPELINE_BASELINE.name)


class TemplateError(ValueError):
    """An evaluation template the model cannot be scored on (unknown, or removed by the model's ablations,
    e.g. sac for a model without media input); `empatheia eval` prints it as one line and exits 2."""


def eval_stage(cfg: EmpatheiaConfig, template: str | None = None) -> stages.Stage:
    """The stage whose template and loss formula evaluate a model of this config.

    template None: overall under the model's ablations, or the Pipeline baseline for such a model (all of
    the model's outputs). A name of `TEMPLATES` (`empatheia eval` passes the stage the checkpoint was trained
    for, or --template): that stage under the model's ablations, so a coe checkpoint is scored on the CoE
    prompt and L_emp rather than on heads and placeholders it never trained; "pipeline" is the baseline.
    """
    if template is None:
        template = stages.PIPELINE_BASELINE.name if cfg.pipeline_baseline else "overall"
    if template == stages.PIPELINE_BASELINE.name:
        return stages.PIPELINE_BASELINE
    if template not in stages.STAGES:
        raise TemplateError(f"unknown evaluation template {template!r}; expected one of {TEMPLATES}")
    try:
        return stages.apply_ablations(stages.STAGES[template], no_coe=not cfg.use_coe,
                                      no_media=not cfg.media_input, no_cs=not cfg.has_cs,
                                      no_sd=not cfg.has_sd)
    except stages.StageSkipped as e:
        raise TemplateError(f"template {template!r} cannot score this model: {e}") from e


_MODEL_FIELDS = ("n_signal", "max_speech_len", "max_video_len", "speech_content_dim", "video_content_dim",
                 "style_dim")


def pipeline_config_fields(
    cfg: EmpatheiaConfig, stage: stages.Stage, overrides: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """`PipelineConfig` fields (without stage/max_len) that agree with the model; `overrides` may set the
    others (max_aud, max_vid, buckets, chat_format) but not contradict the model."""
    fields = {k: v for k, v in stage.pipeline_fields().items() if k != "stage"}
    fields.update({k: getattr(cfg, k) for k in _MODEL_FIELDS})
    for k, v in (overrides or {}).items():
        if k in ("stage", "max_len", "include_target", "window_batches"):
            raise ValueError(f"pipeline_overrides may not set {k!r} (evaluate sets it)")
        if k in fields and fields[k] != v:
            raise ValueError(f"pipeline_overrides[{k!r}]={v!r} contradicts the model ({fields[k]!r})")
        fields[k] = v
    return fields


class ShardsError(ValueError):
    """A shards folder that cannot be evaluated as asked: an unreadable or foreign manifest, a split it lacks
    or holds no records of, a shard file missing or not what the manifest lists, features of another encoder
    than the model's. The message names the folder, split or file; `empatheia eval` prints it as one line and
    exits 2. (A folder that does not exist is a `FileNotFoundError`; a record that fails to decode while
    reading, `shard_format.ShardRecordError`.)"""


def check_split(shards_dir: str | os.PathLike, split: str) -> dict[str, Any]:
    """The manifest of `shards_dir`, after checking it has `split` and that the split's shard files are there
    with the record counts the manifest lists (ArrayRecord footers only: cheap, and a truncated copy fails
    here rather than in the middle of the pass). Errors name the folder, the split or the file."""
    if not Path(shards_dir).is_dir():
        raise FileNotFoundError(f"shards folder {shards_dir} does not exist (run data/prepare.py first)")
    try:
        m = shard_format.load_manifest(shards_dir)
    except FileNotFoundError:
        raise
    except ValueError as e:  # invalid JSON, or not our manifest format
        raise ShardsError(str(e)) from e
    splits = m.get("splits")
    if not isinstance(splits, Mapping) or split not in splits:
        known = sorted(splits) if isinstance(splits, Mapping) else []
        raise ShardsError(f"{shards_dir} has no split {split!r}; its manifest lists {known}")
    if not splits[split].get("records"):
        raise ShardsError(f"split {split!r} of {shards_dir} has no records")
    try:
        ip.ShardReader.for_split(shards_dir, split)
    except shard_format.ShardRecordError as e:
        raise ShardsError(f"split {split!r} of {shards_dir}: {e}") from e
    except (KeyError, TypeError) as e:  # a manifest entry without path/records
        raise ShardsError(f"{Path(shards_dir) / shard_format.MANIFEST}: malformed entry of split {split!r} "
                          f"({type(e).__name__}: {e})") from e
    return m


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


def emotion_map_of(manifest: Mapping[str, Any]) -> schema.EmotionMap:
    """The emotion classes of a shards folder (its manifest's map; avamerg7 for older folders)."""
    name = ((manifest.get("emotion_map") or {}).get("name")) or "avamerg7"
    return schema.EmotionMap.load(name)


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
    fields = pipeline_config_fields(cfg, stage, pipeline_overrides)
    # the model's feature dims: equal to the shards' under a media template (checked), and the shapes its
    # program takes when the template reads no feature (text-only shards have dims 0)
    pipe = ip.make_dataset(shards_dir, split, stage.template_stage, tokenizer, batch_size=batch_size,
                           max_len=max_len, shuffle=False, num_epochs=1, drop_remainder=False,
                           window_batches=1, process_index=0, process_count=1,
                           feature_dims=(cfg.audio_dim, cfg.video_dim), **fields)
    graphdef, state = nnx.split(model)
    step = _jit("loss", lambda g, s, b, st=stage, w=weights: _loss_and_outputs(g, s, b, st, w),
                compiler_options, stage=stage, weights=weights)
    means = _Means()
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
        for k in _ROW_MASKS:  # filler rows hold zero masks already; this also drops rows past max_examples
            batch[k] = np.where(_rows(real, batch[k]), batch[k], 0)
        for k in LABELS:
            batch[k] = np.where(real, batch[k], -1)
        metrics, out = jax.device_get(step(graphdef, state, {k: jnp.asarray(v) for k, v in batch.items()}))
        if collect is not None:
            for b in np.flatnonzero(real):
                got = collect.setdefault(int(batch["record_index"][b]), {})
                got["labels"] = {name: int(batch[name][b]) for name in LABELS}
                for name in LABELS:  # the SD classifiers' predictions: per-class accuracy in reports
                    if f"{name}_logits" in out:
                        got[f"{name}_cls"] = int(np.argmax(out[f"{name}_logits"][b]))
                for kind in ("speech", "video") if collect_features else ():
                    if f"{kind}_content" in out and f"{kind}_style" in out:
                        rows = int(batch[f"{kind}_content_mask"][b].sum())
                        got[f"{kind}_content"] = np.asarray(out[f"{kind}_content"][b, :rows], np.float32)
                        got[f"{kind}_style"] = np.asarray(out[f"{kind}_style"][b], np.float32)
        n = int(real.sum())
        n_real += n
        _add_loss_terms(means, metrics, batch, out, n, reported)
        _add_head_metrics(means, batch, out)
        means.add("reply_nll", float(metrics["reply_nll"]) * float(metrics["reply_tokens"]),
                  float(metrics["reply_tokens"]))
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
    result["num_examples"] = float(n_real)
    result["skipped_examples"] = float(pipe.counters.as_dict()["skipped_target_too_long"])
    return result


_ROW_MASKS = ("loss_mask", "speech_content_mask", "video_content_mask", "style_mask")


def _rows(real: np.ndarray, v: np.ndarray) -> np.ndarray:
    return real.reshape(real.shape + (1,) * (v.ndim - 1))


def _add_loss_terms(means: _Means, metrics: Mapping[str, Any], batch, out, n_real: int, reported) -> None:
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


def _add_head_metrics(means: _Means, batch, out) -> None:
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
            means.add(_ACC_NAME[name], correct, counted)


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
) -> list[dict[str, Any]]:
    """Greedy generations for the records of `split`, parsed (`parse_generation`), in record order.

    Prompts are the eval stage's template without the target (`include_target=False`), tokenised exactly as
    in training, sorted by length within windows of 16 batches (bounded memory) and batched (left-padded;
    a short batch is completed with copies so the batch size, hence the program, never changes); media
    features are spliced through `inputs_embeds`. Examples whose prompt does not fit `max_len` are left out.
    Each dict: record_index, uid, labels, prompt_tokens, num_new, text (the new tokens decoded with special
    tokens, up to the end token), signal_complete, and the fields of `parse_generation`.

    `score_emotions` (CoE templates) also chooses CoE step 2 among the 32 ED labels by likelihood after the
    model's own step 1 (`label_continuations`, `score_continuations`): "emotion_word_scored",
    "emotion_fine_scored" (index in `schema.ED_EMOTIONS_32`, -1 when the text had no CoE to condition on),
    "emotion_scored" (its class) and
    "emotion_label_logprobs" (the 32 log-likelihoods, in label order; absent when unscored).
    """
    if batch_size < 1:  # a negative size would make the batching loop empty: no predictions, no error
        raise ValueError(f"generate_predictions: batch_size must be >= 1, got {batch_size}")
    cfg = model.config
    manifest = check_split(shards_dir, split)
    stage = eval_stage(cfg, template)
    _check_model_and_data(model, tokenizer, manifest, shards_dir, split, stage)
    emap = emotion_map_of(manifest)
    fields = pipeline_config_fields(cfg, stage, pipeline_overrides)
    pcfg = ip.PipelineConfig(stage=stage.template_stage, max_len=max_len, include_target=False, **fields)
    spliced = cfg.has_media and pcfg.template_spec().has_media  # placeholders to fill with features
    reader = ip.ShardReader.for_split(shards_dir, split)
    builder = ip.ExampleBuilder(tokenizer, pcfg, audio_dim=cfg.audio_dim, video_dim=cfg.video_dim)
    n = len(reader) if max_examples is None else min(len(reader), max_examples)
    eos = eos_token_ids(model.llm, tokenizer)
    signal = set(cfg.signal_ids)
    window = batch_size * _SORT_WINDOW_BATCHES
    spec = pcfg.template_spec()
    if score_emotions and not (spec.use_coe and spec.has_response and not spec.pipeline_baseline):
        raise TemplateError(f"score_emotions needs a Chain-of-Empathy target; template {stage.name!r} "
                            "has none")
    labels = label_continuations(tokenizer) if score_emotions else None
    out: list[dict[str, Any]] = []
    bar = _progress(None, total=-(-n // batch_size), desc=f"eval {split} (generation)", enabled=progress)
    for w0 in range(0, n, window):
        # Build one window of prompts (memory stays bounded on a large split), sort it by length, batch it.
        kept = []
        for i, (where, rec) in enumerate(reader.read_located(range(w0, min(w0 + window, n))), w0):
            try:
                ex = builder(rec, record_index=i, where=where)
            except ip.ExampleTooLongError:
                continue
            lab = rec.get("labels") or {}
            kept.append({"input_ids": ex["input_ids"], "aud_feats": ex["aud_feats"],
                         "vid_feats": ex["vid_feats"], "record_index": i, "uid": rec.get("uid"),
                         "labels": {k: -1 if lab.get(k) is None else int(lab[k])
                                    for k in (*LABELS, "emotion_fine")}})
        kept.sort(key=lambda e: len(e["input_ids"]))
        preds = {}
        for b0 in range(0, len(kept), batch_size):
            chunk = kept[b0 : b0 + batch_size]
            rows = chunk + [chunk[-1]] * (batch_size - len(chunk))  # constant batch size: one program
            prompts = [e["input_ids"].tolist() for e in rows]
            ids, _ = left_pad(prompts, builder.pad_id)
            embeds = None
            if spliced:
                af, am = _pad_rows([e["aud_feats"] for e in rows], pcfg.max_aud, builder.audio_dim)
                vf, vm = _pad_rows([e["vid_feats"] for e in rows], pcfg.max_vid, builder.video_dim)
                embeds = embed_prompts(model, ids, af, am, vf, vm, compiler_options=compiler_options)
            gen = generate_tokens(model.llm, prompts, max_new_tokens, eos_ids=eos,
                                  pad_token_id=builder.pad_id, inputs_embeds=embeds,
                                  repetition_penalty=repetition_penalty,
                                  no_repeat_ngram_size=no_repeat_ngram_size)
            for r, e in enumerate(chunk):
                new = gen.new_tokens[r, : gen.num_new[r]].tolist()
                text = tokenizer.decode(new, skip_special_tokens=False)
                pred = parse_generation(text, emap, pipeline_baseline=stage.pipeline_baseline)
                pred.update(record_index=e["record_index"], uid=e["uid"], labels=e["labels"],
                            prompt_tokens=len(prompts[r]), num_new=int(gen.num_new[r]), text=text)
                if spec.has_signal:  # signal_rate only where the target has them
                    pred["signal_complete"] = signal <= set(new)
                preds[e["record_index"]] = pred
            if labels is not None:
                _add_scored_emotions(model, tokenizer, chunk, prompts, preds, labels, emap, builder, pcfg,
                                     spliced, compiler_options)
            bar.update(1)
        out += [preds[i] for i in sorted(preds)]
    bar.close()
    return out


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
        ids, _ = left_pad([p for _, _, p in rows], builder.pad_id)
        embeds = None
        if spliced:
            af, am = _pad_rows([e["aud_feats"] for _, e, _ in rows], pcfg.max_aud, builder.audio_dim)
            vf, vm = _pad_rows([e["vid_feats"] for _, e, _ in rows], pcfg.max_vid, builder.video_dim)
            embeds = embed_prompts(model, ids, af, am, vf, vm, compiler_options=compiler_options)
        scores = score_continuations(model.llm, [p for _, _, p in rows], labels, pad_token_id=builder.pad_id,
                                     inputs_embeds=embeds)
        for (pred, _, _), row in zip(group, scores[: len(group)], strict=True):
            fine = int(np.argmax(row))
            word = schema.ED_EMOTIONS_32[fine]
            coarse = emotion_class(word, emap)
            pred.update(emotion_word_scored=word, emotion_fine_scored=fine,
                        emotion_scored=-1 if coarse is None else int(coarse),
                        emotion_label_logprobs=[round(float(x), 4) for x in row])


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
    labels by likelihood after the model's own step 1 (`generation.score_continuations`).
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
    if not {"cs", "sd"} <= eval_stage(model.config, template).heads:
        speech = video = None  # rendered from C and S, which this stage's forward does not compute
    collected: dict[int, dict[str, Any]] | None = {} if speech or video or details is not None else None
    result = teacher_forced_metrics(model, tokenizer, shards_dir, split, weights=weights, collect=collected,
                                    collect_features=bool(speech or video), **common)
    if details is not None:
        details["classified"] = {i: {k: v for k, v in c.items() if k == "labels" or k.endswith("_cls")}
                                 for i, c in (collected or {}).items()}
    for rows in (speech, video):
        if rows is not None and collected:
            result.update(rows.model_rows(name, collected))
    if generate_text:
        preds = generate_predictions(model, tokenizer, shards_dir, split, max_new_tokens=max_new_tokens,
                                     repetition_penalty=repetition_penalty,
                                     no_repeat_ngram_size=no_repeat_ngram_size, score_emotions=score_emotions,
                                     **{**common, "batch_size": generate_batch_size or batch_size})
        result.update(text_metrics(preds))
        if details is not None:
            details["predictions"] = preds
        if predictions_path is not None:
            write_predictions(preds, predictions_path)
    return {k: result[k] for k in sorted(result, key=_metric_order)}


def write_predictions(predictions: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> Path:
    """One JSON object per line (record_index, uid, labels, text, coe, reply, emotion, ...)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for p in predictions:
            f.write(json.dumps(p, ensure_ascii=False) + "\n")
    return path


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
    train = ip.ShardReader.for_split(shards_dir, train_split)
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

    test = ip.ShardReader.for_split(shards_dir, split)
    means = _Means()
    replies = []
    n = len(test) if max_examples is None else min(len(test), max_examples)
    for i in range(n):
        rec = test[i]
        replies.append(tpl.clean_text(rec.get("response")))
        lab = rec.get("labels") or {}
        for k, maj in majority.items():
            label = -1 if lab.get(k) is None else int(lab[k])
            correct, counted = accuracy([maj], [label])
            means.add(_ACC_NAME[k], correct, counted)
            if k == "emotion":
                means.add("emotion_acc_text", correct, counted)
        for kind, x in (rec.get("targets") or {}).items():
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
    return {k: out[k] for k in sorted(out, key=_metric_order)}


def chance_levels(cfg: EmpatheiaConfig | None = None) -> dict[str, float]:
    """1 / number of classes of every accuracy metric (the model's class counts, else the paper's 7/4/2/3)."""
    n = {"emotion": 7, "age": 4, "gender": 2, "timbre": 3}
    if cfg is not None:
        n = {"emotion": cfg.num_emotions, "age": cfg.num_ages, "gender": cfg.num_genders,
             "timbre": cfg.num_timbres}
    out = {_ACC_NAME[k]: 1.0 / v for k, v in n.items()}
    out["emotion_acc_text"] = 1.0 / n["emotion"]
    for k in ("age", "gender", "timbre"):
        out[f"{k}_acc_text"] = 1.0 / n[k]
    return out


def _metric_order(name: str) -> tuple[int, str]:
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
        metrics = sorted(names, key=_metric_order)
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


__all__ = [
    "METRICS",
    "accuracy",
    "baselines",
    "chance_levels",
    "check_split",
    "distinct_n",
    "embed_prompts",
    "emotion_class",
    "TEMPLATES",
    "TemplateError",
    "eval_stage",
    "evaluate",
    "per_class_report",
    "write_report",
    "emotion_map_of",
    "feature_distances",
    "format_table",
    "generate_predictions",
    "model_outputs",
    "parse_generation",
    "pipeline_config_fields",
    "teacher_forced_metrics",
    "text_metrics",
    "words",
    "write_predictions",
]
