"""AvaMERG schema: emotion maps, utterance ids, dataclass round trip, labels and the validator."""

from __future__ import annotations

import copy
import json
import os
import shutil
import wave

import numpy as np
import pytest
from helpers import require

from empatheia_jax.data import raw_layout, schema
from empatheia_jax.data.raw_layout import parse_utterance_id, utterance_id
from empatheia_jax.data.schema import (
    AGES,
    ED_EMOTIONS_32,
    EMOTIONS_7,
    Dialogue,
    EmotionMap,
    SchemaError,
    dialogue_utterances,
    labels_for,
    response_utterance_id,
    turn_utterances,
    validate_dialogues,
    validate_file,
)

# ---------------------------------------------------------------------------------------------- emotions


def test_vocabularies():
    assert EMOTIONS_7 == ("happy", "surprised", "angry", "fear", "sad", "disgusted", "contempt")
    assert len(ED_EMOTIONS_32) == 32 and list(ED_EMOTIONS_32) == sorted(set(ED_EMOTIONS_32))
    assert schema.SCHEMA_VERSION == 1
    assert AGES == ("child", "young", "middle-aged", "elderly")


def test_all_ed_labels_project_to_seven_classes():
    m = EmotionMap.load("avamerg7")
    assert m.classes == EMOTIONS_7
    got = {w: m.project(w) for w in ED_EMOTIONS_32}
    assert all(v is not None and 0 <= v < 7 for v in got.values()), got
    # spot values from the organisers' table
    assert got["terrified"] == EMOTIONS_7.index("fear")
    assert got["jealous"] == EMOTIONS_7.index("contempt")
    assert got["devastated"] == EMOTIONS_7.index("surprised")
    assert got["anxious"] == EMOTIONS_7.index("sad")
    assert [m.fine_index(w) for w in ED_EMOTIONS_32] == list(range(32))


def test_projection_words_aliases_and_unknowns():
    m = EmotionMap.load()
    assert m.project("sad") == 4  # a class name, not a key of the ED table
    assert m.project("  Sad ") == 4 and m.project("SAD.") == 4
    assert m.project("worried") == 4  # worried -> anxious -> sad
    assert m.class_name("Nervous") == "sad"
    assert m.project("fearful") == 3  # fearful -> afraid -> fear
    assert m.project("flabbergasted") is None
    assert m.project("tired") is None  # the organisers' alias table maps it to itself only
    assert m.project("") is None and m.project(None) is None and m.project(3) is None
    assert m.fine_index("worried") == ED_EMOTIONS_32.index("anxious")
    assert m.fine_index("happy") == -1 and m.fine_index("flabbergasted") == -1


def test_e3rg_map_differs_on_anxious():
    a, e = EmotionMap.load("avamerg7"), EmotionMap.load("e3rg8")
    assert e.classes == EMOTIONS_7 + ("neutral",)
    assert a.class_name("anxious") == "sad" and e.class_name("anxious") == "fear"
    assert e.class_name("nostalgic") == "neutral" and a.project("neutral") is None
    assert all(e.project(w) is not None for w in ED_EMOTIONS_32)
    with pytest.raises(ValueError, match="unknown emotion map"):
        EmotionMap.load("plutchik")


# ---------------------------------------------------------------------------------------- utterance ids


@pytest.mark.parametrize("k", [0, 9, 10, 123])
def test_utterance_id_round_trip(k):
    stem = utterance_id("01118", k, 28)
    assert stem == f"dia01118utt{k}_28"
    assert parse_utterance_id(stem) == ("01118", k, 28)
    assert parse_utterance_id(utterance_id("ed4c9-b", k, 0)) == ("ed4c9-b", k, 0)


@pytest.mark.parametrize("cid", ["", "a_b", "a b", "x/y", "gutter", "UTTx", "é1", "a.b"])
def test_bad_conversation_ids_rejected(cid):
    with pytest.raises(ValueError, match="conversation id"):
        utterance_id(cid, 0, 1)
    assert raw_layout.check_conversation_id(cid) is not None


@pytest.mark.parametrize(
    "stem",
    ["dia1utt2_3.wav", "dia1utt02_3", "dia1utt2", "xdia1utt2_3", "dia1utt2_3x", "diautt2_3", "dia1utt-2_3"],
)
def test_parse_rejects_malformed(stem):
    with pytest.raises(ValueError):
        parse_utterance_id(stem)


def test_utterance_id_rejects_bad_numbers():
    for k, pid in ((-1, 0), (0, -1), (True, 0), (1.0, 0)):
        with pytest.raises(ValueError):
            utterance_id("c1", k, pid)


