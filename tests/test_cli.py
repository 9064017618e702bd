"""`empatheia train | eval | chat | export` as a newcomer runs them: real subprocesses on one tiny run.

- eval prints the metrics table and writes --json equal to `evaluate.evaluate/baselines/chance_levels` called
  in Python on the same checkpoint; chat writes OUT.npz/OUT.json equal to `chat.respond` in Python (both
  bit for bit: the reference calls run in a Python process of the CLI's environment, see REFERENCE).
- Quiet by default: no absl/orbax INFO lines on stderr (orbax logs through absl, which `app.run` sets to
  INFO); `--verbose` is accepted and `logs.configure` lets library INFO through only when asked.
- Every user error exits 2 with ONE stderr line `error: ...` naming the flag, key or file, and no traceback.

- `eval --data FILE.csv` imports an EmpatheticDialogues csv, prepares it text-only and scores the coe
  checkpoint on the CoE prompt (the stage it was trained for), equal to `evaluate.evaluate(template="coe")` on
  the same dialogues; `--template` overrides the stage.
- `eval --asr` scores the model on the split prepared again with Whisper's transcripts as history texts and
  reports the input WER; a csv (no audio) is refused by name.

One training run (stage coe, 1 step of the `tiny` config) is shared by the module. Error cases that fail
before the model is loaded cost ~1-3 s each; the few that need the loaded model (unreadable media, prompt
too long, missing encoder entry, a media template on text-only data) ~7 s.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import make_tiny_shards, read_shard_split, saved_smollm2_tokenizer
from test_text_only import ED_UIDS, write_ed_csv

REPO = Path(__file__).resolve().parents[1]
ABSL_INFO = re.compile(r"^I\d{4} \d\d:\d\d:\d\d")  # absl's prefix: I1125 07:21:24.838946 ...


def cli(env, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "empatheia_jax.cli", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


def ok(p: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return p


def stderr_lines(text: str) -> list[str]:
    """Non-empty stderr lines; tqdm redraws with carriage returns, so those split lines too."""
    return [line for line in re.split(r"[\r\n]", text) if line.strip()]


def assert_quiet(stderr: str) -> None:
    lines = stderr_lines(stderr)
    noisy = [line for line in lines if ABSL_INFO.match(line) or "INFO" in line]
    assert not noisy, f"{len(noisy)} INFO lines, e.g. {noisy[:3]}"


def assert_user_error(p: subprocess.CompletedProcess, *names: str) -> str:
    """Exit 2, one stderr line `error: ...` naming every one of `names`, no traceback, nothing on stdout."""
    lines = stderr_lines(p.stderr)
    assert p.returncode == 2, (p.returncode, p.stderr[-4000:])
    assert "Traceback" not in p.stderr, p.stderr[-4000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for name in names:
        assert str(name) in lines[0], (name, lines[0])
    assert p.stdout == ""
    return lines[0]


# ----------------------------------------------------------------------------------------------------------
# One tiny trained run
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> str:
    return saved_smollm2_tokenizer(tmp_path_factory)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return make_tiny_shards(tmp_path_factory.mktemp("cli_data"), real_targets=True)


@pytest.fixture(scope="module")
def media(shards) -> Path:
    return shards.parent / "raw" / "media"


@pytest.fixture(scope="module")
def trained(tok, shards, cli_env, tmp_path_factory):
    """(workdir, the train process): stage coe, one step; the model has every head (untrained but CS/SD)."""
    workdir = tmp_path_factory.mktemp("cli_run") / "coe"
    p = ok(cli(cli_env, "train", "--config", REPO / "configs" / "tiny.py", f"--config.model.tokenizer={tok}",
               f"--config.data.shards={shards}", f"--workdir={workdir}", "--config.stage=coe",
               "--config.schedule.coe.steps=1", "--config.optim.warmup_steps=0"))
    return workdir, p


@pytest.fixture(scope="module")
def ed_csv(tmp_path_factory) -> Path:
    """A small EmpatheticDialogues-format csv (4 turns of 3 conversations, and one dropped for its label)."""
    return write_ed_csv(tmp_path_factory.mktemp("ed") / "my_dialogues_test.csv")


@pytest.fixture(scope="module")
def ed_shards(ed_csv, tmp_path_factory) -> Path:
    """The csv's text-only shards, prepared by the library in a cache of their own (not the CLI's)."""
    from empatheia_jax.data.ed import convert_ed_csv, dumps
    from empatheia_jax.data.prepare import cached_text_only_shards

    text = dumps(convert_ed_csv(str(ed_csv)).dialogues)
    return cached_text_only_shards(text, tmp_path_factory.mktemp("ed_cache"), split="test", progress=False,
                                   log=lambda _: None)[0]


@pytest.fixture(scope="module")
def chat_inputs(media, tmp_path_factory) -> dict:
    """A turn with speech and video after a two-utterance history (the first with media, the second none)."""
    history = tmp_path_factory.mktemp("chat_in") / "history.json"
    history.write_text(json.dumps([
        {"role": "speaker", "utterance": "My dog died.", "audio": str(media / "diatest0utt0_5.wav"),
         "video": str(media / "diatest0utt0_5.mp4")},
        {"role": "listener", "utterance": "Oh no, tell me more."},
    ]))
    return {"text": "I feel so alone today.", "audio": str(media / "diatest1utt2_7.wav"),
            "video": str(media / "diatest1utt2_7.mp4"), "history": str(history), "max_new_tokens": 3}


# The library calls the CLI must equal, made in a Python process of the same environment as the CLI's (one CPU
# device, XLA optimisation off, the session's compilation cache): equal programs, so the values can be
# compared exactly where XLA is deterministic, and the pytest process never builds the model.
REFERENCE = """
import json, sys
import numpy as np
from empatheia_jax.data.shard_reader import ShardReader
from empatheia_jax.eval import baselines, evaluate, report
from empatheia_jax.eval import speech as speech_eval
from empatheia_jax.eval import video as video_eval
from empatheia_jax.serve import chat
from empatheia_jax.serve.decoding import Decoding
from empatheia_jax.serve.history import load_history
from empatheia_jax.serve.load import load_trained
from empatheia_jax.serve.prompt import encoder_from_manifest

