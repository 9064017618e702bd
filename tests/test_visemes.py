"""The mouth track of a text-only reply (empatheia_jax/generators/visemes.py): Kokoro's phonemes on the time
axis of Kokoro's own durations, sampled per 25-fps video frame, with no waveform decoded."""

from __future__ import annotations

import numpy as np
import pytest

from empatheia_jax.generators import face_render, kokoro, kokoro_voices, visemes

SENTENCE = "Mama bought a big apple pie."
LISTENER = {"age": "young", "gender": "female", "timbre": "mid"}
# every symbol English espeak wrote for 3,000 utterances of the shipped ED csv (data/ed/)
ESPEAK_EN = set(" ˈɪtːndasɹləiʊmæʌˌɛkwzð.hfobupevɔɑɐjŋɡɚʃ,ɜɾᵻθ?ʒ!\"ʔ:)(;")


@pytest.fixture(scope="module")
def spoken():
    """(phonemes, frames per row, synthesized audio) of SENTENCE in the listener's empathetic voice."""
    engine = kokoro.shared()
    voice = kokoro_voices.voice(LISTENER, "empathetic")
    phonemes = kokoro.phonemize(SENTENCE)
    content = engine.content_features(phonemes)
    frames = kokoro.frames_of(engine.durations(content, voice.style, voice.speed))
    return phonemes, frames, engine.synthesize(content, voice.style, voice.speed)


def _rows(phonemes: str) -> list[str]:
    table = kokoro.vocab()
    return ["<pad>", *(c for c in phonemes if c in table), "<pad>"]


