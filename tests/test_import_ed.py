"""EmpatheticDialogues importer: the real validation csv, its known quirks, and synthetic edge cases."""

from __future__ import annotations

import collections
import json
import os

import pytest

from data import import_ed as import_ed_cli
from empatheia_jax.data import ed as import_ed
from empatheia_jax.data.ed import (
    PROFILE_COMBOS,
    convert_ed_csv,
    dumps,
    ed_conversation_id,
    split_from_filename,
)
from empatheia_jax.data.schema import Dialogue, EmotionMap, validate_dialogues

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REAL_CSV = os.environ.get(
    "EMPATHEIA_ED_CSV", os.path.join(REPO, "data", "ed", "empathetic_dialogues_validation.csv")
)

# Found by inspecting the file: 5 rows swallow later raw lines (embedded newline); these leave 3
# conversations with utterance_idx gaps; 1 conversation has a single (speaker) utterance.
MERGED_ROWS = {  # conv_id -> physical line the merged csv row starts on
    "hit:4299_conv:8599": 4342,
    "hit:5003_conv:10007": 5171,
    "hit:9594_conv:19188": 8362,
    "hit:10142_conv:20284": 9098,
    "hit:10931_conv:21862": 10496,
}
GAPS = {"hit:4339_conv:8679", "hit:5003_conv:10007", "hit:10934_conv:21869"}
DROPPED = set(MERGED_ROWS) | GAPS | {"hit:5771_conv:11543"}
LOST_IN_MERGE = {
    "hit:4299_conv:8599": ["hit:4302_conv:8605", "hit:4327_conv:8654", "hit:4331_conv:8663"],
    "hit:10142_conv:20284": ["hit:10143_conv:20287", "hit:10147_conv:20294", "hit:10172_conv:20344"],
    "hit:10931_conv:21862": ["hit:10933_conv:21866"],
}


@pytest.fixture(scope="module")
def real():
    """The shipped csv (data/ed/) is always there: the real checks never skip."""
    return convert_ed_csv(REAL_CSV)


def test_real_counts(real):
    assert real.rows_read == 12030
    assert real.conversations_in == 2763
    assert len(real.dialogues) == 2763 - len(DROPPED) == 2755
    # one turn per listener utterance: floor(n/2) over the kept conversations
    assert real.num_turns == 5707
    assert len({d["conversation_id"] for d in real.dialogues}) == 2755


def test_real_output_is_valid(real):
    problems = validate_dialogues(
        real.dialogues, source="valid.json", media_dir=None, emotion_map=EmotionMap.load("avamerg7")
    )
    assert problems == []
    assert all(Dialogue.from_json(d).to_json() == d for d in real.dialogues[:50])


def test_real_quirks_are_exactly_the_known_ones(real):
    by_kind = collections.defaultdict(dict)
    for q in real.details:
        by_kind[q.kind].setdefault(q.conv_id, []).append(q)
    assert set(by_kind) == {"merged-row", "index-gap", "lost-in-merge", "dropped"}
    assert {c: qs[0].line for c, qs in by_kind["merged-row"].items()} == MERGED_ROWS
    assert set(by_kind["index-gap"]) == GAPS
    assert set(by_kind["dropped"]) == DROPPED
    for conv, lost in LOST_IN_MERGE.items():
        assert by_kind["lost-in-merge"][conv][0].message.endswith(", ".join(lost))
    assert set(by_kind["lost-in-merge"]) == set(LOST_IN_MERGE)
    assert len(real.quirks) == 5 + 3 + 3 + 8
    line = next(s for s in real.quirks if s.startswith("merged-row: conv_id=hit:4299_conv:8599"))
    assert "line 4342 (row 4341)" in line and "17 more raw csv line(s)" in line
    gap = next(s for s in real.quirks if s.startswith("index-gap: conv_id=hit:10934_conv:21869"))
    assert "[3, 4]" in gap
    kept = {d["conversation_id"] for d in real.dialogues}
    assert not kept & {ed_conversation_id(c) for c in DROPPED}


def test_real_content(real):
    text = dumps(real.dialogues)
    assert "_comma_" not in text
    d = real.dialogues[0]
    assert d["conversation_id"] == "ed3c6" and d["topic"] == ""
    assert [len(t["dialogue_history"]) for t in d["turns"]] == [1, 3]
    t0, t1 = d["turns"]
    scenario = (
        "Today,as i was leaving for work in the morning,i had a tire burst in the middle of a busy road. "
        "That scared the hell out of me!"
    )
    assert t0["context"] == scenario
    assert t0["chain_of_empathy"] == {
        "speaker_emotion": "terrified",
        "event_scenario": scenario,
        "emotion_cause": "",
        "goal_to_response": "",
    }
    assert t0["dialogue_history"] == [{"index": 0, "role": "speaker", "utterance": scenario}]
    assert t0["response"] == "Are you fine now?"
    assert t1["dialogue_history"][1:] == [
        {"index": 1, "role": "listener", "utterance": "Are you fine now?"},
        {"index": 2, "role": "speaker", "utterance": "Yeah,i'm doing alright now, but with minor injuries."},
    ]
    assert t1["response"] == "Cool :) Is your car damaged a lot?"
    # 32 ED labels all present and all projected
    assert len({t["chain_of_empathy"]["speaker_emotion"] for d in real.dialogues for t in d["turns"]}) == 32