workdir, shards, out, inputs = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
ed_shards = sys.argv[5]
model, tokenizer, config, meta = load_trained(workdir)
speech = speech_eval.SpeechEval(shards, "test", train_split=config.data.train_split, examples=16,
                                progress=False)
video = video_eval.VideoEval(shards, "test", train_split=config.data.train_split, examples=6, progress=False)
# a text corpus has no recordings: its gold speech is spoken from the gold targets, as make_sample made it
from empatheia_jax.generators.kokoro_voices import to_pcm16
spoken = [to_pcm16(speech._gold_from_targets(it)) / 32768.0 for it in speech.items]
gold_gap = max(float(np.abs(a - b).max()) for a, b in zip(spoken, speech.gold, strict=True))
columns = {"trained": evaluate.evaluate(
    model, tokenizer, shards, "test", batch_size=4, max_len=int(config.data.max_len), generate_text=False,
    pipeline_overrides={"max_aud": int(config.data.max_aud), "max_vid": int(config.data.max_vid)},
    progress=False, speech=speech, video=video)}
columns["baseline"] = baselines.baselines(shards, "test", train_split=config.data.train_split,
                                          max_speech_len=model.config.max_speech_len,
                                          max_video_len=model.config.max_video_len)
split_records = {}
for part in (config.data.train_split, "test"):
    reader = ShardReader.for_split(shards, part)
    split_records[part] = [reader[i] for i in range(len(reader))]
train_part = config.data.train_split
columns["bag_of_words"] = baselines.bag_of_words(split_records[train_part], split_records["test"])
for rows in (speech, video):
    for name, values in rows.reference_columns().items():
        columns.setdefault(name, {}).update(values)
columns["chance"] = baselines.chance_levels(model.config)
overrides = {"max_aud": int(config.data.max_aud), "max_vid": int(config.data.max_vid)}
ed = evaluate.evaluate(model, tokenizer, ed_shards, "test", batch_size=4, max_len=int(config.data.max_len),
                       decoding=Decoding(max_new_tokens=4), pipeline_overrides=overrides, progress=False,
                       template="coe")
n = inputs["max_new_tokens"]
encoder = encoder_from_manifest(meta["encoder"])
r = chat.respond(model, tokenizer, text=inputs["text"], audio=inputs["audio"], video=inputs["video"],
                 history=load_history(inputs["history"]), encoder=encoder,
                 decoding=Decoding(max_new_tokens=n),
                 max_len=int(config.data.max_len) + n + 2 * model.config.n_signal + 2)
np.savez(out + ".npz", input_ids=r.input_ids, emotion_probs=r.emotion_probs, **r.features)
c = chat.respond(model, tokenizer, text=inputs["text"], encoder=encoder,
                 decoding=Decoding(max_new_tokens=12, repetition_penalty=0.05, no_repeat_ngram_size=2),
                 max_len=int(config.data.max_len) + 12 + 2 * model.config.n_signal + 2)
np.savez(out + "_controls.npz", input_ids=c.input_ids, **c.features)
plain = chat.respond(model, tokenizer, text=inputs["text"], encoder=encoder,
                     decoding=Decoding(max_new_tokens=12),
                     max_len=int(config.data.max_len) + 12 + 2 * model.config.n_signal + 2)
json.dump({"eval": columns, "table": report.format_table(columns), "ed": ed, "text": r.text,
           "reply": r.reply, "emotion": r.emotion, "features": sorted(r.features), "controls_text": c.text,
           "plain_text": plain.text, "gold_gap": gold_gap, "gold_items": len(speech.items)},
          open(out + ".json", "w"))
"""


@pytest.fixture(scope="module")
def reference(trained, shards, chat_inputs, ed_shards, cli_env, tmp_path_factory) -> tuple[dict, dict]:
    """(json, arrays) of `evaluate.evaluate/baselines/chance_levels` and `chat.respond` on the trained run,
    and `evaluate.evaluate(template="coe")` on the ED csv's text-only shards."""
    out = tmp_path_factory.mktemp("reference") / "ref"
    p = subprocess.run([sys.executable, "-c", REFERENCE, trained[0], shards, out, json.dumps(chat_inputs),
                        ed_shards],
                       env=cli_env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-4000:]
    with np.load(f"{out}.npz") as z:
        arrays = {k: z[k] for k in z.files}
    with np.load(f"{out}_controls.npz") as z:
        arrays.update({f"controls_{k}": z[k] for k in z.files})
    return json.loads(Path(f"{out}.json").read_text()), arrays


def test_train_prints_its_result_and_no_library_info(trained):
    workdir, p = trained
    assert p.stdout.startswith(f"completed: step 1 in {workdir}")
    assert "eval/emp = " in p.stdout
    assert_quiet(p.stderr)
    assert "train coe" in p.stderr  # the progress bar still shows


