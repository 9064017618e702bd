"""TFDS builder for AvaMERG (manual download), writing ``array_record`` without TensorFlow.

Records are built by the same code as ``data/prepare.py`` (`raw_splits.load_raw`, `dialogue_records`'s
`extract_features` and `dialogue_records` -> `empatheia_jax.data.shard_format.make_shard_record`), so a
TFDS build and a prepare run hold the same text, labels, features and targets; `from_tfds_example` turns
a TFDS example back into a shard record that `empatheia_jax.data.shard_format.check_shard_record` accepts.

Build (no TensorFlow needed)::

    python -m data.tfds_avamerg --manual-dir RAW --data-dir ~/tensorflow_datasets [--encoder lite]

then ``tfds.data_source("avamerg", data_dir=...)`` (random access, grain-compatible).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow_datasets as tfds
from etils import epath
from tensorflow_datasets.core import utils as tfds_utils

from empatheia_jax.data import schema
from empatheia_jax.data.encoders import Encoder, get_encoder
from empatheia_jax.data.shard_format import COE_FIELDS, LABEL_FIELDS, PROFILE_FIELDS, check_shard_record
from empatheia_jax.data.targets import TARGET_KINDS, TargetReader

TARGETS_SUBDIR = "targets"

MANUAL_DOWNLOAD_INSTRUCTIONS = """\
Place the AvaMERG data in the manual directory (default ~/tensorflow_datasets/downloads/manual/, or
pass --manual-dir / DownloadConfig(manual_dir=...)):

  MANUAL/train.json, MANUAL/valid.json, MANUAL/test.json   lists of AvaMERG dialogues
  MANUAL/media/dia{conversation_id}utt{k}_{profileID}.wav  speech of every utterance (and response)
  MANUAL/media/dia{conversation_id}utt{k}_{profileID}.mp4  talking-face video of every utterance
  MANUAL/targets/ (optional)                               generator targets: meta.json +
                                                           {kind}-*-of-*.safetensors
                                                           (empatheia_jax.data.targets)

