"""The AvaMERG-format sample: determinism, media/JSON contract, and that the media carry the labels.

Builds use a 14-conversation ED-format csv written here (hermetic and fast); one test reads the real ED
validation csv when it is present, to check the text masking on real dialogues.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import wave
from pathlib import Path

import numpy as np
import pytest

from data import make_sample
from empatheia_jax.data.schema import Dialogue, EmotionMap, dialogue_utterances, validate_dialogues
from empatheia_jax.generators import kokoro_voices
from empatheia_jax.generators.face_paint import _layout, _mouth_box
from empatheia_jax.generators.face_render import render_face_video, render_frames
from empatheia_jax.generators.speech_synth import (
    FRAME_RATE,
    SAMPLE_RATE,
    read_wav,
    speech_envelope,
    synthesize_speech,
)

# (ED label, [speaker, listener, speaker, listener]); two conversations per class of the first four
# classes in EMOTIONS_7 order, so a 4-dialogue draw depends on the seed.
_CONVS = [
    ("joyful", ["I got the job I wanted! I start on Monday.", "That is great news, congratulations!",
                "Thanks, I am so happy about it.", "You earned it. What will you do first?"]),
    ("excited", ["My sister is visiting next week.", "Oh nice, how long since you saw her?",
                 "Almost two years. I can't wait!", "That will be a wonderful visit."]),
    ("surprised", ["My friends threw me a party I knew nothing about.", "Wow, what a surprise!",
                   "I walked in and everyone yelled.", "Did you have any idea?"]),
    ("impressed", ["My neighbour built a boat in his garage.", "A whole boat? How big is it?",
                   "Big enough for four people. It floats too.", "That is impressive work."]),
    ("furious", ["Someone scratched my car in the parking lot and left.", "That is awful. Did anyone see it?",
                 "No, and I am so angry about it.", "I would be furious too."]),
    ("annoyed", ["My roommate keeps eating my food.", "Have you talked to him about it?",
                 "Twice. He just laughs.", "Maybe label your shelf."]),
    ("terrified", ["A tire burst on the highway this morning. That scared me!", "Are you okay now?",
                   "Yes, I pulled over safely.", "Good, that sounds frightening."]),
    ("afraid", ["I heard noises downstairs last night.", "What did you do?",
                "I called the police and hid upstairs.", "Was anyone there?"]),
    ("sad", ["My old dog died last week.", "I am so sorry. How old was he?",
             "Fourteen. The house feels empty.", "He had a long life with you."]),
    ("lonely", ["I moved to a new city and know nobody.", "That is hard. Have you tried any clubs?",
                "Not yet, I work late most days.", "Maybe a weekend class would help."]),
    ("disgusted", ["I found a hair baked into my bread.", "Gross! Where did you buy it?",
                   "At the bakery on Main Street.", "I would complain to them."]),
    ("disgusted", ["The fridge at work smells of old fish.", "Did somebody leave food in it?",
                   "For weeks, I think.", "Someone should clean it out."]),
    ("jealous", ["My coworker got the promotion instead of me.", "How do you feel about that?",
                 "He always gets the credit.", "Your turn will come."]),
    ("jealous", ["My brother bought a new house by the lake.", "That sounds lovely.",
                 "He never even saved money.", "Some people have all the luck."]),
]


def _write_ed_csv(path: Path) -> None:
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f, lineterminator="\r\n")
        w.writerow(["conv_id", "utterance_idx", "context", "prompt", "speaker_idx", "utterance", "selfeval",
                    "tags"])
        for c, (label, utts) in enumerate(_CONVS):
            for i, u in enumerate(utts):
                w.writerow([f"hit:{c}_conv:{2 * c}", i + 1, label, utts[0].replace(",", "_comma_"),
                            1 + i % 2, u.replace(",", "_comma_"), "5|5|5", ""])


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("sample")
    old = os.environ.get("EMPATHEIA_CACHE")
    os.environ["EMPATHEIA_CACHE"] = str(root / "cache")
    csv_path = root / "ed.csv"
    _write_ed_csv(csv_path)
    yield root, csv_path
    if old is None:
        os.environ.pop("EMPATHEIA_CACHE", None)
    else:
        os.environ["EMPATHEIA_CACHE"] = old


@pytest.fixture(scope="module")
def builds(env):
    root, csv_path = env
    a = make_sample.build_sample(root / "a", 4, 0, ed_csv=csv_path, masked_fraction=0.5, workers=1)
    b = make_sample.build_sample(root / "b", 4, 0, ed_csv=csv_path, masked_fraction=0.5, workers=2)
    c = make_sample.build_sample(root / "c", 4, 1, ed_csv=csv_path, masked_fraction=0.5, workers=1)
    return root, (a, b, c)


def _tree_hashes(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


def _dialogues(d: Path, split: str) -> list[dict]:
    return json.loads((d / f"{split}.json").read_text(encoding="utf-8"))


def test_build_is_deterministic_serial_and_parallel(builds):
    root, (a, b, c) = builds
    ha, hb = _tree_hashes(root / "a"), _tree_hashes(root / "b")
    assert ha == hb  # workers=1 vs workers=2: same bytes everywhere, media included
    assert any(k.endswith(".mp4") for k in ha) and any(k.endswith(".wav") for k in ha)
    ids_a = sorted(cid for s in a["splits"].values() for cid in s)
    ids_c = sorted(cid for s in c["splits"].values() for cid in s)
    assert ids_a != ids_c  # another seed draws other dialogues
    assert [a["dialogues"][i]["emotion"] for s in a["splits"].values() for i in s]  # non-empty


def test_layout_meta_and_validation(builds):
    root, (meta, _, _) = builds
    d = root / "a"
    emap = EmotionMap.load("avamerg7")
    assert {s: len(v) for s, v in meta["splits"].items()} == {"train": 2, "valid": 1, "test": 1}
    assert meta["seed"] == 0 and meta["num_dialogues"] == 4 and meta["generator_version"]
    assert json.loads((d / "sample_meta.json").read_text()) == meta
    masked = [cid for cid, v in meta["dialogues"].items() if v["text_masked"]]
    assert len(masked) == 3  # half-up rounding of 0.5 * (2, 1, 1)
    listed = set()
    for split in ("train", "valid", "test"):
        objs = _dialogues(d, split)
        assert [o["conversation_id"] for o in objs] == meta["splits"][split]
        media = str(d / "media")
        problems = validate_dialogues(objs, source=f"{split}.json", media_dir=media, emotion_map=emap)
        assert problems == []
        for o in objs:
            listed |= {uid for uid, _, _ in dialogue_utterances(Dialogue.from_json(o))}
    files = {p.name for p in (d / "media").iterdir()}
    assert files == {uid + ext for uid in listed for ext in (".wav", ".mp4")}  # every utterance, nothing else


def test_every_utterance_decodes_with_matching_durations(builds):
    import av

    root, _ = builds
    media = root / "a" / "media"
    for wav_path in sorted(media.glob("*.wav")):
        with wave.open(str(wav_path)) as w:
            assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, SAMPLE_RATE)
            seconds = w.getnframes() / w.getframerate()
            pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2")
        assert seconds > 0.3 and np.abs(pcm).max() > 1000  # real speech, not silence
        with av.open(str(wav_path.with_suffix(".mp4"))) as container:
            stream = container.streams.video[0]
            assert stream.codec_context.name == "h264" and stream.average_rate == FRAME_RATE
            n_frames = sum(1 for _ in container.decode(video=0))
        assert abs(n_frames - seconds * FRAME_RATE) <= 1


def test_masked_dialogues_hide_emotion_words(builds):
    root, (meta, _, _) = builds
    emap = EmotionMap.load("avamerg7")
    for split in ("train", "valid", "test"):
        for o in _dialogues(root / "a", split):
            info = meta["dialogues"][o["conversation_id"]]
            assert emap.class_name(o["turns"][0]["chain_of_empathy"]["speaker_emotion"]) == info["emotion"]
            if not info["text_masked"]:
                continue
            for t in o["turns"]:
                assert t["context"] == t["chain_of_empathy"]["event_scenario"] == make_sample.NEUTRAL_SCENARIO
                for text in [u["utterance"] for u in t["dialogue_history"]] + [t["response"]]:
                    assert text.strip() and not make_sample.has_emotion_word(text), text
                    assert "!" not in text


def test_neutralize_text():
    raw = "Wow! I got the job. I am so happy about it!! We start Monday :)"
    text, removed = make_sample.neutralize_text(raw)
    assert text == "I got the job. We start Monday." and removed == 1
    assert make_sample.has_emotion_word("That scared the hell out of me")
    assert not make_sample.has_emotion_word("I moved to a new city last spring.")


def test_real_ed_masking_and_balance(monkeypatch):
    """On the ED validation csv shipped in data/ed/: balanced draw, no emotion word left in masked text."""
    monkeypatch.delenv("EMPATHEIA_ED_CSV", raising=False)
    path = make_sample.resolve_ed_csv()
    assert path == make_sample.shipped_ed_csv().resolve()
    from empatheia_jax.data.ed import convert_ed_csv

    emap = EmotionMap.load("avamerg7")
    chosen = make_sample.select_dialogues(convert_ed_csv(str(path)).dialogues, 70, 0, emap)
    classes = [emap.class_name(o["turns"][0]["chain_of_empathy"]["speaker_emotion"]) for o in chosen]
    assert all(classes.count(c) == 10 for c in set(classes)) and len(set(classes)) == 7
    for o in chosen:
        masked, _ = make_sample.mask_dialogue(o)
        for _, _, text in dialogue_utterances(Dialogue.from_json(masked)):
            assert text.strip() and not make_sample.has_emotion_word(text), text


def test_splits_and_csv_resolution(tmp_path, monkeypatch):
    for n in range(10, 260, 7):
        s = make_sample.assign_splits(n)
        assert s.count("valid") >= 1 and s.count("test") >= 1 and s.count("train") >= 0.75 * n
    monkeypatch.setenv("EMPATHEIA_ED_CSV", str(tmp_path / "missing.csv"))
    monkeypatch.setattr(make_sample, "repo_root", lambda: tmp_path / "repo")
    with pytest.raises(FileNotFoundError, match="EMPATHEIA_ED_CSV"):
        make_sample.resolve_ed_csv()
    (tmp_path / "ed.csv").write_text("x")
    monkeypatch.setenv("EMPATHEIA_ED_CSV", str(tmp_path / "ed.csv"))
    assert make_sample.resolve_ed_csv() == (tmp_path / "ed.csv").resolve()
    assert make_sample.main(["--out", str(tmp_path / "o"), "--dialogues", "2", "--ed-csv",
                             str(tmp_path / "nope.csv"), "--quiet"]) == 2


def test_shipped_ed_csv_is_checked_against_its_sha256(tmp_path, monkeypatch):
    """The default csv is the in-repo copy, and a changed copy (e.g. CRLF turned into LF) is refused."""
    monkeypatch.delenv("EMPATHEIA_ED_CSV", raising=False)
    shipped = make_sample.shipped_ed_csv()
    make_sample.check_shipped_ed_csv(shipped)  # the committed file matches its recorded sum
    repo = tmp_path / "repo"
    (repo / "data" / "ed").mkdir(parents=True)
    copy = repo / "data" / "ed" / shipped.name
    copy.write_bytes(shipped.read_bytes().replace(b"\r\n", b"\n"))
    (repo / "data" / "ed" / "SHA256SUMS").write_bytes((shipped.parent / "SHA256SUMS").read_bytes())
    monkeypatch.setattr(make_sample, "repo_root", lambda: repo)
    with pytest.raises(ValueError, match="sha256 .* does not match"):
        make_sample.resolve_ed_csv()
    assert make_sample.main(["--out", str(tmp_path / "o"), "--dialogues", "2", "--quiet"]) == 2


def _median_f0(wav: np.ndarray, sr: int = SAMPLE_RATE) -> float:
    """Autocorrelation pitch over voiced 40 ms frames (60-600 Hz)."""
    x = wav.astype(np.float64) / 32768.0
    hop = sr // 25
    frames = x[: len(x) // hop * hop].reshape(-1, hop)
    rms = np.sqrt((frames**2).mean(1))
    f0 = []
    for fr in frames[rms > 0.3 * rms.max()]:
        fr = fr - fr.mean()
        ac = np.correlate(fr, fr, "full")[hop - 1:]
        lo, hi = sr // 600, sr // 60
        lag = lo + int(np.argmax(ac[lo:hi]))
        if ac[lag] > 0.3 * ac[0]:
            f0.append(sr / lag)
    return float(np.median(f0))


_TEXT = "I went to the market this morning and bought some bread and apples."
_MALE = {"age": "young", "gender": "male", "timbre": "mid", "ID": 3}
_FEMALE = {"age": "young", "gender": "female", "timbre": "mid", "ID": 9}


def test_speech_carries_emotion_and_profile():
    happy = synthesize_speech(_TEXT, _MALE, "happy")
    sad = synthesize_speech(_TEXT, _MALE, "sad")
    angry = synthesize_speech(_TEXT, _MALE, "angry")
    female = synthesize_speech(_TEXT, _FEMALE, "sad")
    assert happy.dtype == np.int16 and len(happy) % (SAMPLE_RATE // FRAME_RATE) == 0
    assert _median_f0(happy) > 1.3 * _median_f0(sad)  # happy: higher pitch
    assert len(sad) > 1.3 * len(happy)  # sad: slower
    rms = {k: np.sqrt(np.mean((w / 32768.0) ** 2)) for k, w in (("happy", happy), ("sad", sad),
                                                                 ("angry", angry))}
    assert rms["angry"] > rms["happy"] > 2 * rms["sad"]  # loudness order
    assert _median_f0(female) > 1.4 * _median_f0(sad)  # same emotion, female voice higher


def test_speech_is_deterministic_regardless_of_call_order():
    first = synthesize_speech(_TEXT, _FEMALE, "fear")
    synthesize_speech("Something else entirely, said quickly.", _MALE, "angry")
    again = synthesize_speech(_TEXT, _FEMALE, "fear")
    assert first.tobytes() == again.tobytes()


def test_face_follows_speech_and_emotion(tmp_path):
    import av

    wav = synthesize_speech(_TEXT, _FEMALE, "happy")
    env = speech_envelope(wav)
    assert len(env) * (SAMPLE_RATE // FRAME_RATE) == len(wav) and env.max() == 1.0 and env[0] == 0.0
    frames = render_frames(np.array([0.0, 1.0]), _FEMALE, "neutral")
    x0, y0, x1, y1 = (int(v) for v in _mouth_box(_layout("young", 128)))
    mouth = np.abs(frames[0, y0:y1, x0:x1].astype(int) - frames[1, y0:y1, x0:x1].astype(int))
    assert mouth.mean() > 5  # mouth open in loud speech vs closed in silence
    assert np.array_equal(frames[0, :y0], frames[1, :y0])  # only the mouth moves
    faces = {e: render_frames(np.zeros(1), _FEMALE, e)[0].astype(int) for e in ("happy", "sad", "angry")}
    for a, b in (("happy", "sad"), ("happy", "angry"), ("sad", "angry")):
        assert np.abs(faces[a] - faces[b]).mean() > 2, (a, b)
    older = render_frames(np.zeros(1), {**_FEMALE, "age": "elderly"}, "happy")[0].astype(int)
    assert np.abs(older - faces["happy"]).mean() > 2  # age changes the face
    p1, p2 = tmp_path / "a.mp4", tmp_path / "b.mp4"
    assert render_face_video(env, _FEMALE, "happy", p1) == len(env)
    render_face_video(env, _FEMALE, "happy", p2)
    assert p1.read_bytes() == p2.read_bytes()
    with av.open(str(p1)) as c:
        assert sum(1 for _ in c.decode(video=0)) == len(env)


def test_gold_speech_is_spoken_from_exactly_the_speech_targets(builds, tmp_path):
    """The test split's responses have Kokoro gold speech, and re-synthesizing from the exported speech
    targets (content rows and style vector) at the recorded speed gives those wav samples bit for bit."""
    from converters.styletts2_targets import export_speech_targets
    from empatheia_jax.data.schema import response_utterance_id
    from empatheia_jax.data.targets import TargetReader
    from empatheia_jax.generators import kokoro

    root, (meta, _, _) = builds
    d = root / "a"
    gold = meta["gold_speech"]
    assert gold["splits"] == ["test"] and gold["model_sha256"] == kokoro.MODEL_SHA256
    test_dialogues = [Dialogue.from_json(o) for o in _dialogues(d, "test")]
    responses = {response_utterance_id(x, j) for x in test_dialogues for j in range(len(x.turns))}
    assert set(gold["utterances"]) == responses
    assert {p.stem for p in (d / "gold_speech").iterdir()} == responses
    export_speech_targets(d, tmp_path / "targets", splits=["test"], progress=False)
    reader = TargetReader(tmp_path / "targets")
    assert reader.meta["speech_style"]["source"] == "kokoro"
    engine = kokoro.shared(1)
    for uid, recipe in gold["utterances"].items():
        sr, wav = read_wav(d / "gold_speech" / f"{uid}.wav")
        assert sr == kokoro.SAMPLE_RATE and len(wav) == recipe["samples"] > sr // 2
        content, style = reader.get("speech_content", uid), reader.get("speech_style", uid)
        again = engine.synthesize(content, style, recipe["speed"])
        np.testing.assert_array_equal(kokoro_voices.to_pcm16(again), wav)
