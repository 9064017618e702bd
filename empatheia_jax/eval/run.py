"""`empatheia eval`'s run: from parsed options to the printed table, the --json file and the --report folder.

The command line only parses flags into an `EvalOptions` and calls `run_eval`; everything between is here,
in the order a run takes, each step a named helper:

  the data (--data csv imported, or a shards folder, checked before the model loads, so a wrong file fails
  in seconds) -> the emotion head -> the model (`load_ckpt`) -> the shards (an imported csv prepared
  text-only, cached; --asr shards transcribed by Whisper, cached) -> the template (the stage the checkpoint
  was trained for unless --template) -> the model columns (trained, its emotion voters, --untrained) and
  the reference columns -> the outputs (table, --json, --report).

Why the order: every input the user gave is checked before the minute a model takes to load, and the
template, data and targets a number was computed on are printed and recorded with it, since the numbers
mean nothing without them. Bad input raises `DataError` (or the library's own errors: shards, checkpoint,
emotion head) and options that do not go together `EvalUsageError`; the command line turns each into one
`error:` line and exit 2.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from empatheia_jax.data import splits
from empatheia_jax.eval import report as eval_report
from empatheia_jax.eval.metrics import text as mtext
from empatheia_jax.serve import load as serve_load
from empatheia_jax.serve.decoding import Decoding
from empatheia_jax.train import stages

# stages.TEMPLATES, spelt out so that the command line's flags name them without building a stage
TEMPLATE_NAMES = ("coe", "ccl", "sac", "overall", "pipeline")
ASR_ROWS = ("input_wer", "asr_utterances")  # the --asr rows of a model column (eval/metrics/names.py)

_Columns = dict[str, dict[str, float]]  # column name -> {metric: value}, as the table prints them
_Voters = dict[str, list[dict[str, Any]]]  # voter name -> its parsed generations


class DataError(ValueError):
    """An `eval --data` input that cannot be evaluated (not an EmpatheticDialogues csv, nothing in it to
    evaluate); the message names the file. One `error:` line and exit 2, like every bad input."""


class EvalUsageError(ValueError):
    """Options that do not go together (--data with --shards, --raw without --asr, an unknown
    --vote_templates name); the command line prints it as bad usage, exit 2."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalOptions:
    """What `empatheia eval` was asked for: one field per flag, named as the flag; what each means, and its
    default, is the flag's (`cli`), which fills every field, so no default is restated here. `split_given`
    says whether --split was given (a csv's split is named from its file otherwise) and `decoding` is the
    decoding flags resolved (`cli._decoding_from_flags`: --max_new_tokens, --repetition_penalty,
    --no_repeat_ngram_size, and --reply_* with --seed as its `reply_sampling`, None: greedy replies)."""

    ckpt: str
    step: int | None
    backbone: str | None
    split: str
    split_given: bool
    shards: str | None
    data: str | None
    data_cache: str | None
    asr: bool
    raw: str | None
    template: str | None
    untrained: bool
    generate: bool
    batch_size: int
    max_examples: int
    generate_batch_size: int
    decoding: Decoding
    score_emotions: bool
    emotion_head: str | None
    json: str | None
    report: str | None
    journal: str | None
    vote_templates: Sequence[str]
    vote_ckpt: Sequence[str]
    speech_examples: int
    video_examples: int
    gold_speech: str | None


def load_ckpt(ckpt: str, *, step: int | None = None, backbone: str | None = None, restore: bool = True
              ) -> tuple[Any, Any, Any, dict[str, Any]]:
    """`serve.load.load_trained(ckpt, step)`, with checkpoint errors naming `--ckpt` (the resolver behind
    it words its messages for `--init_from`, which takes the same kinds of paths)."""
    from empatheia_jax.train.checkpoint import CheckpointError

    try:
        return serve_load.load_trained(ckpt, step=step, restore=restore, backbone=backbone)
    except CheckpointError as e:
        message = str(e)
        if message.startswith("--init_from "):
            message = "--ckpt " + message[len("--init_from "):]
        elif str(ckpt) not in message:
            message = f"--ckpt {ckpt}: {message}"
        raise CheckpointError(message) from e


