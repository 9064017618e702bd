"""Generator-target files: round trip, shape checks naming file+key, atomic commits, stand-in targets."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile as sf

from empatheia_jax.data.targets import (
    STAND_IN,
    StandinTargets,
    TargetFormatError,
    TargetReader,
    TargetWriter,
    standin_units,
)


def _rand(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_round_trip_multiple_shards_and_kinds(tmp_path):
    content = {f"dia1utt{k}_3": _rand((k + 2, 1024), k) for k in range(5)}
    style = {f"dia1utt{k}_3": _rand((256,), 10 + k) for k in range(5)}
    with TargetWriter(tmp_path, "speech_content", "styletts2", 1024, shard_size=2) as w:
        for key, a in content.items():
            w.add(key, a)
    with TargetWriter(tmp_path, "video_style", STAND_IN, 256, shard_size=10, extra_meta={"seed": 0}) as w:
        for key, a in style.items():
            w.add(key, a)
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["speech_content"]["files"] == [
        f"speech_content-0000{i}-of-00003.safetensors" for i in range(3)
    ]
    assert meta["speech_content"]["shape"] == ["T", 1024] and meta["video_style"]["shape"] == [256]
    assert meta["video_style"]["source"] == "stand-in" and meta["video_style"]["seed"] == 0
    r = TargetReader(tmp_path)
    assert r.kinds == ("speech_content", "video_style")
    assert r.is_stand_in("video_style") and not r.is_stand_in("speech_content")
    for key in content:
        np.testing.assert_array_equal(r.get("speech_content", key), content[key])
        np.testing.assert_array_equal(r.get("video_style", key), style[key])
    assert r.get("speech_content", "dia1utt9_3") is None
    with pytest.raises(KeyError, match="no 'speech_style' targets"):
        r.get("speech_style", "dia1utt0_3")
    assert r.verify() == []
    assert sorted(r.keys("speech_content")) == sorted(content)


def test_writer_rejects_bad_shapes_and_duplicates(tmp_path):
    with TargetWriter(tmp_path, "speech_content", "styletts2", 1024) as w:
        with pytest.raises(TargetFormatError, match=r"shape \[3, 512\], expected \['T', 1024\]"):
            w.add("u0", np.zeros((3, 512)))
        with pytest.raises(TargetFormatError, match="shape"):
            w.add("u0", np.zeros((1024,)))
        w.add("u0", np.zeros((2, 1024)))
        with pytest.raises(ValueError, match="duplicate"):
            w.add("u0", np.zeros((2, 1024)))
        with pytest.raises(TargetFormatError, match="non-finite"):
            w.add("u1", np.full((2, 1024), np.nan))
    with pytest.raises(ValueError, match="unknown target kind"):
        TargetWriter(tmp_path, "speech_contents", "styletts2")


def test_reader_dim_mismatch_names_file_and_key(tmp_path):
    with TargetWriter(tmp_path, "video_content", "dreamtalk", dim=8) as w:
        w.add("diaXutt1_2", np.ones((4, 8)))
    meta = json.loads((tmp_path / "meta.json").read_text())
    meta["video_content"]["dim"] = 256  # meta and tensors now disagree
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    r = TargetReader(tmp_path)
    with pytest.raises(TargetFormatError) as e:
        r.get("video_content", "diaXutt1_2")
    assert "video_content-00000-of-00001.safetensors" in str(e.value) and "diaXutt1_2" in str(e.value)
    assert "[4, 8]" in str(e.value) and "256" in str(e.value)
    assert len(r.verify()) == 1


def test_atomic_commit_and_interrupted_write(tmp_path):
    # an exception inside the block leaves nothing behind: no shards, no meta -> reader refuses
    with (
        pytest.raises(RuntimeError, match="boom"),
        TargetWriter(tmp_path, "speech_style", STAND_IN, shard_size=1) as w,
    ):
        w.add("a", np.zeros(256))
        w.add("b", np.zeros(256))  # flushed to a temporary shard already
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) in ([], [tmp_path / ".meta.lock"])
    with pytest.raises(FileNotFoundError, match="meta.json does not exist"):
        TargetReader(tmp_path)
    # nothing visible before close(); rewriting a kind replaces its shards (stale ones removed)
    w = TargetWriter(tmp_path, "speech_style", STAND_IN, shard_size=1)
    for k in "abc":
        w.add(k, np.full(256, ord(k), np.float32))
    assert not (tmp_path / "meta.json").exists()
    w.close()
    assert len(list(tmp_path.glob("speech_style-*.safetensors"))) == 3
    with TargetWriter(tmp_path, "speech_style", STAND_IN, shard_size=5) as w:
        w.add("z", np.ones(256))
    assert [p.name for p in tmp_path.glob("speech_style-*.safetensors")] == [
        "speech_style-00000-of-00001.safetensors"
    ]
    r = TargetReader(tmp_path)
    assert r.get("speech_style", "a") is None and r.get("speech_style", "z")[0] == 1.0
    # a file listed in meta but missing is reported by name
    (tmp_path / "speech_style-00000-of-00001.safetensors").unlink()
    with pytest.raises(TargetFormatError, match="speech_style-00000-of-00001.safetensors is missing"):
        TargetReader(tmp_path)


def test_standin_targets_deterministic_and_shaped(tmp_path):
    sr = 16000
    t = np.arange(int(1.2 * sr)) / sr
    for name, f0 in (("low", 110.0), ("high", 250.0)):
        sf.write(tmp_path / f"{name}.wav", (0.3 * np.sin(2 * np.pi * f0 * t)).astype(np.float32), sr)
    import av

    with av.open(str(tmp_path / "v.mp4"), "w") as c:
        s = c.add_stream("libx264", rate=25)
        s.width = s.height = 32
        s.pix_fmt = "yuv420p"
        for i in range(10):
            img = np.full((32, 32, 3), 30 + 10 * i, np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    text = "I'm so  sorry to hear that!"
    a = StandinTargets(seed=0).compute(text, tmp_path / "low.wav", tmp_path / "v.mp4")
    b = StandinTargets(seed=0).compute(text, tmp_path / "low.wav", tmp_path / "v.mp4")
    assert standin_units(text) == "i'm so sorry to hear that!"
    assert a["speech_content"].shape == (len(standin_units(text)), 1024)
    assert a["video_content"].shape == (30, 256)  # 1.2 s at 25 fps
    assert a["speech_style"].shape == (256,) and a["video_style"].shape == (256,)
    for k in a:
        assert a[k].dtype == np.float32
        np.testing.assert_array_equal(a[k], b[k])
    # style follows the audio; another seed is another projection
    high = StandinTargets(seed=0).speech_style(tmp_path / "high.wav")
    assert np.linalg.norm(high - a["speech_style"]) > 0.1 * np.linalg.norm(a["speech_style"])
    other = StandinTargets(seed=1).speech_content(text)
    assert not np.allclose(other, a["speech_content"])
    # a row depends on its character and its neighbours only (plus position): learnable from the text
    st = StandinTargets(seed=0)
    h, j = st.speech_content("hello"), st.speech_content("jello")
    assert not np.allclose(h[0], j[0]) and not np.allclose(h[1], j[1])
    np.testing.assert_array_equal(h[2:], j[2:])
