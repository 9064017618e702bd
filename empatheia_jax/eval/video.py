"""The video rows of `empatheia eval`: Empatheia's C^v/S^v drawn by the face generator against the gold video.

The embedded default's video generator is the procedural face renderer
(empatheia_jax/generators/face_render.py, a stand-in for
DreamTalk with a documented control space); its gold video is `render_controls` of the gold targets, the
very frames the sample's mp4 was encoded from, so gold and generated frames are compared raw (no h264 on
either side). What is compared (docs/design.md "Video out"):
- **the model** (trained column): `render_controls(C^v, S^v)` with C^v read over the GOLD reply's frames
  (teacher-forced, the rows its target has), so generated and gold clips have the same length and play
  with the same speech; S^v shows the expression of the reply's emotion (`FaceRenderer.expressed`, as
  chat's avatar does: the class of the generated CoE step 2, else the SD's, `speech.predicted_emotions`);
- **mean_style**: the gold controls' mouth track with the mean train style vector, decoded to its nearest
  avatar: an avatar that moves right and looks like everyone's average;
- **pipeline_tts**: the gold mouth track on the avatar of the majority train listener profile (the
  Pipeline baseline's fixed avatar).
Rows (`video_metrics.video_rows`): SSIM, PSNR, CPBD, F-LMD / M-LMD (FaceMesh landmarks), lip sync
(correlation of the mouth opening with the gold speech's envelope, SyncNet's weights being unobtainable;
the gold speech is the speech whose timing drew the gold clip: RAW/gold_speech's Kokoro reply for a
clip with frame units, `video_units`, which only a phoneme mouth has, else the media wav),
and `video_{age,gender,timbre,emotion}_acc`: the profile and expression recovered FROM THE FRAMES of each
test record's rendered avatar (PROBE_FRAMES frames of it) by a `speech_metrics.LinearStyleProbe`, against the
listener's labels and the expression the gold avatar shows (its video_style target: the listener's answer
to the dialogue's emotion, `kokoro_voices.utterance_style`), over every test record with a style target.

`video_pinned_*_acc` (the model's column only): the same probe on the avatar `chat --listener` would draw
had the user chosen each record's listener profile (`serve.avatar.pinned_styles`, in the style the
predicted emotion calls for), over the model's own content rows: is the chosen avatar seen as chosen, and
does its expression follow the predicted emotion to the gold avatar's.

The probe is fitted here, on train records' gold clips, each drawn with one of the nine expressions in turn
(a listener shows only the expressions it answers with, so the train replies alone would not teach all
nine): it reads what
a viewer sees, FaceMesh geometry and colours, not the style vector. `gold_rows` scores the probe on the gold
test clips, the ceiling the other columns are read against.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from empatheia_jax.data.shard_format import target_source
from empatheia_jax.data.shard_reader import ShardReader
from empatheia_jax.eval.speech import gold_speech_from_targets, predicted_emotions

GOLD_SPEECH = "gold_speech"
"""RAW's folder of the test replies' Kokoro gold speech (data/make_sample.py), as the speech rows read it."""
VIDEO_METRICS = ("video_ssim", "video_psnr", "video_cpbd", "video_f_lmd", "video_m_lmd", "video_lip_sync",
                 "video_age_acc", "video_gender_acc", "video_timbre_acc", "video_emotion_acc",
                 "video_pinned_age_acc", "video_pinned_gender_acc", "video_pinned_timbre_acc",
                 "video_pinned_emotion_acc", "video_examples")
HIGHER_IS_BETTER = frozenset({"video_ssim", "video_psnr", "video_cpbd", "video_lip_sync", "video_age_acc",
                              "video_gender_acc", "video_timbre_acc", "video_emotion_acc",
                              "video_pinned_age_acc", "video_pinned_gender_acc", "video_pinned_timbre_acc",
                              "video_pinned_emotion_acc"})
LOWER_IS_BETTER = frozenset({"video_f_lmd", "video_m_lmd"})
_ROW_NAMES = {"ssim": "video_ssim", "psnr": "video_psnr", "cpbd": "video_cpbd", "f_lmd": "video_f_lmd",
              "m_lmd": "video_m_lmd", "lip_sync": "video_lip_sync", "n": "video_examples"}
LISTENER_EXPRESSION = "empathetic"  # the Pipeline baseline's fixed, calm avatar
PROBE_FRAMES = 8
"""Frames of a clip the style probe reads, evenly spaced: the avatar is constant, only the mouth and the
eyelids move, and the probe's features are medians and means over frames (~6.5 ms a frame)."""
PROBE_CLIPS = 72
"""Train clips the probe is fitted on: 8 per expression (the first train records with video targets)."""