def run_eval(opts: EvalOptions) -> None:
    """Evaluates `opts.ckpt` as `empatheia eval` does: prints the metrics table with what it was computed
    on, and writes --json / --report when asked (module docstring for the steps)."""
    from empatheia_jax.data import shard_format
    from empatheia_jax.eval import evaluate

    _check_options(opts)
    shards, split, ed_json = _eval_data(opts)
    head = _emotion_head(opts)  # a wrong file fails before the model loads
    heard: tuple[str, dict[str, Any]] | None = None
    if opts.asr and shards:  # a given folder: transcribed before the model loads (a wrong one fails fast)
        heard = _asr_shards(opts, shards, split)
    model, tokenizer, config, meta = load_ckpt(opts.ckpt, step=opts.step, backbone=opts.backbone)
    shards = _eval_shards(opts, shards, split, ed_json, model.config, config)
    # --asr: the model reads the ASR shards; the baselines and the speech/video references, fitted on the
    # train split the ASR shards lack, read the original ones (the same records in the same order)
    base, asr = shards, None
    if opts.asr:
        shards, asr = heard or _asr_shards(opts, shards, split)
    stage, why = _eval_template(opts, model.config, meta)
    kwargs = _eval_kwargs(opts, config, stage, head)
    manifest = splits.check_split(shards, split)
    base_manifest = splits.check_split(base, split) if asr else manifest
    # text-only data under a template that reads media: one line now, not a failure inside the pipeline
    shard_format.check_media_for_template(manifest, shards, split, stage=stage.name,
                                          needs_media=stage.template_spec(model.config.n_signal).has_media,
                                          hint="--template coe (the CoE prompt reads text only)")
    speech, video = evaluate.media_evals(base, split, stage, train_split=config.data.train_split,
                                         speech_examples=opts.speech_examples,
                                         video_examples=opts.video_examples, gold_speech=opts.gold_speech)
    columns, details, voters = _eval_columns(opts, model, tokenizer, shards, split, stage, kwargs, speech,
                                             video)
    if asr is not None:  # a property of the input, the same for every model column
        for name in ("trained", "untrained"):
            if name in columns:
                columns[name].update({k: float(asr[k]) for k in ASR_ROWS if asr.get(k) is not None})
    columns.update(evaluate.reference_columns(model.config, base, split, base_manifest, speech=speech,
                                              video=video, train_split=config.data.train_split))
    _eval_outputs(opts, columns, details, voters, manifest=manifest, stage=stage.name, why=why, meta=meta,
                  shards=shards, split=split, asr=asr)


def _check_options(opts: EvalOptions) -> None:
    if opts.data and opts.shards:
        raise EvalUsageError("eval takes --data or --shards, not both")
    if opts.raw and not opts.asr:
        raise EvalUsageError("--raw names the AvaMERG folder eval --asr transcribes; it needs --asr")


# ----------------------------------------------------------------------------------------------------------
# The data: a shards folder, an imported csv, the ASR shards
# ----------------------------------------------------------------------------------------------------------


def _eval_data(opts: EvalOptions) -> tuple[str | None, str, str | None]:
    """(--shards or the --data folder, the split, the JSON text of a --data csv), read before the model is
    loaded, so a wrong folder or file fails in seconds. A csv's split is named from its file unless --split
    is given: ED ships one file per split."""
    shards, split, ed_json = opts.shards, opts.split, None
    if opts.data:
        data = Path(opts.data)
        if data.is_dir():
            shards = str(data)
        elif data.is_file():
            from empatheia_jax.data.ed import split_from_filename

            if opts.asr:
                raise DataError(f"--data {data}: --asr transcribes speech and a csv has no audio; give a "
                                "shards folder prepared from AvaMERG media (--data DIR or --shards)")

            split = opts.split if opts.split_given else split_from_filename(str(data))
            ed_json = _import_ed_csv(data, split)
        else:
            raise FileNotFoundError(f"--data {data}: no such file or folder")
    if shards:
        splits.check_split(shards, split)
    return shards, split, ed_json


