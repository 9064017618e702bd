#!/usr/bin/env python
"""The reference model, end to end: stage coe on EmpatheticDialogues, stages ccl_units and ccl (the avatar's
voice and face) on every ED reply's content targets, then the SD's stage sac on the sample; the export of the
last stage, its dev evaluation and its model card.

    python launch/ed_reference.py RUNDIR [flags] [--config.FIELD=VALUE ...]
    python launch/ed_reference.py RUNDIR --dry_run    # the plan: each step, done or to do, and its command

RUNDIR (best outside the work tree, e.g. ~/runs/ed_reference) holds:

    ed/raw, ed/targets, ed/shards   the imported csv (train + a conversation-level dev hold-out), its reply
                                    targets (Kokoro speech features, the face generator's mouth on Kokoro's
                                    timeline: no media needed) and the text-only shards that embed them
    coe, report                     the ED stage (--config.* overrides reach it alone) and its dev evaluation
    ed_STAGE, STAGE                 the CS on ED (--ed_stages), the stages on the sample (--sample_stages)
    export                          the final model (PEFT adapter + heads) with its model card
    report_avatar.json, report_final/   the export's dev evaluations: the avatar's and the text's (CoE)

Needs `make demo`'s converted backbone and sample shards (--work: WORK/smollm2, WORK/shards; a re-measure,
below, the backbone only). Runs from the repository root wherever it is started: relative paths are the
repository's.

The run is a plan: a list of steps built from the flags (`plan`), each one function with its done check (its
output exists, newer than what it reads). A done step is skipped and a training stage resumes from its last
checkpoint, so running the same command again continues an interrupted run (a run longer than a session, on
CPU). Training, evaluation, export and the data tools run as subprocesses (`python -m empatheia_jax.cli ...`,
`python -m data.*`, `python -m converters.*`): they are long and resume by themselves, and each one's memory
goes back when it ends. The coe stage given --config overrides is always handed to the trainer, which alone
resolves them (a finished stage returns at once; a larger schedule.coe.steps trains on).

--coe_from chains from a finished coe stage instead of training one (a workdir, or a PEFT export such as the
committed reference model, `python -m empatheia_jax.reference`): the ED stages train the CS only, so its LoRA
reaches the new export unchanged and a redesigned CS costs the ccl stage, not the hours of coe. When the
export's adapter then holds --coe_from's values exactly (model_card.text_figures_from), its card's text
figures are carried and the text evaluations are skipped; --text_eval measures them anyway. With no stage
after --coe_from and --text_eval (`--ed_stages 0 --sample_stages 0 --text_eval`), --coe_from's export itself
is measured again (a re-measure): its text figures with today's evaluation, the emotion head fitted to it,
its avatar figures carried (`model_card --avatar_from`); no reply targets are made.

Exit status: 0 done; 2 bad usage or a missing input; 3 a stage stopped before its last step (SIGTERM: it
checkpointed; run the same command again to resume); otherwise a failed step's own status.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOG = "[ed_reference]"
CI_SUBSET = 16  # the dev records tests/test_reference_model.py re-measures (its SUBSET)
NONE = "0"  # --ed_stages / --sample_stages: no stage
# The flags that decide what is trained and measured: the model card's command names those not at default.
RECIPE_FLAGS = ("coe_from", "head_from", "ed_stages", "sample_stages", "text_eval", "coe_eval", "ed_csv",
                "holdout", "export_dtype", "ed_ckpt_every", "reply_flags", "eval_flags", "speech_examples",
                "video_examples")


class Stop(Exception):
    """Ends the run with exit status `code` after printing `message`."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class Step:
    """One step of the plan: what it makes, the command or library call that makes it, and its done check.
    `skip` gives a reason not to run it that is decided during the run (e.g. after the export)."""

    name: str
    show: Callable[[], str]
    done: Callable[[], bool]
    run: Callable[[], None]
    skip: Callable[[], str | None] = lambda: None

    def status(self) -> str:
        reason = self.skip()
        return f"skip: {reason}" if reason else "done" if self.done() else "to do"


def fresh(output: Path, *inputs: Path) -> bool:
    """Whether `output` exists and is newer than each of `inputs` that exists (the shell's `-nt`)."""
    if not output.exists():
        return False
    return all(output.stat().st_mtime > p.stat().st_mtime for p in inputs if p.exists())


def same_files(a: Path, b: Path) -> bool:
    return a.is_file() and b.is_file() and filecmp.cmp(a, b, shallow=False)


