"""The speech bridge (converters/synthesize.py): chat's features -> Kokoro -> wav, and its refusals."""

from __future__ import annotations

import numpy as np
import pytest

from converters import kokoro
from converters.synthesize import SpeechBridgeError, main, synthesize_reply
from data.kokoro_voices import to_pcm16, voice
from data.speech_synth import read_wav
from empatheia_jax.chat import ChatResult, write_outputs

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
    assert len(notes) == 1 and f"{len(content)} phoneme rows" in notes[0] and "predicts 10" in notes[0]
    assert 0 < seconds < len(content) * MS_PER_PHONEME / 1000


def test_refusals_name_the_reason(tmp_path, gold, capsys):
    content, style = gold
    npz = _chat_output(tmp_path, content, style, source="stand-in", name="standin")
    with pytest.raises(SpeechBridgeError, match="stand-in speech targets"):
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