def _import_ed_csv(path: Path, split: str) -> str:
    """The AvaMERG JSON text of an EmpatheticDialogues csv (`data.import_ed`), checked as the importer's own
    CLI checks it. Done before the model loads, so a wrong file fails in a second."""
    from empatheia_jax.data.ed import convert_ed_csv, dumps
    from empatheia_jax.data.schema import EmotionMap, validate_dialogues

    try:
        result = convert_ed_csv(str(path), progress=sys.stderr.isatty())  # a bar on a terminal only
    except (ValueError, csv.Error) as e:  # no header, missing columns, not UTF-8 text, a broken csv
        message = str(e).removeprefix(f"{path}: ")
        raise DataError(f"--data {path}: {message}") from e
    if not result.dialogues:
        raise DataError(f"--data {path}: no dialogue to evaluate ({result.rows_read} csv rows, "
                        f"{result.conversations_in} conversations, none with a listener reply that imports)")
    problems = validate_dialogues(result.dialogues, source=path.name, media_dir=None,
                                  emotion_map=EmotionMap.load("avamerg7"))
    if problems:  # the importer's own output must be valid
        raise DataError(f"--data {path}: the import gave {len(problems)} schema problem(s), "
                        f"e.g. {problems[0]}")
    quirks = f"; {len(result.quirks)} csv quirk(s) skipped (python -m data.import_ed lists them)"
    # said once the import succeeded: a file that fails is one `error:` line, like every bad input
    print(f"imported {path} (EmpatheticDialogues csv) as split {split!r}: {len(result.dialogues)} dialogues, "
          f"{result.num_turns} turns{quirks if result.quirks else ''}", file=sys.stderr)
    return dumps(result.dialogues)


def _data_cache(opts: EvalOptions) -> Path:
    if opts.data_cache:
        return Path(opts.data_cache)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "empatheia_jax" / "eval_data"


def _eval_shards(opts: EvalOptions, shards: str | None, split: str, ed_json: str | None, model_cfg: Any,
                 config: Any) -> str:
    """The shards folder to evaluate: an imported csv's cached text-only shards (labelled in the model's
    emotion classes, as chat maps them, hence after loading), else the given one, else the run's own."""
    if ed_json is not None:
        from empatheia_jax.serve.chat import emotion_map_name

        shards, _ = _prepare_cached(opts, ed_json, split, emotion_map_name(model_cfg))
    shards = shards or config.data.shards
    if not opts.shards and not opts.data and not Path(shards).is_dir():
        raise FileNotFoundError(f"shards folder {shards} (the run's config.data.shards) does not exist; "
                                "pass --shards or --data")
    return shards


def _prepare_cached(opts: EvalOptions, ed_json: str, split: str, emotion_map: str) -> tuple[str, bool]:
    """The text-only shards of an imported csv: prepared under --data_cache, or reused from there."""
    from empatheia_jax.data.prepare import cached_text_only_shards
    from empatheia_jax.data.raw_splits import InvalidInputError

    cache = _data_cache(opts)
    try:
        shards, reused = cached_text_only_shards(ed_json, cache, split=split, emotion_map=emotion_map,
                                                 command=f"empatheia eval --data {opts.data}")
    except InvalidInputError as e:
        raise DataError(f"--data {opts.data}: {e}") from e
    return str(shards), reused


def _asr_shards(opts: EvalOptions, shards: str, split: str) -> tuple[str, dict[str, Any]]:
    """(the ASR shards of `split`, their summary): prepared under --data_cache, or reused from there; one
    stderr line says what Whisper heard and where the shards are."""
    from empatheia_jax.data.asr_shards import cached_asr_shards

    out, reused, summary = cached_asr_shards(shards, split, _data_cache(opts), progress=sys.stderr.isatty(),
                                             command=f"empatheia eval --asr ({shards} split {split})",
                                             raw=opts.raw)
    print(_asr_line({**summary, "reused": reused}), file=sys.stderr)
    return str(out), summary


def _asr_line(summary: dict[str, Any]) -> str:
    wer = summary.get("input_wer")
    wer = "-" if wer is None else f"{wer:.4f}"
    how = " (reused)" if summary.get("reused") else ""
    return (f"asr: {summary['asr_utterances']} history utterances heard by {summary['recogniser']}, "
            f"input WER {wer} against the typed text ({summary['asr_empty']} heard as "
            f"nothing, {summary['asr_typed']} without speech left typed); shards {summary['shards']}{how}, "
            f"transcripts {summary['transcripts']}")


# ----------------------------------------------------------------------------------------------------------
# The model's side: template, emotion head, the evaluate arguments
# ----------------------------------------------------------------------------------------------------------


