"""The shard record and the shard folder: the contract between data preparation and the input pipeline.

One record = one AvaMERG ``turns`` entry, serialised with `flax.serialization.msgpack_serialize`. Raw
text is stored, so a template change needs no re-preparation. Built by `make_shard_record` (used by
`data/prepare.py` and the TFDS builder `data/tfds_avamerg`), read by `decode_shard_record` (used by the
input pipeline), so writer and readers share one definition.

Shard folder::

    SHARDS/manifest.json                                   written last; no manifest = unfinished run
    SHARDS/{split}/{split}-{i:05d}-of-{n:05d}.array_record one record per example
    SHARDS/skipped_report.txt                              only when --skip-invalid skipped dialogues
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from empatheia_jax.assets import sha256_file
from empatheia_jax.data import schema
from empatheia_jax.data.targets import TARGET_KINDS

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "empatheia-shards/1"
# group_size:1 = random access per record (grain reads single records); uncompressed because zstd decoding
# (0.9 ms/record) was the input pipeline bottleneck (docs/benchmarks.md).
ARRAY_RECORD_OPTIONS = "group_size:1,uncompressed"

PROFILE_FIELDS = ("age", "gender", "timbre", "ID")
HISTORY_FIELDS = ("index", "role", "utterance", "utt_id")
COE_FIELDS = ("event_scenario", "speaker_emotion", "emotion_cause", "goal_to_response")
LABEL_FIELDS = ("emotion", "emotion_fine", "age", "gender", "timbre")

SHARD_RECORD_FIELDS: dict[str, str] = {
    "schema_version": "int: empatheia_jax.data.schema.SCHEMA_VERSION of the writer",
    "uid": 'str: "{conversation_id}:{turn}", unique per example',
    "split": "str: the RAW/{split}.json the dialogue came from",
    "conversation_id": "str",
    "turn": "int: index of the example in the dialogue's turns",
    "topic": "str",
    "speaker_profile": "{age:str, gender:str, timbre:str, ID:int}",
    "listener_profile": "{age:str, gender:str, timbre:str, ID:int}",
    "history": "[{index:int, role:str, utterance:str, utt_id:str}] in dialogue order",
    "response": "str: the listener's gold reply",
    "response_utt_id": "str: media/target key of the reply (k = len(history), listener's profile ID)",
    "coe": '{event_scenario, speaker_emotion, emotion_cause, goal_to_response}: str, "" when absent',
    "labels": "{emotion, emotion_fine, age, gender, timbre}: int, -1 = unknown (masked in the loss)",
    "audio_feats": "float32 [n_hist, k, d_a]: encoder features of each history utterance's wav; k = 0 (no "
    "vector) in a text-only record (prepared without media)",
    "video_feats": "float32 [n_hist, k, d_v]: encoder features of each history utterance's mp4; k = 0 in a "
    "text-only record",
    "targets": "{kind: float32 array} of the response utterance; kinds absent from the targets are omitted: "
    "speech_content [T_ph,1024], video_content [T_f,256], speech_style [256], video_style [256]",
}


class ShardRecordError(ValueError):
    """A record that cannot be decoded or does not follow SHARD_RECORD_FIELDS; names shard and index."""


class MissingMediaError(ShardRecordError):
    """A split holding text-only records (prepared with `--text-only` or `--media optional`) asked for by a
    template that reads <Aud>/<Vid> features. Raised before any record is read, naming the folder, the split
    and the stage; a subclass of ShardRecordError, so every command already reports it as bad input."""


def make_shard_record(
    dialogue: schema.Dialogue,
    turn: int,
    *,
    split: str,
    emotion_map: schema.EmotionMap,
    audio_feats: np.ndarray,
    video_feats: np.ndarray,
    targets: Mapping[str, np.ndarray] | None = None,
) -> dict[str, Any]:
    """The record of example `turn` of `dialogue`; features are stacked in history order by the caller."""
    t = dialogue.turns[turn]
    utts = schema.turn_utterances(dialogue, t)
    coe = t.chain_of_empathy
    rec = {
        "schema_version": int(schema.SCHEMA_VERSION),
        "uid": f"{dialogue.conversation_id}:{turn}",
        "split": split,
        "conversation_id": dialogue.conversation_id,
        "turn": int(turn),
        "topic": dialogue.topic,
        "speaker_profile": _profile(dialogue.speaker_profile),
        "listener_profile": _profile(dialogue.listener_profile),
        "history": [
            {"index": int(u.index), "role": u.role, "utterance": u.utterance, "utt_id": uid}
            for u, (uid, _, _) in zip(t.dialogue_history, utts, strict=True)
        ],
        "response": t.response,
        "response_utt_id": schema.response_utterance_id(dialogue, turn),
        "coe": {k: getattr(coe, k) or "" for k in COE_FIELDS},
        "labels": {k: int(v) for k, v in schema.labels_for(dialogue, turn, emotion_map).items()},
        "audio_feats": np.ascontiguousarray(audio_feats, dtype=np.float32),
        "video_feats": np.ascontiguousarray(video_feats, dtype=np.float32),
        "targets": {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in (targets or {}).items()},
    }
    problems = check_shard_record(rec)
    if problems:
        raise ShardRecordError(f"record {rec['uid']} is malformed: " + "; ".join(problems))
    return rec


def _profile(p: schema.Profile) -> dict[str, Any]:
    return {"age": p.age, "gender": p.gender, "timbre": p.timbre, "ID": int(p.ID)}


def check_shard_record(rec: Any) -> list[str]:
    """Every way `rec` deviates from SHARD_RECORD_FIELDS (empty list = valid)."""
    if not isinstance(rec, dict):
        return [f"record must be a dict, got {type(rec).__name__}"]
    p: list[str] = []
    missing = [f for f in SHARD_RECORD_FIELDS if f not in rec]
    if missing:
        return [f"missing fields {missing}"]
    extra = sorted(set(rec) - set(SHARD_RECORD_FIELDS))
    if extra:
        p.append(f"unknown fields {extra}")
    for f in ("uid", "split", "conversation_id", "topic", "response", "response_utt_id"):
        if not isinstance(rec[f], str):
            p.append(f"{f} must be str")
    for f in ("schema_version", "turn"):
        if not isinstance(rec[f], int):
            p.append(f"{f} must be int")
    for f in ("speaker_profile", "listener_profile"):
        if not isinstance(rec[f], dict) or set(rec[f]) != set(PROFILE_FIELDS):
            p.append(f"{f} must have keys {PROFILE_FIELDS}")
    hist = rec["history"]
    if not isinstance(hist, list) or not all(
        isinstance(h, dict) and set(h) == set(HISTORY_FIELDS) for h in hist
    ):
        p.append(f"history must be a list of {{{', '.join(HISTORY_FIELDS)}}}")
        hist = None
    for f, keys, typ in (("coe", COE_FIELDS, str), ("labels", LABEL_FIELDS, int)):
        v = rec[f]
        if not isinstance(v, dict) or set(v) != set(keys) or not all(isinstance(x, typ) for x in v.values()):
            p.append(f"{f} must map {keys} to {typ.__name__}")
    shapes = {}
    for f in ("audio_feats", "video_feats"):
        a = rec[f]
        if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.ndim != 3:
            p.append(f"{f} must be a float32 array [n_hist, k, d]")
        else:
            shapes[f] = a.shape
            if hist is not None and a.shape[0] != len(hist):
                p.append(f"{f} has {a.shape[0]} rows for {len(hist)} history utterances")
    if len(shapes) == 2 and shapes["audio_feats"][1] != shapes["video_feats"][1]:
        p.append(f"audio k={shapes['audio_feats'][1]} != video k={shapes['video_feats'][1]}")
    tg = rec["targets"]
    if not isinstance(tg, dict):
        p.append("targets must be a dict")
    else:
        for kind, a in tg.items():
            if kind not in TARGET_KINDS:
                p.append(f"unknown target kind {kind!r}")
            elif not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.ndim != TARGET_KINDS[kind][0]:
                p.append(f"targets.{kind} must be a float32 array of rank {TARGET_KINDS[kind][0]}")
    return p


def encode_shard_record(rec: dict[str, Any]) -> bytes:
    """msgpack bytes of a record (checked first, so a bad record never reaches a shard)."""
    from flax.serialization import msgpack_serialize

    problems = check_shard_record(rec)
    if problems:
        raise ShardRecordError(f"record {rec.get('uid', '?')} is malformed: " + "; ".join(problems))
    return msgpack_serialize(rec)


def decode_shard_record(data: bytes, *, shard: str | os.PathLike, index: int) -> dict[str, Any]:
    """Record from msgpack bytes; bad bytes raise ShardRecordError naming the shard and the index."""
    from flax.serialization import msgpack_restore

    where = f"{os.fspath(shard)} record {index}"
    try:
        rec = msgpack_restore(bytes(data))
    except Exception as e:  # noqa: BLE001 - msgpack raises many types on corrupt input
        raise ShardRecordError(f"{where}: corrupt record ({type(e).__name__}: {e})") from e
    problems = check_shard_record(rec)
    if problems:
        raise ShardRecordError(f"{where}: corrupt or foreign record: " + "; ".join(problems))
    return rec


# ----------------------------------------------------------------------------------------------
# raw folder


# ----------------------------------------------------------------------------------------------
# shard folder


def shard_filename(split: str, i: int, n: int) -> str:
    return f"{split}-{i:05d}-of-{n:05d}.array_record"


def load_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a shard folder; refuses a folder without one (an unfinished or foreign run)."""
    p = Path(directory) / MANIFEST
    if not p.is_file():
        raise FileNotFoundError(
            f"{p} does not exist: {directory} is not a finished shard folder (data/prepare.py writes the "
            "manifest last, so an interrupted run leaves none); re-run data/prepare.py"
        )
    try:
        m = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: invalid JSON ({e})") from e
    fmt = m.get("format") if isinstance(m, dict) else None
    if fmt != MANIFEST_FORMAT:
        raise ValueError(f"{p}: not a {MANIFEST_FORMAT} manifest (format={fmt!r})")
    return m


