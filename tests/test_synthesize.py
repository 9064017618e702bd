"""The speech bridge (converters/synthesize.py): chat's features -> Kokoro -> wav, and its refusals."""

from __future__ import annotations

import numpy as np
import pytest

from converters.synthesize import main
from empatheia_jax.generators import kokoro
from empatheia_jax.generators.base import GeneratorError
from empatheia_jax.generators.kokoro_voices import to_pcm16, voice
from empatheia_jax.generators.speech_synth import read_wav
from empatheia_jax.serve.avatar import render_avatar, synthesize_reply
from empatheia_jax.serve.chat import ChatResult
from empatheia_jax.serve.outputs import write_outputs

REPLY = "That sounds really hard. I am here for you."
MS_PER_PHONEME = 65  # Kokoro at speed 1 on English: 62-68 ms per phoneme row, pauses included (measured)


def _chat_output(tmp_path, content, style, source="kokoro", name="reply"):
    result = ChatResult(text=REPLY, coe={}, reply=REPLY, emotion="", emotion_probs=np.zeros(0, np.float32),
                        profile={}, features={"speech_content": content, "speech_style": style},
                        signal_tokens_forced=False, speech_targets=source)
    npz, _ = write_outputs(result, tmp_path / name)
    return npz


@pytest.fixture(scope="module")
def gold():
    ph = kokoro.phonemize(REPLY)
    content = kokoro.shared(1).content_features(ph)
    return content, voice({"age": "young", "gender": "male", "timbre": "mid"}, "empathetic").style


def test_gold_features_are_spoken_exactly_and_at_a_plausible_length(tmp_path, gold):
    content, style = gold
    padded = np.zeros((64, 1024), np.float32)  # the CS predicts max_speech_len rows; the bridge reads T
    padded[: len(content)] = content
    padded[len(content):] = 5.0  # rows past T must not be read
    npz = _chat_output(tmp_path, padded, style)
    path, seconds, notes = synthesize_reply(npz, tmp_path / "reply.wav")
    assert notes == []
    sr, wav = read_wav(path)
    assert sr == kokoro.SAMPLE_RATE and len(wav) == round(seconds * sr)
    # gold features stay far below the duration cap: the bridge's audio is Kokoro's own
    np.testing.assert_array_equal(wav, to_pcm16(kokoro.shared(1).synthesize(content, style)))
    expected = len(content) * MS_PER_PHONEME / 1000
    assert 0.5 * expected < seconds < 2 * expected
    assert np.sqrt(np.mean((wav / 32768.0) ** 2)) > 0.01  # speech, not silence


def test_more_phonemes_than_rows_is_spoken_truncated_with_a_note(tmp_path, gold):
    content, style = gold
    npz = _chat_output(tmp_path, content[:10], style)
    _, seconds, notes = synthesize_reply(npz, tmp_path / "short.wav")
    assert len(notes) == 1 and f"{len(content)} content rows" in notes[0] and "predicts 10" in notes[0]
    assert 0 < seconds < len(content) * MS_PER_PHONEME / 1000


