"""Prepare AvaMERG-format data into ArrayRecord shards: validate, extract features, join targets.

    python -m data.prepare --raw RAW --out SHARDS --encoder lite [--targets TARGETS]
        [--make-standin-targets] [--split-by conversation] [--skip-invalid]
        [--records-per-shard N] [--workers 2] [--overwrite] [--text-only | --media optional]

RAW holds ``{split}.json`` (lists of AvaMERG dialogues) and ``media/{utt_id}.wav|.mp4``. Each split file
becomes ``SHARDS/{split}/{split}-{i}-of-{n}.array_record`` with one msgpack record per ``turns`` entry
(`empatheia_jax.data.shard_format.SHARD_RECORD_FIELDS`). Invalid input fails the run with every problem
listed; ``--skip-invalid`` skips the bad dialogues instead and lists them in ``SHARDS/skipped_report.txt``
and the manifest. ``manifest.json`` is written last, so an interrupted run leaves a folder that
`verify_shards` and the input pipeline refuse. This module is the run: options, targets, the manifest;
its steps live in `raw_splits` (validation), `dialogue_records` (features and records of a dialogue) and
`shard_writer` (one split's shards).

Media (`--media`): ``required`` (default) validates and encodes every utterance's .wav and .mp4;
``none`` (``--text-only``) reads no media and runs no encoder, for text corpora such as an imported
EmpatheticDialogues csv (the stage-1/2 templates need only text); ``optional`` prepares a dialogue with
none of its media files text-only and holds a dialogue with some of them to all of them (a record
that claims media must have them). Text-only records carry zero feature vectors per utterance
(``audio_feats``/``video_feats`` of shape ``[n_hist, 0, d]``); ``manifest.media`` and each split's
``text_only_records`` say so, and templates with ``<Aud>``/``<Vid>`` refuse such a split up front.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from empatheia_jax.assets import atomic_write
from empatheia_jax.data import raw_layout, schema
from empatheia_jax.data.dialogue_records import FeaturePool
from empatheia_jax.data.encoders import Encoder, get_encoder
from empatheia_jax.data.raw_splits import MEDIA_MODES, InvalidInputError, PreparedRaw, load_raw
from empatheia_jax.data.shard_format import (
    ARRAY_RECORD_OPTIONS,
    MANIFEST,
    MANIFEST_FORMAT,
    SHARD_RECORD_FIELDS,
    verify_shards,
)
from empatheia_jax.data.shard_writer import (
    SKIPPED_REPORT,
    SplitRun,
    clean_stale,
    write_skipped_report,
    write_split,
)
from empatheia_jax.data.targets import (
    STAND_IN,
    STANDIN_KINDS,
    TargetReader,
    make_standin_targets,
    read_targets_meta,
)

__all__ = ["cached_text_only_shards", "prepare"]


def _write_json_atomic(path: Path, obj: Any) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(obj, indent=2) + "\n"))


def _check_options(*, split_by: str, records_per_shard: int, media: str, make_standin: bool) -> None:
    """Refuse option combinations before anything is read or written."""
    if split_by != "conversation":
        raise ValueError(
            f"--split-by {split_by!r}: only 'conversation' (splits = RAW/{{split}}.json) is supported"
        )
    if records_per_shard < 1:
        raise ValueError("records_per_shard must be >= 1")
    if media not in MEDIA_MODES:
        raise ValueError(f"media={media!r}: expected one of {MEDIA_MODES}")
    if make_standin and media != "required":
        raise ValueError("--make-standin-targets computes targets from every utterance's media; "
                         f"it cannot run with media={media!r} (--text-only / --media optional)")


def _make_missing_standins(
    raw: Path,
    targets: str | os.PathLike | None,
    data: PreparedRaw,
    *,
    workers: int,
    progress: bool,
    log: Callable[[str], None],
) -> None:
    """Stand-in targets for the kinds no generator has exported into `targets`: a stand-in must never
    replace real generator features, so a partly exported folder keeps its real kinds."""
    if targets is None:
        raise ValueError("--make-standin-targets needs --targets DIR to write them to")
    valid = [d for ds in data.splits.values() for d in ds]  # skipped dialogues may lack media
    real = {k: v.get("source") for k, v in read_targets_meta(Path(targets)).items()
            if isinstance(v, dict) and v.get("source") != STAND_IN}
    missing = [k for k in STANDIN_KINDS if k not in real]
    if real:
        log(f"targets already exported by a generator, kept: "
            f"{', '.join(f'{k} ({s})' for k, s in real.items())}")
    if missing:
        make_standin_targets(raw, targets, dialogues=valid, workers=workers, progress=progress,
                             kinds=missing)


def _open_targets(
    targets: str | os.PathLike | None, media: str, log: Callable[[str], None]
) -> TargetReader | None:
    """The target reader, logging each kind's source so stand-ins are visible in every run's log."""
    reader = TargetReader(targets) if targets is not None else None
    if reader is not None:
        for kind, info in reader.summary().items():
            flag = "  <-- STAND-IN, not generator features" if info["stand_in"] else ""
            log(f"targets {kind}: dim {info['dim']}, source {info['source']}{flag}")
    elif media != "none":  # a text-only run is for the text stages, which read no target
        log("no --targets: records carry no generator targets (stages 2-4 need them)")
    return reader


@dataclass
class _Written:
    """What the split writers report back for the manifest and for the sweep of stale shards."""

    split_info: dict[str, Any] = field(default_factory=dict)
    coverage: dict[str, dict[str, int]] = field(default_factory=dict)
    keep: set[Path] = field(default_factory=set)  # shard files of this run (resolved)
    utterances: int = 0
    feature_seconds: float = 0.0


def _load_valid(
    raw: Path,
    out: Path,
    *,
    splits: list[str] | None,
    em: schema.EmotionMap,
    skip_invalid: bool,
    media: str,
    log: Callable[[str], None],
) -> PreparedRaw:
    """`load_raw`, saying how many dialogues are skipped and how many are prepared text-only."""
    data = load_raw(raw, splits=splits, emotion_map=em, skip_invalid=skip_invalid, media=media)
    if data.skipped:
        log(f"SKIPPING {len(data.skipped)} invalid dialogue(s); see {out / SKIPPED_REPORT}")
    if media == "optional" and data.text_only:
        log(f"{len(data.text_only)} dialogue(s) have none of their media files: prepared text-only "
            "(--media optional)")
    return data


def _write_all(
    run: SplitRun, enc: Encoder | None, encoder: str, encoder_kwargs: dict[str, Any], workers: int
) -> _Written:
    """Every split's shards into a folder marked unfinished (its manifest removed first), then the sweep of
    an earlier run's shards and the skipped report."""
    run.out.mkdir(parents=True, exist_ok=True)
    (run.out / MANIFEST).unlink(missing_ok=True)  # from here on the folder is "unfinished"
    # text-only dialogues have no utterance to encode; a text-only run needs no pool (and has no encoder)
    pool_workers = workers if enc is not None else 1
    with FeaturePool(enc, encoder, encoder_kwargs, pool_workers) as features:
        written = _write_splits(run, features)
    clean_stale(run.out, written.keep)
    write_skipped_report(run.out, run.data.skipped)
    return written


