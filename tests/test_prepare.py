"""data/prepare.py, empatheia_jax/data/shard_format.py and the TFDS builder on a tiny synthetic AvaMERG
folder.

Every check compares values: record text/labels against the JSON, features against the encoder run
directly on the utterance's media, targets against TargetReader, TFDS examples against prepare's records.
"""

from __future__ import annotations

import shutil
import sys

import numpy as np
import pytest
from helpers import make_raw, read_shard_split, synthetic_dialogue

from data import prepare as prepare_cli
from empatheia_jax.data import prepare as prep
from empatheia_jax.data import schema, shard_writer
from empatheia_jax.data.encoders import get_encoder
from empatheia_jax.data.raw_splits import InvalidInputError
from empatheia_jax.data.shard_format import (
    ShardRecordError,
    decode_shard_record,
    load_manifest,
    verify_shards,
)
from empatheia_jax.data.targets import TargetReader, make_standin_targets

SPLITS = {
    "train": [
        synthetic_dialogue("c1", "sad", 2),
        synthetic_dialogue("c2", "joyful", 3, spk=(3, "child", "male", "mid")),
    ],
    "valid": [synthetic_dialogue("c3", "terrified", 1)],
}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("prep")
    raw = make_raw(root / "raw", SPLITS)
    make_standin_targets(raw, raw / "targets", progress=False)
    out = root / "shards"
    manifest = prep.prepare(
        raw, out, targets=raw / "targets", records_per_shard=2, progress=False, command="test"
    )
    return raw, out, manifest


def test_records_match_json_media_and_targets(prepared):
    raw, out, manifest = prepared
    enc = get_encoder("lite")
    em = schema.EmotionMap.load("avamerg7")
    targets = TargetReader(raw / "targets")
    assert manifest == load_manifest(out)
    assert manifest["encoder"] == {"name": "lite", "config": enc.config()}
    assert manifest["features"] == {"k": 1, "audio_dim": enc.audio_dim, "video_dim": enc.video_dim}
    assert manifest["targets"]["stand_in"] is True
    assert all(v["source"] == "stand-in" for v in manifest["targets"]["kinds"].values())
    assert list(manifest["splits"]) == ["train", "valid"]  # sample_meta.json is no split
    for split, objs in SPLITS.items():
        recs = read_shard_split(out, split)
        assert len(recs) == manifest["splits"][split]["records"] == sum(len(o["turns"]) for o in objs)
        assert manifest["targets"]["coverage"][split] == {k: len(recs) for k in targets.kinds}
        by_uid = {r["uid"]: r for r in recs}
        for obj in objs:
            d = schema.Dialogue.from_json(obj)
            for j, turn in enumerate(obj["turns"]):
                r = by_uid[f"{d.conversation_id}:{j}"]
                assert r["split"] == split and r["turn"] == j and r["topic"] == obj["topic"]
                assert [h["utterance"] for h in r["history"]] == [
                    u["utterance"] for u in turn["dialogue_history"]
                ]
                assert [h["role"] for h in r["history"]] == [u["role"] for u in turn["dialogue_history"]]
                assert r["response"] == turn["response"]
                assert r["coe"] == {k: turn["chain_of_empathy"][k] for k in r["coe"]}
                assert r["labels"] == schema.labels_for(d, j, em)
                assert r["listener_profile"] == obj["listener_profile"]
                assert r["response_utt_id"] == schema.response_utterance_id(d, j)
                for i, h in enumerate(r["history"]):
                    assert h["utt_id"] == schema.turn_utterances(d, j)[i][0]
                    np.testing.assert_array_equal(
                        r["audio_feats"][i], enc.encode_audio(raw / "media" / f"{h['utt_id']}.wav")
                    )
                    np.testing.assert_array_equal(
                        r["video_feats"][i], enc.encode_video(raw / "media" / f"{h['utt_id']}.mp4")
                    )
                assert (
                    set(r["targets"])
                    == set(targets.kinds)
                    == {"speech_content", "video_content", "speech_style", "video_style"}
                )
                for kind, a in r["targets"].items():
                    np.testing.assert_array_equal(a, targets.get(kind, r["response_utt_id"]))
    # spot-check label values themselves (not only agreement with schema.labels_for)
    r0 = {r["uid"]: r for r in read_shard_split(out, "valid")}["c3:0"]
    assert r0["labels"]["emotion"] == schema.EMOTIONS_7.index("fear")
    assert r0["labels"]["gender"] == schema.GENDERS.index("male") and r0["labels"][
        "age"
    ] == schema.AGES.index("elderly")