def test_real_profiles_balanced(real):
    sp = collections.Counter(d["speaker_profile"]["ID"] for d in real.dialogues)
    lp = collections.Counter(d["listener_profile"]["ID"] for d in real.dialogues)
    assert set(sp) == set(lp) == set(range(24))
    assert max(sp.values()) - min(sp.values()) <= 1 and max(lp.values()) - min(lp.values()) <= 1
    assert all(d["speaker_profile"]["ID"] != d["listener_profile"]["ID"] for d in real.dialogues)
    for d in real.dialogues:
        for p in (d["speaker_profile"], d["listener_profile"]):
            assert (p["age"], p["gender"], p["timbre"]) == PROFILE_COMBOS[p["ID"]]
    pairs = collections.Counter(
        (d["speaker_profile"]["ID"], d["listener_profile"]["ID"]) for d in real.dialogues
    )
    assert len(pairs) == 24 * 23  # every ordered pair of distinct avatars occurs


def test_real_deterministic(real, tmp_path):
    again = convert_ed_csv(REAL_CSV)
    assert dumps(again.dialogues).encode() == dumps(real.dialogues).encode()
    assert again.quirks == real.quirks


def test_cli_writes_split_and_report(tmp_path):
    assert import_ed_cli.main(["--csv", REAL_CSV, "--out", str(tmp_path), "--quiet"]) == 0
    data = json.loads((tmp_path / "valid.json").read_text(encoding="utf-8"))
    assert len(data) == 2755
    report = (tmp_path / "valid.import_report.txt").read_text(encoding="utf-8")
    assert "sha256=6aadbcd9e1cf5b67958847aa7232577a9f938e1ca32374689bc654e77b6f7cd8" in report
    assert "dialogues written: 2755" in report and "turns written: 5707" in report
    assert sum(line.startswith("merged-row: ") for line in report.splitlines()) == 5


def test_holdout_is_whole_conversations_seeded_and_stable(real, tmp_path):
    """--holdout dev:0.2: whole conversations by a seeded hash of their id, disjoint, covering, about the
    fraction; the same seed gives the same split, and one conversation's side never depends on the others."""
    import hashlib

    kept, held = import_ed.holdout(real.dialogues, 0.2, seed=0)
    ids = [d["conversation_id"] for d in real.dialogues]
    assert sorted(d["conversation_id"] for d in kept + held) == sorted(ids)
    assert not {d["conversation_id"] for d in kept} & {d["conversation_id"] for d in held}
    assert 0.17 < len(held) / len(ids) < 0.23
    for d in real.dialogues[:50]:  # an independent recomputation of the rule
        u = int(hashlib.sha256(f"0:{d['conversation_id']}".encode()).hexdigest()[:16], 16) / 2**64
        assert (d in held) == (u < 0.2)
    half = {d["conversation_id"] for d in real.dialogues[::2]}
    assert import_ed.holdout(real.dialogues[::2], 0.2, seed=0)[1] == [d for d in held
                                                                       if d["conversation_id"] in half]
    assert import_ed.holdout(real.dialogues, 0.2, seed=1)[1] != held
    with pytest.raises(ValueError, match="fraction"):
        import_ed.holdout(real.dialogues, 1.0)

    args = ["--csv", REAL_CSV, "--out", str(tmp_path), "--quiet", "--holdout", "dev:0.2"]
    assert import_ed_cli.main(args) == 0
    assert json.loads((tmp_path / "dev.json").read_text()) == held
    assert json.loads((tmp_path / "valid.json").read_text()) == kept
    report = (tmp_path / "valid.import_report.txt").read_text()
    assert f"holdout: dev.json {len(held)} dialogues" in report
    for bad in ("dev", "dev:1.5", "valid:0.2", ":0.2", "dev:x"):
        with pytest.raises(SystemExit):
            import_ed_cli.main(["--csv", REAL_CSV, "--out", str(tmp_path / "bad"), "--quiet",
                                "--holdout", bad])


# ------------------------------------------------------------------------------------- synthetic cases

HEADER = "conv_id,utterance_idx,context,prompt,speaker_idx,utterance,selfeval,tags\r\n"