def _write_splits(run: SplitRun, features: FeaturePool) -> _Written:
    """Every split's shards in turn, checking target coverage after each so a run with
    `require_targets` stops at the first split that lacks some."""
    written = _Written()
    for split, dialogues in run.data.splits.items():
        info, cov, feature_seconds = write_split(run, features, split, dialogues)
        written.feature_seconds += feature_seconds
        shards = info["shards"]
        written.keep |= {(run.out / s["path"]).resolve() for s in shards}
        written.utterances += info["utterances"]
        written.split_info[split] = info
        coverage = {k: cov.get(k, 0) for k in (run.targets.kinds if run.targets else ())}
        written.coverage[split] = coverage
        n_rec = info["records"]
        run.log(f"{split}: {n_rec} records from {info['dialogues']} dialogues in {len(shards)} shard(s)")
        if run.targets is not None:
            for kind in run.targets.kinds:
                if coverage[kind] < n_rec:
                    missing = n_rec - coverage[kind]
                    msg = f"{split}: {missing} of {n_rec} records have no {kind} target"
                    if run.require_targets:
                        raise InvalidInputError([msg])
                    run.log("WARNING " + msg)
    return written

def _targets_summary(
    reader: TargetReader | None, targets: str | os.PathLike | None, coverage: dict[str, dict[str, int]]
) -> dict[str, Any] | None:
    """The manifest's `targets`: stand-in and real kinds listed apart, so no consumer mistakes stand-ins
    for generator features."""
    if reader is None:
        return None
    return {
        "dir": str(Path(targets).resolve()),
        "stand_in": any(v["stand_in"] for v in reader.summary().values()),
        "stand_in_kinds": sorted(k for k, v in reader.summary().items() if v["stand_in"]),
        "real_kinds": sorted(k for k, v in reader.summary().items() if not v["stand_in"]),
        "kinds": reader.summary(),
        "coverage": coverage,
    }