def target_source(manifest: Mapping[str, Any], kind: str) -> str | None:
    """Who made the shards' `kind` targets (meta.json's "source": "kokoro", "face_render", "stand-in", ...),
    None when the shards carry none: what decides which generator can read them."""
    kinds = (manifest.get("targets") or {}).get("kinds") or {}
    return (kinds.get(kind) or {}).get("source")


def text_only_records(manifest: Mapping[str, Any], split: str) -> int:
    """How many records of `split` were prepared without media features (0 for folders written before
    text-only preparation existed, whose every record has its features)."""
    info = (manifest.get("splits") or {}).get(split) or {}
    if manifest.get("media") == "none":
        return int(info.get("records") or 0)
    return int(info.get("text_only_records") or 0)


def check_media_for_template(
    manifest: Mapping[str, Any],
    directory: str | os.PathLike,
    split: str,
    *,
    stage: str,
    needs_media: bool,
    hint: str = "a template without media input (stage coe or ccl)",
) -> None:
    """Raises MissingMediaError when a template that reads <Aud>/<Vid> features (`needs_media`) is asked
    for a split with text-only records: one clear line up front instead of a failure at the first such
    record, deep in the input pipeline."""
    n = text_only_records(manifest, split) if needs_media else 0
    if n:
        total = ((manifest.get("splits") or {}).get(split) or {}).get("records", "?")
        how = "--text-only" if manifest.get("media") == "none" else "--media optional"
        raise MissingMediaError(
            f"{directory} split {split!r}: {n} of {total} records are text-only (prepared with {how}), but "
            f"the {stage} template reads speech/video features (<Aud>/<Vid>); use {hint}, or prepare the "
            "split with its media"
        )


