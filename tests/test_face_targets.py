"""The procedural face generator's control space (empatheia_jax/generators/face_render.py) and its video
targets
(converters/face_targets.py): the controls are the complete description of the sample's videos."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest

from converters import face_targets
from data import make_sample
from empatheia_jax.data.schema import Dialogue, dialogue_utterances, load_dialogues
from empatheia_jax.data.targets import TargetReader
from empatheia_jax.generators import face_render, kokoro
from empatheia_jax.generators.kokoro_speech import KokoroSpeech


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    root = tmp_path_factory.mktemp("face")
    raw = root / "raw"
    make_sample.build_sample(raw, 3, 0, workers=1, gold_speech=())
    face_targets.export_face_targets(raw, root / "targets", progress=False)
    return raw, TargetReader(root / "targets")


def test_gold_controls_reproduce_every_sample_video_byte_for_byte(sample, tmp_path):
    raw, reader = sample
    assert reader.meta["video_content"]["source"] == reader.meta["video_style"]["source"] == "face_render"
    uids = [uid for split in ("train", "valid", "test")
            for d in load_dialogues(raw / f"{split}.json") for uid, _, _ in dialogue_utterances(d)]
    assert sorted(reader.keys("video_content")) == sorted(set(uids))
    for uid in uids[:6]:
        content, style = reader.get("video_content", uid), reader.get("video_style", uid)
        out = tmp_path / f"{uid}.mp4"
        face_render.encode_mp4(face_render.render_controls(content, style), out)
        digest = hashlib.sha256((raw / "media" / f"{uid}.mp4").read_bytes()).hexdigest()
        assert hashlib.sha256(out.read_bytes()).hexdigest() == digest, uid
        assert np.all(content[:, 2:] == 0) and np.isin(content[:, 1], np.float32([0.0, 0.6, 1.0])).all()


def test_style_decodes_to_the_profile_and_expression(sample):
    raw, reader = sample
    d = Dialogue.from_json(json.loads((raw / "train.json").read_text())[0])
    emotion = json.loads((raw / "sample_meta.json").read_text())["dialogues"][d.conversation_id]["emotion"]
    for uid, role, _ in dialogue_utterances(d):
        avatar = face_render.decode_style(reader.get("video_style", uid))
        p = d.profile_of(role)
        assert (avatar["age"], avatar["gender"], avatar["timbre"]) == (p.age, p.gender, p.timbre)
        # the listener mirrors joy, surprise and sadness and answers the rest calmly
        mirrored = emotion if emotion in {"happy", "surprised", "sad"} else "empathetic"
        assert avatar["emotion"] == (mirrored if role == "listener" else emotion)
        ident = lambda i: (i % 5, (i // 5) % 5, i % 3 == 0)  # noqa: E731 - skin, hair, blue iris
        assert ident(avatar["ID"]) == ident(int(p.ID))


def test_predicted_controls_render_as_the_nearest_avatar():
    env = np.abs(np.sin(np.linspace(0, 9, 40)))
    profile = {"age": "child", "gender": "male", "timbre": "high", "ID": 13}
    content, style = face_render.face_controls(env, profile, "happy")
    rng = np.random.default_rng(0)
    noisy_style = style + 0.2 * rng.standard_normal(style.shape).astype(np.float32)
    # within half a drawn step of every control (mouth steps are 1/15 apart, eyelid states 0.3+)
    noisy_content = content + rng.uniform(-0.03, 0.03, content.shape).astype(np.float32)
    np.testing.assert_array_equal(face_render.render_controls(noisy_content, noisy_style),
                                  face_render.render_controls(content, style))
    other = style.copy()
    other[4:6] = other[5:3:-1]  # male -> female
    assert not np.array_equal(face_render.render_controls(content, other),
                              face_render.render_controls(content, style))
    with pytest.raises(face_render.ControlError, match="video style must be 256"):
        face_render.render_controls(content, style[:100])
    bad = content.copy()
    bad[3, 0] = np.nan
    with pytest.raises(face_render.ControlError, match="finite"):
        face_render.render_controls(bad, style)


def test_missing_wav_is_named_and_nothing_written(sample, tmp_path, capsys):
    raw, _ = sample
    broken = tmp_path / "raw"
    shutil.copytree(raw, broken)
    victim = sorted((broken / "media").glob("*.wav"))[0]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        face_targets.export_face_targets(broken, tmp_path / "t", progress=False)
    assert not (tmp_path / "t" / "meta.json").exists()
    assert face_targets.main(["--raw", str(broken), "--out", str(tmp_path / "t2"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and victim.name in err[0]


def test_phoneme_mouth_targets_need_no_media_and_follow_kokoro_speech(sample, tmp_path):
    """`--mouth phonemes --responses-only` on a folder without media (a text corpus such as imported ED):
    one target per turn response; each mouth track lasts exactly as long as Kokoro speaks the reply in the
    listener's voice, and moves with that speech (lip sync against its envelope, the eval's measure)."""
    from empatheia_jax.data.schema import response_utterance_id
    from empatheia_jax.eval.metrics.video import lip_sync
    from empatheia_jax.generators import kokoro_voices
    from empatheia_jax.generators.speech_synth import speech_envelope

    raw, _ = sample
    text_only = tmp_path / "raw"
    text_only.mkdir()
    for f in raw.glob("*.json"):
        shutil.copy(f, text_only / f.name)
    counts = face_targets.export_face_targets(text_only, tmp_path / "t", splits=["test"], progress=False,
                                              mouth="phonemes", responses_only=True)
    dialogues = load_dialogues(text_only / "test.json")
    responses = {response_utterance_id(d, j): (d, t) for d in dialogues for j, t in enumerate(d.turns)}
    reader = TargetReader(tmp_path / "t")
    assert counts == {"video_content": len(responses), "video_style": len(responses),
                      "video_units": len(responses)}
    assert sorted(reader.keys("video_content")) == sorted(responses)
    assert "phonemes" in reader.meta["video_content"]["mouth"]
    syncs = []
    emotions = json.loads((raw / "sample_meta.json").read_text())["dialogues"]
    for uid, (d, turn) in list(responses.items())[:3]:
        content = reader.get("video_content", uid)
        style = kokoro_voices.utterance_style("listener", emotions[d.conversation_id]["emotion"])
        audio, _ = kokoro_voices.gold_speech(turn.response, d.profile_of("listener").to_json(), style,
                                             kokoro_voices.LISTENER_SPEED)
        assert len(content) == -(-len(audio) * 25 // 24000), uid
        syncs.append(lip_sync(content[:, face_render.CONTENT_MOUTH], speech_envelope(audio, 24000)))
        assert face_render.decode_style(reader.get("video_style", uid))["emotion"] == style
        # each frame's unit: the Kokoro id of the phoneme the frame's mouth was drawn from
        units = reader.get("video_units", uid)
        assert units.shape == (len(content), 1) and np.all(units == np.round(units))
        ids = set(KokoroSpeech.content_units(turn.response).tolist())
        assert set(units[:, 0].astype(int).tolist()) <= ids and units[0, 0] == units[-1, 0] == 0
        shut = content[:, face_render.CONTENT_MOUTH] == 0.0
        table = kokoro.vocab()
        # (silent rows: pads, pauses, and the spaces, stress and length marks that borrow a silent side)
        assert set(units[shut, 0].astype(int).tolist()) <= {0, *(table[c] for c in "pbm.,!?;:—… ˈˌː")}
    assert min(syncs) > 0.5, syncs
    with pytest.raises(ValueError, match="--mouth"):
        face_targets.export_face_targets(text_only, tmp_path / "t3", mouth="lips", progress=False)
    # a speech-mouth export over the same folder has no units and removes the stale ones
    counts = face_targets.export_face_targets(raw, tmp_path / "t", splits=["test"], progress=False)
    assert "video_units" not in counts and "video_units" not in TargetReader(tmp_path / "t").kinds
    assert not list((tmp_path / "t").glob("video_units-*"))


def test_reply_mouth_times_the_listener_by_kokoro_and_the_speaker_by_the_wav(sample, tmp_path):
    """`--mouth replies` (the demo's): a listener utterance's mouth and frame units are the phoneme mouth at
    LISTENER_SPEED (the gold reply speech's timeline), a speaker utterance keeps its wav's envelope and has
    no units."""
    from empatheia_jax.generators import kokoro_voices

    raw, speech_reader = sample
    counts = face_targets.export_face_targets(raw, tmp_path / "t", splits=["test"], progress=False,
                                              mouth="replies")
    reader = TargetReader(tmp_path / "t")
    jobs = face_targets.face_jobs(raw, ["test"])
    listeners = [j for j in jobs if j.speed is not None]
    speakers = [j for j in jobs if j.speed is None]
    assert listeners and speakers and all(j.speed == kokoro_voices.LISTENER_SPEED for j in listeners)
    assert counts["video_content"] == len(jobs) and counts["video_units"] == len(listeners)
    assert reader.meta["video_units"]["mouth"] == face_targets.MOUTH_METHOD["replies"]
    j = listeners[0]
    content, _, units = face_targets.text_targets(j.text, j.profile, j.style, j.speed)
    np.testing.assert_array_equal(reader.get("video_content", j.uid), content)
    np.testing.assert_array_equal(reader.get("video_units", j.uid), units)
    s = speakers[0]
    assert ("video_units", s.uid) not in reader
    gold = speech_reader.get("video_content", s.uid)
    np.testing.assert_array_equal(reader.get("video_content", s.uid), gold)


def test_stale_targets_name_what_changed(tmp_path):
    """Targets are current when every versioned kind was made under today's voice map and mouth rule."""
    from converters.target_export import stale_targets
    from empatheia_jax.generators import visemes
    from empatheia_jax.generators.kokoro_voices import MAP_VERSION

    assert stale_targets(tmp_path) == ["no speech_style targets", "no video_content targets",
                                       "no video_style targets"]
    meta = {kind: {"voice_map_version": MAP_VERSION, "mouth_version": visemes.MOUTH_VERSION}
            for kind in ("speech_style", "video_content", "video_style")}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    assert stale_targets(tmp_path) == []
    meta["video_content"]["mouth_version"] = "old"
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    assert stale_targets(tmp_path) == [f"video_content made with mouth_version 'old', today's is "
                                       f"{visemes.MOUTH_VERSION!r}"]
    (tmp_path / "meta.json").write_text("{")
    assert len(stale_targets(tmp_path)) == 1 and "not valid JSON" in stale_targets(tmp_path)[0]
