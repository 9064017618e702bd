"""Video metrics on real frames of the procedural talking face (empatheia_jax/generators/face_render.py):
each metric is at its
best for gold vs gold and gets worse on a perturbed copy (shifted, blurred, out of sync)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from empatheia_jax.eval.metrics import speech as sm
from empatheia_jax.eval.metrics import video as vm
from empatheia_jax.generators.face_paint import EXPRESSIONS
from empatheia_jax.generators.face_render import _blink_state, render_frames

CLIPS = (
    ({"age": "young", "gender": "female", "timbre": "mid", "ID": 1}, "happy"),
    ({"age": "elderly", "gender": "male", "timbre": "low", "ID": 7}, "sad"),
    ({"age": "child", "gender": "male", "timbre": "high", "ID": 3}, "surprised"),
)
N_FRAMES = 50  # 2 s at 25 fps


def envelope(n: int = N_FRAMES, seed: int = 0) -> np.ndarray:
    """Speech-like RMS envelope per frame: syllables of 3-7 frames (sine-squared bumps of random loudness)
    between pauses of 0-3 frames: neither a shift nor another seed lines up with it by construction."""
    rng = np.random.default_rng(seed)
    out: list[float] = []
    while len(out) < n:
        out += [0.0] * int(rng.integers(0, 4))
        k = int(rng.integers(3, 8))
        out += list(rng.uniform(0.3, 1.0) * np.sin(np.pi * (np.arange(k) + 0.5) / k) ** 2)
    return np.array(out[:n])


def shifted(frames: np.ndarray, px: int) -> np.ndarray:
    """Content moved px pixels right; the left edge column repeated into the gap."""
    out = np.roll(frames, px, axis=2)
    out[:, :, :px] = frames[:, :, :1]
    return out


def blurred(frames: np.ndarray, sigma: float = 1.2) -> np.ndarray:
    from scipy.ndimage import gaussian_filter

    return np.round(gaussian_filter(frames.astype(np.float64), sigma=(0, sigma, sigma, 0))).astype(np.uint8)


@pytest.fixture(scope="module")
def clips():
    """Per clip: (frames [50, 128, 128, 3], the envelope that drove the mouth, landmarks)."""
    out = []
    for i, (profile, emotion) in enumerate(CLIPS):
        env = envelope(seed=i)
        frames = render_frames(env, profile, emotion)
        out.append((frames, env, vm.landmarks(frames)))
    return out


def test_facemesh_detects_rendered_faces():
    """FaceMesh finds every procedural face at the renderer's native 128x128, for three avatars (child, young
    woman, elderly man with glasses) and every expression, incl. the half- and fully-closed eyes of a blink
    and the open "O" of surprise."""
    env = envelope(85, seed=5)  # one blink period (3.4 s)
    for profile, _ in CLIPS:
        blinks = [i for i in range(85) if _blink_state(i, profile["ID"], 25)]
        picked = sorted({*range(0, 85, 12), *blinks})  # ~8 open-eyed frames + the 4 blink frames
        for emotion in EXPRESSIONS:
            frames = render_frames(env, profile, emotion)[picked]
            lm = vm.landmarks(frames)
            assert lm.shape == (len(picked), vm.N_LANDMARKS, 2) and lm.dtype == np.float32
            assert vm.detection_rate(lm) == 1.0, (profile, emotion)
            assert np.all((lm > 0) & (lm < vm.LMD_FRAME)), (profile, emotion)
    blank = np.full((2, 128, 128, 3), 200, np.uint8)
    lm = vm.landmarks(blank)
    assert np.isnan(lm).all() and vm.detection_rate(lm) == 0.0
    assert vm.shared_face_mesh() is vm.shared_face_mesh()


def test_mouth_subset_is_facemesh_lips():
    vm._patch_protobuf()
    from mediapipe.python.solutions.face_mesh_connections import FACEMESH_LIPS

    assert set(vm.MOUTH_LANDMARKS) == {i for edge in FACEMESH_LIPS for i in edge}
    assert len(vm.MOUTH_LANDMARKS) == 40


def test_ssim_psnr(clips):
    gold = clips[0][0]
    assert vm.ssim(gold, gold) == 1.0 and vm.psnr(gold, gold) == math.inf
    blur, shift = blurred(gold), shifted(gold, 3)
    for worse in (blur, shift):
        assert vm.ssim(gold, worse) < 0.95
        assert 10.0 < vm.psnr(gold, worse) < 40.0
    assert vm.ssim(gold, shifted(gold, 6)) < vm.ssim(gold, shift)  # monotone in the perturbation
    assert vm.psnr(gold, blurred(gold, 2.0)) < vm.psnr(gold, blur)
    other = clips[1][0]  # another avatar: far worse than a blurred copy
    assert vm.ssim(gold, other) < vm.ssim(gold, blur)
    # different lengths: the first min(T) frames
    assert vm.ssim(gold, gold[:20]) == 1.0 and vm.psnr(gold[:30], gold) == math.inf
    assert vm.ssim(gold[:20], np.concatenate([gold[:20], blur[20:]])) == 1.0
    assert isinstance(vm.ssim(gold, blur), float) and isinstance(vm.psnr(gold, blur), float)
    with pytest.raises(ValueError, match="uint8"):
        vm.ssim(gold, gold.astype(np.float32))
    with pytest.raises(ValueError, match="sizes differ"):
        vm.psnr(gold, gold[:, :64, :64])


def test_cpbd_no_reference_sharpness(clips):
    gold = clips[0][0][:10]
    sharp = vm.cpbd(gold)
    assert 0.6 < sharp <= 1.0, sharp
    assert vm.cpbd(blurred(gold, 1.0)) < 0.5 * sharp
    assert vm.cpbd(blurred(gold, 2.0)) <= vm.cpbd(blurred(gold, 1.0))
    assert vm.cpbd(gold, stride=5) == pytest.approx(np.mean([vm.cpbd(gold[:1]), vm.cpbd(gold[5:6])]))


def test_lmd(clips):
    gold, _, lm = clips[0]
    again = vm.landmarks(gold)  # static-image mode: the same frame gives the same landmarks
    assert vm.lmd(lm, again) == 0.0 and vm.lmd(lm, again, "mouth") == 0.0
    # a 3-pixel shift of the frame moves every landmark by ~3 pixels of the 128-px frame
    lm_shift = vm.landmarks(shifted(gold, 3))
    assert 2.5 < vm.lmd(lm, lm_shift) < 3.5 and 2.5 < vm.lmd(lm, lm_shift, "mouth") < 3.5
    # normalisation: the same clip at 256x256 lands on the same 128-px coordinates (well under a pixel)
    up = np.repeat(np.repeat(gold[:10], 2, axis=1), 2, axis=2)
    assert vm.lmd(lm[:10], vm.landmarks(up)) < 1.0
    # the mouth subset sees a different mouth where the whole face barely changes
    closed = render_frames(np.zeros(N_FRAMES), *CLIPS[0])
    lm_closed = vm.landmarks(closed)
    assert vm.lmd(lm, lm_closed, "mouth") > 1.5 * vm.lmd(lm, lm_closed, "full") > 0
    # lengths aligned, frames without a face left out, nothing at all: NaN
    assert vm.lmd(lm, lm_shift[:10]) == pytest.approx(vm.lmd(lm[:10], lm_shift[:10]))
    holes = lm_shift.copy()
    holes[5:] = np.nan
    assert vm.lmd(lm, holes) == pytest.approx(vm.lmd(lm[:5], lm_shift[:5]))
    assert math.isnan(vm.lmd(lm, np.full_like(lm, np.nan)))
    with pytest.raises(ValueError, match="subset"):
        vm.lmd(lm, lm, "eyes")


def test_lip_sync(clips):
    for _, env, lm in clips:
        track = vm.mouth_opening(lm)
        # the rendered mouth follows the envelope that drove it
        good = vm.lip_sync(lm, env)
        assert good > 0.9, good
        assert vm.lip_sync(track, env) == good
        # ~10 frames (400 ms) out of sync, either way: far outside the +-2 frame lag search
        late = np.concatenate([np.zeros(10), env[:-10]])
        early = np.concatenate([env[10:], np.zeros(10)])
        assert vm.lip_sync(lm, late) < good - 0.4 and vm.lip_sync(lm, early) < good - 0.4
        # one frame of lag is within the search
        assert vm.lip_sync(lm, np.concatenate([np.zeros(1), env[:-1]])) > 0.8
        # another utterance's envelope
        assert vm.lip_sync(lm, envelope(seed=99)) < good - 0.4
    frames, env, lm = clips[0]
    assert vm.lip_sync(frames[:20], env) == pytest.approx(vm.lip_sync(lm[:20], env))
    assert vm.lip_sync(np.ones(N_FRAMES), env) == 0.0  # a mouth that never moves
    assert math.isnan(vm.lip_sync(lm, np.full(N_FRAMES, 0.5)))  # nothing to follow
    with pytest.raises(ValueError, match="mouth track"):
        vm.lip_sync(np.zeros((3, 3)), env)


def test_style_probe_recovers_gender_and_emotion():
    """Probes fitted on 3 avatar identities recover gender and emotion of 2 unseen ones; age and timbre vary
    as nuisance. Shuffled training labels bring the emotion probe down to chance."""
    ages, timbres = ("child", "young", "middle-aged", "elderly"), ("low", "mid", "high")
    emotions = ("happy", "sad", "angry", "surprised")
    env = envelope(10, seed=3)
    feats, labels, ids = [], {"gender": [], "emotion": []}, []
    for pid in range(5):
        for g, gender in enumerate(("female", "male")):
            for e, emotion in enumerate(emotions):
                profile = {"age": ages[(pid + e) % 4], "gender": gender, "timbre": timbres[(pid + g + e) % 3],
                           "ID": pid}
                feats.append(vm.video_style_features(render_frames(env, profile, emotion)))
                labels["gender"].append(gender)
                labels["emotion"].append(emotion)
                ids.append(pid)
    x, ids = np.stack(feats), np.array(ids)
    assert x.shape == (40, vm.STYLE_DIM) and np.isfinite(x).all()
    assert max(stop for _, stop in vm.STYLE_GROUPS.values()) == vm.STYLE_DIM

    def pick(rows, y=labels):
        return {k: [v[i] for i in rows] for k, v in y.items()}

    train, test = np.flatnonzero(ids < 3), np.flatnonzero(ids >= 3)
    probe = sm.LinearStyleProbe().fit(x[train], pick(train))
    acc = probe.accuracy(x[test], pick(test))
    assert acc["gender"] >= 0.9 and acc["emotion"] >= 0.9, acc
    report = probe.report(x[test], pick(test))
    assert report["emotion"]["n_classes"] == 4 and report["gender"]["majority"] == 0.5
    json.dumps(report)
    assert probe.predict(x[test[:3]])["gender"] == pick(test[:3])["gender"]
    chance = []
    for seed in range(8):  # one permutation may keep many labels in place: average over several
        rng = np.random.default_rng(seed)
        shuffled = {k: list(rng.permutation(v)) for k, v in labels.items()}
        probe_s = sm.LinearStyleProbe().fit(x[train], pick(train, shuffled))
        chance.append(probe_s.accuracy(x[test], pick(test)))
    assert np.mean([c["emotion"] for c in chance]) < 0.5, chance
    with pytest.raises(ValueError, match="age"):
        probe.accuracy(x[test], {"age": ["young"] * len(test)})
    # no face: NaN features
    assert np.isnan(vm.video_style_features(np.full((2, 128, 128, 3), 200, np.uint8))).all()


def test_video_rows(clips):
    gold = [c[0][:30] for c in clips[:2]]
    envs = [c[1][:30] for c in clips[:2]]
    systems = {"gold": gold, "blurred": [blurred(f) for f in gold], "shifted": [shifted(f, 3) for f in gold],
               "other": gold[::-1]}
    features: dict = {}
    rows = vm.video_rows(systems, gold, envs, progress=False, features=features)
    json.dumps(rows)
    same, blur, shift, other = rows["gold"], rows["blurred"], rows["shifted"], rows["other"]
    assert same["ssim"] == 1.0 and same["psnr"] == math.inf and same["f_lmd"] == 0.0 and same["m_lmd"] == 0.0
    assert same["lip_sync"] > 0.9 and same["face_detected"] == 1.0 and same["n"] == 2.0
    assert blur["ssim"] < 0.95 and blur["cpbd"] < 0.5 * same["cpbd"] and math.isfinite(blur["psnr"])
    assert 2.5 < shift["f_lmd"] < 3.5 and shift["ssim"] < 0.95
    assert other["lip_sync"] < same["lip_sync"] - 0.4 and other["f_lmd"] > 1.0 and other["ssim"] < 0.9
    assert all(isinstance(v, float) for row in rows.values() for v in row.values())
    assert set(features) == {"gold", *systems} and features["gold"].shape == (2, vm.STYLE_DIM)
    np.testing.assert_array_equal(features["gold"], features["other"][::-1])
    with pytest.raises(ValueError, match="1 clips for 2 gold"):
        vm.video_rows({"short": gold[:1]}, gold, envs, progress=False)


def test_import_is_cheap_and_facemesh_is_quiet():
    """Importing the module loads none of the heavy libraries; loading FaceMesh and running it prints nothing
    (no protobuf AttributeError, no TFLite/absl log lines, no Python warning)."""
    code = ("import sys; from empatheia_jax.eval.metrics import video as vm; "
            "heavy = {'mediapipe', 'skimage', 'cpbd', 'scipy', 'cv2'} & set(sys.modules); "
            "assert not heavy, heavy; "
            "from empatheia_jax.generators.face_render import render_frames; import numpy as np; "
            "p = {'age': 'young', 'gender': 'male', 'timbre': 'mid'}; "
            "f = render_frames(np.linspace(0, 1, 3), p, 'angry'); "
            "assert vm.detection_rate(vm.landmarks(f)) == 1.0")
    res = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "" and res.stderr == "", (res.stdout, res.stderr)


def test_video_rows_of_a_text_corpus_and_of_a_model_without_its_sd(tmp_path):
    """A text corpus (imported ED) has no recordings: the gold envelope lip sync reads is the gold reply
    spoken from its speech targets, the same as the gold_speech wav the sample writes. A model evaluated
    without its SD (a ccl checkpoint) draws its C^v on the gold avatar: lip sync and frame rows, no style
    rows; the gold mouth scores as the gold, a mouth that moves at random far below it."""
    import shutil

    from empatheia_jax.eval import video as video_eval
    from tests.helpers import make_tiny_shards

    shards = make_tiny_shards(tmp_path / "data", counts=(("train", 10), ("test", 2)), real_targets=True,
                              mouth="replies")
    recorded = video_eval.VideoEval(shards, "test", examples=2, progress=False)
    shutil.rmtree(shards.parent / "raw" / video_eval.GOLD_SPEECH)
    spoken = video_eval.VideoEval(shards, "test", examples=2, progress=False)
    assert len(spoken.items) == 2
    for a, b in zip(recorded.items, spoken.items, strict=True):
        np.testing.assert_array_equal(a["envelope"], b["envelope"])
    gold = {it["record_index"]: {"video_content": it["content"]} for it in spoken.items}
    rows = spoken.model_rows("trained", gold)
    assert rows["video_examples"] == 2 and rows["video_lip_sync"] > 0.5, rows
    assert not any(k.endswith("_acc") for k in rows), rows
    rng = np.random.default_rng(0)
    noise = {i: {"video_content": c["video_content"][rng.permutation(len(c["video_content"]))]}
             for i, c in gold.items()}  # the gold mouth shapes in a random order
    worse = spoken.model_rows("trained", noise)
    assert worse["video_lip_sync"] < rows["video_lip_sync"] - 0.2, (worse, rows)