class VideoEvalUnavailable(RuntimeError):
    """The video rows cannot be computed for these shards (why, naming the file or the target source)."""


class VideoEval:
    """What every column's video rows share: the gold clips, their speech envelopes, the reference avatars."""

    def __init__(self, shards_dir: str | os.PathLike, split: str = "test", *, train_split: str = "train",
                 examples: int = 6, progress: bool = True):
        from empatheia_jax.data.splits import check_split, emotion_map_of
        from empatheia_jax.generators.face_render import FaceRenderer, decode_style
        manifest = check_split(shards_dir, split)
        self.emotion_classes = tuple(emotion_map_of(manifest).classes)
        sources = {k: target_source(manifest, k) for k in ("video_content", "video_style")}
        if set(sources.values()) != {"face_render"}:
            raise VideoEvalUnavailable(f"{shards_dir}: video targets are {sources}, not the face generator's "
                                       "controls, so there is no generator here to draw them with")
        media = Path(manifest.get("raw", "")) / "media"
        gold_speech = Path(manifest.get("raw", "")) / GOLD_SPEECH
        self.examples, self.progress = int(examples), progress
        check_split(shards_dir, train_split)
        reader = ShardReader.for_split(shards_dir, split)
        self.labels: dict[int, dict[str, str]] = {}
        self.gold_controls: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # of every labelled record
        self.items: list[dict[str, Any]] = []
        for i in range(len(reader)):
            rec = reader[i]
            targets = rec.get("targets") or {}
            if {"video_content", "video_style"} <= targets.keys():
                self.gold_controls[i] = (np.asarray(targets["video_content"]),
                                         np.asarray(targets["video_style"], np.float32))
                # the expression the gold avatar shows is the label: the listener's answer to the dialogue's
                # emotion (kokoro_voices.utterance_style) in current targets, always calm in older ones
                self.labels[i] = {**{k: str(rec["listener_profile"][k]) for k in ("age", "gender", "timbre")},
                                  "emotion": decode_style(self.gold_controls[i][1])["emotion"]}
            if len(self.items) < self.examples and i in self.labels:
                content, style = self.gold_controls[i]
                self.items.append({"record_index": i, "content": content, "style": style,
                                   "envelope": self._gold_envelope(rec, media, gold_speech)})
        if self.examples and not self.items:
            raise VideoEvalUnavailable(f"no {split} record of {shards_dir} has video targets")
        styles, profiles, probe_clips = [], [], []
        train = ShardReader.for_split(shards_dir, train_split)
        for i in range(len(train)):
            rec = train[i]
            targets = rec.get("targets") or {}
            s = targets.get("video_style")
            if s is not None:
                styles.append(np.asarray(s, np.float64))
                profiles.append(tuple(str(rec["listener_profile"][k]) for k in ("age", "gender", "timbre")))
                if "video_content" in targets and len(probe_clips) < PROBE_CLIPS:
                    probe_clips.append((np.asarray(targets["video_content"]), np.asarray(s, np.float32)))
        if not styles:
            raise VideoEvalUnavailable(f"{shards_dir}: the {train_split} split has no video_style targets")
        self.mean_style = np.mean(styles, axis=0).astype(np.float32)
        age, gender, timbre = collections.Counter(profiles).most_common(1)[0][0]
        self.pipeline_style, _ = FaceRenderer.avatar_style({"age": age, "gender": gender, "timbre": timbre},
                                                          LISTENER_EXPRESSION)
        self.probe = self._fit_probe(probe_clips)
        self.gold = [self._draw(it["content"], it["style"]) for it in self.items]

    @staticmethod
    def _gold_envelope(rec: Mapping[str, Any], media: Path, gold_speech: Path) -> np.ndarray:
        """The envelope of the speech whose timing drew a record's gold clip, which lip sync reads: a clip
        with frame units was laid on Kokoro's timeline of the gold reply speech (face_targets --mouth
        replies/phonemes): RAW/gold_speech's wav, or, in a text corpus that has none, that speech spoken
        from the record's speech targets (`speech.gold_speech_from_targets`, the same samples); any other
        clip follows its media wav."""
        from empatheia_jax.generators.kokoro import SAMPLE_RATE
        from empatheia_jax.generators.kokoro_voices import to_pcm16
        from empatheia_jax.generators.speech_synth import read_wav, speech_envelope

        targets = rec.get("targets") or {}
        timed_by_kokoro = "video_units" in targets
        wav = (gold_speech if timed_by_kokoro else media) / f"{rec['response_utt_id']}.wav"
        if wav.is_file():
            sr, x = read_wav(wav)
            return speech_envelope(x, sr)
        if timed_by_kokoro and {"speech_content", "speech_style"} <= targets.keys():
            audio = gold_speech_from_targets(np.asarray(targets["speech_content"]),
                                             np.asarray(targets["speech_style"], np.float32))
            return speech_envelope(to_pcm16(audio), SAMPLE_RATE)
        raise VideoEvalUnavailable(f"{wav}: missing (lip sync reads the gold speech)")

    def _fit_probe(self, clips: list[tuple[np.ndarray, np.ndarray]]):
        """A LinearStyleProbe on train clips drawn with each expression in turn (module docstring)."""
        from empatheia_jax.eval.metrics.speech import LinearStyleProbe
        from empatheia_jax.generators.face_render import STYLE_GROUPS, decode_style

        offset, expressions = STYLE_GROUPS["emotion"]
        features, labels = [], {k: [] for k in ("age", "gender", "timbre", "emotion")}
        for j, (content, style) in enumerate(clips):
            style = style.copy()
            style[offset: offset + len(expressions)] = 0.0
            style[offset + j % len(expressions)] = 1.0
            features.append(self._probe_features(content, style))
            avatar = decode_style(style)
            for k in labels:
                labels[k].append(str(avatar[k]))
        if len(set(labels["emotion"])) < 2:
            raise VideoEvalUnavailable(f"{len(clips)} train clips with video targets are too few to fit the "
                                       "frame-based style probe")
        return LinearStyleProbe().fit(np.stack(features), labels)

    @classmethod
    def _probe_features(cls, content: np.ndarray, style: np.ndarray) -> np.ndarray:
        """video_style_features of PROBE_FRAMES frames spread over the clip, drawn from these controls."""
        from empatheia_jax.eval.metrics.video import video_style_features

        content = np.asarray(content)
        rows = np.unique(np.linspace(0, len(content) - 1, PROBE_FRAMES).round().astype(int))
        return video_style_features(cls._draw(content[rows], style))

    @staticmethod
    def _draw(content: np.ndarray, style: np.ndarray) -> np.ndarray:
        from empatheia_jax.generators.face_render import render_controls

        return render_controls(content, style)

    def _rows(self, name: str, clips: list[np.ndarray], styles: Mapping[int, tuple[np.ndarray, np.ndarray]]
              ) -> dict[str, float]:
        from empatheia_jax.eval.metrics.video import video_rows

        out: dict[str, float] = {}
        if clips:
            rows = video_rows({name: clips}, self.gold, [it["envelope"] for it in self.items],
                              progress=self.progress)[name]
            out = {_ROW_NAMES[k]: float(v) for k, v in rows.items() if k in _ROW_NAMES}
        out.update(self._style_rows(styles))
        return out

    def _style_rows(self, drawn: Mapping[int, tuple[np.ndarray, np.ndarray]]) -> dict[str, float]:
        """video_{attr}_acc: the probe's reading of each labelled record's avatar, drawn from its controls."""
        from tqdm import tqdm

        idx = [i for i in sorted(self.labels) if i in drawn]
        if not idx:
            return {}
        bar = tqdm(idx, desc="video metrics: style probe", unit="clip", disable=not self.progress,
                   leave=False)
        x = np.stack([self._probe_features(*drawn[i]) for i in bar])
        acc = self.probe.accuracy(x, {a: [self.labels[i][a] for i in idx]
                                      for a in ("age", "gender", "timbre", "emotion")})
        return {f"video_{a}_acc": float(v) for a, v in acc.items()}

    def model_rows(self, name: str, collected: Mapping[int, Mapping[str, Any]]) -> dict[str, float]:
        """The video rows of a model from `teacher_forced.teacher_forced_metrics(collect=...)`'s outputs.

        A model evaluated without its SD (a ccl checkpoint: the CS alone) draws its predicted C^v on each
        record's gold avatar, as the speech rows speak it in the gold voice: the rows then measure the mouth
        alone (lip sync, the frames against the gold), and the style and expression rows are absent."""
        missing = [it["record_index"] for it in self.items
                   if "video_content" not in collected.get(it["record_index"], {})]
        if missing:
            raise ValueError(f"no predicted video features for test records {missing[:5]}")
        if not any("video_style" in c for c in collected.values()):
            clips = [self._draw(collected[it["record_index"]]["video_content"], it["style"])
                     for it in self.items]
            return self._rows(name, clips, {})
        from empatheia_jax.generators.face_render import FaceRenderer
        from empatheia_jax.generators.speech_synth import listener_style

        emotions = predicted_emotions(collected, self.emotion_classes)
        drawn = {i: (c["video_content"], c["video_style"] if emotions[i] is None else
                     FaceRenderer.expressed(c["video_style"], listener_style(emotions[i])))
                 for i, c in collected.items() if {"video_content", "video_style"} <= c.keys()}
        clips = [self._draw(*drawn[it["record_index"]]) for it in self.items]
        return {**self._rows(name, clips, drawn), **self._pinned_rows(collected)}

    def _pinned_rows(self, collected: Mapping[int, Mapping[str, Any]]) -> dict[str, float]:
        """video_pinned_*_acc: the probe on each labelled record's pinned avatar (module docstring)."""
        from empatheia_jax.serve.avatar import pinned_styles

        idx = [i for i in sorted(self.labels) if "video_content" in collected.get(i, {})]
        emotions = predicted_emotions(collected, self.emotion_classes)
        styles = pinned_styles("face_render", {i: {k: self.labels[i][k] for k in ("age", "gender", "timbre")}
                                               for i in idx}, emotions)
        rows = self._style_rows({i: (collected[i]["video_content"], styles[i]) for i in idx})
        return {k.replace("video_", "video_pinned_", 1): v for k, v in rows.items()}

    def reference_columns(self) -> dict[str, dict[str, float]]:
        """mean_style and pipeline_tts (module docstring): the gold mouth track, one fixed avatar each; and
        `gold`: the style probe on the gold avatars (`gold_rows`)."""
        out = {}
        for name, style in (("mean_style", self.mean_style), ("pipeline_tts", self.pipeline_style)):
            clips = [self._draw(it["content"], style) for it in self.items]
            out[name] = self._rows(name, clips, {i: (c, style) for i, (c, _) in self.gold_controls.items()})
        out["gold"] = self.gold_rows()
        return out

    def gold_rows(self) -> dict[str, float]:
        """The probe on the gold test avatars: the ceiling of the video_*_acc rows."""
        return self._style_rows(self.gold_controls)


__all__ = ["VIDEO_METRICS", "VideoEval", "VideoEvalUnavailable"]