def _trained_stage(meta: dict[str, Any]) -> str | None:
    """The stage a checkpoint (or export) was trained for, from its meta; None when it does not say."""
    stage = meta.get("stage")
    name = stage.get("name") if isinstance(stage, dict) else None
    return name if name in TEMPLATE_NAMES else None


def _eval_template(opts: EvalOptions, model_cfg: Any, meta: dict[str, Any]) -> tuple[stages.Stage, str]:
    """(the eval stage, why it was chosen): a checkpoint is scored on the prompt it was trained for unless
    --template says otherwise; the choice is printed, since every number depends on it."""
    trained_stage = _trained_stage(meta)
    stage = stages.eval_stage(model_cfg, opts.template or trained_stage)
    why = ("--template" if opts.template else "the stage this checkpoint was trained for" if trained_stage
           else "the default: its checkpoint does not name its stage")
    print(f"template: {stage.name} ({why})", file=sys.stderr)
    return stage, why


def _emotion_head(opts: EvalOptions) -> Any:
    """--emotion_head, else the emotion head an export folder (--ckpt) carries, else None."""
    from empatheia_jax.eval import emotion_head

    path = opts.emotion_head
    if path is None:
        beside = Path(opts.ckpt) / emotion_head.FILE_NAME
        if not beside.is_file():
            return None
        path = str(beside)
    elif not Path(path).is_file():
        raise FileNotFoundError(f"--emotion_head {path}: no such file")
    head = emotion_head.EmotionHead.load(path)
    print(f"emotion head: {path} (C={head.c:g}, weights head {head.head_weight}, free {head.free_weight})",
          file=sys.stderr)
    return head


def _eval_kwargs(opts: EvalOptions, config: Any, stage: stages.Stage, emotion_head: Any = None
                 ) -> dict[str, Any]:
    """`evaluate.evaluate`'s arguments from the options, shared by every column, so the trained and untrained
    models are scored alike (the prompt budget and media maxima are the run's training ones)."""
    return dict(
        batch_size=opts.batch_size,
        max_len=int(config.data.max_len),
        decoding=opts.decoding,
        generate_text=opts.generate,
        generate_batch_size=opts.generate_batch_size or None,
        pipeline_overrides={"max_aud": int(config.data.max_aud), "max_vid": int(config.data.max_vid)},
        template=stage.name,
        max_examples=opts.max_examples or None,
        score_emotions=opts.score_emotions,
        emotion_head=emotion_head,
    )


# ----------------------------------------------------------------------------------------------------------
# The columns: trained (with its voters), untrained
# ----------------------------------------------------------------------------------------------------------


def _voting(opts: EvalOptions) -> bool:
    """Whether emotion voting is asked for: it decides what the run keeps as well as what is written."""
    return bool(opts.vote_templates or opts.vote_ckpt)


def _eval_columns(opts: EvalOptions, model: Any, tokenizer: Any, shards: str, split: str, stage: stages.Stage,
                  kwargs: dict[str, Any], speech: Any, video: Any
                  ) -> tuple[_Columns, dict[str, Any] | None, _Voters]:
    """(the model columns: trained, with the voting rows, and --untrained; the trained model's details for
    the report, None when nothing reads them; the voters' predictions by name). The details are kept only
    for a report or a vote: they hold every generation of the split."""
    from empatheia_jax.eval import evaluate

    voting = _voting(opts)
    details: dict[str, Any] | None = {} if opts.report or voting else None
    columns = {"trained": evaluate.evaluate(model, tokenizer, shards, split, speech=speech, video=video,
                                            details=details, journal=_journal(opts), **kwargs)}
    voters: _Voters = {}
    if details is not None and "predictions" in details:
        voters[stage.name] = details["predictions"]
    if voting:
        voters.update(_voters(opts, model, tokenizer, shards, split, kwargs, exclude=stage.name))
        columns["trained"].update(mtext.vote_metrics(list(voters.values())))
        columns["trained"]["num_voters"] = float(len(voters))
    if opts.untrained:  # loss, classifier and feature rows: an untrained head's features drive no generator
        fresh, tok, _, _ = load_ckpt(opts.ckpt, step=opts.step, backbone=opts.backbone, restore=False)
        columns["untrained"] = evaluate.evaluate(fresh, tok, shards, split, name="untrained",
                                                 **{**kwargs, "emotion_head": None})  # fitted to the trained
    return columns, details, voters