def test_refusals_name_the_reason(tmp_path, gold, capsys):
    content, style = gold
    npz = _chat_output(tmp_path, content, style, source="stand-in", name="standin")
    with pytest.raises(GeneratorError, match="stand-in speech targets"):
        synthesize_reply(npz, tmp_path / "x.wav")
    assert main(["--features", str(npz), "--out", str(tmp_path / "x.wav")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "stand-in" in err[0]
    assert not (tmp_path / "x.wav").exists()
    assert main(["--features", str(tmp_path / "missing.npz"), "--out", str(tmp_path / "y.wav")]) == 2
    assert "missing.json" in capsys.readouterr().err
    ok = _chat_output(tmp_path, content, style, name="ok")
    assert main(["--features", str(ok), "--out", str(tmp_path / "z.wav"), "--rows", "2"]) == 2
    assert "--rows 2" in capsys.readouterr().err


def test_avatar_is_the_predicted_controls_drawn_with_the_speech(tmp_path, gold):
    """render_avatar: as many 25-fps frames as the speech lasts, drawn from C^v/S^v at AVATAR_SIZE with idle
    life (rows past the prediction keep the mouth closed, with a note), the speech muxed in as AAC."""
    import av

    from empatheia_jax.generators.face_render import AVATAR_SIZE, encode_mp4, face_controls, render_controls

    content, style = gold
    env = np.abs(np.sin(np.linspace(0, 20, 60)))
    v_content, v_style = face_controls(env, {"age": "young", "gender": "male", "timbre": "mid", "ID": 4},
                                       "empathetic")
    result = ChatResult(text=REPLY, coe={}, reply=REPLY, emotion="", emotion_probs=np.zeros(0, np.float32),
                        profile={}, features={"speech_content": content, "speech_style": style,
                                              "video_content": v_content, "video_style": v_style},
                        signal_tokens_forced=False, speech_targets="kokoro", video_targets="face_render")
    npz, _ = write_outputs(result, tmp_path / "reply")
    wav_path, seconds, _ = synthesize_reply(npz, tmp_path / "reply.wav")
    mp4, n_frames, notes = render_avatar(npz, wav_path, tmp_path / "reply.mp4")
    sr, wav = read_wav(wav_path)
    assert n_frames == -(-len(wav) * 25 // sr) > 60  # the speech outlasts the 60 predicted rows
    assert len(notes) == 1 and "predicts 60" in notes[0]
    with av.open(str(mp4)) as c:
        assert c.streams.video[0].average_rate == 25 and c.streams.audio[0].rate == kokoro.SAMPLE_RATE
        frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[0])])
    padded = np.concatenate([v_content, np.zeros((n_frames - 60, v_content.shape[1]), np.float32)])
    want = render_controls(padded, v_style, size=AVATAR_SIZE, idle=True)
    assert frames.shape == want.shape == (n_frames, 256, 256, 3)
    # h264 at crf 20: the decoded frames are the drawn ones up to compression noise, and the same encode
    # without audio decodes to the very same pixels
    assert np.abs(frames.astype(int) - want.astype(int)).mean() < 3.0
    encode_mp4(want, tmp_path / "silent.mp4")
    with av.open(str(tmp_path / "silent.mp4")) as c:
        silent = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[0])])
    np.testing.assert_array_equal(frames, silent)
    standin = write_outputs(ChatResult(**{**result.__dict__, "video_targets": "stand-in"}), tmp_path / "s")[0]
    with pytest.raises(GeneratorError, match="stand-in video targets"):
        render_avatar(standin, wav_path, tmp_path / "s.mp4")