def stage_list(value: str) -> list[str]:
    """A --ed_stages / --sample_stages value: stage names, space- or comma-separated; "0" or "" = none."""
    names = value.replace(",", " ").split()
    return [] if names == [NONE] else names


def child_env(run_dir: Path) -> dict[str, str]:
    """The subprocesses' environment: offline Hugging Face, a persistent compilation cache in the run folder,
    and glibc's huge-page tunable (read only at start-up; launch/find_python.sh says why)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(run_dir / "jax_cache"))
    tunables = env.get("GLIBC_TUNABLES", "")
    if ":glibc.malloc.hugetlb=" not in f":{tunables}":
        env["GLIBC_TUNABLES"] = f"{tunables}:glibc.malloc.hugetlb=1" if tunables else "glibc.malloc.hugetlb=1"
    return env


class Reference:
    """One command line's run: its flags, its folders, and the steps they make (`plan`)."""

    def __init__(self, args: argparse.Namespace, overrides: Sequence[str]):
        self.args, self.overrides = args, list(overrides)
        self.dir, self.work = Path(args.rundir), Path(args.work)
        self.raw, self.targets, self.shards = (self.dir / "ed" / n for n in ("raw", "targets", "shards"))
        self.export = self.dir / "export"
        self.heads = self.export / "heads.safetensors"
        self.head = self.export / "emotion_head.safetensors"
        self.final = self.dir / "report_final"
        self.ed_stages, self.sample_stages = stage_list(args.ed_stages), stage_list(args.sample_stages)
        # No stage after --coe_from and --text_eval: --coe_from's export is measured again as it is (the same
        # weights, so the avatar figures and the training rows of its card carry, and no targets are needed).
        self.remeasure = bool(args.coe_from and args.text_eval and not (self.ed_stages or self.sample_stages)
                              and (Path(args.coe_from) / "empatheia_config.json").is_file())
        # (stage, workdir, its data: "coe" | "ed" | "sample"), in training order
        self.stages = ([] if args.coe_from else [("coe", self.dir / "coe", "coe")]) \
            + [(s, self.dir / f"ed_{s}", "ed") for s in self.ed_stages] \
            + [(s, self.dir / s, "sample") for s in self.sample_stages]
        self.last = str(self.stages[-1][1]) if self.stages else args.coe_from
        # the coe stage alone, or no stage after --coe_from (unless a re-measure): nothing to export
        self.exports = bool(self.ed_stages or self.sample_stages or self.remeasure)
        self.env = child_env(self.dir)
        self._carried: bool | None = None

    # -- what the run needs and makes ---------------------------------------------------------------------

    def needs(self) -> list[Path]:
        """The files of `make demo` it reads: the converted backbone and (to train) the sample's shards."""
        needs = [self.work / "smollm2" / "COMPLETE"]
        return needs if self.remeasure else [*needs, self.work / "shards" / "manifest.json"]

    def plan(self) -> list[Step]:
        steps = [self.import_ed()]
        if not self.remeasure:
            steps.append(self.reply_targets())
        steps.append(self.text_shards())
        init_from = self.args.coe_from
        for stage, workdir, data in self.stages:
            steps.append(self.train(stage, workdir, data, init_from))
            if data == "coe" and self.args.coe_eval:
                steps.append(self.coe_eval())
            init_from = str(workdir)
        if not self.exports:
            return steps
        steps.append(self.copy_export() if self.remeasure else self.export_last())
        steps.append(self.copy_head() if self.args.head_from else self.fit_head())
        if not self.remeasure:
            steps.append(self.avatar_eval())
        return [*steps, self.final_eval(), self.head_weights(), self.subset_eval(), self.model_card()]

    def notes(self) -> list[str]:
        """What the plan decides beyond its steps, printed before them."""
        notes = [f"the coe stage is {self.args.coe_from} (--coe_from)"] if self.args.coe_from else []
        if self.remeasure:
            notes.append("no stage after --coe_from, --text_eval: its export is measured again as it is")
        elif self.exports and self._carry_possible():
            notes.append("the text steps are skipped if the export's adapter is --coe_from's (checked once "
                         "it is exported: model_card.text_figures_from)")
        if not self.exports:
            notes.append("no stage after the coe stage: nothing to export")
        return notes

    # -- helpers --------------------------------------------------------------------------------------------

    def python(self, *argv: str) -> list[str]:
        return [self.args.python, *argv]

    def cli(self, *argv: str) -> list[str]:
        return self.python("-m", "empatheia_jax.cli", *argv)

    def call(self, argv: list[str]) -> None:
        """Runs one subprocess from the repository root; a failure ends the run with its status."""
        code = subprocess.run(argv, cwd=REPO, env=self.env).returncode
        if code:
            raise Stop(128 - code if code < 0 else code, f"exit {code}: {shlex.join(argv)}")

    def command_step(self, name: str, argv: list[str], done: Callable[[], bool],
                     skip: Callable[[], str | None] = lambda: None) -> Step:
        return Step(name, lambda: shlex.join(argv), done, lambda: self.call(argv), skip)

    def backbone(self) -> list[str]:
        """A re-measured export's recorded backbone path is the machine's it was exported on: name ours."""
        return ["--backbone", str(self.work / "smollm2")] if self.remeasure else []

    def eval_flags(self) -> list[str]:
        return shlex.split(self.args.eval_flags)

    def dev_eval(self, ckpt: Path, *flags: str) -> list[str]:
        return self.cli("eval", "--ckpt", str(ckpt), "--data", str(self.shards), "--split", "dev", *flags)

    # -- data -----------------------------------------------------------------------------------------------

    def import_ed(self) -> Step:
        a = self.args
        argv = self.python("-m", "data.import_ed", "--csv", a.ed_csv, "--out", str(self.raw),
                           "--split", "train", "--holdout", a.holdout)
        return self.command_step(f"import {a.ed_csv} (train + {a.holdout}, whole conversations)", argv,
                                 lambda: (self.raw / "dev.json").is_file())

    def reply_targets(self) -> Step:
        """Made again when missing, incomplete or made with another voice map or mouth rule (stale_targets);
        the shards that embed them are then prepared again."""
        from converters.target_export import stale_targets

        raw_out = ["--raw", str(self.raw), "--out", str(self.targets)]
        rest = ["--responses-only", "--workers", "2", "--quiet"]
        speech = self.python("-m", "converters.styletts2_targets", *raw_out, *rest)
        face = self.python("-m", "converters.face_targets", *raw_out, "--mouth", "phonemes", *rest)

        def run() -> None:
            (self.shards / "manifest.json").unlink(missing_ok=True)
            self.call(speech)
            self.call(face)

        return Step("reply targets: Kokoro speech features, the face generator's mouth on Kokoro's timeline",
                    lambda: f"{shlex.join(speech)} && {shlex.join(face)}",
                    lambda: not stale_targets(self.targets), run)

    def text_shards(self) -> Step:
        targets = [] if self.remeasure else ["--targets", str(self.targets)]
        argv = self.python("-m", "data.prepare", "--raw", str(self.raw), "--out", str(self.shards),
                           "--text-only", *targets, "--overwrite")
        what = "no reply targets: the text evaluation reads none" if self.remeasure else "with reply targets"
        return self.command_step(f"text-only shards ({what})", argv,
                                 lambda: (self.shards / "manifest.json").is_file())

    # -- training -------------------------------------------------------------------------------------------

    def train(self, stage: str, workdir: Path, data: str, init_from: str | None) -> Step:
        """A training stage, done when its last step is saved. Stopped before it (a preemption: the trainer
        checkpoints and exits 0), the run stops with status 3 rather than export it or start the next."""
        from empatheia_jax.train.checkpoint import stage_finished

        sample = self.work / "shards"
        common = ["--workdir", str(workdir), f"--config.model.backbone={self.work / 'smollm2'}"]
        on_ed = [f"--config.data.features_like={sample}", f"--config.data.shards={self.shards}"]
        chained = [f"--config.stage={stage}", f"--config.init_from={init_from}"]
        if data == "coe":
            what, flags = "on EmpatheticDialogues", ["configs/smollm2_ed.py", *common, *on_ed,
                                                     *self.overrides]
        elif data == "ed":
            what, flags = "on the ED replies' targets", [
                "configs/smollm2_ed_avatar.py", *chained, *common, *on_ed,
                f"--config.checkpoint.every={self.args.ed_ckpt_every}"]
        else:  # the demo's config with the CS of the ED stages (configs/smollm2_ed_sample.py)
            what, flags = "on the sample", ["configs/smollm2_ed_sample.py", *chained, *common,
                                            f"--config.data.shards={sample}"]
        argv = self.cli("train", "--config", *flags)

        def run() -> None:
            self.call(argv)
            if not stage_finished(workdir, stage):
                raise Stop(3, f"{stage} stopped before its last step (preempted): run the same command again "
                              "to resume")

        rerun = data == "coe" and bool(self.overrides)  # the trainer alone resolves the overrides
        return Step(f"stage {stage} {what} -> {workdir}", lambda: shlex.join(argv),
                    lambda: not rerun and stage_finished(workdir, stage), run)

    def coe_eval(self) -> Step:
        """A diagnostic (--nocoe_eval skips it): the card reports the final model's evaluation."""
        coe, report = self.dir / "coe", self.dir / "report"
        argv = self.dev_eval(coe, "--report", str(report), "--no_repeat_ngram_size", "4", "--score_emotions",
                             *self.eval_flags())
        return self.command_step(f"dev evaluation of the coe stage -> {report}", argv,
                                 lambda: fresh(report / "metrics.json", coe / "checkpoints"))

    # -- the export -----------------------------------------------------------------------------------------

    def export_last(self) -> Step:
        """The export is what gets evaluated, so the card's figures are those of the weights it ships. Chained
        from --coe_from, whose text model it keeps, it serves at --coe_from's prompt budget (data.max_len),
        at which its text figures were measured."""
        from empatheia_jax.eval.model_card import recorded_config

        a, max_len = self.args, []
        if a.coe_from:
            max_len = ["--max_len", str(recorded_config(a.coe_from)["data"]["max_len"])]
        argv = self.cli("export", "--ckpt", self.last, "--out", str(self.export), "--dtype", a.export_dtype,
                        *max_len, "--overwrite")
        return self.command_step(f"export of {self.last} ({a.export_dtype}) -> {self.export}", argv,
                                 lambda: fresh(self.heads, Path(self.last) / "checkpoints"))

    def copy_export(self) -> Step:
        """A re-measure's export: --coe_from's files, less the emotion head it carries (fitted again unless
        --head_from)."""
        source = Path(self.args.coe_from)

        def run() -> None:
            shutil.rmtree(self.export, ignore_errors=True)
            shutil.copytree(source, self.export)
            self.head.unlink(missing_ok=True)

        return Step(f"--coe_from's export, to be measured again -> {self.export}",
                    lambda: f"shutil.copytree({source}, {self.export}) less emotion_head.safetensors",
                    lambda: all(same_files(source / n, self.export / n)
                                for n in ("heads.safetensors", "adapter_model.safetensors")), run)

    def carries_text(self) -> bool:
        """Whether --coe_from's card already measured the text figures on these weights: every text figure is
        a function of the PEFT adapter, and the export's holds --coe_from's values exactly (the ED stages
        train the CS only; --sample_stages 0 keeps the sample stages from the added rows). Decided once the
        export exists; --text_eval measures them anyway."""
        if self._carried is None:
            if not self._carry_possible() or not self.heads.is_file():
                return False
            from empatheia_jax.eval.model_card import CardError, text_figures_from

            try:
                text_figures_from(self.export, self.args.coe_from)
                self._carried = True
            except CardError as e:
                self._carried = False
                print(f"{LOG} the text figures are measured again: {e}", file=sys.stderr, flush=True)
        return self._carried

    def _carry_possible(self) -> bool:
        a = self.args
        return bool(a.coe_from and not a.text_eval and (Path(a.coe_from) / "card.json").is_file())

    def _text_carried(self) -> str | None:
        """The skip reason of the steps that only the text figures need."""
        return f"the text figures are carried from {self.args.coe_from}" if self.carries_text() else None

    # -- the emotion head and the evaluations of the export -------------------------------------------------

    def fit_head(self) -> Step:
        """A probe over the model's reading of the dialogue, fitted on the train part with its C chosen on
        dev (empatheia_jax/eval/emotion_head.py); read only by the text evaluation."""
        argv = self.python("-m", "empatheia_jax.eval.fit_emotion_head", "probe", "--ckpt", str(self.export),
                           "--shards", str(self.shards), "--json", str(self.dir / "emotion_head_probe.json"),
                           *self.backbone())
        return self.command_step(f"emotion head of the export (train part; C on dev) -> {self.head}", argv,
                                 lambda: fresh(self.head, self.heads), self._text_carried)

    def copy_head(self) -> Step:
        """--head_from: a head fitted to the same LLM (the ED stages train the CS only, so the coe stage's
        head still reads the same states)."""
        source = Path(self.args.head_from)
        return Step(f"emotion head from --head_from -> {self.head}",
                    lambda: f"shutil.copyfile({source}, {self.head})", lambda: same_files(source, self.head),
                    lambda: shutil.copyfile(source, self.head), self._text_carried)

    def avatar_eval(self) -> Step:
        a, report = self.args, self.dir / "report_avatar.json"
        argv = self.dev_eval(self.export, "--template", "ccl", "--nogenerate", "--speech_examples",
                             str(a.speech_examples), "--video_examples", str(a.video_examples), "--json",
                             str(report))
        return self.command_step(f"the avatar on dev replies: the CS's content spoken and heard -> {report}",
                                 argv, lambda: fresh(report, self.heads))

    def final_eval(self) -> Step:
        """The longest step (hours on a CPU with drawn replies): it keeps a journal of its finished batches in
        the report folder, so running the command again after a kill resumes it (eval/journal.py)."""
        argv = self.dev_eval(self.export, "--template", "coe", "--report", str(self.final),
                             "--no_repeat_ngram_size", "4", "--score_emotions",
                             *shlex.split(self.args.reply_flags), *self.backbone(), *self.eval_flags())
        return self.command_step(f"dev evaluation of the export (CoE prompt) -> {self.final}", argv,
                                 lambda: fresh(self.final / "metrics.json", self.heads), self._text_carried)

    def head_weights(self) -> Step:
        out, predictions = self.dir / "emotion_head_weights.json", self.final / "predictions_coe.jsonl"
        argv = self.python("-m", "empatheia_jax.eval.fit_emotion_head", "weights", "--head", str(self.head),
                           "--predictions", str(predictions), "--shards", str(self.shards),
                           "--json", str(out))
        return self.command_step(f"the head's combination with step 2, chosen on dev predictions -> {out}",
                                 argv, lambda: fresh(out, predictions, self.head), self._text_carried)

    def subset_eval(self) -> Step:
        """The figure the project's test re-measures in CI time: the first CI_SUBSET dev records."""
        out = self.final / "subset.json"
        argv = self.dev_eval(self.export, "--template", "coe", "--max_examples", str(CI_SUBSET), "--json",
                             str(out), "--no_repeat_ngram_size", "4", "--score_emotions", *self.backbone(),
                             *self.eval_flags())
        return self.command_step(f"dev evaluation of the first {CI_SUBSET} records -> {out}", argv,
                                 lambda: fresh(out, self.heads, self.head), self._text_carried)

    # -- the model card -------------------------------------------------------------------------------------

    def card_flags(self) -> tuple[list[str], list[Path]]:
        """`model_card`'s flags and the files they read (the card is written again when one is newer)."""
        a = self.args
        if self.carries_text():
            flags, reads = ["--text_from", a.coe_from], [Path(a.coe_from) / "card.json"]
        else:
            reads = [self.final / "metrics.json", self.final / "subset.json",
                     self.dir / "emotion_head_weights.json"]
            flags = ["--metrics", str(reads[0]), "--subset_metrics", str(reads[1]), "--subset_examples",
                     str(CI_SUBSET), "--emotion_head_weights", str(reads[2])]
            # the stages that made --coe_from's adapter are this export's history too (its card's rows)
            if not self.remeasure and a.coe_from and (Path(a.coe_from) / "card.json").is_file():
                flags += ["--chained_from", a.coe_from]
        for _, workdir, _ in self.stages:
            flags += ["--workdir", str(workdir)]
        if self.remeasure:  # the same weights: its card's avatar figures and training rows
            flags += ["--avatar_from", a.coe_from]
            reads.append(Path(a.coe_from) / "card.json")
        else:
            flags += ["--avatar_metrics", str(self.dir / "report_avatar.json")]
            reads.append(self.dir / "report_avatar.json")
        return flags, [*reads, self.heads, self.head]

    def model_card(self) -> Step:
        def argv() -> list[str]:
            return self.python("-m", "empatheia_jax.eval.model_card", str(self.export), *self.card_flags()[0],
                               "--command", recipe_command(self.args, self.overrides),
                               "--device", self.args.device)

        return Step(f"model card -> {self.export}", lambda: shlex.join(argv()),
                    lambda: fresh(self.export / "card.json", *self.card_flags()[1]),
                    lambda: self.call(argv()))


