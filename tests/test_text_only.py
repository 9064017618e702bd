"""Text-only data (issue 17): `data.prepare --text-only` / `--media optional`, the cache behind
`empatheia eval --data FILE.csv`, and evaluation templates on text-only shards.

- An EmpatheticDialogues csv written here is imported and prepared without media: every record's text,
  labels and CoE fields are checked against the csv, and its features are zero vectors per utterance.
- The shipped ED validation csv prepares text-only to the 5,707 turns docs/design.md states.
- `--media optional`: a dialogue with none of its media files is text-only; one with some of them and one
  missing still fails naming that file (a record that claims media must have them).
- Evaluation: the coe template on text-only shards gives exactly the metrics of the same dialogues prepared
  with media (the template reads no feature), and L_emp is its whole loss; a template with <Aud>/<Vid> on
  text-only shards fails before any batch, naming the folder, split and stage.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    FAST,
    load_smollm2_tokenizer,
    make_raw,
    read_shard_split,
    synthetic_dialogue,
    tiny_empatheia,
)

from data import import_ed as import_ed_cli
from data import prepare as prepare_cli
from empatheia_jax.data import ed as import_ed
from empatheia_jax.data import prepare as prep
from empatheia_jax.data import schema
from empatheia_jax.data.raw_splits import InvalidInputError
from empatheia_jax.data.shard_format import MissingMediaError, load_manifest, verify_shards

REPO = Path(__file__).resolve().parents[1]
ED_COLUMNS = ("conv_id", "utterance_idx", "context", "prompt", "speaker_idx", "utterance", "selfeval", "tags")

# (conv_id, emotion, prompt, utterances); speakers alternate 1 (speaker) / 2 (listener); commas are written
# as ED writes them (_comma_).
ED_CONVERSATIONS = (
    ("hit:1_conv:2", "sad", "My dog died, and I miss him.",
     ["My dog died last week.", "I am so sorry, that must be hard.", "It is. He was 14.",
      "Fourteen good years. Tell me about him?"]),
    ("hit:1_conv:3", "joyful", "I got the job!",
     ["Guess what, I got the job!", "Congratulations! You worked hard for it.", "Thanks so much."]),
    ("hit:2_conv:4", "terrified", "A car almost hit me.",
     ["A car nearly ran me over today.", "Oh no. Are you hurt?"]),
    ("hit:3_conv:5", "zzzunknown", "Something.", ["An unknown label.", "It is dropped."]),
)
# one turn per listener utterance; the unknown label is dropped by the importer
ED_UIDS = ["ed1c2:0", "ed1c2:1", "ed1c3:0", "ed2c4:0"]


def write_ed_csv(path: Path, conversations=ED_CONVERSATIONS) -> Path:
    """An EmpatheticDialogues-format csv (the real file's columns and escapes) of `conversations`."""
    with path.open("w", encoding="utf-8", newline="") as f:
        w = csv.writer(f, lineterminator="\r\n")
        w.writerow(ED_COLUMNS)
        for conv_id, emotion, prompt, utts in conversations:
            for k, text in enumerate(utts):
                w.writerow([conv_id, k + 1, emotion, prompt.replace(",", "_comma_"), 1 + k % 2,
                            text.replace(",", "_comma_"), "", ""])
    return path


@pytest.fixture(scope="module")
def ed_shards(tmp_path_factory) -> Path:
    """The csv above imported (data.import_ed) into RAW without any media folder, then `--text-only`."""
    root = tmp_path_factory.mktemp("ed")
    csv_path = write_ed_csv(root / "my_dialogues_test.csv")
    assert import_ed_cli.main(["--csv", str(csv_path), "--out", str(root / "raw"), "--quiet"]) == 0
    assert prepare_cli.main(["--raw", str(root / "raw"), "--out", str(root / "shards"), "--text-only",
                      "--no-progress"]) == 0
    return root / "shards"


def test_text_only_prepare_of_an_imported_ed_csv(ed_shards):
    m = load_manifest(ed_shards)
    assert m["media"] == "none" and m["encoder"] is None
    assert m["features"] == {"k": 0, "audio_dim": 0, "video_dim": 0}
    assert list(m["splits"]) == ["test"]  # named from the file
    info = m["splits"]["test"]
    assert info["records"] == info["text_only_records"] == 4 and info["text_only_dialogues"] == 3
    assert verify_shards(ed_shards) == []
    recs = {r["uid"]: r for r in read_shard_split(ed_shards, "test")}
    assert sorted(recs) == ED_UIDS
    em = schema.EmotionMap.load("avamerg7")
    for conv_id, emotion, prompt, utts in ED_CONVERSATIONS[:3]:
        cid = import_ed.ed_conversation_id(conv_id)
        listener_turns = [k for k in range(1, len(utts)) if k % 2 == 1]
        for j, k in enumerate(listener_turns):
            r = recs[f"{cid}:{j}"]
            assert [h["utterance"] for h in r["history"]] == utts[:k]  # commas restored
            assert [h["role"] for h in r["history"]] == ["speaker" if i % 2 == 0 else "listener"
                                                         for i in range(k)]
            assert r["response"] == utts[k]
            assert r["coe"] == {"event_scenario": prompt, "speaker_emotion": emotion,
                                "emotion_cause": "", "goal_to_response": ""}
            assert r["labels"]["emotion"] == em.project(emotion) >= 0
            assert r["labels"]["age"] >= 0 and r["labels"]["timbre"] >= 0  # the importer's avatars
            for key in ("audio_feats", "video_feats"):  # no vector for any utterance: nothing pretends media
                assert r[key].dtype == np.float32 and r[key].shape == (k, 0, 0)
            assert r["targets"] == {}


def test_shipped_ed_validation_csv_prepares_text_only(tmp_path):
    """The real file (quirks and all): every imported turn becomes a record; the cache reuses the folder."""
    result = import_ed.convert_ed_csv(str(REPO / "data" / "ed" / "empathetic_dialogues_validation.csv"))
    text = import_ed.dumps(result.dialogues)
    logs: list[str] = []
    shards, reused = prep.cached_text_only_shards(text, tmp_path / "cache", split="valid", progress=False,
                                                  log=logs.append)
    assert not reused and shards.parent.name.startswith("valid-avamerg7-")
    m = load_manifest(shards)
    assert m["records"] == m["splits"]["valid"]["text_only_records"] == result.num_turns == 5707
    assert m["splits"]["valid"]["dialogues"] == 2755 and m["media"] == "none"
    # a second run on the same dialogues reuses the folder; another split name or a changed text does not
    again, reused = prep.cached_text_only_shards(text, tmp_path / "cache", split="valid", log=logs.append)
    assert (again, reused) == (shards, True) and any("reusing" in line for line in logs)
    assert load_manifest(again)["created"] == m["created"]
    # a damaged folder is rebuilt, not served
    shard = next((shards / "valid").glob("*.array_record"))
    shard.write_bytes(shard.read_bytes()[:-10])
    again, reused = prep.cached_text_only_shards(text, tmp_path / "cache", split="valid", progress=False,
                                                 log=logs.append)
    assert again == shards and not reused and verify_shards(shards) == []
    assert not list(shards.parent.glob(".shards.tmp-*"))


# ----------------------------------------------------------------------------------------------------------
# --media optional: per dialogue, none of its files = text-only; some of them = all of them
# ----------------------------------------------------------------------------------------------------------

FULL, NONE, PARTIAL = (synthetic_dialogue("full", "sad", 2), synthetic_dialogue("bare", "joyful", 1),
                       synthetic_dialogue("part", "terrified", 2))


@pytest.fixture(scope="module")
def optional_raw(tmp_path_factory) -> Path:
    bare = {u for u, _, _ in schema.dialogue_utterances(schema.Dialogue.from_json(NONE))}
    # "part" lacks only the .wav and .mp4 of its utterance 2
    return make_raw(tmp_path_factory.mktemp("optional") / "raw", {"train": [FULL, NONE, PARTIAL]},
                    skip_media=bare | {"diapartutt2_1"})


def test_media_optional_is_per_dialogue_and_a_missing_file_is_still_named(optional_raw, tmp_path):
    out = tmp_path / "out"
    # default (required): every dialogue without its media is a problem
    with pytest.raises(InvalidInputError) as e:
        prep.prepare(optional_raw, out, progress=False)
    assert "diabareutt0_1.wav" in str(e.value) and "diapartutt2_1.wav" in str(e.value)
    # optional: the bare dialogue is text-only, the partial one still fails naming both of its missing files
    with pytest.raises(InvalidInputError) as e:
        prep.prepare(optional_raw, out, progress=False, media="optional")
    msg = str(e.value)
    assert "diapartutt2_1.wav" in msg and "diapartutt2_1.mp4" in msg and "conversation part" in msg
    assert "bare" not in msg and e.value.problems == [p for p in e.value.problems if "part" in p]
    assert prepare_cli.main(["--raw", str(optional_raw), "--out", str(out), "--media", "optional",
                      "--no-progress"]) == 2
    assert not (out / "manifest.json").exists()

    m = prep.prepare(optional_raw, out, progress=False, media="optional", skip_invalid=True)
    assert m["media"] == "optional" and m["encoder"]["name"] == "lite"
    assert m["skipped"]["dialogues"] == [{"split": "train", "conversation_id": "part", "problems": 2}]
    info = m["splits"]["train"]
    assert (info["records"], info["text_only_records"], info["text_only_dialogues"]) == (3, 1, 1)
    recs = {r["uid"]: r for r in read_shard_split(out, "train")}
    assert sorted(recs) == ["bare:0", "full:0", "full:1"]
    bare = recs["bare:0"]  # zero vectors, in the encoder's widths
    assert bare["audio_feats"].shape == (1, 0, 96) and bare["video_feats"].shape == (1, 0, 526)
    enc = prep.get_encoder("lite")
    full = recs["full:1"]
    assert full["audio_feats"].shape == (3, 1, 96)
    for i, h in enumerate(full["history"]):
        np.testing.assert_array_equal(full["audio_feats"][i], enc.encode_audio(optional_raw / "media" /
                                                                              f"{h['utt_id']}.wav"))


def test_text_only_cli_flags(tmp_path, capsys):
    raw = tmp_path  # refused before RAW is read
    for bad in (["--text-only", "--encoder", "lite"], ["--text-only", "--media", "optional"],
                ["--text-only", "--k", "2"], ["--media", "optional", "--make-standin-targets"]):
        with pytest.raises(SystemExit) as e:
            prepare_cli.main(["--raw", str(raw), "--out", str(tmp_path / "o"), *bad])
        assert e.value.code == 2, bad
    assert "--text-only" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------
# Evaluation templates on text-only shards
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_smollm2_tokenizer(tmp_path_factory)


@pytest.fixture(scope="module")
def model(tok):
    """A tiny random Empatheia with every head and the lite encoder's feature dims (96, 526)."""
    return tiny_empatheia(tok, dims=(96, 526))


def test_eval_stage_follows_the_template(model):
    from empatheia_jax.models.empatheia_config import EmpatheiaConfig
    from empatheia_jax.train import stages

    cfg = model.config
    assert stages.TEMPLATES == ("coe", "ccl", "sac", "overall", "pipeline")
    assert stages.eval_stage(cfg) == stages.eval_stage(cfg, "overall") == stages.STAGES["overall"]
    coe = stages.eval_stage(cfg, "coe")
    assert (coe.name, coe.template_stage, coe.loss_terms, coe.heads) == ("coe", "coe", ("emp",), frozenset())
    assert stages.eval_stage(cfg, "sac").heads == {"sd"} and stages.eval_stage(cfg, "ccl").heads == {"cs"}
    assert stages.eval_stage(cfg, "pipeline") is stages.PIPELINE_BASELINE
    no_media = EmpatheiaConfig.from_dict({**cfg.to_dict(), "media_input": False})
    assert not stages.eval_stage(no_media, "overall").template_spec().has_media  # the model's ablation holds
    with pytest.raises(stages.TemplateError, match="template 'sac' cannot score this model"):
        stages.eval_stage(no_media, "sac")
    with pytest.raises(stages.TemplateError, match="unknown evaluation template 'stage5'"):
        stages.eval_stage(cfg, "stage5")
    from empatheia_jax.eval import run as eval_run

    assert eval_run.TEMPLATE_NAMES == stages.TEMPLATES


def test_coe_template_on_text_only_shards_equals_the_media_shards(model, tok, optional_raw, tmp_path):
    """The same dialogues prepared with media and without: the coe template reads only text, so every metric
    is identical; its loss formula is L_emp alone; the media templates refuse the text-only folder."""
    from empatheia_jax.data import input_pipeline as ip
    from empatheia_jax.eval import evaluate as ev
    from empatheia_jax.serve.decoding import Decoding

    media, text = tmp_path / "media", tmp_path / "text"
    prep.prepare(optional_raw, media, progress=False, skip_invalid=True)  # "full" only: the others lack media
    prep.prepare(optional_raw, text, progress=False, media="none")
    assert load_manifest(media)["splits"]["train"]["text_only_records"] == 0
    kw = dict(batch_size=2, max_len=256, decoding=Decoding(max_new_tokens=3), progress=False,
              compiler_options=FAST, template="coe")
    got = ev.evaluate(model, tok, text, "train", max_examples=2, **kw)  # records of "full" come first
    want = ev.evaluate(model, tok, media, "train", **kw)
    assert [r["uid"] for r in read_shard_split(text, "train")][:2] == ["full:0", "full:1"]
    assert got == want and got["num_examples"] == got["num_generated"] == 2
    assert got["eval_loss"] == pytest.approx(got["emp"]) and got["emp"] > 0
    assert not {"cls_emotion", "emotion_acc_cls", "speech_content_l2", "kl"} & got.keys()  # no head ran
    everything = ev.evaluate(model, tok, text, "train", generate_text=False, **kw)
    assert everything["num_examples"] == 5  # full: 2, bare: 1, part: 2

    for template in ("overall", "sac"):
        with pytest.raises(MissingMediaError) as e:
            ev.evaluate(model, tok, text, "train", **{**kw, "template": template})
        for name in (str(text), "split 'train'", "5 of 5 records are text-only", f"the {template} template",
                     "--template coe"):
            assert name in str(e.value), (name, str(e.value))
    with pytest.raises(MissingMediaError, match="the sac template"):  # the trainer's path too
        ip.make_dataset(text, "train", "sac", tok, batch_size=2, n_signal=4)
    # a folder written before text-only preparation (no `media` keys) counts as having every feature
    from empatheia_jax.data.shard_format import text_only_records

    assert text_only_records({"splits": {"train": {"records": 5}}}, "train") == 0
    assert text_only_records(load_manifest(text), "train") == 5