def _manifest(
    *,
    command: str | None,
    raw: Path,
    split_by: str,
    em: schema.EmotionMap,
    media: str,
    enc: Encoder | None,
    features: dict[str, int],
    targets: dict[str, Any] | None,
    written: _Written,
    skipped: list[dict[str, Any]],
    seconds: float,
    workers: int,
) -> dict[str, Any]:
    """The manifest.json content (docs/design.md "Shards and manifest"); its key order is the file's."""
    total_records = sum(s["records"] for s in written.split_info.values())
    return {
        "format": MANIFEST_FORMAT,
        "schema_version": schema.SCHEMA_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command if command is not None else shlex.join([sys.executable, *sys.argv]),
        "raw": str(raw.resolve()),
        "split_by": split_by,
        "emotion_map": {"name": em.name, "classes": list(em.classes)},
        "media": media,
        "encoder": None if enc is None else {"name": enc.name, "config": enc.config()},
        "features": features,
        "targets": targets,
        "record_fields": list(SHARD_RECORD_FIELDS),
        "array_record_options": ARRAY_RECORD_OPTIONS,
        "records": total_records,
        "splits": written.split_info,
        "skipped": {
            "count": len(skipped),
            "report": SKIPPED_REPORT if skipped else None,
            "dialogues": [
                {"split": s["split"], "conversation_id": s["conversation_id"], "problems": len(s["problems"])}
                for s in skipped
            ],
        },
        "timing": {
            "seconds": round(seconds, 3),
            "feature_seconds": round(written.feature_seconds, 3),
            "utterances": written.utterances,
            "records_per_second": round(total_records / max(seconds, 1e-9), 2),
            "utterances_per_second": round(written.utterances / max(written.feature_seconds, 1e-9), 2),
            "workers": workers,
        },
    }


def _log_done(
    log: Callable[[str], None], manifest: dict[str, Any], enc: Encoder | None, *, out: Path, seconds: float
) -> None:
    """The closing lines; stand-in targets are named again last, where a reader of the log looks."""
    tsum = manifest["targets"]
    if tsum and tsum["stand_in"]:
        real = ", ".join(tsum["real_kinds"]) or "none"
        log(f"NOTE: targets {', '.join(tsum['stand_in_kinds'])} are STAND-INS (source=stand-in), "
            f"real: {real}; recorded as such in manifest.json")
    how = "text-only: no media, no encoder"
    if enc is not None:
        how = f"{manifest['timing']['utterances']} utterances encoded with {enc.name}"
    log(
        f"wrote {manifest['records']} records ({how}) to {out} "
        f"in {seconds:.1f}s "
        f"({manifest['timing']['records_per_second']} records/s)"
    )


