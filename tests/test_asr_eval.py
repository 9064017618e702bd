"""`data.asr_shards.cached_asr_shards`, what `empatheia eval --asr` evaluates on: a split prepared again with
every history utterance's text replaced by Whisper tiny.en's transcript of its speech.

- A tiny raw AvaMERG folder whose history utterances are real speech (Kokoro's gold voices), one of them with
  a deliberately wrong text in the JSON: the ASR shards' history texts are the transcripts (the wrong text
  is replaced by what the speech says), everything else equals the original shards (features, replies,
  labels), and `input_wer` is jiwer's WER of the normalised transcripts against the typed texts.
- A second call reuses the cached folder without transcribing; a folder that fails `verify_shards` is rebuilt.
- A missing speech file, a moved raw folder or targets folder and text-only shards are errors naming them;
  `raw=` (`eval --raw`) gives a moved raw folder's new place.

~25 s on 2 cores: Kokoro speaks four sentences (~2 s each after loading), Whisper loads and hears them
twice (the rebuild), the lite encoder prepares two 5-record folders.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import make_raw, read_shard_split, require, synthetic_dialogue, write_gold_speech

from empatheia_jax.data import raw_layout
from empatheia_jax.data.asr_shards import TRANSCRIPTS, AsrShardsError, cached_asr_shards
from empatheia_jax.data.encoders import asr
from empatheia_jax.data.prepare import prepare

jiwer = require("jiwer", "the input WER of eval --asr")

SPEAKER = {"age": "young", "gender": "female", "timbre": "high"}
LISTENER = {"age": "elderly", "gender": "male", "timbre": "low"}
# (conversation, utterance index) -> (what the speech says, the text in the JSON)
WRONG = "I feel great about the weekend trip."
SAID = {
    ("test0", 0): "I lost my job today and I do not know what to do.",
    ("test0", 1): "Oh no, that sounds really hard. What happened?",
    ("test0", 2): "My manager told us the company is closing the office.",
    ("test1", 0): "My sister is moving to another country next week.",
}
TYPED = {**SAID, ("test0", 2): WRONG}  # the JSON's text of test0 utterance 2 is not what was said


def _dialogue(cid: str, n_turns: int) -> dict:
    d = synthetic_dialogue(cid, "sad", n_turns, spk=(1, *SPEAKER.values()), lst=(2, *LISTENER.values()))
    for turn in d["turns"]:
        for u in turn["dialogue_history"]:
            u["utterance"] = TYPED.get((cid, u["index"]), u["utterance"])
        turn["response"] = TYPED.get((cid, len(turn["dialogue_history"])), turn["response"])
    return d


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> dict:
    """The raw folder (history speech by Kokoro), its shards, and the first `cached_asr_shards` call."""
    root = tmp_path_factory.mktemp("asr_eval")
    raw = make_raw(root / "raw", {"test": [_dialogue("test0", 2), _dialogue("test1", 1)]})
    uids = {}
    for (cid, k), text in SAID.items():
        uid = raw_layout.utterance_id(cid, k, 1 if k % 2 == 0 else 2)
        uids[uid] = (cid, k)
        write_gold_speech(raw / "media" / f"{uid}.wav", text, SPEAKER if k % 2 == 0 else LISTENER)
    shards = root / "shards"
    prepare(raw, shards, records_per_shard=4, progress=False, command="tests", log=lambda _: None)
    logs: list[str] = []
    out, reused, summary = cached_asr_shards(shards, "test", root / "cache", progress=False, log=logs.append)
    return {"root": root, "raw": raw, "shards": shards, "uids": uids, "out": out, "reused": reused,
            "summary": summary, "logs": logs}


def _transcripts(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out.parent / TRANSCRIPTS).read_text().splitlines()]


def test_asr_shards_hold_the_transcripts_and_nothing_else_changes(prepared):
    out, uids = prepared["out"], prepared["uids"]
    assert not prepared["reused"] and out.name == "shards" and out.parent.name.startswith("asr-test-")
    rows = _transcripts(out)
    assert [r["utt_id"] for r in rows] == list(uids)  # every history utterance, in file order, once
    written = {}
    for r in rows:
        said, typed = SAID[uids[r["utt_id"]]], TYPED[uids[r["utt_id"]]]
        assert r["text"] == typed and 0.0 < r["confidence"] <= 1.0, r
        assert asr.word_error_rate([said], [r["transcript"]]) < 0.2, r  # the speech was heard
        assert r["written"] == r["transcript"]  # nothing empty here
        written[r["utt_id"]] = r["transcript"]
    wrong = next(r for r in rows if r["text"] == WRONG)
    assert asr.word_error_rate([WRONG], [wrong["transcript"]]) > 0.5, wrong  # the JSON's text is gone

    original = read_shard_split(prepared["shards"], "test")
    heard = read_shard_split(out, "test")
    assert [r["uid"] for r in heard] == [r["uid"] for r in original] and len(heard) == 3
    for a, b in zip(original, heard, strict=True):
        assert [h["utterance"] for h in b["history"]] == [written[h["utt_id"]] for h in b["history"]]
        assert [h["utterance"] for h in a["history"]] == [TYPED[uids[h["utt_id"]]] for h in a["history"]]
        # the gold reply keeps its typed text, also where the same utterance is heard later as history
        for key in ("response", "response_utt_id", "coe", "labels", "speaker_profile", "listener_profile"):
            assert a[key] == b[key], key
        for key in ("audio_feats", "video_feats"):
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)

    summary = prepared["summary"]
    refs = [asr.normalize(r["text"]) for r in rows]
    hyps = [asr.normalize(r["transcript"]) for r in rows]
    assert summary["input_wer"] == pytest.approx(jiwer.wer(refs, hyps), abs=1e-12)
    assert summary["input_wer"] > 0.1  # the wrong text costs at least its own words
    assert (summary["asr_utterances"], summary["asr_empty"], summary["asr_typed"], summary["asr_scored"]) == (
        4, 0, 0, 4)
    old = json.loads((prepared["shards"] / "manifest.json").read_text())
    new = json.loads((out / "manifest.json").read_text())
    for key in ("encoder", "emotion_map", "media", "features"):
        assert new[key] == old[key], key
    assert list(new["splits"]) == ["test"] and Path(new["raw"]) == out.parent / "raw"
    assert (out.parent / "raw" / "media").resolve() == (prepared["raw"] / "media").resolve()


def test_second_call_reuses_the_cache_and_a_broken_folder_is_rebuilt(prepared):
    logs: list[str] = []
    out, reused, summary = cached_asr_shards(prepared["shards"], "test", prepared["root"] / "cache",
                                             progress=False, log=logs.append)
    assert reused and out == prepared["out"] and summary == prepared["summary"]
    assert logs == [f"reusing ASR shards {out} (prepared earlier from the same speech and settings)"]
    next(out.glob("test/*.array_record")).unlink()
    out2, reused, summary = cached_asr_shards(prepared["shards"], "test", prepared["root"] / "cache",
                                              progress=False, log=lambda _: None)
    assert not reused and out2 == out and summary == prepared["summary"]
    assert [r["uid"] for r in read_shard_split(out, "test")] == [r["uid"] for r in read_shard_split(
        prepared["shards"], "test")]


def test_a_moved_raw_folder_is_given_with_raw(prepared, tmp_path):
    """Shards moved with their raw folder (another machine): `raw=` names its new place; the same speech
    gives the same cache key, so the transcripts made before are reused; a wrong `raw=` is named."""
    moved = tmp_path / "moved_raw"
    shutil.copytree(prepared["raw"], moved)
    shards = _shards_copy(prepared, tmp_path, raw=str(tmp_path / "gone"))
    with pytest.raises(AsrShardsError, match="give its new place with --raw"):
        cached_asr_shards(shards, "test", prepared["root"] / "cache", progress=False, log=lambda _: None)
    out, reused, summary = cached_asr_shards(shards, "test", prepared["root"] / "cache", progress=False,
                                             log=lambda _: None, raw=moved)
    assert reused and out == prepared["out"] and summary["input_wer"] == prepared["summary"]["input_wer"]
    with pytest.raises(AsrShardsError, match=re.escape(f"--raw {tmp_path / 'nope'} is not a folder")):
        cached_asr_shards(shards, "test", prepared["root"] / "cache", raw=tmp_path / "nope")


def _shards_copy(prepared: dict, tmp_path: Path, **manifest: object) -> Path:
    """A copy of the shards' manifest (all the checks read) with some entries replaced."""
    folder = tmp_path / "shards"
    folder.mkdir()
    m = json.loads((prepared["shards"] / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**m, **manifest}))
    return folder