def test_manifest_hashes_verify_and_corruption_is_named(prepared, tmp_path):
    _, out, manifest = prepared
    assert verify_shards(out) == []
    shards = manifest["splits"]["train"]["shards"]
    assert len(shards) == 3 and [s["records"] for s in shards] == [2, 2, 1]
    copy = tmp_path / "shards"
    shutil.copytree(out, copy)
    victim = copy / shards[1]["path"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0xFF
    victim.write_bytes(bytes(data))
    problems = verify_shards(copy)
    assert len(problems) == 1 and str(victim) in problems[0] and "sha256" in problems[0]
    # a corrupt record names shard and index
    with pytest.raises(ShardRecordError, match=r"train-00001-of-00003\.array_record record 7: corrupt"):
        decode_shard_record(b"\xc1garbage", shard=victim, index=7)
    good = (copy / shards[0]["path"]).read_bytes()
    from array_record.python.array_record_module import ArrayRecordReader

    rec_bytes = ArrayRecordReader(str(copy / shards[0]["path"])).read([0])[0]
    with pytest.raises(ShardRecordError, match="record 0"):
        decode_shard_record(rec_bytes[: len(rec_bytes) // 2], shard=copy / shards[0]["path"], index=0)
    assert good  # untouched shard still readable
    # leftovers and a missing manifest are reported too
    (copy / "train" / "train-00009-of-00010.array_record").write_bytes(b"x")
    assert any("not listed" in p for p in verify_shards(copy))
    (copy / "manifest.json").unlink()
    assert "manifest.json does not exist" in verify_shards(copy)[0]


def test_invalid_input_fails_listing_problems_or_skips(tmp_path):
    bad_emotion = synthetic_dialogue("bad1", "zzzunknown", 1)
    no_media = synthetic_dialogue("bad2", "sad", 2)
    raw = make_raw(
        tmp_path / "raw",
        {"train": [synthetic_dialogue("ok1", "sad", 2), bad_emotion, no_media]},
        skip_media={"diabad2utt2_1"},
    )
    out = tmp_path / "out"
    with pytest.raises(InvalidInputError) as e:
        prep.prepare(raw, out, progress=False)
    msg = str(e.value)
    assert "bad1" in msg and "zzzunknown" in msg and "bad2" in msg and "diabad2utt2_1.wav" in msg
    assert "--skip-invalid" in msg and not (out / "manifest.json").exists()
    assert prepare_cli.main(["--raw", str(raw), "--out", str(out), "--no-progress"]) == 2

    # stand-in targets are made for the valid dialogues only (bad2 lacks media) and joined
    m = prep.prepare(raw, out, skip_invalid=True, targets=tmp_path / "tg", make_standin=True, progress=False)
    assert m["splits"]["train"]["records"] == 2 and m["splits"]["train"]["dialogues"] == 1
    assert m["targets"]["stand_in"] and m["targets"]["coverage"]["train"]["speech_content"] == 2
    assert m["skipped"]["count"] == 2 and m["skipped"]["report"] == "skipped_report.txt"
    report = (out / "skipped_report.txt").read_text()
    assert (
        "train\tbad1" in report
        and "zzzunknown" in report
        and "train\tbad2" in report
        and "diabad2utt2_1" in report
    )
    assert {r["uid"] for r in read_shard_split(out, "train")} == {"ok1:0", "ok1:1"}
    assert verify_shards(out) == []


def test_conversation_in_two_splits_is_an_error(tmp_path):
    d = synthetic_dialogue("dup", "sad", 1)
    raw = make_raw(tmp_path / "raw", {"train": [d], "test": [d]})
    with pytest.raises(InvalidInputError, match="must not span splits"):
        prep.prepare(raw, tmp_path / "out", skip_invalid=True, progress=False)


def test_cli_overwrite_interrupt_and_workers(prepared, tmp_path, monkeypatch):
    raw, out_ref, _ = prepared
    out = tmp_path / "out"
    args = ["--raw", str(raw), "--out", str(out), "--targets", str(raw / "targets"), "--no-progress"]
    assert prepare_cli.main([*args, "--records-per-shard", "1", "--workers", "2"]) == 0
    m = load_manifest(out)
    assert m["command"].startswith("python -m data.prepare --raw") and m["timing"]["workers"] == 2
    assert len(m["splits"]["train"]["shards"]) == 5
    # workers=2 gives exactly the records of the in-process run
    for split in ("train", "valid"):
        a, b = read_shard_split(out, split), read_shard_split(out_ref, split)
        assert [r["uid"] for r in a] == [r["uid"] for r in b]
        for ra, rb in zip(a, b, strict=True):
            np.testing.assert_array_equal(ra["audio_feats"], rb["audio_feats"])
            np.testing.assert_array_equal(ra["video_feats"], rb["video_feats"])
    assert prepare_cli.main(args) == 2  # refuses to overwrite without --overwrite
    assert prepare_cli.main([*args, "--overwrite", "--records-per-shard", "10"]) == 0
    assert sorted(p.name for p in (out / "train").iterdir()) == ["train-00000-of-00001.array_record"]
    assert verify_shards(out) == []
    # an interrupted run leaves no manifest and no temporary shards
    calls = {"n": 0}
    real = shard_writer.encode_shard_record

    def flaky(rec):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(rec)

    monkeypatch.setattr(shard_writer, "encode_shard_record", flaky)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(raw, out, overwrite=True, progress=False)
    assert not (out / "manifest.json").exists() and not list(out.glob("*/.*.tmp"))
    assert "does not exist" in verify_shards(out)[0]


def test_tfds_builder_without_tensorflow(prepared, tmp_path):
    with pytest.raises(ModuleNotFoundError):
        import tensorflow  # noqa: F401
    import tensorflow_datasets as tfds

    from data.tfds_avamerg import build, from_tfds_example

    raw, out, _ = prepared
    b = build(str(raw), str(tmp_path / "tfds"))
    assert b.info.file_format.value == "array_record"
    assert b.info.metadata["targets_stand_in"] is True
    ds = tfds.data_source("avamerg", data_dir=str(tmp_path / "tfds"))
    for split, objs in SPLITS.items():
        assert len(ds[split]) == sum(len(o["turns"]) for o in objs)
        ref = {r["uid"]: r for r in read_shard_split(out, split)}
        for i in range(len(ds[split])):
            got = from_tfds_example(ds[split][i])
            want = ref[got["uid"]]
            for key, v in want.items():
                if key == "targets":
                    assert set(got[key]) == set(v)
                    for kind in v:
                        np.testing.assert_array_equal(got[key][kind], v[kind])
                elif isinstance(v, np.ndarray):
                    np.testing.assert_array_equal(got[key], v)
                else:
                    assert got[key] == v, key
    assert "tensorflow" not in sys.modules