def _frame_at(frames: np.ndarray, rows: slice) -> int:
    """The 25-fps video frame holding the centre of the rows `rows` on the audio's time axis."""
    ends = np.cumsum(frames) * kokoro.FRAME_SAMPLES
    start = ends[rows.start] - frames[rows.start] * kokoro.FRAME_SAMPLES
    return int((start + ends[rows.stop - 1]) / 2 * 25 // kokoro.SAMPLE_RATE)


def test_track_opens_on_vowels_and_closes_on_bilabials(spoken):
    phonemes, frames, _ = spoken
    track = visemes.mouth_track(phonemes, frames)
    rows = _rows(phonemes)
    assert phonemes == "mˈɑːmɐ bˈɔːt ɐ bˈɪɡ ˈæpəl pˈaɪ." and len(rows) == len(frames) == 33
    assert track.dtype == np.float32 and track.min() >= 0.0 and track.max() <= 1.0
    # every p, b, m shuts the mouth at its centre (m m b b p p)
    bilabials = [i for i, c in enumerate(rows) if c in "pbm"]
    assert len(bilabials) == 6
    for i in bilabials:
        assert track[_frame_at(frames, slice(i, i + 1))] <= 0.15, (i, rows[i])
    # the open vowels of "mama" (ˈɑː) and "apple" (ˈæ) open it: their centre frame, and every frame whose
    # window lies inside them
    for vowel in ("ˈɑː", "ˈæ"):
        start = phonemes.index(vowel) + 1  # + 1: the leading pad row
        span = slice(start, start + len(vowel))
        assert track[_frame_at(frames, span)] > 0.6, vowel
        ends = np.cumsum(frames) * kokoro.FRAME_SAMPLES
        t0, t1 = ends[span.start - 1], ends[span.stop - 1]
        inside = [k for k in range(len(track)) if t0 <= k * 960 and (k + 1) * 960 <= t1]
        assert inside and min(track[inside]) > 0.6, vowel
    # silence before the first word and after the full stop rests
    assert track[0] == 0.0 and track[-1] == 0.0


def test_frame_count_is_the_synthesized_audio_at_25_fps(spoken):
    phonemes, frames, audio = spoken
    assert len(audio) == frames.sum() * kokoro.FRAME_SAMPLES  # the durations time the very audio
    n = -(-len(audio) * 25 // kokoro.SAMPLE_RATE)
    assert len(visemes.mouth_track(phonemes, frames)) == n == face_render.frame_count(len(audio), 24000)


def test_frame_sampling_by_hand():
    """Rows pad ɑ p ɑ pad held 1, 2, 1, 2, 1 frames of 600 samples: row edges at 0, 600, 1800, 2400, 3600,
    4200 samples; video frames every 960 samples, ceil(4200 / 960) = 5 of them, the last 360 long."""
    frames = np.array([1, 2, 1, 2, 1])
    # frame 0: pad 600 + ɑ 360; 1: ɑ 840 + p 120 (0.125 < 0.3: a mean); 2: p 480 (0.5: shut);
    # 3: ɑ 720 + pad 240; 4: pad 360 of 360
    raw = [360 / 960, 840 / 960, 0.0, 720 / 960, 0.0]
    np.testing.assert_allclose(visemes.mouth_track("ɑpɑ", frames, coarticulation=0.0), raw, atol=1e-6)
    c = 0.2  # each open frame: 0.6 x itself + 0.2 x each neighbour (edges repeat); the shut frame stays 0
    smooth = [0.6 * raw[0] + c * (raw[0] + raw[1]), 0.6 * raw[1] + c * (raw[0] + raw[2]), 0.0,
              0.6 * raw[3] + c * (raw[2] + raw[4]), 0.6 * raw[4] + c * (raw[3] + raw[4])]
    np.testing.assert_allclose(visemes.mouth_track("ɑpɑ", frames, coarticulation=c), smooth, atol=1e-6)
    # the same rows at 50 fps: 480-sample frames; p covers 120 of frame 3 (a mean) and all of frame 4
    np.testing.assert_allclose(visemes.mouth_track("ɑpɑ", frames, fps=50, coarticulation=0.0),
                               [0, 0.75, 1, 0.75, 0, 1, 1, 0.5, 0], atol=1e-6)
    with pytest.raises(ValueError, match="content rows"):
        visemes.mouth_track("ɑpɑ", frames[:4])
    with pytest.raises(ValueError, match="frames_of"):
        visemes.mouth_track("ɑpɑ", frames + 0.5)


def test_rows_without_articulation_take_their_neighbours():
    openings, closed = visemes.row_openings("mˈɑː ə. b")
    # pad, m, ˈ (next: ɑ), ɑ, ː (previous: ɑ), space (mean of ɑ and ə), ə, full stop (rest), space (mean
    # of rest and b), b, pad
    np.testing.assert_allclose(openings, [0, 0, 1, 1, 1, 0.75, 0.5, 0, 0, 0, 0])
    assert closed.tolist() == [False, True, False, False, False, False, False, False, False, True, False]
    decided = set(visemes.OPENINGS) | visemes.NEXT | visemes.PREVIOUS | visemes.BETWEEN | visemes.PAUSES
    assert ESPEAK_EN.issubset(decided) and ESPEAK_EN.issubset(kokoro.vocab())
    assert set(kokoro.vocab()) - decided == {"S", "T"}
    assert all(visemes.OPENINGS[c] == 0.0 for c in "pbm")
    assert min(visemes.OPENINGS[c] for c in "aɑɒæʌ") >= 0.9 > max(visemes.OPENINGS[c] for c in "eɛəoɔ")
    assert max(visemes.OPENINGS[c] for c in "iuɪʊ") < min(visemes.OPENINGS[c] for c in "eɛəoɔ")


def test_frame_units_follow_the_mouth_track_frames(spoken):
    """Each frame carries the Kokoro unit id (KokoroSpeech.content_units' id space) of the row at its centre:
    as many frames as the mouth track, the bilabials' centre frames carry m/b/p, units in phoneme order."""
    phonemes, frames, _ = spoken
    units = visemes.frame_units(phonemes, frames)
    track = visemes.mouth_track(phonemes, frames)
    table = kokoro.vocab()
    assert units.dtype == np.int32 and units.shape == track.shape
    rows = _rows(phonemes)
    row_ids = np.concatenate([[0], kokoro.token_ids(phonemes), [0]])
    for i, c in enumerate(rows):
        if c in "pbm":
            assert units[_frame_at(frames, slice(i, i + 1))] == table[c], (i, c)
    # the frame sequence of ids is the row sequence with rows repeated (or, for rows shorter than a frame,
    # skipped): walking the frames never goes back in the phoneme order
    row_of = [int(np.flatnonzero(row_ids == u)[0]) if u else None for u in units]
    positions = []
    j = 0
    for u in units:
        while row_ids[j] != u:
            j += 1
        positions.append(j)
    assert positions == sorted(positions) and row_of[0] is None and units[0] == units[-1] == 0
    assert {table[c] for c in "mɑbɔɪæp"} <= set(units.tolist())  # every vowel nucleus and bilabial seen
    # a mouth that is shut carries a bilabial's id (or a pad's / a pause's: silent rows)
    silent = {0, table["."], table["m"], table["b"], table["p"]}
    assert all(int(u) in silent for u in units[track == 0.0])


def test_frame_units_by_hand():
    """Rows pad ɑ p ɑ pad held 1, 2, 1, 2, 1 frames (edges 0, 600, 1800, 2400, 3600, 4200 samples); video
    frames [0, 960), [960, 1920), ... with centres 480 (pad), 1440 (ɑ), 2400 (the second ɑ starts there),
    3360 (ɑ) and the clipped last frame's 4020 (pad); frame 2 is half p, the track shuts it: p."""
    table = kokoro.vocab()
    got = visemes.frame_units("ɑpɑ", np.array([1, 2, 1, 2, 1]))
    assert got.tolist() == [0, table["ɑ"], table["p"], table["ɑ"], 0]
    assert visemes.mouth_track("ɑpɑ", np.array([1, 2, 1, 2, 1]))[2] == 0.0
    # a generic unit layout: edges 0, 600, 1200, 3000, 4200, 4800; centres 480, 1440, 2400, 3360, 4320
    got = visemes.row_frame_units(np.array([0, 5, 7, 9, 0]), np.array([1, 1, 3, 2, 1]),
                                  closed=np.zeros(5, bool))
    assert got.tolist() == [0, 7, 7, 9, 0]
    # the default closure comes from the ids: m 600..1200 covers 37.5 % of frame 0 (whose centre is the
    # pad's), b 1200..2400 75 % of frame 1 (m 25 %)
    m, b, a = table["m"], table["b"], table["ɑ"]
    got = visemes.row_frame_units(np.array([0, m, b, a, 0]), np.array([1, 1, 2, 3, 1]))
    assert got[:2].tolist() == [m, b]
    with pytest.raises(ValueError, match="row units"):
        visemes.row_frame_units(np.array([0, 1]), np.array([1, 1, 1]))


def test_loudness_by_hand():
    """The rows of `test_frame_sampling_by_hand` with an energy curve of two values per duration frame
    (300 samples each): pad 0 0 | ɑ 8 8 8 8 | p 2 2 | ɑ 4 4 4 4 | pad 0 0, scaled between its 5th and 95th
    percentiles (0 and 8). Frame 0 [0, 960): 360 samples at 8 -> 0.375; frame 1: 840 at 8 and 120 at 2 ->
    0.906; frame 3: 720 at 4 -> 0.375. Open frames take the mean of the phoneme opening and that loudness;
    the shut frame and the resting one stay 0."""
    frames = np.array([1, 2, 1, 2, 1])
    energy = np.array([0, 0, 8, 8, 8, 8, 2, 2, 4, 4, 4, 4, 0, 0], np.float32)
    got = visemes.mouth_track("ɑpɑ", frames, coarticulation=0.0, energy=energy)
    raw, loud = np.array([0.375, 0.875, 0, 0.75, 0]), np.array([0.375, 6960 / 960 / 8, 0, 0.375, 0])
    np.testing.assert_allclose(got, np.where(raw > 0, 0.5 * raw + 0.5 * loud, 0), atol=1e-6)
    flat = visemes.mouth_track("ɑpɑ", frames, coarticulation=0.0, energy=np.ones(14))  # says nothing: 0.5
    np.testing.assert_allclose(flat, np.where(raw > 0, 0.5 * raw + 0.25, 0), atol=1e-6)
    with pytest.raises(ValueError, match=r"2 finite values per duration frame \(14\), got 13"):
        visemes.mouth_track("ɑpɑ", frames, energy=energy[:13])


def test_the_loudness_of_kokoros_predictor_moves_the_mouth_with_its_audio(spoken):
    """Kokoro's own energy curve (`Kokoro.energy`, the predictor alone) lies on the audio's timeline, two
    values per duration frame, and the track that follows it moves with the synthesized audio's loudness
    (lip sync, the eval's measure) better than the phonemes alone, while every p, b, m still shuts."""
    from empatheia_jax.eval.metrics.video import lip_sync
    from empatheia_jax.generators.speech_synth import speech_envelope

    phonemes, frames, audio = spoken
    engine = kokoro.shared()
    voice = kokoro_voices.voice(LISTENER, "empathetic")
    content = engine.content_features(phonemes)
    energy = engine.energy(content, voice.style, engine.durations(content, voice.style, voice.speed))
    assert energy.shape == (2 * frames.sum(),)
    plain = visemes.mouth_track(phonemes, frames)
    loud = visemes.mouth_track(phonemes, frames, energy=energy)
    assert len(loud) == len(plain) and np.array_equal(loud == 0, plain == 0)
    env = speech_envelope(kokoro_voices.to_pcm16(audio), kokoro.SAMPLE_RATE)
    assert lip_sync(loud, env) > lip_sync(plain, env) + 0.05