# ----------------------------------------------------------------------------------------------------------
# Flags
# ----------------------------------------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse's own prints the usage first)
        self.exit(2, f"error: {message} (python launch/ed_reference.py --help)\n")


def parser() -> Parser:
    p = Parser(prog="python launch/ed_reference.py", allow_abbrev=False, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog="--config.FIELD=VALUE ... overrides reach the coe stage "
                      "(e.g. --config.schedule.coe.steps=1000).")
    add = p.add_argument
    add("rundir", help="the run folder, best outside the work tree (e.g. ~/runs/ed_reference)")
    add("--dry_run", action="store_true",
        help="print the plan (each step, done or to do, and the command or library call it makes) and run "
             "nothing")
    add("--work", default="work", help="`make demo`'s folder: WORK/smollm2, WORK/shards (default work)")
    add("--ed_csv", default="data/ed/empathetic_dialogues_validation.csv", help="the ED csv to import")
    add("--holdout", default="dev:0.15", help="the dev hold-out of whole conversations, dev:FRACTION")
    add("--ed_stages", default="ccl_units ccl",
        help="the avatar stages on ED after coe, in order (default 'ccl_units ccl': the CS from its units "
             "alone, then with r^t; 0 = none)")
    add("--sample_stages", default="sac",
        help="the stages on the sample, in order (default sac; 0 = none; 'sac overall' adds the joint stage, "
             "whose LoRA steps at the demo's lr 1e-3 on 64 sample dialogues undo the ED training: 41%% of "
             "dev replies repeat a 4-gram, docs/benchmarks.md)")
    add("--coe_from", default=None,
        help="a finished coe stage to chain from instead of training one: a workdir or a PEFT export, e.g. "
             "the committed reference model (above)")
    add("--head_from", default=None,
        help="an emotion_head.safetensors fitted to the same LLM (e.g. the committed reference's), copied "
             "into the export instead of fitting one")
    add("--text_eval", action="store_true",
        help="measure the text figures even when the export's adapter is --coe_from's (by default they are "
             "then carried from its card)")
    add("--nocoe_eval", dest="coe_eval", action="store_false",
        help="skip the coe stage's dev evaluation (a diagnostic: the card reports the final model's)")
    add("--ed_ckpt_every", type=int, default=50,
        help="the ED stages' checkpoint interval in steps (default 50: minutes on a CPU, 5-15 s a step)")
    add("--export_dtype", default="bfloat16",
        help="the stored dtype of the exported adapter and heads (default bfloat16, half the files of "
             "float32)")
    add("--reply_flags", default="--reply_temperature 0.7 --reply_top_p 0.95 --reply_candidates 16 --seed 0",
        help="how the final dev evaluation decodes the reply after the greedy CoE, as --reply_flags='...' "
             "(default the consensus of 16 replies drawn at T 0.7, top-p 0.95, seed 0: "
             "serve/reply_choice.py, chosen on dev; '' = greedy replies)")
    add("--eval_flags", default="", help="extra `empatheia eval` flags for the dev evaluations")
    add("--speech_examples", type=int, default=32,
        help="dev replies spoken and heard by Whisper in the avatar's evaluation (default 32)")
    add("--video_examples", type=int, default=16, help="dev replies drawn (default 16)")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    add("--device", default=f"{cores}-core CPU",
        help="the card's device line (default this machine's cores: '%(default)s')")
    add("--python", default=sys.executable, help="the Python that runs the steps (default this one)")
    return p


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """(flags, the --config overrides for the coe stage), checked: a bad one is a one-line error, exit 2."""
    p = parser()
    args, rest = p.parse_known_args(argv)
    bad = [a for a in rest if not (a.startswith("--config.") and "=" in a)]
    if bad:
        p.error(f"unrecognized argument {bad[0]!r} (only --config.FIELD=VALUE passes, to the coe stage)")
    for problem in flag_problems(args, rest):
        p.error(problem)
    return args, rest