def test_listener_pins_the_voice_and_the_face_and_the_emotion_sets_the_style(tmp_path, gold):
    """`--listener`: the avatar's voice map and face replace the predicted S^s/S^v (whatever they were), in
    the style the reply's emotion calls for (CoE step 2 "lonely" -> sad: slower, lower, a sad face);
    a child's voice is measurably higher than an elderly man's; bad values name the flag."""
    from empatheia_jax.data import ed
    from empatheia_jax.eval.metrics.speech import f0_stats
    from empatheia_jax.generators.face_render import (
        AVATAR_SIZE,
        decode_style,
        face_controls,
        render_controls,
    )
    from empatheia_jax.serve.avatar import parse_listener

    content, style = gold
    v_content, v_style = face_controls(np.abs(np.sin(np.linspace(0, 20, 90))),
                                       {"age": "young", "gender": "male", "timbre": "mid"}, "happy")
    result = ChatResult(text=REPLY, coe={}, reply=REPLY, emotion="", emotion_probs=np.zeros(0, np.float32),
                        profile={}, features={"speech_content": content, "speech_style": style,
                                              "video_content": v_content, "video_style": v_style},
                        signal_tokens_forced=False, speech_targets="kokoro", video_targets="face_render",
                        emotion_text="lonely")
    npz, _ = write_outputs(result, tmp_path / "reply")
    child = parse_listener("child, female, HIGH")
    assert child == {"age": "child", "gender": "female", "timbre": "high"}
    elder = parse_listener("elderly,male,low")
    heard = {}
    for name, listener in (("child", child), ("elder", elder)):
        path, _, notes = synthesize_reply(npz, tmp_path / f"{name}.wav", listener=listener)
        assert any("pinned, in the sad style" in n for n in notes), notes
        sr, wav = read_wav(path)
        pinned = voice(listener, "sad")
        np.testing.assert_array_equal(wav, to_pcm16(kokoro.shared(1).synthesize(content, pinned.style,
                                                                                 pinned.speed)))
        heard[name] = f0_stats(wav / 32768.0, sr)["f0_median_hz"]
    assert heard["child"] > 1.8 * heard["elder"], heard
    mp4, n_frames, notes = render_avatar(npz, tmp_path / "elder.wav", tmp_path / "elder.mp4", listener=elder)
    assert any("elderly/male/low pinned" in n for n in notes), notes
    drawn = face_controls(np.zeros(1), ed.profile_json(ed.combo_index(**elder)), "sad")[1]  # as the corpus
    assert {k: decode_style(drawn)[k] for k in ("age", "gender", "timbre", "emotion")} == {
        "age": "elderly", "gender": "male", "timbre": "low", "emotion": "sad"}
    import av

    with av.open(str(mp4)) as c:
        first = next(iter(c.decode(c.streams.video[0]))).to_ndarray(format="rgb24")
    want = render_controls(v_content[:1], drawn, size=AVATAR_SIZE, idle=True)[0]
    other = render_controls(v_content[:1], v_style, size=AVATAR_SIZE, idle=True)[0]
    err = np.abs(first.astype(int) - want.astype(int)).mean()
    assert err < 3.0 < np.abs(first.astype(int) - other.astype(int)).mean(), err
    for bad, why in (("old,male,mid", "age 'old'"), ("young,female", "age,gender,timbre")):
        with pytest.raises(ValueError, match=why):
            parse_listener(bad)


def test_unpinned_face_shows_the_reply_emotion_on_the_predicted_avatar(tmp_path, gold, monkeypatch):
    """Without --listener the SD's predicted avatar is drawn, with the expression of the reply's emotion (CoE
    step 2 "lonely" -> sad), as the pinned avatar would show it; a reply without an emotion keeps S^v."""
    from empatheia_jax.generators.face_render import FaceRenderer, decode_style, face_controls

    content, style = gold
    who = {"age": "elderly", "gender": "female", "timbre": "high"}
    v_content, v_style = face_controls(np.abs(np.sin(np.linspace(0, 20, 40))), who, "happy")
    noisy = v_style + 0.3 * np.random.default_rng(0).random(v_style.shape).astype(np.float32)
    shown = FaceRenderer.expressed(noisy, "sad")
    assert decode_style(shown) == {**decode_style(v_style), "emotion": "sad"}
    np.testing.assert_array_equal(np.delete(shown, range(9, 18)), np.delete(noisy, range(9, 18)))
    with pytest.raises(ValueError, match="'bored'"):
        FaceRenderer.expressed(v_style, "bored")
    for emotion_text, want in (("lonely", "sad"), (None, "happy")):
        features = {"speech_content": content, "speech_style": style, "video_content": v_content,
                    "video_style": noisy}
        result = ChatResult(text=REPLY, coe={}, reply=REPLY, emotion="",
                            emotion_probs=np.zeros(0, np.float32), profile={}, features=features,
                            signal_tokens_forced=False, speech_targets="kokoro", video_targets="face_render",
                            emotion_text=emotion_text)
        npz, _ = write_outputs(result, tmp_path / f"r{want}")
        wav, _, _ = synthesize_reply(npz, tmp_path / f"{want}.wav")
        drawn = {}
        render = FaceRenderer.render

        def spy(self, content, style, wav, out, drawn=drawn, render=render):
            drawn["style"] = style
            return render(self, content, style, wav, out)

        monkeypatch.setattr(FaceRenderer, "render", spy)
        _, _, notes = render_avatar(npz, wav, tmp_path / f"{want}.mp4")
        assert decode_style(drawn["style"])["emotion"] == want
        assert any("shows the sad expression" in n for n in notes) == (want == "sad"), notes