The AvaMERG release (https://avamerg.github.io/) is distributed by its authors; download it there.
"""


@dataclasses.dataclass
class AvamergConfig(tfds.core.BuilderConfig):
    """Which frozen encoder produces `audio_feats`/`video_feats` (see empatheia_jax.data.encoders)."""

    encoder: str = "lite"
    encoder_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    emotion_map: str = "avamerg7"
    skip_invalid: bool = False


def _text() -> tfds.features.Text:
    return tfds.features.Text()


def tfds_features(k: int, audio_dim: int, video_dim: int) -> tfds.features.FeaturesDict:
    """TFDS features mirroring SHARD_RECORD_FIELDS; absent targets are stored as zero-row tensors."""
    profile = {"age": _text(), "gender": _text(), "timbre": _text(), "ID": np.int32}
    return tfds.features.FeaturesDict(
        {
            "schema_version": np.int32,
            "uid": _text(),
            "split": _text(),
            "conversation_id": _text(),
            "turn": np.int32,
            "topic": _text(),
            "speaker_profile": dict(profile),
            "listener_profile": dict(profile),
            "history": tfds.features.Sequence(
                {"index": np.int32, "role": _text(), "utterance": _text(), "utt_id": _text()}
            ),
            "response": _text(),
            "response_utt_id": _text(),
            "coe": {f: _text() for f in COE_FIELDS},
            "labels": {f: np.int32 for f in LABEL_FIELDS},
            "audio_feats": tfds.features.Tensor(shape=(None, k, audio_dim), dtype=np.float32),
            "video_feats": tfds.features.Tensor(shape=(None, k, video_dim), dtype=np.float32),
            "targets": {
                kind: tfds.features.Tensor(shape=(None, dim) if rank == 2 else (None,), dtype=np.float32)
                for kind, (rank, dim) in TARGET_KINDS.items()
            },
        }
    )


def to_tfds_example(rec: dict[str, Any]) -> dict[str, Any]:
    """Shard record -> TFDS example (missing target kinds become empty tensors)."""
    ex = {k: v for k, v in rec.items() if k != "targets"}
    ex["targets"] = {}
    for kind, (rank, dim) in TARGET_KINDS.items():
        a = rec["targets"].get(kind)
        ex["targets"][kind] = a if a is not None else np.zeros((0, dim) if rank == 2 else (0,), np.float32)
    return ex


def _s(v: Any) -> str:
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


def from_tfds_example(ex: dict[str, Any]) -> dict[str, Any]:
    """TFDS example (as `tfds.data_source` returns it) -> shard record (SHARD_RECORD_FIELDS)."""
    h = ex["history"]
    n = len(h["index"])
    rec = {
        "schema_version": int(ex["schema_version"]),
        "uid": _s(ex["uid"]),
        "split": _s(ex["split"]),
        "conversation_id": _s(ex["conversation_id"]),
        "turn": int(ex["turn"]),
        "topic": _s(ex["topic"]),
        "speaker_profile": {
            f: int(ex["speaker_profile"][f]) if f == "ID" else _s(ex["speaker_profile"][f])
            for f in PROFILE_FIELDS
        },
        "listener_profile": {
            f: int(ex["listener_profile"][f]) if f == "ID" else _s(ex["listener_profile"][f])
            for f in PROFILE_FIELDS
        },
        "history": [
            {
                "index": int(h["index"][i]),
                "role": _s(h["role"][i]),
                "utterance": _s(h["utterance"][i]),
                "utt_id": _s(h["utt_id"][i]),
            }
            for i in range(n)
        ],  # fmt: skip
        "response": _s(ex["response"]),
        "response_utt_id": _s(ex["response_utt_id"]),
        "coe": {f: _s(ex["coe"][f]) for f in COE_FIELDS},
        "labels": {f: int(ex["labels"][f]) for f in LABEL_FIELDS},
        "audio_feats": np.asarray(ex["audio_feats"], np.float32),
        "video_feats": np.asarray(ex["video_feats"], np.float32),
        "targets": {
            kind: np.asarray(a, np.float32) for kind, a in ex["targets"].items() if np.asarray(a).shape[0] > 0
        },
    }
    problems = check_shard_record(rec)
    if problems:
        raise ValueError(f"TFDS example {rec['uid']} does not convert to a shard record: {problems}")
    return rec


class Builder(tfds.core.GeneratorBasedBuilder):
    """AvaMERG (avatar-based multimodal empathetic response generation), one example per dialogue turn."""

    name = "avamerg"
    # Set explicitly: tfds infers both through `importlib_resources`, a backport that is not a dependency
    # on Python >= 3.9 (and is not installed here), so the inference fails for any packaged builder.
    pkg_dir_path = epath.Path(__file__).parent

    @tfds_utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        return epath.Path(__file__)

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Shard-record fields of empatheia_jax.data.shard_format (schema version 1)."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = MANUAL_DOWNLOAD_INSTRUCTIONS
    BUILDER_CONFIGS = [
        AvamergConfig(name="lite", description="lite encoder: log-mel/pitch/energy + face-frame statistics"),
    ]
    DEFAULT_BUILDER_CONFIG_NAME = "lite"

    def _encoder(self) -> Encoder:
        if getattr(self, "_enc", None) is None:
            cfg = self.builder_config
            self._enc = get_encoder(cfg.encoder, **cfg.encoder_kwargs)
        return self._enc

    def _info(self) -> tfds.core.DatasetInfo:
        enc = self._encoder()
        return tfds.core.DatasetInfo(
            builder=self,
            description=(
                "AvaMERG multimodal empathetic dialogue (Empatheia). One example per turn: raw text, "
                "Chain-of-Empathy fields, labels, frozen-encoder features of each history utterance and the "
                "generator targets of the response (zero rows when absent)."
            ),
            features=tfds_features(enc.k, enc.audio_dim, enc.video_dim),
            homepage="https://avamerg.github.io/",
            metadata=tfds.core.MetadataDict(),
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict[str, Any]:
        from empatheia_jax.data.raw_splits import load_raw

        raw = Path(dl_manager.manual_dir)
        cfg = self.builder_config
        em = schema.EmotionMap.load(cfg.emotion_map)
        data = load_raw(raw, emotion_map=em, skip_invalid=cfg.skip_invalid)
        reader = TargetReader(raw / TARGETS_SUBDIR) if (raw / TARGETS_SUBDIR / "meta.json").exists() else None
        if reader is not None:
            for kind in reader.kinds:
                if reader.dim(kind) != TARGET_KINDS[kind][1]:
                    raise ValueError(
                        f"{raw / TARGETS_SUBDIR}: {kind} dim {reader.dim(kind)} != {TARGET_KINDS[kind][1]}"
                    )
        enc = self._encoder()
        self.info.metadata.update(
            {
                "encoder": {"name": enc.name, "config": enc.config()},
                "targets": reader.summary() if reader is not None else None,
                "targets_stand_in": bool(reader and any(reader.is_stand_in(k) for k in reader.kinds)),
                "skipped": [
                    {"split": s["split"], "conversation_id": s["conversation_id"], "problems": s["problems"]}
                    for s in data.skipped
                ],
                "schema_version": schema.SCHEMA_VERSION,
            }
        )
        return {split: self._generate_examples(data, split, reader, em) for split in data.splits}

    def _generate_examples(self, data: Any, split: str, reader: TargetReader | None, em: schema.EmotionMap):
        from empatheia_jax.data.dialogue_records import dialogue_records, extract_features, history_utterances

        enc = self._encoder()
        for d in data.splits[split]:
            feats = extract_features(enc, history_utterances(d), data.media_dir)
            for rec in dialogue_records(
                d, split=split, feats=feats, emotion_map=em, targets=reader,
                audio_dim=enc.audio_dim, video_dim=enc.video_dim, k=enc.k,
            ):  # fmt: skip
                yield rec["uid"], to_tfds_example(rec)