def _tensorboard_scalars(folder: Path) -> dict[tuple[int, str], float]:
    """{(step, tag): value} of the scalar summaries in a folder's event files, read record by record (the
    TFRecord framing: length, its crc, the Event proto, its crc; tensorboard itself is not installed)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    out = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (n,) = struct.unpack_from("<Q", data, at)
            event = Event.FromString(data[at + 12 : at + 12 + n])
            at += 12 + n + 4
            for value in event.summary.value:
                out[(event.step, value.tag)] = value.simple_value
    return out


def test_train_logs_its_metrics_to_tensorboard_as_to_metrics_jsonl(trained):
    """TensorBoard's event files hold every scalar metrics.jsonl logs, at the same steps (tensorboardX is
    imported with torch hidden from it: `metrics._summary_writer_class`)."""
    workdir, _ = trained
    logged = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        step = record.pop("step")
        logged.update({(step, k): v for k, v in record.items()})
    scalars = _tensorboard_scalars(workdir / "tensorboard")
    tags = {tag.split("/")[0] for _, tag in logged}
    assert {"train", "eval"} <= tags, tags
    assert scalars.keys() == logged.keys()
    for key, value in logged.items():
        assert scalars[key] == pytest.approx(value, rel=1e-6), key


# ----------------------------------------------------------------------------------------------------------
# eval and chat end to end
# ----------------------------------------------------------------------------------------------------------


def test_eval_prints_the_table_and_its_json_equals_the_library(trained, shards, reference, cli_env, tmp_path):
    """--template overall overrides the stage the coe checkpoint was trained for: every head and row."""
    out = tmp_path / "nested" / "metrics.json"  # a missing parent folder is created
    p = ok(cli(cli_env, "eval", "--ckpt", trained[0], "--split", "test", "--nogenerate", "--batch_size", 4,
               "--json", out, "--template", "overall"))
    assert_quiet(p.stderr)
    assert "template: overall (--template)" in p.stderr
    # shards without recordings speak their gold targets: the very speech make_sample wrote (int16 rounding)
    assert reference[0]["gold_items"] > 0 and reference[0]["gold_gap"] <= 1 / 32768, reference[0]["gold_gap"]
    got, want = json.loads(out.read_text()), reference[0]["eval"]
    assert list(got) == ["trained", "baseline", "bag_of_words", "mean_style", "pipeline_tts", "gold",
                         "chance", "targets", "template", "shards", "split"]
    assert (got.pop("template"), got.pop("shards"), got.pop("split")) == ("overall", str(shards), "test")
    targets = got.pop("targets")
    assert targets == ("targets: speech_content=kokoro, video_content=face_render, speech_style=kokoro, "
                       "video_style=face_render")
    assert "emotion_acc_cls" in want["trained"] and "eval_loss" in want["trained"]
    # the speech and video rows: every test reply spoken / drawn from the model's features and from the two
    # references
    for column in ("trained", "mean_style", "pipeline_tts"):
        assert want[column]["speech_examples"] + want[column]["speech_unusable"] == 3, column
        assert {"speech_mcd", "speech_spk_sim", "speech_gender_acc", "speech_wer", "speech_cer"} <= want[
            column].keys(), column
        assert want[column]["video_examples"] == 3, column
        assert {"video_ssim", "video_m_lmd", "video_lip_sync", "video_gender_acc"} <= want[column].keys()
    # the frame-based style probe on the gold avatars: every attribute, near its ceiling, above one avatar;
    # Whisper tiny.en on the gold speech: the intelligibility floor, well below the 1-step model's. The
    # replies here are "test1 line 3: Oh no, tell me more.", a third of their words digits, which Whisper
    # writes as digits or words at will ("Test one line three") and the scoring leaves as written: those
    # cost 4 of 27 words (0.148), every other word is heard; natural replies reach < 0.15 in test_asr.py.
    assert want["gold"].keys() == {f"video_{a}_acc" for a in ("age", "gender", "timbre", "emotion")} | {
        "speech_wer", "speech_cer"}
    assert want["gold"]["speech_wer"] < 0.25 and want["gold"]["speech_cer"] < 0.2, want["gold"]
    assert want["trained"]["speech_wer"] > want["gold"]["speech_wer"] + 0.3, (want["trained"], want["gold"])
    assert want["gold"]["video_gender_acc"] > want["pipeline_tts"]["video_gender_acc"], want["gold"]
    # the pinned avatar (what chat --listener draws had the user chosen each record's listener profile): the
    # probes, fitted on gold voices and faces, read the profile chosen, whatever emotion the 1-step SD guesses
    pinned = {k: v for k, v in want["trained"].items() if "_pinned_" in k}
    assert pinned.keys() == {f"speech_pinned_{a}_acc" for a in ("age", "gender", "timbre")} | {
        f"video_pinned_{a}_acc" for a in ("age", "gender", "timbre", "emotion")}
    assert min(v for k, v in pinned.items() if "emotion" not in k) >= 0.9, pinned
    assert not [k for c in ("mean_style", "pipeline_tts", "gold") for k in want[c] if "_pinned_" in k]
    for column in want:  # same programs (same XLA flags, the shared compilation cache): bit-identical
        assert got[column].keys() == want[column].keys(), column
        for k, v in want[column].items():
            assert got[column][k] == v, (column, k, got[column][k], v)
    # the printed table is the library's, then the lines saying which targets are real and what was scored
    assert p.stdout.strip() == (reference[0]["table"].strip() + "\n" + targets
                                + f"\ntemplate: overall; data: {shards} split test")
    assert "| emotion_acc_cls" in p.stdout and "| speech_content_l2" in p.stdout


def test_eval_data_csv_imports_prepares_and_scores_the_trained_stage(trained, reference, ed_csv, cli_env,
                                                                    tmp_path):
    """`eval --data FILE.csv` on the coe checkpoint: the csv is imported and prepared text-only into
    --data_cache, scored on the CoE prompt (the stage it was trained for) with every turn a row, and the
    result equals the library on the same dialogues prepared apart; no baseline (no train split)."""
    out, cache = tmp_path / "metrics.json", tmp_path / "cache"
    p = ok(cli(cli_env, "eval", "--ckpt", trained[0], "--data", ed_csv, "--data_cache", cache,
               "--batch_size", 4, "--max_new_tokens", 4, "--json", out))
    assert_quiet(p.stderr)
    got = json.loads(out.read_text())
    assert list(got) == ["trained", "chance", "targets", "template", "shards", "split"]
    assert (got["template"], got["split"], got["targets"]) == ("coe", "test", "targets: none")
    shards = Path(got["shards"])
    assert shards.name == "shards" and shards.parent.parent == cache
    assert shards.parent.name.startswith("test-avamerg7-")
    assert json.loads((shards / "manifest.json").read_text())["media"] == "none"
    for line in (f"imported {ed_csv} (EmpatheticDialogues csv) as split 'test': 3 dialogues, 4 turns; "
                 "1 csv quirk(s) skipped",
                 f"text-only shards ready in {shards}",
                 "template: coe (the stage this checkpoint was trained for)", "note: no baseline column"):
        assert line in p.stderr, line
    trained_col, want = got["trained"], reference[0]["ed"]
    assert trained_col == want  # same programs as the library call: bit-identical
    assert trained_col["num_examples"] == trained_col["num_generated"] == len(ED_UIDS)  # every turn
    assert trained_col["eval_loss"] == trained_col["emp"] > 0  # L_emp is the coe formula
    assert "speech_content_l2" not in trained_col and "emotion_acc_cls" not in trained_col  # no head ran
    assert "emotion_acc_text" in trained_col and "dist1_corpus" in trained_col
    # the report: one row per metric of the two columns, then targets and what was scored
    rows = [line.split("|")[1].strip() for line in p.stdout.splitlines() if line.startswith("| ")][1:]
    assert sorted(rows) == sorted(set(trained_col) | set(got["chance"]))
    assert p.stdout.strip().endswith(f"targets: none\ntemplate: coe; data: {shards} split test")


def test_emotion_head_fitted_chosen_and_scored_through_the_command_line(trained, ed_shards, cli_env,
                                                                        tmp_path):
    """`fit_emotion_head probe` fits the head to the coe checkpoint; `eval --emotion_head` adds its rows;
    `fit_emotion_head weights` chooses the combination on that eval's predictions, and the next eval's
    combined rows equal `emotion_head.combine` over the predictions it wrote. A missing head file is one
    error line."""
    from empatheia_jax.eval import emotion_head as eh

    def fit(*args):
        return subprocess.run([sys.executable, "-m", "empatheia_jax.eval.fit_emotion_head", *map(str, args)],
                              env=cli_env, capture_output=True, text=True, timeout=300, cwd=REPO)

    head = tmp_path / "head.safetensors"
    probe_args = ("probe", "--ckpt", trained[0], "--shards", ed_shards, "--train_split", "test",
                  "--dev_split", "test", "--features", tmp_path / "features.npz")
    p = ok(fit(*probe_args, "--out", head, "--json", tmp_path / "probe.json"))
    assert_quiet(p.stderr)
    assert "read test (prompts)" in p.stderr
    again = ok(fit(*probe_args, "--out", tmp_path / "again.safetensors"))  # the kept features: no model run
    assert "read test (prompts)" not in again.stderr
    np.testing.assert_array_equal(eh.EmotionHead.load(tmp_path / "again.safetensors").coef,
                                  eh.EmotionHead.load(head).coef)
    probe = json.loads((tmp_path / "probe.json").read_text())
    assert probe["train_records"] == probe["dev_records"] == len(ED_UIDS) and probe["c"] in eh.C_GRID
    assert eh.EmotionHead.load(head).head_weight is None

    def evaluate(report, *more):
        return ok(cli(cli_env, "eval", "--ckpt", trained[0], "--shards", ed_shards, "--split", "test",
                      "--template", "coe", "--batch_size", 4, "--max_new_tokens", 6, "--score_emotions",
                      "--emotion_head", head, "--report", report, *more))

    p = evaluate(tmp_path / "r1")
    assert_quiet(p.stderr)
    first = json.loads((tmp_path / "r1" / "metrics.json").read_text())["trained"]
    assert first["emotion32_acc_head"] == pytest.approx(probe["emotion32_acc_head"])  # the same reading
    assert "emotion32_acc_combined" not in first  # no weights chosen yet
    ok(fit("weights", "--head", head, "--predictions", tmp_path / "r1" / "predictions_coe.jsonl", "--shards",
           ed_shards, "--json", tmp_path / "weights.json"))
    weights = json.loads((tmp_path / "weights.json").read_text())
    assert "emotion32_acc_combined_cv" not in weights  # 4 records: fewer than the folds
    chosen = eh.EmotionHead.load(head)
    assert chosen.head_weight in eh.HEAD_WEIGHT_GRID and chosen.free_weight in eh.FREE_WEIGHT_GRID
    # Replies drawn after the greedy CoE leave every emotion field as it is; the report records the draw.
    evaluate(tmp_path / "r2", "--reply_temperature", 0.9, "--reply_candidates", 2, "--seed", 3)
    report = json.loads((tmp_path / "r2" / "metrics.json").read_text())
    assert report["reply_sampling"] == {"temperature": 0.9, "top_p": 0.95, "seed": 3, "candidates": 2}
    second = report["trained"]
    preds = [json.loads(x) for x in (tmp_path / "r2" / "predictions_coe.jsonl").read_text().splitlines()]
    a = eh.prediction_arrays(preds)
    combined = eh.combine(a["head"], a["scored"], a["free"], chosen.head_weight, chosen.free_weight)
    assert [p["emotion_fine_combined"] for p in preds] == combined.tolist()
    assert second["emotion32_acc_combined"] == pytest.approx(np.mean(combined == a["gold"]))
    # the greedy run's predictions, hence the same figures as the weights were chosen by
    assert second["emotion32_acc_combined"] == pytest.approx(weights["emotion32_acc_combined"])
    assert second["emotion_acc_combined"] == pytest.approx(weights["emotion_acc_combined"])
    p = cli(cli_env, "eval", "--ckpt", trained[0], "--shards", ed_shards, "--split", "test", "--template",
            "coe", "--emotion_head", tmp_path / "nope.safetensors")
    assert_user_error(p, "--emotion_head", "nope.safetensors")


def test_eval_report_with_per_class_plots_and_emotion_voting(trained, ed_csv, cli_env, tmp_path):
    """`--report` writes the Markdown report, metrics.json, the per-class tables and PNGs and each voter's
    predictions; `--vote_templates` / `--vote_ckpt` add the voters, and the vote rows equal a hand count of
    the majority over the voters' written predictions (earliest voter wins a tie, unparsed abstains)."""
    import collections

    from PIL import Image

    report = tmp_path / "report"
    p = ok(cli(cli_env, "eval", "--ckpt", trained[0], "--data", ed_csv, "--data_cache", tmp_path / "cache",
               "--batch_size", 4, "--max_new_tokens", 6, "--report", report, "--vote_templates", "ccl,coe",
               "--vote_ckpt", trained[0], "--max_examples", 3, "--score_emotions"))
    assert_quiet(p.stderr)
    assert f"report: {report / 'report.md'}" in p.stderr
    assert not (report / "generation.journal.jsonl").exists()  # resumable until written, then removed
    metrics = json.loads((report / "metrics.json").read_text())
    assert metrics["voters"] == ["coe", "template:ccl", "ckpt1:coe"]  # the main template is not voted twice
    voters = [[json.loads(x) for x in (report / f"predictions_{v}.jsonl").read_text().splitlines()]
              for v in metrics["voters"]]
    assert [len(v) for v in voters] == [3] * 3  # --max_examples: the first 3 of the 4 records, every voter
    assert metrics["trained"]["num_examples"] == metrics["trained"]["num_generated"] == 3
    unscored = [{k: v for k, v in p.items() if "scored" not in k and k != "emotion_label_logprobs"}
                for p in voters[0]]  # only the main template's predictions are scored
    assert voters[2] == unscored  # the same checkpoint on the same template: the same generations

    def hand_vote(key: str) -> float:
        hits = []
        for i, gold in enumerate(voters[0]):
            cast = [v[i][key] for v in voters if v[i][key] >= 0]
            counts = collections.Counter(cast)
            winner = next((c for c in cast if counts[c] == max(counts.values())), -1)
            hits.append(winner == gold["labels"][key])
        return sum(hits) / len(hits)

    trained_col = metrics["trained"]
    assert trained_col["num_voters"] == 3
    assert trained_col["emotion_acc_vote"] == pytest.approx(hand_vote("emotion"))
    assert trained_col["emotion32_acc_vote"] == pytest.approx(hand_vote("emotion_fine"))
    # --score_emotions: the scored rows recount from the written predictions
    scored = [p["emotion_fine_scored"] == p["labels"]["emotion_fine"] for p in voters[0]]
    assert trained_col["emotion32_acc_scored"] == pytest.approx(sum(scored) / len(scored))
    assert trained_col["emotion_scored_rate"] == pytest.approx(
        sum(p["emotion_fine_scored"] >= 0 for p in voters[0]) / len(voters[0]))
    # per class: the coe generations against their gold labels, by hand
    per_class = json.loads((report / "per_class.json").read_text())
    assert set(per_class) == {"emotion_text", "emotion32_text", "emotion32_scored"}  # coe runs no classifier
    from empatheia_jax.data.schema import EmotionMap

    classes = EmotionMap.load("avamerg7").classes
    by_class = collections.defaultdict(list)
    for pred in voters[0]:
        by_class[classes[pred["labels"]["emotion"]]].append(pred["emotion"] == pred["labels"]["emotion"])
    assert per_class["emotion_text"] == {c: {"accuracy": pytest.approx(sum(h) / len(h)), "n": len(h)}
                                         for c, h in by_class.items()}
    text = (report / "report.md").read_text()
    for plot in per_class:
        with Image.open(report / f"per_class_{plot}.png") as im:
            assert im.format == "PNG"
        assert f"![{plot}](per_class_{plot}.png)" in text
    assert "| emotion_acc_vote" in text and "emotion voting over 3 voters" in text