def prepare(
    raw: str | os.PathLike,
    out: str | os.PathLike,
    *,
    encoder: str = "lite",
    encoder_kwargs: dict[str, Any] | None = None,
    targets: str | os.PathLike | None = None,
    make_standin: bool = False,
    splits: list[str] | None = None,
    split_by: str = "conversation",
    skip_invalid: bool = False,
    records_per_shard: int = 1000,
    workers: int = 1,
    emotion_map: str = "avamerg7",
    overwrite: bool = False,
    require_targets: bool = False,
    progress: bool = True,
    command: str | None = None,
    log: Callable[[str], None] | None = None,
    media: str = "required",
) -> dict[str, Any]:
    """Run the whole preparation and return the manifest (also written to ``OUT/manifest.json``).

    `media` (MEDIA_MODES, see `load_raw`): "none" runs no encoder (`encoder`/`encoder_kwargs` unused) and
    writes `encoder: null`, `features: {k: 0, audio_dim: 0, video_dim: 0}`; every mode records
    `media` and each split's `text_only_records`/`text_only_dialogues` in the manifest.
    """
    log = log or (lambda s: print(f"[prepare] {s}", file=sys.stderr))
    t_start = time.perf_counter()
    _check_options(split_by=split_by, records_per_shard=records_per_shard, media=media,
                   make_standin=make_standin)
    raw, out = Path(raw), Path(out)
    if (out / MANIFEST).exists() and not overwrite:
        raise FileExistsError(f"{out / MANIFEST} exists; pass --overwrite to replace this shard folder")
    em = schema.EmotionMap.load(emotion_map)
    encoder_kwargs = dict(encoder_kwargs or {})
    enc = None if media == "none" else get_encoder(encoder, **encoder_kwargs)
    audio_dim, video_dim, k = (enc.audio_dim, enc.video_dim, enc.k) if enc is not None else (0, 0, 0)
    data = _load_valid(raw, out, splits=splits, em=em, skip_invalid=skip_invalid, media=media, log=log)
    if make_standin:
        _make_missing_standins(raw, targets, data, workers=workers, progress=progress, log=log)
    reader = _open_targets(targets, media, log)
    run = SplitRun(
        out=out, data=data, emotion_map=em, targets=reader, audio_dim=audio_dim, video_dim=video_dim, k=k,
        records_per_shard=records_per_shard, skip_invalid=skip_invalid, require_targets=require_targets,
        progress=progress, log=log,
    )
    written = _write_all(run, enc, encoder, encoder_kwargs, workers)
    seconds = time.perf_counter() - t_start
    manifest = _manifest(
        command=command, raw=raw, split_by=split_by, em=em, media=media, enc=enc,
        features={"k": k, "audio_dim": audio_dim, "video_dim": video_dim},
        targets=_targets_summary(reader, targets, written.coverage), written=written,
        skipped=data.skipped, seconds=seconds, workers=workers,
    )
    _write_json_atomic(out / MANIFEST, manifest)
    _log_done(log, manifest, enc, out=out, seconds=seconds)
    return manifest


def cached_text_only_shards(
    dialogues_json: str,
    cache: str | os.PathLike,
    *,
    split: str,
    emotion_map: str = "avamerg7",
    progress: bool = True,
    command: str | None = None,
    log: Callable[[str], None] | None = None,
) -> tuple[Path, bool]:
    """Text-only shards of one split given as AvaMERG JSON text (e.g. `data.import_ed.dumps` of an imported
    EmpatheticDialogues csv), prepared once under `cache` and reused; returns (shards folder, reused).

    The folder, ``CACHE/{split}-{emotion_map}-{key}/`` with ``raw/{split}.json`` and ``shards/``, is keyed by
    the sha256 of the JSON text, the split, the emotion map and the record/manifest versions, so an edited
    csv, a changed importer or another emotion map never meets a stale folder, and evaluating the same file
    again costs no preparation. A shards folder that fails `verify_shards` (interrupted, tampered) is
    rebuilt. The shards are written beside under a temporary name and renamed when complete, so concurrent
    runs on one input never read a half-written folder.
    """
    log = log or (lambda s: print(f"[prepare] {s}", file=sys.stderr))
    if not dialogues_json.strip():
        raise ValueError("no dialogues to prepare (empty JSON text)")
    h = hashlib.sha256()
    for part in (dialogues_json, split, emotion_map, str(schema.SCHEMA_VERSION), MANIFEST_FORMAT):
        h.update(part.encode("utf-8") + b"\0")
    root = Path(cache) / f"{split}-{emotion_map}-{h.hexdigest()[:16]}"
    shards = root / "shards"
    if (shards / MANIFEST).is_file() and not verify_shards(shards):
        log(f"reusing text-only shards {shards} (prepared earlier from the same dialogues)")
        return shards, True
    raw = root / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    path = Path(raw_layout.split_json_path(raw, split))
    tmp_json = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp_json.write_text(dialogues_json, encoding="utf-8")
    os.replace(tmp_json, path)  # the same key holds the same text: concurrent writers agree
    tmp = root / f".shards.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        prepare(raw, tmp, media="none", splits=[split], emotion_map=emotion_map, progress=progress,
                command=command, log=log)
        if shards.exists() and verify_shards(shards):
            shutil.rmtree(shards)  # a broken folder of an earlier run
        try:
            os.rename(tmp, shards)
        except OSError:  # another run finished first: use its folder if it is sound
            if verify_shards(shards):
                raise
            return shards, True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"text-only shards ready in {shards}")
    return shards, False