def shard_paths(directory: str | os.PathLike, split: str) -> list[Path]:
    """Paths of the shards of `split`, in order, as listed by the manifest."""
    m = load_manifest(directory)
    if split not in m["splits"]:
        raise KeyError(f"{directory}: no split {split!r}; manifest has {sorted(m['splits'])}")
    return [Path(directory) / s["path"] for s in m["splits"][split]["shards"]]


def verify_shards(directory: str | os.PathLike, *, check_hashes: bool = True) -> list[str]:
    """Problems of a shard folder against its manifest: missing/extra files, sha256, record counts.

    Each problem names the shard file. An empty list means the folder is exactly what prepare wrote.
    """
    from array_record.python.array_record_module import ArrayRecordReader

    d = Path(directory)
    try:
        m = load_manifest(d)
    except (FileNotFoundError, ValueError) as e:
        return [str(e)]
    problems = []
    listed = set()
    for split, info in m.get("splits", {}).items():
        total, n_before = 0, len(problems)
        for s in info.get("shards", []):
            path = d / s["path"]
            listed.add(path.resolve())
            if not path.is_file():
                problems.append(f"{path}: missing shard (listed in {MANIFEST})")
                continue
            if check_hashes:
                digest = sha256_file(path)
                if digest != s["sha256"]:
                    problems.append(
                        f"{path}: sha256 {digest} != manifest {s['sha256']} (corrupted or modified)"
                    )
                    continue
            try:
                r = ArrayRecordReader(str(path))
                n = r.num_records()
                r.close()
            except Exception as e:  # noqa: BLE001 - riegeli errors
                problems.append(f"{path}: unreadable ArrayRecord file ({e})")
                continue
            if n != s["records"]:
                problems.append(f"{path}: {n} records, manifest says {s['records']}")
            total += n
        if len(problems) == n_before and total != info.get("records"):
            problems.append(f"{d / split}: {total} records in shards, manifest says {info.get('records')}")
    for path in sorted(d.glob("*/*.array_record")):
        if path.resolve() not in listed:
            problems.append(f"{path}: shard not listed in {MANIFEST} (left over from another run?)")
    return problems