def _row(conv, idx, spk, text, emotion="sad", prompt="my dog died"):
    return f"{conv},{idx},{emotion},{prompt},{spk},{text},5|5|5_5|5|5,\r\n"


def test_synthetic_quirks(tmp_path):
    rows = [
        # clean, 3 utterances -> 1 turn; trailing speaker utterance is not a turn
        _row("hit:1_conv:2", 1, 7, "hi_comma_ there"),
        _row("hit:1_conv:2", 2, 8, "hello"),
        _row("hit:1_conv:2", 3, 7, "bye"),
        # speaker_idx does not alternate: kept, roles follow speaker_idx
        _row("hit:2_conv:4", 1, 1, "a"),
        _row("hit:2_conv:4", 2, 2, "b"),
        _row("hit:2_conv:4", 3, 2, "c"),
        _row("hit:2_conv:4", 4, 1, "d"),
        # three speakers: dropped
        _row("hit:3_conv:6", 1, 1, "a"),
        _row("hit:3_conv:6", 2, 2, "b"),
        _row("hit:3_conv:6", 3, 3, "c"),
        # empty utterance at idx 3: keep the 2 before
        _row("hit:4_conv:8", 1, 1, "a"),
        _row("hit:4_conv:8", 2, 2, "b"),
        _row("hit:4_conv:8", 3, 1, "  "),
        _row("hit:4_conv:8", 4, 2, "d"),
        # duplicate row and a short row
        _row("hit:5_conv:10", 1, 1, "a"),
        _row("hit:5_conv:10", 1, 1, "a again"),
        _row("hit:5_conv:10", 2, 2, "b"),
        "hit:5_conv:10,3,sad\r\n",
        # unknown emotion label
        _row("hit:6_conv:12", 1, 1, "a", emotion="bored"),
        _row("hit:6_conv:12", 2, 2, "b", emotion="bored"),
    ]
    path = tmp_path / "ed_train.csv"
    path.write_bytes((HEADER + "".join(rows)).encode())
    res = convert_ed_csv(str(path))
    kinds = sorted((q.kind, q.conv_id) for q in res.details)
    assert kinds == sorted(
        [
            ("speaker-order", "hit:2_conv:4"),
            ("speaker-order", "hit:3_conv:6"),
            ("dropped", "hit:3_conv:6"),
            ("empty-utterance", "hit:4_conv:8"),
            ("duplicate-row", "hit:5_conv:10"),
            ("bad-row", "hit:5_conv:10"),
            ("dropped", "hit:6_conv:12"),
        ]
    )
    assert next(q for q in res.details if q.kind == "duplicate-row").line == 17
    assert [d["conversation_id"] for d in res.dialogues] == ["ed1c2", "ed2c4", "ed4c8", "ed5c10"]
    d1, d2, d4, d5 = res.dialogues
    assert len(d1["turns"]) == 1 and d1["turns"][0]["dialogue_history"][0]["utterance"] == "hi, there"
    assert d1["turns"][0]["context"] == "my dog died"
    assert [t["response"] for t in d2["turns"]] == ["b", "c"]  # two consecutive listener utterances
    assert [u["role"] for u in d2["turns"][-1]["dialogue_history"]] == ["speaker", "listener"]
    assert len(d4["turns"]) == 1 and d4["turns"][0]["response"] == "b"
    assert d5["turns"][0]["dialogue_history"][0]["utterance"] == "a"
    assert [(d["speaker_profile"]["ID"], d["listener_profile"]["ID"]) for d in res.dialogues] == [
        (0, 1),
        (1, 2),
        (2, 3),
        (3, 4),
    ]
    assert validate_dialogues(res.dialogues, source="t", media_dir=None, emotion_map=EmotionMap.load()) == []


def test_missing_columns_is_an_error(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("a,b\r\n1,2\r\n")
    with pytest.raises(ValueError, match="missing columns"):
        convert_ed_csv(str(path))


def test_ids_and_split_names():
    assert ed_conversation_id("hit:0_conv:1") == "ed0c1"
    assert ed_conversation_id("hit:12_conv:3") != ed_conversation_id("hit:1_conv:23")
    assert ed_conversation_id("weird utt/id") == "ed-weird-u-tt-id"
    assert split_from_filename("/x/empathetic_dialogues_validation.csv") == "valid"
    assert split_from_filename("train.csv") == "train" and split_from_filename("ED-test.csv") == "test"
    assert split_from_filename("mine.csv") == "mine"
    assert import_ed.profile_pair(0) == (0, 1) and import_ed.profile_pair(24) == (0, 2)
    assert all(len(set(import_ed.profile_pair(i))) == 2 for i in range(24 * 23))