# ------------------------------------------------------------------------------------- fixture dataset


def _utt(i, role, text):
    return {"index": i, "role": role, "utterance": text}


def _coe(emotion):
    return {
        "speaker_emotion": emotion,
        "event_scenario": "lost a job",
        "emotion_cause": "layoffs",
        "goal_to_response": "comfort",
    }


def _profile(age, gender, timbre, pid):
    return {"age": age, "gender": gender, "timbre": timbre, "ID": pid}


def _clean_dialogues() -> list[dict]:
    """Fresh objects every call, with no shared sub-objects (as if read from a file)."""
    return json.loads(json.dumps(_clean_dialogues_shared()))


def _clean_dialogues_shared() -> list[dict]:
    h = [
        _utt(0, "speaker", "I lost my job."),
        _utt(1, "listener", "Oh no."),
        _utt(2, "speaker", "Yes, today."),
    ]
    return [
        {
            "conversation_id": "01118",
            "speaker_profile": _profile("young", "male", "high", 28),
            "listener_profile": _profile("elderly", "female", "low", 5),
            "topic": "Life Events",
            "turns": [
                {
                    "context": "c",
                    "dialogue_history": h[:1],
                    "response": "Oh no.",
                    "chain_of_empathy": _coe("sad"),
                },
                {
                    "context": "c",
                    "dialogue_history": h,
                    "response": "I'm sorry.",
                    "chain_of_empathy": _coe("sad"),
                },
            ],
        },
        {
            "conversation_id": "abc-2",
            "speaker_profile": _profile("child", "female", "mid", 3),
            "listener_profile": _profile("middle-aged", "male", "mid", 4),
            "topic": "Support and Comfort",
            "turns": [
                {
                    "context": "c",
                    "dialogue_history": [_utt(0, "speaker", "I'm worried.")],
                    "response": "Why?",
                    "chain_of_empathy": _coe("Worried"),
                }
            ],
        },
        {
            "conversation_id": "x9",
            "speaker_profile": _profile("elderly", "male", "low", 10),
            "listener_profile": _profile("young", "female", "high", 11),
            "topic": "",
            "turns": [
                {
                    "context": "c",
                    "dialogue_history": h[:1],
                    "response": "Oh no.",
                    "chain_of_empathy": _coe("afraid"),
                },
                {
                    "context": "c",
                    "dialogue_history": h,
                    "response": "Hugs.",
                    "chain_of_empathy": _coe("afraid"),
                },
            ],
        },
    ]


