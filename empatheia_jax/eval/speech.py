"""The speech rows of `empatheia eval`: Empatheia's C^s/S^s spoken by Kokoro-82M against the gold speech.

What is compared (docs/design.md "Speech out"):
- **The model** (trained / untrained columns): Kokoro(C^s, S^s) with C^s read over the GOLD reply (the
  teacher-forced pass, teacher_forced.py, the rows its target has) and S^s from the signal tokens. Speaking
  the gold reply's content keeps the words equal, so MCD against the gold speech is defined; the question is
  how close the predicted features come to the ones the gold speech was made from.
- **mean_style**: the gold content with the mean train speech_style: a TTS that gets the words perfectly
  and has one average voice. Its gap to the model's speaker similarity is what style prediction buys.
- **pipeline_tts**: the gold content in the voice the style map gives the majority train listener profile:
  the paper's Pipeline baseline (an LLM's text through an off-the-shelf TTS with a fixed voice) with a
  perfect LLM.
- **Style accuracy** (speech_age_acc / _gender_acc / _timbre_acc): a nearest-centroid probe
  (`speech_metrics.StyleClassifier`) fitted on the train split's GOLD speech_style targets with the
  listener's profile labels, applied to each system's style vector over every test record with a style
  target. Kokoro has no style encoder, so the probe reads the vector that drives the generator, the one
  the gold voice was chosen as.
- **The pinned avatar** (speech_pinned_age_acc / _gender_acc / _timbre_acc, the model's column only): the
  same probe on the voice `chat --listener` would speak with if the user chose each record's listener
  profile (`serve.avatar.pinned_styles`: the voice map of that profile in the style the predicted emotion
  calls for, `predicted_emotions`). The probe was fitted on gold voices, so this asks whether a chosen
  avatar is heard as the one chosen, whatever emotion the model predicts.
- **Intelligibility** (speech_wer / speech_cer, `data.encoders.asr`): Whisper tiny.en, a recogniser
  trained on none of this, transcribes every spoken reply of every system; its corpus WER/CER against the
  record's gold reply text (`response`, the words the teacher-forced content is over) says whether the
  speech carries the words. The `gold` column is the same recogniser on the gold speech: its floor (what
  the recogniser's own errors cost on speech that is right by construction). Transcripts are kept in
  `SpeechEval.transcripts` ({column: [Transcript]}, in `items` order).

Gold speech: `RAW/gold_speech/{response_utt_id}.wav` (24 kHz, data/make_sample.py), RAW from the shards'
manifest unless given; shards of a text corpus (no such folder, e.g. imported ED with its reply targets) are
spoken from their gold targets by Kokoro, which is how the sample's gold speech was made. Only shards whose
speech targets are Kokoro features can be spoken; `SpeechEvalUnavailable` says why not otherwise, and eval
prints it as a note.
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

SPEECH_METRICS = ("speech_mcd", "speech_spk_sim", "speech_f0_diff_st", "speech_dur_ratio", "speech_wer",
                  "speech_cer", "speech_age_acc", "speech_gender_acc", "speech_timbre_acc",
                  "speech_pinned_age_acc", "speech_pinned_gender_acc", "speech_pinned_timbre_acc",
                  "speech_examples", "speech_unusable")
HIGHER_IS_BETTER = frozenset({"speech_spk_sim", "speech_age_acc", "speech_gender_acc", "speech_timbre_acc",
                              "speech_pinned_age_acc", "speech_pinned_gender_acc",
                              "speech_pinned_timbre_acc"})
LOWER_IS_BETTER = frozenset({"speech_mcd", "speech_f0_diff_st", "speech_wer", "speech_cer"})
PROFILE = ("age", "gender", "timbre")
_ROW_NAMES = {"mcd": "speech_mcd", "speaker_similarity": "speech_spk_sim",
              "f0_semitones": "speech_f0_diff_st",
              "duration_ratio": "speech_dur_ratio", "n": "speech_examples", "unusable": "speech_unusable",
              "wer": "speech_wer", "cer": "speech_cer"}


def gold_speech_from_targets(content: np.ndarray, style: np.ndarray, threads: int = 1) -> np.ndarray:
    """The gold speech (float32, 24 kHz) of a reply without a recording (a text corpus with Kokoro targets):
    Kokoro speaking its gold content in its gold style at `LISTENER_SPEED`, what `kokoro_voices.gold_speech`
    made the sample's listener replies with, sample for sample, and the timeline a phoneme mouth was laid on
    (`converters.face_targets.text_targets`)."""
    from empatheia_jax.generators import kokoro
    from empatheia_jax.generators.kokoro_voices import LISTENER_SPEED

    return kokoro.shared(threads).synthesize(content, style, LISTENER_SPEED)


class SpeechEvalUnavailable(RuntimeError):
    """The speech rows cannot be computed for these shards (why, naming the file or the target source)."""


def _gold_dir(manifest: Mapping[str, Any], gold_dir: str | os.PathLike | None) -> Path | None:
    """The gold speech folder: `gold_dir` (which must exist), else RAW/gold_speech of the shards' raw folder
    when it exists, else None: the replies are spoken from their gold targets (a text corpus)."""
    default = gold_dir is None
    if default:
        gold_dir = Path(manifest.get("raw", "")) / "gold_speech"
    path = Path(gold_dir)
    if not path.is_dir():
        if not default:
            raise SpeechEvalUnavailable(f"no gold speech folder {path} (--gold_speech)")
        return None  # spoken from the gold targets (a text corpus: no recorded speech)
    return path


class SpeechEval:
    """What every column's speech rows share: the gold wavs, the style probe, and the reference systems."""

    def __init__(self, shards_dir: str | os.PathLike, split: str = "test", *, train_split: str = "train",
                 gold_dir: str | os.PathLike | None = None, examples: int = 16, threads: int = 2,
                 progress: bool = True):
        from empatheia_jax.data.splits import check_split, emotion_map_of

        manifest = check_split(shards_dir, split)
        self.emotion_classes = tuple(emotion_map_of(manifest).classes)
        source = target_source(manifest, "speech_content")
        style_source = target_source(manifest, "speech_style")
        if source != "kokoro" or style_source != "kokoro":
            raise SpeechEvalUnavailable(
                f"{shards_dir}: speech targets are {source or 'absent'}/{style_source or 'absent'} "
                "(content/style), not Kokoro features, so there is no generator to speak them with")
        self.gold_dir = _gold_dir(manifest, gold_dir)
        self.examples, self.threads, self.progress = int(examples), int(threads), progress
        check_split(shards_dir, train_split)
        self._read_test(shards_dir, split)
        self.gold = [self._read(it["wav"]) if it["wav"] is not None else self._gold_from_targets(it)
                     for it in self.items]
        self.transcripts: dict[str, list[Any]] = {}  # column -> [asr.Transcript], items order
        self._fit_references(shards_dir, train_split)

    def _read_test(self, shards_dir: str | os.PathLike, split: str) -> None:
        """The test records: each one's style probe labels, the spoken examples where gold speech exists."""
        reader = ShardReader.for_split(shards_dir, split)
        self.labels: dict[int, dict[str, str]] = {}
        self.items: list[dict[str, Any]] = []
        for i in range(len(reader)):
            rec = reader[i]
            targets = rec.get("targets") or {}
            if "speech_style" in targets:
                self.labels[i] = {k: str(rec["listener_profile"][k]) for k in PROFILE}
            wav = None if self.gold_dir is None else self.gold_dir / f"{rec['response_utt_id']}.wav"
            spoken = wav.is_file() if wav is not None else "speech_style" in targets
            if len(self.items) < self.examples and "speech_content" in targets and spoken:
                self.items.append({"record_index": i, "wav": wav, "uid": rec["response_utt_id"],
                                   "content": np.asarray(targets["speech_content"]),
                                   "style": np.asarray(targets.get("speech_style", ()), np.float32),
                                   "reply": str(rec["response"])})
        if self.examples and not self.items:
            raise SpeechEvalUnavailable(f"no {split} record of {shards_dir} has gold speech in "
                                        f"{self.gold_dir or 'its speech targets'}")

    def _fit_references(self, shards_dir: str | os.PathLike, train_split: str) -> None:
        """The probe and the reference voices, from the train split's gold style targets."""
        train = ShardReader.for_split(shards_dir, train_split)
        styles, labels = [], {k: [] for k in PROFILE}
        for i in range(len(train)):
            rec = train[i]
            s = (rec.get("targets") or {}).get("speech_style")
            if s is not None:
                styles.append(np.asarray(s, np.float64))
                for k in PROFILE:
                    labels[k].append(str(rec["listener_profile"][k]))
        if not styles:
            raise SpeechEvalUnavailable(f"{shards_dir}: the {train_split} split has no speech_style targets")
        from empatheia_jax.eval.metrics.speech import LinearStyleProbe

        self.probe = LinearStyleProbe().fit(np.stack(styles), labels)
        self.mean_style = np.mean(styles, axis=0).astype(np.float32)
        majority = {k: collections.Counter(v).most_common(1)[0][0] for k, v in labels.items()}
        from empatheia_jax.generators.kokoro_voices import voice

        self.majority_profile = majority
        self.pipeline_style = voice(majority, "empathetic").style

    def _gold_from_targets(self, item: Mapping[str, Any]) -> np.ndarray:
        return gold_speech_from_targets(item["content"], item["style"], self.threads)

    @staticmethod
    def _read(path: Path) -> np.ndarray:
        from empatheia_jax.generators.kokoro import SAMPLE_RATE
        from empatheia_jax.generators.speech_synth import read_wav

        sr, wav = read_wav(path)
        if sr != SAMPLE_RATE:
            raise SpeechEvalUnavailable(f"{path}: {sr} Hz; gold speech must be {SAMPLE_RATE} Hz, Kokoro's")
        return wav.astype(np.float32) / 32768.0

    def _speak(self, name: str, pairs: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
        """Kokoro as chat speaks (`generators.registry`, durations capped)."""
        from tqdm import tqdm

        from empatheia_jax.generators import registry

        speaker = registry.get("kokoro", threads=self.threads)
        bar = tqdm(pairs, desc=f"speech: {name}", unit="utt", disable=not self.progress, leave=False)
        return [speaker.speak(c, s, len(c)) for c, s in bar]

    def _heard_rows(self, name: str, wavs: list[np.ndarray]) -> dict[str, float]:
        """speech_wer / speech_cer of `wavs` (one per item) against the items' reply texts; the transcripts go
        to `self.transcripts[name]` ("gold" for the gold speech, heard once per instance). A reply without a
        word (punctuation only) has no WER and is left out of both rates."""
        from tqdm import tqdm

        from empatheia_jax.data.encoders import asr
        from empatheia_jax.eval.metrics.speech import intelligibility_rows
        from empatheia_jax.generators.kokoro import SAMPLE_RATE

        key = "gold" if wavs is self.gold else name
        if not (key == "gold" and key in self.transcripts):
            recognizer = asr.shared(self.threads)
            bar = tqdm(wavs, desc=f"speech: {name} heard by {asr.MODEL_NAME}", unit="utt",
                       disable=not self.progress, leave=False)
            self.transcripts[key] = [recognizer.transcribe(w, SAMPLE_RATE) for w in bar]
        pairs = [(it["reply"], t.text) for it, t in zip(self.items, self.transcripts[key], strict=True)
                 if asr.normalize(it["reply"])]
        if not pairs:
            return {}
        rows = intelligibility_rows([r for r, _ in pairs], [h for _, h in pairs])
        return {_ROW_NAMES[k]: v for k, v in rows.items()}

    def _rows(self, name: str, wavs: list[np.ndarray], styles: Mapping[int, np.ndarray]) -> dict[str, float]:
        from empatheia_jax.eval.metrics.speech import speech_rows
        from empatheia_jax.generators.kokoro import SAMPLE_RATE

        out: dict[str, float] = {}
        if wavs:
            rows = speech_rows({name: wavs}, self.gold, SAMPLE_RATE, progress=self.progress)[name]
            out = {_ROW_NAMES[k]: v for k, v in rows.items() if k in _ROW_NAMES}
            out.update(self._heard_rows(name, wavs))
        idx = [i for i in sorted(self.labels) if i in styles]
        if idx:
            acc = self.probe.accuracy(np.stack([styles[i] for i in idx]),
                                      {k: [self.labels[i][k] for i in idx] for k in PROFILE})
            out.update({f"speech_{k}_acc": float(v) for k, v in acc.items()})
        return out

    def model_rows(self, name: str, collected: Mapping[int, Mapping[str, Any]]) -> dict[str, float]:
        """The speech rows of a model from `teacher_forced.teacher_forced_metrics(collect=...)`'s outputs.

        A model evaluated without its SD (a ccl checkpoint: the CS alone, on a text corpus without the media
        the signal tokens read) speaks its predicted C^s in each record's gold voice: the rows then measure
        the content alone (speech_wer: are the words there), and the style rows are absent."""
        missing = [it["record_index"] for it in self.items
                   if "speech_content" not in collected.get(it["record_index"], {})]
        if missing:
            raise ValueError(f"no predicted speech features for test records {missing[:5]}")
        picked = [collected[it["record_index"]] for it in self.items]
        pairs = [(c["speech_content"], c["speech_style"] if "speech_style" in c else it["style"])
                 for c, it in zip(picked, self.items, strict=True)]
        if any(len(style) == 0 for _, style in pairs):
            raise ValueError("no predicted speech style and no gold speech_style target to speak with")
        styles = {i: np.asarray(c["speech_style"]) for i, c in collected.items() if "speech_style" in c}
        out = self._rows(name, self._speak(name, pairs), styles)
        if styles:  # the model has an SD, so `chat --listener` can pin its avatar
            out.update(self._pinned_rows(collected))
        return out

    def _pinned_rows(self, collected: Mapping[int, Mapping[str, Any]]) -> dict[str, float]:
        """speech_pinned_*_acc: the probe on the pinned avatar of each labelled record (module docstring)."""
        from empatheia_jax.serve.avatar import pinned_styles

        idx = [i for i in sorted(self.labels) if i in collected]
        if not idx:
            return {}
        emotions = predicted_emotions(collected, self.emotion_classes)
        styles = pinned_styles("kokoro", {i: self.labels[i] for i in idx}, emotions)
        acc = self.probe.accuracy(np.stack([styles[i] for i in idx]),
                                  {k: [self.labels[i][k] for i in idx] for k in PROFILE})
        return {f"speech_pinned_{k}_acc": float(v) for k, v in acc.items()}

    def reference_columns(self) -> dict[str, dict[str, float]]:
        """mean_style and pipeline_tts (see the module docstring): gold content, a fixed voice each; and
        `gold`: the recogniser on the gold speech (speech_wer/speech_cer only: the gold speech's MCD and
        similarity against itself are 0 and 1 by construction, `gold_rows`)."""
        out = {}
        for name, style in (("mean_style", self.mean_style), ("pipeline_tts", self.pipeline_style)):
            wavs = self._speak(name, [(it["content"], style) for it in self.items])
            out[name] = self._rows(name, wavs, {i: style for i in self.labels})
        out["gold"] = self._heard_rows("gold", self.gold)
        return out

    def gold_rows(self) -> dict[str, float]:
        """The gold speech against itself: MCD 0, similarity 1 (the rows measure what they say), and the
        recogniser's WER/CER on it, the floor of every system's."""
        return self._rows("gold", self.gold, {})


def predicted_emotions(collected: Mapping[int, Mapping[str, Any]], classes: tuple[str, ...]
                       ) -> dict[int, str | None]:
    """Per record, the emotion the avatar shows, chosen as chat chooses it (`serve.avatar.reply_emotion`): the
    class of the generated CoE step 2 when it names one (`emotion_coe`, which `evaluate` adds from the
    generations), else the SD emotion head's (`emotion_cls`); both index the shards' emotion map. None where
    neither exists."""
    out: dict[int, str | None] = {}
    for i, c in collected.items():
        picks = [c[k] for k in ("emotion_coe", "emotion_cls") if 0 <= c.get(k, -1) < len(classes)]
        out[i] = classes[picks[0]] if picks else None
    return out


def describe_targets(manifest: Mapping[str, Any]) -> str:
    """One line saying which generator targets are real and which are stand-ins (every report prints it)."""
    kinds = (manifest.get("targets") or {}).get("kinds") or {}
    if not kinds:
        return "targets: none"
    parts = [f"{k}={v.get('source')}" + (" (STAND-IN)" if v.get("stand_in") else "")
             for k, v in kinds.items()]
    return "targets: " + ", ".join(parts)


__all__ = ["SPEECH_METRICS", "SpeechEval", "SpeechEvalUnavailable", "describe_targets"]