def _voters(opts: EvalOptions, model: Any, tokenizer: Any, shards: str, split: str, kwargs: dict[str, Any], *,
            exclude: str) -> dict[str, list[dict[str, Any]]]:
    """The generations of every other voter (`--vote_templates` with this model, `--vote_ckpt` each on its
    trained stage), named for the report: `template:<name>` / `ckpt<i>:<template>`. Voters decode greedy
    replies (their CoE step 2 is what they vote with)."""
    from empatheia_jax.eval.generation_pass import generate_predictions

    gen = {k: kwargs[k] for k in ("batch_size", "max_len", "pipeline_overrides", "max_examples")}
    gen["batch_size"] = kwargs["generate_batch_size"] or kwargs["batch_size"]
    gen["decoding"] = dataclasses.replace(kwargs["decoding"], reply_sampling=None)
    out: dict[str, list[dict[str, Any]]] = {}
    for name in opts.vote_templates:
        if name not in TEMPLATE_NAMES:
            raise EvalUsageError(f"--vote_templates {name}: expected one of {', '.join(TEMPLATE_NAMES)}")
        if name != exclude:
            out[f"template:{name}"] = generate_predictions(model, tokenizer, shards, split, template=name,
                                                           **gen)
    for i, ckpt in enumerate(opts.vote_ckpt, 1):
        other, tok, _, meta = serve_load.load_trained(ckpt)
        stage = _trained_stage(meta)
        out[f"ckpt{i}:{stage or 'overall'}"] = generate_predictions(other, tok, shards, split, template=stage,
                                                                    **gen)
    return out


# ----------------------------------------------------------------------------------------------------------
# The outputs: table, --json, --report
# ----------------------------------------------------------------------------------------------------------


def _journal(opts: EvalOptions) -> Path | None:
    """The trained column's generation journal (--journal, else one in the --report folder), or None."""
    if opts.journal:
        return Path(opts.journal)
    return Path(opts.report) / "generation.journal.jsonl" if opts.report else None


def _eval_outputs(opts: EvalOptions, columns: _Columns, details: dict[str, Any] | None, voters: _Voters, *,
                  manifest: dict[str, Any], stage: str, why: str, meta: dict[str, Any], shards: str,
                  split: str, asr: dict[str, Any] | None = None) -> None:
    """Prints the table with what it was computed on (targets, template, data: the numbers mean nothing
    without them), then writes --json and --report, which record the same."""
    from empatheia_jax.eval import speech as speech_eval

    print(eval_report.format_table(columns))
    targets = speech_eval.describe_targets(manifest)
    print(targets)
    print(f"template: {stage}; data: {shards} split {split}")
    extra = {"targets": targets, "template": stage, "shards": str(shards), "split": split}
    if asr is not None:
        extra["asr"] = asr
    if _voting(opts):
        extra["voters"] = list(voters)
    if opts.decoding.reply_sampling is not None:  # temperature, top_p, seed, candidates
        extra["reply_sampling"] = dataclasses.asdict(opts.decoding.reply_sampling)
    if opts.json:
        Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.json).write_text(json.dumps({**columns, **extra}, indent=1))
    if opts.report:
        notes = [f"checkpoint: {opts.ckpt} (step {meta.get('step', '?')})",
                 f"template: {stage} ({why})", f"data: {shards} split {split}", targets]
        if asr is not None:
            notes.append(_asr_line(asr))
        if _voting(opts):
            notes.append(f"emotion voting over {len(voters)} voters: {', '.join(voters)}")
        per_class = eval_report.per_class_report(details, splits.emotion_map_of(manifest))
        report = eval_report.write_report(opts.report, columns, notes=notes, per_class=per_class,
                                          predictions=voters, extra=extra)
        print(f"report: {report}", file=sys.stderr)
    journal = _journal(opts)
    if journal is not None:  # the eval is written: its predictions are in the report
        journal.unlink(missing_ok=True)


__all__ = [
    "ASR_ROWS",
    "TEMPLATE_NAMES",
    "DataError",
    "EvalOptions",
    "EvalUsageError",
    "load_ckpt",
    "run_eval",
]