def test_eval_data_errors_are_one_line(trained, shards, ed_csv, cli_env, tmp_path):
    """A missing file, a csv that is not ED, an empty one, one with nothing to evaluate, --data with --shards
    and a missing split of a --data folder fail before the model loads; a media template on text-only data
    after it, naming the data and --template coe."""
    ckpt = trained[0]
    assert_user_error(cli(cli_env, "eval", "--ckpt", ckpt, "--data", tmp_path / "no.csv"),
                      f"--data {tmp_path / 'no.csv'}: no such file or folder")
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    assert_user_error(cli(cli_env, "eval", "--ckpt", ckpt, "--data", other), f"--data {other}",
                      "not an EmpatheticDialogues csv, missing columns")
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    assert_user_error(cli(cli_env, "eval", "--ckpt", ckpt, "--data", empty), f"--data {empty}", "empty file")
    header_only = write_ed_csv(tmp_path / "header.csv", conversations=())
    assert_user_error(cli(cli_env, "eval", "--ckpt", ckpt, "--data", header_only), f"--data {header_only}",
                      "no dialogue to evaluate")
    assert_user_error(cli(cli_env, "eval", "--ckpt", ckpt, "--data", ed_csv, "--shards", shards),
                      "--data or --shards, not both")
    assert_user_error(cli(cli_env, "eval", "--ckpt", ckpt, "--raw", tmp_path), "--raw", "it needs --asr")
    assert_user_error(cli(cli_env, "eval", "--ckpt", ckpt, "--data", shards, "--split", "nosuch"),
                      f"{shards} has no split 'nosuch'")
    assert_user_error(cli(cli_env, "eval", "--ckpt", ckpt, "--template", "bogus"), "--template")
    p = cli(cli_env, "eval", "--ckpt", ckpt, "--data", ed_csv, "--data_cache", tmp_path / "cache",
            "--template", "overall")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    line = [x for x in stderr_lines(p.stderr) if x.startswith("error: ")]
    assert len(line) == 1 and p.stdout == "", p.stderr[-3000:]
    for name in (str(tmp_path / "cache"), "split 'test'", "4 of 4 records are text-only",
                 "the overall template", "--template coe"):
        assert name in line[0], (name, line[0])