def flag_problems(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    """What is wrong with the flags, found before anything runs (not after hours of coe)."""
    from empatheia_jax.eval.model_card import CardError, recorded_config
    from empatheia_jax.train.stages import get_stage
    from empatheia_jax.weights.export_hf import STORE_DTYPES

    problems = []
    name, _, fraction = args.holdout.partition(":")
    if name != "dev" or not _fraction(fraction):
        problems.append(f"--holdout {args.holdout}: expected dev:FRACTION with FRACTION in (0, 1) (the "
                        "evaluations read split dev)")
    for flag in ("ed_stages", "sample_stages"):
        for stage in stage_list(getattr(args, flag)):
            try:
                get_stage(stage)
            except ValueError as e:
                problems.append(f"--{flag}: {e}")
    if args.coe_from:
        try:
            recorded_config(args.coe_from)
        except CardError as e:
            problems.append(f"--coe_from: {e}")
        if overrides:
            problems.append(f"{overrides[0]}: --config overrides reach the coe stage, which --coe_from "
                            "replaces")
    elif args.text_eval:
        problems.append("--text_eval measures again what --coe_from's card would carry: give --coe_from")
    if args.head_from and not Path(args.head_from).is_file():
        problems.append(f"--head_from {args.head_from}: no such file")
    if args.export_dtype not in STORE_DTYPES:
        problems.append(f"--export_dtype {args.export_dtype}: expected one of {', '.join(STORE_DTYPES)}")
    for flag, least in (("ed_ckpt_every", 1), ("speech_examples", 0), ("video_examples", 0)):
        if getattr(args, flag) < least:
            problems.append(f"--{flag} {getattr(args, flag)}: must be at least {least}")
    for flag in ("reply_flags", "eval_flags"):
        try:
            shlex.split(getattr(args, flag))
        except ValueError as e:
            problems.append(f"--{flag}: {e}")
    return problems


def _fraction(text: str) -> bool:
    try:
        return 0.0 < float(text) < 1.0
    except ValueError:
        return False


def recipe_command(args: argparse.Namespace, overrides: Sequence[str]) -> str:
    """The command line the model card records: RUNDIR, each recipe flag not at its default, the overrides."""
    defaults, words = parser().parse_args([args.rundir]), ["python", "launch/ed_reference.py", args.rundir]
    for flag in RECIPE_FLAGS:
        value = getattr(args, flag)
        if value == getattr(defaults, flag):
            continue
        if isinstance(value, bool):
            words.append(f"--{flag}" if value else f"--no{flag}")
        else:
            words.append(f"--{flag}={value}")
    return shlex.join([*words, *overrides])


# ----------------------------------------------------------------------------------------------------------
# Running the plan
# ----------------------------------------------------------------------------------------------------------


def print_plan(ref: Reference, steps: list[Step]) -> None:
    print(f"{LOG} plan for {ref.dir} (dry run: nothing runs)")
    for need in ref.needs():
        print(f"needs {need}" + ("" if need.is_file() else " (missing: run `make demo`, or give --work)"))
    for note in ref.notes():
        print(f"note: {note}")
    for i, step in enumerate(steps, 1):
        print(f"{i:2d}. [{step.status()}] {step.name}")
        print(f"      {step.show()}")


def execute(ref: Reference, steps: list[Step]) -> None:
    missing = [need for need in ref.needs() if not need.is_file()]
    if missing:
        raise Stop(2, f"{missing[0]} is missing: run `make demo` first (or give --work)")
    for note in ref.notes():
        print(f"{LOG} {note}", flush=True)
    ref.dir.joinpath("ed").mkdir(parents=True, exist_ok=True)
    for step in steps:
        reason = step.skip()
        if reason or step.done():
            print(f"{LOG} {step.name}: {f'skipped ({reason})' if reason else 'done'}", flush=True)
            continue
        print(f"{LOG} {step.name}", flush=True)
        step.run()
    if ref.exports:
        print(f"{LOG} done: {ref.export} (chat: empatheia chat --ckpt {ref.export} --text ...)")


def main(argv: Sequence[str] | None = None) -> int:
    os.chdir(REPO)  # relative paths are the repository's, wherever the command was started
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # converters/ (the reply targets' done check)
    args, overrides = parse(sys.argv[1:] if argv is None else argv)
    ref = Reference(args, overrides)
    steps = ref.plan()
    if args.dry_run:
        print_plan(ref, steps)
        return 0
    # SIGTERM (a session's end, a scheduler) also reaches the trainer, which checkpoints and exits 0: wait for
    # it rather than die first; the stage's done check then stops the run (status 3).
    previous = signal.signal(signal.SIGTERM, lambda *_: print(f"{LOG} SIGTERM: waiting for the running step "
                                                              "to stop", file=sys.stderr, flush=True))
    try:
        execute(ref, steps)
    except Stop as e:
        print(f"{LOG} {e}", file=sys.stderr)
        return e.code
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