def test_missing_speech_raw_or_targets_are_named(prepared, tmp_path):
    raw = tmp_path / "raw"
    shutil.copytree(prepared["raw"], raw)
    wav = raw / "media" / f"{next(iter(prepared['uids']))}.wav"
    wav.unlink()
    with pytest.raises(AsrShardsError, match=re.escape(f"utterance {wav.stem} has no speech file {wav}")):
        cached_asr_shards(_shards_copy(prepared, tmp_path, raw=str(raw)), "test", tmp_path / "c")
    shutil.rmtree(tmp_path / "shards")
    moved = tmp_path / "moved"
    why = re.escape(f"records the raw folder {moved}, which does not exist")
    with pytest.raises(AsrShardsError, match=why):
        cached_asr_shards(_shards_copy(prepared, tmp_path, raw=str(moved)), "test", tmp_path / "c")
    shutil.rmtree(tmp_path / "shards")
    gone = tmp_path / "targets"
    why = re.escape(f"records the targets folder {gone}, which does not exist")
    with pytest.raises(AsrShardsError, match=why):
        cached_asr_shards(_shards_copy(prepared, tmp_path, targets={"dir": str(gone)}), "test",
                          tmp_path / "c")
    shutil.rmtree(tmp_path / "shards")
    with pytest.raises(AsrShardsError, match=r"prepared text-only \(manifest media: none\)"):
        cached_asr_shards(_shards_copy(prepared, tmp_path, media="none"), "test", tmp_path / "c")
    shutil.rmtree(tmp_path / "shards")
    with pytest.raises(AsrShardsError, match=r"has no split 'valid'"):
        cached_asr_shards(_shards_copy(prepared, tmp_path), "valid", tmp_path / "c")
    assert not (tmp_path / "c").exists()  # nothing written before the checks pass