def test_eval_asr_reads_the_transcribed_shards_and_reports_the_input_wer(trained, shards, ed_csv, cli_env,
                                                                          tmp_path):
    """`eval --asr` on the run's own shards: the test split is prepared again under --data_cache with
    Whisper's transcripts as history texts (the tiny shards' speech is tones, in which Whisper hears nothing:
    each becomes "..."), the model is scored on those shards, the trained column carries input_wer /
    asr_utterances from the cache's summary, the baselines still come from the original shards' train split;
    a csv is refused by name."""
    out, cache = tmp_path / "metrics.json", tmp_path / "cache"
    p = ok(cli(cli_env, "eval", "--ckpt", trained[0], "--asr", "--data_cache", cache, "--nogenerate",
               "--speech_examples", 0, "--video_examples", 0, "--json", out))
    assert_quiet(p.stderr)
    got = json.loads(out.read_text())
    asr_shards = Path(got["shards"])
    assert asr_shards.name == "shards" and asr_shards.parent.parent == cache
    summary = json.loads((asr_shards.parent / "summary.json").read_text())
    assert got["asr"] == summary and summary["asr_utterances"] == 4  # test0 (1 turn), test1 (2 turns)
    assert got["trained"]["asr_utterances"] == 4.0
    assert got["trained"]["input_wer"] == summary["input_wer"] > 0  # tones are not the typed words
    heard = {r["utt_id"]: r for r in map(json.loads, Path(summary["transcripts"]).read_text().splitlines())}
    for rec in read_shard_split(asr_shards, "test"):
        for h in rec["history"]:
            want = heard[h["utt_id"]]["transcript"] or "..."
            assert h["utterance"] == want, (h, heard[h["utt_id"]])
    assert "baseline" in got and "input_wer" not in got["baseline"]  # fitted on the original train split
    line = [x for x in stderr_lines(p.stderr) if x.startswith("asr: ")]
    wer = summary["input_wer"]
    assert line == [f"asr: 4 history utterances heard by Whisper tiny.en, input WER {wer:.4f} "
                    f"against the typed text ({summary['asr_empty']} heard as nothing, 0 without speech left "
                    f"typed); shards {asr_shards}, transcripts {asr_shards.parent / 'transcripts.jsonl'}"]
    assert "| input_wer" in p.stdout and f"data: {asr_shards} split test" in p.stdout
    assert_user_error(cli(cli_env, "eval", "--ckpt", trained[0], "--asr", "--data", ed_csv),
                      f"--data {ed_csv}: --asr transcribes speech and a csv has no audio")
    moved = tmp_path / "moved_shards"  # shards whose raw folder moved: named before the model loads
    shutil.copytree(shards, moved)
    manifest = json.loads((moved / "manifest.json").read_text())
    (moved / "manifest.json").write_text(json.dumps({**manifest, "raw": str(tmp_path / "gone")}))
    assert_user_error(cli(cli_env, "eval", "--ckpt", trained[0], "--asr", "--shards", moved),
                      f"records the raw folder {tmp_path / 'gone'}, which does not exist")


