"""The face users watch (empatheia_jax/generators/face_render.py `FaceRenderer`): drawn at AVATAR_SIZE with
idle life (head sway and nod, breathing, blinks) from the same controls, while the sample/eval path (128
pixels, no idle) keeps its bytes."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from empatheia_jax.generators import face_idle, face_paint
from empatheia_jax.generators import face_render as fr
from empatheia_jax.generators.speech_synth import write_wav

PROFILE = {"age": "young", "gender": "female", "timbre": "mid", "ID": 4}
FPS = 25


def _flat(n: int) -> np.ndarray:
    """Content with the mouth closed and the eyelids open in every frame: a silent, listening avatar."""
    return np.zeros((n, fr.CONTENT_DIM), np.float32)


def _mouth_read_back(style: np.ndarray, size: int, idle: bool) -> np.ndarray:
    """Per mouth level 0..15: how much the frame differs from the same frame with the mouth closed (the idle
    schedule is the same for both clips, so only the mouth differs), per pixel of the frame."""
    content = _flat(face_paint.MOUTH_LEVELS)
    content[:, fr.CONTENT_MOUTH] = np.arange(face_paint.MOUTH_LEVELS) / (face_paint.MOUTH_LEVELS - 1)
    open_ = fr.render_controls(content, style, size=size, idle=idle).astype(np.int64)
    closed = fr.render_controls(_flat(face_paint.MOUTH_LEVELS), style, size=size, idle=idle).astype(np.int64)
    return np.abs(open_ - closed).sum((1, 2, 3)) / size**2


@pytest.mark.parametrize(("profile", "emotion"), [(PROFILE, "empathetic"),
                                                  ({"age": "elderly", "gender": "male", "timbre": "low",
                                                    "ID": 9}, "surprised")])
def test_controls_round_trip_at_the_avatar_size(profile, emotion):
    _, style = fr.face_controls(np.zeros(4), profile, emotion)
    small = _mouth_read_back(style, fr.DEFAULT_SIZE, idle=False)
    for idle in (False, True):
        big = _mouth_read_back(style, fr.AVATAR_SIZE, idle=idle)
        assert big[0] == 0 and np.all(np.diff(big) > 0), (idle, big)  # monotone in the control
        np.testing.assert_array_equal(np.argsort(big), np.argsort(small))  # the 128 render's ordering
    # the same avatar: the 256 still face halved is the 128 one up to edge anti-aliasing
    still = fr.render_controls(_flat(1), style, size=fr.AVATAR_SIZE)[0].astype(np.float64)
    halved = still.reshape(128, 2, 128, 2, 3).mean((1, 3))
    assert np.abs(halved - fr.render_controls(_flat(1), style)[0]).mean() < 1.0
    # and a predicted style draws its nearest avatar there too
    rng = np.random.default_rng(0)
    noisy = style + 0.2 * rng.standard_normal(style.shape).astype(np.float32)
    content = _flat(8)
    np.testing.assert_array_equal(fr.render_controls(content, noisy, size=fr.AVATAR_SIZE, idle=True),
                                  fr.render_controls(content, style, size=fr.AVATAR_SIZE, idle=True))


def test_a_silent_avatar_lives_only_when_idle():
    _, style = fr.face_controls(np.zeros(4), PROFILE, "empathetic")
    n = 5 * FPS  # 5 s
    live = fr.render_controls(_flat(n), style, size=fr.AVATAR_SIZE, idle=True)
    still = fr.render_controls(_flat(n), style, size=fr.AVATAR_SIZE)
    assert live.shape == still.shape == (n, 256, 256, 3)
    assert all(np.array_equal(f, still[0]) for f in still)  # idle=False: frozen, frame for frame
    change = np.abs(np.diff(live.astype(np.int16), axis=0)).mean((1, 2, 3))  # per consecutive pair, of 255
    assert change.min() > 0.02 and np.median(change) > 0.2, change  # every frame moves, visibly over time
    second_apart = np.abs(live[FPS:].astype(np.int16) - live[:-FPS]).mean((1, 2, 3))
    assert np.median(second_apart) > 2.0
    # blinks: the eye whites (the only near-white pixels of a closed-mouth face) vanish within 5 s
    whites = (live > 235).all(-1).sum((1, 2))
    open_eyes = (still[0] > 235).all(-1).sum()  # the sub-pixel position moves a few edge pixels across 235
    assert 0.6 * open_eyes < np.median(whites) < 1.2 * open_eyes
    assert whites.min() < 0.1 * open_eyes, (whites.min(), open_eyes)
    # the motion stays small: the frame's centre of mass moves by ~1-2 % of the frame, not more
    shift = np.abs(live.astype(np.float64) - still[0]).mean((1, 2, 3))
    assert shift.max() < 12


def test_idle_schedule_is_natural_deterministic_and_ors_the_eyelid_control():
    life = face_idle.idle_life(60 * FPS, 4, fr.AVATAR_SIZE)
    onsets = np.flatnonzero(np.diff((life.blink == 2).astype(int)) == 1) + 1
    gaps = np.diff(onsets) / FPS
    assert onsets[0] < 2.6 * FPS and gaps.min() >= 2.9 and gaps.max() <= 5.1 and len(onsets) >= 12
    for motion in (life.head_dx, life.head_dy, life.torso_dy):
        assert 0.004 * 256 < np.abs(motion).max() < 0.03 * 256  # ~1-2 % of the frame size
    again = face_idle.idle_life(60 * FPS, 4, fr.AVATAR_SIZE)
    np.testing.assert_array_equal(life.head_dx, again.head_dx)
    np.testing.assert_array_equal(life.blink, again.blink)
    other = face_idle.idle_life(60 * FPS, 5, fr.AVATAR_SIZE)
    assert not np.array_equal(life.blink, other.blink) and not np.allclose(life.head_dx, other.head_dx)
    # same inputs, same frames; an eyelid control still closes the eyes whatever the schedule says
    _, style = fr.face_controls(np.zeros(4), PROFILE, "empathetic")
    content = _flat(40)
    content[10:13, fr.CONTENT_BLINK] = 1.0
    content[:, fr.CONTENT_MOUTH] = np.abs(np.sin(np.arange(40) / 3))
    a = fr.render_controls(content, style, size=fr.AVATAR_SIZE, idle=True)
    np.testing.assert_array_equal(a, fr.render_controls(content, style, size=fr.AVATAR_SIZE, idle=True))
    assert (a[10:13] > 235).all(-1).sum((1, 2)).max() == 0 < (a[20] > 235).all(-1).sum()


def test_the_sample_path_keeps_its_bytes():
    """sha256 of the 128-pixel frames computed with face_render.py as it was before the avatar was drawn at
    256 with idle life: the sample's videos, their targets and eval's clips do not move."""
    env = np.abs(np.sin(np.linspace(0, 9, 30)))
    for profile, emotion, digest in [
        ({"age": "middle-aged", "gender": "female", "timbre": "low", "ID": 8}, "sad",
         "53b41a4bd908308ae303c94a9b51f7dae70e29d7a4ce830604fb532f43e175f3"),
        ({"age": "child", "gender": "male", "timbre": "high", "ID": 13}, "surprised",
         "3fe3711e3544ef0efb0cba86bff22cd30079978284cff6d695a9caf8b96e77ad"),
    ]:
        content, style = fr.face_controls(env, profile, emotion)
        assert hashlib.sha256(fr.render_controls(content, style).tobytes()).hexdigest() == digest, emotion
        assert hashlib.sha256(fr.render_frames(env, profile, emotion).tobytes()).hexdigest() == digest


def test_face_renderer_draws_the_avatar_for_as_long_as_the_speech(tmp_path):
    import av

    sr = 24000
    wav = tmp_path / "reply.wav"
    samples = (3000 * np.sin(np.arange(int(1.23 * sr)) / 9)).astype(np.int16)
    write_wav(wav, samples, sr)
    content, style = fr.face_controls(np.abs(np.sin(np.linspace(0, 6, 20))), PROFILE, "empathetic")
    n, notes = fr.FaceRenderer().render(content, style, wav, tmp_path / "reply.mp4")
    assert n == fr.frame_count(len(samples), sr) == 31 and notes  # ceil(1.23 s x 25); 20 rows predicted
    with av.open(str(tmp_path / "reply.mp4")) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[0])]
    assert len(frames) == n and frames[0].shape == (fr.AVATAR_SIZE, fr.AVATAR_SIZE, 3)


def test_a_pinned_listener_is_drawn_as_the_avatar_the_corpus_gives_its_profile():
    """`chat --listener` names a profile, not a person: the face is that profile's identity in the sample and
    ED (ID = combo index), the avatar the model saw answer with it; an ID given explicitly is kept."""
    from empatheia_jax.data import ed

    looks = set()
    for i, (age, gender, timbre) in enumerate(ed.PROFILE_COMBOS):
        style, rate = fr.FaceRenderer.avatar_style({"age": age, "gender": gender, "timbre": timbre}, "happy")
        np.testing.assert_array_equal(style, fr.face_controls(np.zeros(1), ed.profile_json(i), "happy")[1])
        assert rate == 1.0
        avatar = fr.decode_style(style)
        assert (avatar["age"], avatar["gender"], avatar["timbre"], avatar["emotion"]) == (age, gender, timbre,
                                                                                          "happy")
        looks.add((avatar["skin"], avatar["hair"], avatar["iris"]))
    assert len(looks) > 12
    chosen, _ = fr.FaceRenderer.avatar_style(PROFILE, "sad")
    np.testing.assert_array_equal(chosen, fr.face_controls(np.zeros(1), PROFILE, "sad")[1])
    with pytest.raises(ValueError, match="age"):
        fr.FaceRenderer.avatar_style({"age": "teen", "gender": "male", "timbre": "low"}, "sad")