def _write_wav(path: str) -> None:
    with wave.open(path, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((np.sin(np.arange(1600) * 0.1) * 3000).astype("<i2").tobytes())


def _write_mp4(path: str) -> None:
    av = require("av", "writes the test mp4")
    with av.open(path, "w") as c:
        s = c.add_stream("libx264" if "libx264" in av.codecs_available else "mpeg4", rate=25)
        s.width, s.height, s.pix_fmt = 16, 16, "yuv420p"
        for i in range(4):
            frame = av.VideoFrame.from_ndarray(np.full((16, 16, 3), 40 * i, np.uint8), format="rgb24")
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


@pytest.fixture(scope="module")
def raw_dir(tmp_path_factory) -> str:
    """RAW/{valid.json, media/} with one tiny real wav+mp4 per utterance of the clean dialogues."""
    root = tmp_path_factory.mktemp("raw")
    media = root / "media"
    media.mkdir()
    _write_wav(str(root / "proto.wav"))
    _write_mp4(str(root / "proto.mp4"))
    for obj in _clean_dialogues():
        for uid, _, _ in dialogue_utterances(Dialogue.from_json(obj)):
            shutil.copy(root / "proto.wav", media / f"{uid}.wav")
            shutil.copy(root / "proto.mp4", media / f"{uid}.mp4")
    (root / "valid.json").write_text(json.dumps(_clean_dialogues()), encoding="utf-8")
    return str(root)


def test_media_layout(raw_dir):
    names = sorted(os.listdir(os.path.join(raw_dir, "media")))
    assert len(names) == 2 * (4 + 2 + 4)
    assert "dia01118utt3_5.mp4" in names and "dia01118utt2_28.wav" in names and "diaabc-2utt1_4.wav" in names


def test_clean_dataset_has_no_problems(raw_dir):
    m = EmotionMap.load()
    media = raw_layout.media_dir_of(raw_dir)
    assert validate_dialogues(_clean_dialogues(), source="valid.json", media_dir=media, emotion_map=m) == []
    assert validate_file(raw_layout.split_json_path(raw_dir, "valid"), media) == []


def test_every_planted_fault_is_reported(raw_dir, tmp_path):
    media = tmp_path / "media"
    shutil.copytree(os.path.join(raw_dir, "media"), media)
    objs = copy.deepcopy(_clean_dialogues())
    d1, d2, d3 = objs
    del d1["turns"][1]["response"]  # missing field
    d1["turns"][1]["dialogue_history"][2]["role"] = "narrator"  # unknown role
    os.remove(media / "dia01118utt1_5.wav")  # missing media (k=1 first appears as turn 0's response)
    (media / "dia01118utt0_28.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"junk" * 20)  # corrupt mp4
    (media / "diax9utt1_11.wav").write_bytes(b"RIFF\x10\x00\x00\x00WAVEjunkjunk")  # corrupt wav
    d2["listener_profile"]["age"] = "teen"  # bad age
    d2["speaker_profile"]["ID"] = "3"  # wrong type
    d2["turns"][0]["chain_of_empathy"]["speaker_emotion"] = "flabbergasted"  # unknown emotion word
    d2["turns"][0]["dialogue_history"][0]["utterance"] = "   "  # empty utterance
    d3["turns"][1]["dialogue_history"][2].update(index=3, role="listener")  # history index gap, media exists
    objs.append({**copy.deepcopy(d3), "conversation_id": "empty4", "turns": []})  # empty dialogue
    no_id = copy.deepcopy(_clean_dialogues()[1])
    del no_id["conversation_id"]
    objs.append(no_id)  # missing id: reported by list position, media not checked

    problems = validate_dialogues(
        objs, source="valid.json", media_dir=str(media), emotion_map=EmotionMap.load()
    )
    got = {(p.conversation_id, p.turn, p.key) for p in problems}
    assert got == {
        ("01118", 1, "turns[1].response"),
        ("01118", 1, "turns[1].dialogue_history[2].role"),
        ("01118", 0, "turns[0].response.media.wav"),
        ("01118", 0, "turns[0].dialogue_history[0].media.mp4"),
        ("x9", 0, "turns[0].response.media.wav"),
        ("abc-2", None, "listener_profile.age"),
        ("abc-2", None, "speaker_profile.ID"),
        ("abc-2", 0, "turns[0].chain_of_empathy.speaker_emotion"),
        ("abc-2", 0, "turns[0].dialogue_history[0].utterance"),
        ("x9", 1, "turns[1].dialogue_history"),
        ("empty4", None, "turns"),
        ("#4", None, "conversation_id"),
    }
    assert len(problems) == len(got)
    by_key = {(p.conversation_id, p.key): p for p in problems}
    assert "missing media file" in by_key["01118", "turns[0].response.media.wav"].message
    assert "dia01118utt1_5.wav" in by_key["01118", "turns[0].response.media.wav"].message
    assert "unreadable" in by_key["01118", "turns[0].dialogue_history[0].media.mp4"].message
    assert "unreadable" in by_key["x9", "turns[0].response.media.wav"].message
    assert "[0, 1, 3]" in by_key["x9", "turns[1].dialogue_history"].message
    assert "'flabbergasted'" in by_key["abc-2", "turns[0].chain_of_empathy.speaker_emotion"].message
    line = str(by_key["abc-2", "listener_profile.age"])
    assert (
        line.startswith("valid.json: conversation abc-2 turn - [listener_profile.age]:") and "'teen'" in line
    )

    # without the readability check, only existence is checked
    quick = validate_dialogues(
        objs, source="v", media_dir=str(media), emotion_map=EmotionMap.load(), check_media_readable=False
    )
    assert len(quick) == len(problems) - 2 and not any("unreadable" in p.message for p in quick)


def test_structural_faults_without_media():
    objs = _clean_dialogues()
    objs[0]["turns"][0]["dialogue_history"] = []  # empty turn
    objs[0]["turns"][1]["chain_of_empathy"].pop("goal_to_response")
    objs[1]["turns"] = "nope"
    objs[2]["speaker_profile"]["gender"] = "robot"
    objs[2]["conversation_id"] = "has utt"
    objs.append(copy.deepcopy(objs[0]))  # duplicate id
    objs.append(["not", "a", "dialogue"])
    problems = validate_dialogues(objs, source="f.json", media_dir=None, emotion_map=EmotionMap.load())
    got = {(p.conversation_id, p.turn, p.key) for p in problems}
    assert got == {
        ("01118", 0, "turns[0].dialogue_history"),
        ("01118", 1, "turns[1].chain_of_empathy.goal_to_response"),
        ("abc-2", None, "turns"),
        ("has utt", None, "speaker_profile.gender"),
        ("has utt", None, "conversation_id"),
        ("01118", None, "conversation_id"),
        ("#4", None, ""),
    }
    # the duplicate's own two problems are reported under its id as well, plus the duplicate itself
    assert len(problems) == 9
    assert "duplicate of dialogue #0" in [p.message for p in problems if p.key == "conversation_id"][-1]


def test_validate_file_reports_json_errors(tmp_path):
    bad = tmp_path / "test.json"
    bad.write_text('[{"conversation_id": "1",}]', encoding="utf-8")
    (p,) = validate_file(bad)
    assert (p.file, p.key) == ("test.json", "json") and "line 1" in p.message
    assert "test.json" in str(p)
    bad.write_text('{"conversation_id": "1"}', encoding="utf-8")
    (p,) = validate_file(bad)
    assert "list of dialogues" in p.message
    (p,) = validate_file(tmp_path / "missing.json")
    assert p.key == "file" and p.file == "missing.json"


# ---------------------------------------------------------------------------- dataclasses and helpers


def test_round_trip_exact_layout_with_extra_keys():
    objs = _clean_dialogues()
    objs[0]["turns"][0]["turn_id"] = "t0"  # the paper's generation prompt has it; keep it
    objs[0]["speaker_profile"]["race"] = "Latino"
    for obj in objs:
        d = Dialogue.from_json(obj)
        assert d.to_json() == obj
        assert json.dumps(d.to_json()) == json.dumps(obj)  # same key order too
    assert Dialogue.from_json(objs[0]).turns[0].extra == {"turn_id": "t0"}


def test_from_json_lists_every_structural_problem():
    obj = _clean_dialogues()[0]
    del obj["topic"]
    obj["speaker_profile"]["ID"] = "28"
    obj["turns"][1]["dialogue_history"][0]["index"] = None
    with pytest.raises(SchemaError) as ei:
        Dialogue.from_json(obj, source="train.json")
    keys = {p.key for p in ei.value.problems}
    assert keys == {"topic", "speaker_profile.ID", "turns[1].dialogue_history[0].index"}
    assert "train.json" in str(ei.value)


def test_missing_coe_fields_load_as_empty_strings():
    obj = _clean_dialogues()[1]
    obj["turns"][0]["chain_of_empathy"] = {"speaker_emotion": "sad"}
    d = Dialogue.from_json(obj)
    assert (
        d.turns[0].chain_of_empathy.event_scenario == "" and d.turns[0].chain_of_empathy.emotion_cause == ""
    )


def test_utterance_helpers_and_labels():
    d = Dialogue.from_json(_clean_dialogues()[0])
    assert turn_utterances(d, 1) == [
        ("dia01118utt0_28", "speaker", "I lost my job."),
        ("dia01118utt1_5", "listener", "Oh no."),
        ("dia01118utt2_28", "speaker", "Yes, today."),
    ]
    assert response_utterance_id(d, 0) == "dia01118utt1_5"
    assert response_utterance_id(d, 1) == "dia01118utt3_5"
    assert [u[0] for u in dialogue_utterances(d)] == [
        "dia01118utt0_28",
        "dia01118utt1_5",
        "dia01118utt2_28",
        "dia01118utt3_5",
    ]
    m = EmotionMap.load()
    # listener profile: elderly female low
    assert labels_for(d, 0, m) == {
        "emotion": 4,
        "emotion_fine": ED_EMOTIONS_32.index("sad"),
        "age": 3,
        "gender": 1,
        "timbre": 0,
    }
    d2 = Dialogue.from_json(_clean_dialogues()[1])
    assert labels_for(d2, d2.turns[0], m) == {
        "emotion": 4,
        "emotion_fine": ED_EMOTIONS_32.index("anxious"),
        "age": 2,
        "gender": 0,
        "timbre": 1,
    }
    assert labels_for(d2, 0, EmotionMap.load("e3rg8"))["emotion"] == EMOTIONS_7.index("fear")
    d2.turns[0].chain_of_empathy.speaker_emotion = "flabbergasted"
    d2.listener_profile.timbre = "squeaky"
    assert labels_for(d2, 0, m) == {"emotion": -1, "emotion_fine": -1, "age": 2, "gender": 0, "timbre": -1}


def test_missing_media_dir_is_one_problem(tmp_path):
    problems = validate_dialogues(
        _clean_dialogues(), source="v.json", media_dir=str(tmp_path / "nope"), emotion_map=EmotionMap.load()
    )
    assert [(p.conversation_id, p.key) for p in problems] == [(None, "media_dir")]