def test_chat_writes_features_equal_to_respond(trained, reference, chat_inputs, cli_env, tmp_path):
    out = tmp_path / "reply"
    p = ok(cli(cli_env, "chat", "--ckpt", trained[0], "--text", chat_inputs["text"], "--audio",
               chat_inputs["audio"], "--video", chat_inputs["video"], "--history", chat_inputs["history"],
               "--max_new_tokens", chat_inputs["max_new_tokens"], "--out", out))
    assert_quiet(p.stderr)
    assert f"features -> {out}.npz" in p.stdout and "Reply:" in p.stdout
    js = json.loads(Path(f"{out}.json").read_text())
    with np.load(f"{out}.npz") as z:
        arrays = {k: z[k] for k in z.files}
    want, want_arrays = reference
    assert js["text"] == want["text"] and js["reply"] == want["reply"] and js["emotion"] == want["emotion"]
    # the same prompt, media features and decode
    np.testing.assert_array_equal(arrays["input_ids"], want_arrays["input_ids"])
    assert want["features"] == ["speech_content", "speech_style", "video_content", "video_style"]
    for k in [*want["features"], "emotion_probs"]:  # bit-identical, as for eval
        assert arrays[k].dtype == np.float32 and arrays[k].shape == want_arrays[k].shape, k
        np.testing.assert_array_equal(arrays[k], want_arrays[k], err_msg=k)


def test_chat_audio_only_turn_is_transcribed(trained, chat_inputs, cli_env, tmp_path):
    """`chat --audio` without --text: Whisper tiny.en's transcript of the speech is the utterance, printed
    first and recorded in OUT.json; neither --text nor --audio is a usage error."""
    import soundfile as sf

    from empatheia_jax.data.encoders import asr
    from empatheia_jax.generators.kokoro import SAMPLE_RATE
    from empatheia_jax.generators.kokoro_voices import gold_speech

    said = "My sister is moving to another country next week."
    wav = tmp_path / "said.wav"
    sf.write(wav, gold_speech(said, {"age": "middle-aged", "gender": "male", "timbre": "low"}, "sad")[0],
             SAMPLE_RATE)
    out = tmp_path / "heard"
    p = ok(cli(cli_env, "chat", "--ckpt", trained[0], "--audio", wav, "--video", chat_inputs["video"],
               "--max_new_tokens", 3, "--out", out))
    assert_quiet(p.stderr)
    [heard] = json.loads(Path(f"{out}.json").read_text())["input_transcripts"]
    assert heard["utterance_index"] == 0 and asr.word_error_rate([said], [heard["transcript"]]) < 0.15, heard
    assert p.stdout.startswith(f"heard (Whisper tiny.en, utterance 0): {heard['transcript']!r}"), p.stdout
    assert_user_error(cli(cli_env, "chat", "--ckpt", trained[0]), "chat needs --ckpt and --text (or --audio")


