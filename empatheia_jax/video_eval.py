"""The video rows of `empatheia eval`: Empatheia's C^v/S^v drawn by the face generator against the gold video.

The embedded default's video generator is the procedural face renderer (data/face_render.py, a stand-in for
DreamTalk with a documented control space); its gold video is `render_controls` of the gold targets, the
very frames the sample's mp4 was encoded from, so gold and generated frames are compared raw (no h264 on
either side). What is compared (docs/design.md "Video out"):
- **the model** (trained column): `render_controls(C^v, S^v)` with C^v read over the GOLD reply's frames
  (teacher-forced, the rows its target has), so generated and gold clips have the same length and play
  with the same speech;
- **mean_style**: the gold controls' mouth track with the mean train style vector, decoded to its nearest
  avatar: an avatar that moves right and looks like everyone's average;
- **pipeline_tts**: the gold mouth track on the avatar of the majority train listener profile (the
  Pipeline baseline's fixed avatar).
Rows (`video_metrics.video_rows`): SSIM, PSNR, CPBD, F-LMD / M-LMD (FaceMesh landmarks), lip sync
(correlation of the mouth opening with the gold speech's envelope, SyncNet's weights being unobtainable),
and `video_{age,gender,timbre,emotion}_acc`: which avatar the style draws (`face_render.decode_style`)
against the listener's labels and the calm listener expression, over every test record with a style target.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from empatheia_jax import input_pipeline as ip

VIDEO_METRICS = ("video_ssim", "video_psnr", "video_cpbd", "video_f_lmd", "video_m_lmd", "video_lip_sync",
                 "video_age_acc", "video_gender_acc", "video_timbre_acc", "video_emotion_acc",
                 "video_examples")
HIGHER_IS_BETTER = frozenset({"video_ssim", "video_psnr", "video_cpbd", "video_lip_sync", "video_age_acc",
                              "video_gender_acc", "video_timbre_acc", "video_emotion_acc"})
LOWER_IS_BETTER = frozenset({"video_f_lmd", "video_m_lmd"})
_ROW_NAMES = {"ssim": "video_ssim", "psnr": "video_psnr", "cpbd": "video_cpbd", "f_lmd": "video_f_lmd",
              "m_lmd": "video_m_lmd", "lip_sync": "video_lip_sync", "n": "video_examples"}
LISTENER_EXPRESSION = "empathetic"


class VideoEvalUnavailable(RuntimeError):
    """The video rows cannot be computed for these shards (why, naming the file or the target source)."""


class VideoEval:
    """What every column's video rows share: the gold clips, their speech envelopes, the reference avatars."""

    def __init__(self, shards_dir: str | os.PathLike, split: str = "test", *, train_split: str = "train",
                 examples: int = 6, progress: bool = True):
        from data.face_render import decode_style, face_controls
        from data.speech_synth import read_wav, speech_envelope
        from empatheia_jax.evaluate import check_split

        manifest = check_split(shards_dir, split)
        kinds = (manifest.get("targets") or {}).get("kinds") or {}
        sources = {k: (kinds.get(k) or {}).get("source") for k in ("video_content", "video_style")}
        if set(sources.values()) != {"face_render"}:
            raise VideoEvalUnavailable(f"{shards_dir}: video targets are {sources}, not the face generator's "
                                       "controls, so there is no generator here to draw them with")
        media = Path(manifest.get("raw", "")) / "media"
        self.examples, self.progress = int(examples), progress
        check_split(shards_dir, train_split)
        reader = ip.ShardReader.for_split(shards_dir, split)
        self.labels: dict[int, dict[str, str]] = {}
        self.items: list[dict[str, Any]] = []
        for i in range(len(reader)):
            rec = reader[i]
            targets = rec.get("targets") or {}
            if "video_style" in targets:
                self.labels[i] = {**{k: str(rec["listener_profile"][k]) for k in ("age", "gender", "timbre")},
                                  "emotion": LISTENER_EXPRESSION}
            wav = media / f"{rec['response_utt_id']}.wav"
            if len(self.items) < self.examples and {"video_content", "video_style"} <= targets.keys():
                if not wav.is_file():
                    raise VideoEvalUnavailable(f"{wav}: missing (lip sync reads the gold speech)")
                sr, x = read_wav(wav)
                self.items.append({"record_index": i, "content": np.asarray(targets["video_content"]),
                                   "style": np.asarray(targets["video_style"]),
                                   "envelope": speech_envelope(x, sr)})
        if self.examples and not self.items:
            raise VideoEvalUnavailable(f"no {split} record of {shards_dir} has video targets")
        styles, profiles = [], []
        train = ip.ShardReader.for_split(shards_dir, train_split)
        for i in range(len(train)):
            rec = train[i]
            s = (rec.get("targets") or {}).get("video_style")
            if s is not None:
                styles.append(np.asarray(s, np.float64))
                profiles.append(tuple(str(rec["listener_profile"][k]) for k in ("age", "gender", "timbre")))
        if not styles:
            raise VideoEvalUnavailable(f"{shards_dir}: the {train_split} split has no video_style targets")
        self.mean_style = np.mean(styles, axis=0).astype(np.float32)
        age, gender, timbre = collections.Counter(profiles).most_common(1)[0][0]
        _, self.pipeline_style = face_controls(np.zeros(1), {"age": age, "gender": gender, "timbre": timbre,
                                                             "ID": 0}, LISTENER_EXPRESSION)
        self._decode = decode_style
        self.gold = [self._draw(it["content"], it["style"]) for it in self.items]

    @staticmethod
    def _draw(content: np.ndarray, style: np.ndarray) -> np.ndarray:
        from data.face_render import render_controls

        return render_controls(content, style)

    def _rows(self, name: str, clips: list[np.ndarray], styles: Mapping[int, np.ndarray]) -> dict[str, float]:
        from empatheia_jax.video_metrics import video_rows

        out: dict[str, float] = {}
        if clips:
            rows = video_rows({name: clips}, self.gold, [it["envelope"] for it in self.items],
                              progress=self.progress)[name]
            out = {_ROW_NAMES[k]: float(v) for k, v in rows.items() if k in _ROW_NAMES}
        idx = [i for i in sorted(self.labels) if i in styles]
        if idx:
            drawn = [self._decode(styles[i]) for i in idx]
            for attr in ("age", "gender", "timbre", "emotion"):
                out[f"video_{attr}_acc"] = float(np.mean([str(d[attr]) == self.labels[i][attr]
                                                          for d, i in zip(drawn, idx, strict=True)]))
        return out

    def model_rows(self, name: str, collected: Mapping[int, Mapping[str, Any]]) -> dict[str, float]:
        """The video rows of a model from `evaluate.teacher_forced_metrics(collect=...)`'s outputs."""
        missing = [it["record_index"] for it in self.items
                   if "video_content" not in collected.get(it["record_index"], {})]
        if missing:
            raise ValueError(f"no predicted video features for test records {missing[:5]}")
        clips = [self._draw(collected[it["record_index"]]["video_content"],
                            collected[it["record_index"]]["video_style"]) for it in self.items]
        styles = {i: np.asarray(c["video_style"]) for i, c in collected.items() if "video_style" in c}
        return self._rows(name, clips, styles)

    def reference_columns(self) -> dict[str, dict[str, float]]:
        """mean_style and pipeline_tts (module docstring): the gold mouth track, one fixed avatar each."""
        out = {}
        for name, style in (("mean_style", self.mean_style), ("pipeline_tts", self.pipeline_style)):
            clips = [self._draw(it["content"], style) for it in self.items]
            out[name] = self._rows(name, clips, {i: style for i in self.labels})
        return out


__all__ = ["VIDEO_METRICS", "VideoEval", "VideoEvalUnavailable"]