def test_chat_avatar_speaks_and_renders_the_reply_from_its_features(trained, chat_inputs, cli_env, tmp_path):
    """--avatar (implies --speak): Kokoro speaks the first T predicted content rows (T = the reply's phoneme
    rows, capped at max_speech_len) in the predicted style; the wav is exactly that synthesis (the bridge's
    `KokoroSpeech.speak`, durations capped), and not silence. The mp4 decodes at 25 fps with an audio track,
    one frame per 40 ms of the speech, drawn from the predicted C^v/S^v."""
    from empatheia_jax.generators import kokoro, registry
    from empatheia_jax.generators.kokoro_voices import to_pcm16
    from empatheia_jax.generators.speech_synth import read_wav

    out = tmp_path / "spoken"
    p = ok(cli(cli_env, "chat", "--ckpt", trained[0], "--text", chat_inputs["text"], "--max_new_tokens", 6,
               "--out", out, "--avatar"))
    assert_quiet(p.stderr)
    js = json.loads(Path(f"{out}.json").read_text())
    rows = js["speech_content_units"]
    assert js["speech_targets"] == "kokoro" and rows == registry.content_rows(js["reply"], "kokoro") >= 3
    assert f"-> {out}.wav" in p.stdout
    with np.load(f"{out}.npz") as z:
        content, style = z["speech_content"], z["speech_style"]
    sr, wav = read_wav(f"{out}.wav")
    assert sr == kokoro.SAMPLE_RATE and len(wav) > 0.1 * sr
    np.testing.assert_array_equal(wav, to_pcm16(registry.get("kokoro").speak(content, style, rows)))
    assert np.abs(wav).max() > 300  # not silence
    # Whisper tiny.en's transcript of that wav, its confidence and its WER against the reply, in OUT.json
    from empatheia_jax.data.encoders import asr

    heard = asr.shared().transcribe(wav, sr)
    assert js["speech_transcript"] == heard.text
    assert js["speech_transcript_confidence"] == pytest.approx(heard.confidence, abs=1e-9)
    want_wer = asr.word_error_rate([js["reply"]], [heard.text]) if asr.normalize(js["reply"]) else None
    assert js["speech_wer"] == want_wer
    assert f"heard by Whisper tiny.en: {heard.text!r}" in p.stdout
    assert js["video_targets"] == "face_render" and f"-> {out}.mp4" in p.stdout
    import av

    with av.open(f"{out}.mp4") as c:
        video, audio = c.streams.video[0], c.streams.audio[0]
        assert video.average_rate == 25 and audio.rate == kokoro.SAMPLE_RATE
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video)]
    assert len(frames) == -(-len(wav) * 25 // sr)


def test_export_then_chat_from_the_export_with_repetition_controls(trained, reference, chat_inputs, cli_env,
                                                                   tmp_path):
    """`empatheia export` writes a folder that `chat --ckpt` reads like the run itself, and chat's
    --repetition_penalty/--no_repeat_ngram_size reach the decode (equal to `chat.respond` with them; a penalty
    below 1 favours seen tokens, so the tiny model's reply surely changes)."""
    out = tmp_path / "export"
    p = ok(cli(cli_env, "export", "--ckpt", trained[0], "--out", out, "--merged"))
    assert_quiet(p.stderr)
    assert f"-> {out}" in p.stdout and (out / "empatheia_config.json").is_file()
    reply = tmp_path / "reply"
    ok(cli(cli_env, "chat", "--ckpt", out, "--text", chat_inputs["text"], "--max_new_tokens", 12,
           "--repetition_penalty", 0.05, "--no_repeat_ngram_size", 2, "--out", reply))
    want, want_arrays = reference
    assert want["controls_text"] != want["plain_text"], "the controls must change this reply to be tested"
    assert json.loads(Path(f"{reply}.json").read_text())["text"] == want["controls_text"]
    with np.load(f"{reply}.npz") as z:
        np.testing.assert_array_equal(z["input_ids"], want_arrays["controls_input_ids"])
        for k in want["features"]:  # merged LoRA: equal up to float rounding (tests/test_export_empatheia.py)
            np.testing.assert_allclose(z[k], want_arrays[f"controls_{k}"], atol=1e-4, err_msg=k)
    # Bad use: both formats, an existing folder, a PEFT adapter for a random backbone, a bad control.
    assert_user_error(cli(cli_env, "export", "--ckpt", trained[0], "--out", tmp_path / "x", "--peft",
                          "--merged"), "--peft or --merged")
    assert_user_error(cli(cli_env, "export", "--ckpt", trained[0], "--out", out, "--merged"), str(out))
    assert_user_error(cli(cli_env, "export", "--ckpt", trained[0], "--out", tmp_path / "y"), "random")
    assert_user_error(cli(cli_env, "chat", "--ckpt", out, "--text", "hi", "--no_repeat_ngram_size=-1"),
                      "no_repeat_ngram_size")


# ----------------------------------------------------------------------------------------------------------
# Logging
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("verbose", [False, True])
def test_logs_configure_hides_library_info_unless_verbose(cli_env, verbose):
    """Under absl (as in `empatheia`: absl's handler on the root logger at INFO) and for absl's own logger."""
    code = f"""
import logging, sys
from absl import app, logging as absl_logging
from empatheia_jax import logs

def main(argv):
    logs.configure(verbose={verbose})
    logging.getLogger("orbax.checkpoint").info("orbax-info")
    absl_logging.info("absl-info")
    logging.getLogger("jax._src.x").warning("jax-warning")
    logging.getLogger("empatheia_jax.train.trainer").info("ours-info")

app.run(main, argv=["x"])
"""
    p = subprocess.run([sys.executable, "-c", code], env=cli_env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = stderr_lines(p.stderr)
    assert "ours-info" in lines  # our own messages: plain, always shown
    assert any("jax-warning" in line for line in lines)
    shown = [w for w in ("orbax-info", "absl-info") if w in p.stderr]
    assert shown == (["orbax-info", "absl-info"] if verbose else [])


# ----------------------------------------------------------------------------------------------------------
# User errors: exit 2, one line, no traceback
# ----------------------------------------------------------------------------------------------------------


def test_flag_errors_are_one_line(trained, cli_env, tmp_path):
    ckpt = trained[0]
    assert_user_error(cli(cli_env, "eval", "--ckpt", ckpt, "--bogus=1"), "Unknown command line flag 'bogus'")
    assert_user_error(cli(cli_env, "eval", "--ckpt", ckpt, "--batch_size=abc"), "--batch_size=abc")
    assert_user_error(cli(cli_env, "chat", "--ckpt", ckpt, "--text", "hi", "--max_new_tokens=0"),
                      "--max_new_tokens=0")
    assert_user_error(cli(cli_env, "chat", "--ckpt", ckpt, "--text", "hi", "--avatar", "--listener",
                          "old,male,mid"), "--listener 'old,male,mid'", "age 'old'")
    assert_user_error(cli(cli_env, "chat", "--ckpt", ckpt, "--text", "hi", "--listener", "young,female,mid"),
                      "--listener", "--speak or --avatar")
    assert_user_error(cli(cli_env, "eval"), "eval needs --ckpt")
    assert_user_error(cli(cli_env, "frobnicate"), "unknown command 'frobnicate'")
    config = REPO / "configs" / "tiny.py"
    line = assert_user_error(cli(cli_env, "train", "--config", config, "--config.optim.lrr=1",
                                 f"--workdir={tmp_path / 'w'}"), "--config.optim.lrr=1", "config.optim")
    assert "did you mean lr" in line
    assert_user_error(cli(cli_env, "train", "--config", tmp_path / "nope.py", f"--workdir={tmp_path / 'w'}"),
                      f"--config {tmp_path / 'nope.py'}: no such file")
    # --verbose is a flag of every command (here with an error that comes before any library logs)
    assert_user_error(cli(cli_env, "chat", "--ckpt", ckpt, "--text", "hi", "--audio", tmp_path / "no.wav",
                          "--verbose"), f"--audio {tmp_path / 'no.wav'}")


def test_config_error_is_one_line_naming_every_key(tok, shards, cli_env, tmp_path):
    p = cli(cli_env, "train", "--config", REPO / "configs" / "tiny.py", f"--config.model.tokenizer={tok}",
            f"--config.data.shards={shards}", f"--workdir={tmp_path / 'bad'}", "--config.optim.lr=-0.5",
            "--config.optim.b2=3")
    assert_user_error(p, "config.optim.lr=-0.5: must be > 0", "config.optim.b2=3.0")
    assert not (tmp_path / "bad").exists()
    # A split the shards do not have fails before any step, not at the first evaluation.
    p = cli(cli_env, "train", "--config", REPO / "configs" / "tiny.py", f"--config.model.tokenizer={tok}",
            f"--config.data.shards={shards}", f"--workdir={tmp_path / 'bad'}", "--config.data.eval_split=dev")
    assert_user_error(p, "data.eval_split='dev': no such split", "manifest.json")
    assert not (tmp_path / "bad").exists()


def test_missing_or_incomplete_checkpoint(trained, cli_env, tmp_path):
    assert_user_error(cli(cli_env, "eval", "--ckpt", tmp_path / "nothere"),
                      f"--ckpt {tmp_path / 'nothere'}: no such file or directory")
    interrupted = tmp_path / "run" / "checkpoints" / "3.orbax-checkpoint-tmp-1"
    interrupted.mkdir(parents=True)  # what a write killed before its commit leaves
    assert_user_error(cli(cli_env, "chat", "--ckpt", tmp_path / "run", "--text", "hi"),
                      f"--ckpt {tmp_path / 'run' / 'checkpoints'}", "interrupted")
    assert_user_error(cli(cli_env, "eval", "--ckpt", trained[0], "--step", 7), "no complete step 7")


def test_missing_or_corrupt_shards(trained, shards, cli_env, tmp_path):
    """An explicit --shards is checked before the model loads (manifest, split, shard files' footers)."""
    ckpt = trained[0]
    assert_user_error(cli(cli_env, "eval", "--ckpt", ckpt, "--shards", tmp_path / "none"),
                      f"shards folder {tmp_path / 'none'} does not exist")
    broken = tmp_path / "shards"
    shutil.copytree(shards, broken)
    shard = next((broken / "test").glob("*.array_record"))
    shard.write_bytes(shard.read_bytes()[:100])  # a truncated copy
    assert_user_error(cli(cli_env, "eval", "--ckpt", ckpt, "--shards", broken), str(shard))
    (broken / "manifest.json").write_text("{not json")
    assert_user_error(cli(cli_env, "eval", "--ckpt", ckpt, "--shards", broken),
                      f"{broken / 'manifest.json'}: invalid JSON")


def test_bad_history_file_fails_before_the_model_loads(trained, media, cli_env, tmp_path):
    ckpt = trained[0]
    bad_json = tmp_path / "h1.json"
    bad_json.write_text("[{")
    assert_user_error(cli(cli_env, "chat", "--ckpt", ckpt, "--text", "hi", "--history", bad_json),
                      f"history file {bad_json}: invalid JSON")
    missing = tmp_path / "h2.json"
    wav = str(media / "diatest0utt0_5.wav")
    entry = {"role": "speaker", "utterance": "x", "audio": wav, "video": "gone.mp4"}
    missing.write_text(json.dumps([entry]))
    assert_user_error(cli(cli_env, "chat", "--ckpt", ckpt, "--text", "hi", "--history", missing),
                      f"{missing}: entry 0: video file {tmp_path / 'gone.mp4'} does not exist")


def test_unreadable_media_is_named(trained, media, cli_env, tmp_path):
    """A valid file of the wrong kind (a .wav given as --video): the encoder's failure names the file."""
    wav = media / "diatest0utt0_5.wav"
    assert_user_error(cli(cli_env, "chat", "--ckpt", trained[0], "--text", "hi", "--video", wav,
                          "--max_new_tokens", 2, "--out", tmp_path / "reply"),
                      f"cannot read video file {wav}")


def test_too_long_prompt_names_the_text_and_the_limit(trained, cli_env, tmp_path):
    assert_user_error(cli(cli_env, "chat", "--ckpt", trained[0], "--text", "so sad " * 200,
                          "--max_new_tokens", 2, "--out", tmp_path / "reply"),
                      "--text", "config.data.max_len")


def test_checkpoint_without_encoder_entry_is_an_error(trained, cli_env, tmp_path):
    """chat's encoder comes from the checkpoint's manifest; none recorded is an error, not a guess."""
    copy = tmp_path / "run"
    shutil.copytree(trained[0], copy)
    meta_file = next((copy / "checkpoints").glob("*/meta/metadata"))
    meta = json.loads(meta_file.read_text())
    assert meta.pop("encoder")["name"] == "lite"
    meta_file.write_text(json.dumps(meta))
    assert_user_error(cli(cli_env, "chat", "--ckpt", copy, "--text", "hi", "--max_new_tokens", 2,
                          "--out", tmp_path / "reply"), f"--ckpt {copy}", "no 'encoder' entry")
