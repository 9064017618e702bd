"""Prepare AvaMERG-format data into ArrayRecord shards: validate, extract features, join targets.

    python -m data.prepare --raw RAW --out SHARDS --encoder lite [--targets TARGETS]
        [--make-standin-targets] [--split-by conversation] [--skip-invalid]
        [--records-per-shard N] [--workers 2] [--overwrite] [--text-only | --media optional]

RAW holds ``{split}.json`` (lists of AvaMERG dialogues) and ``media/{utt_id}.wav|.mp4``. Each split file
becomes ``SHARDS/{split}/{split}-{i}-of-{n}.array_record`` with one msgpack record per ``turns`` entry
(`empatheia_jax.data.shard_format.SHARD_RECORD_FIELDS`). Encoder features are computed once per utterance
(turns are growing prefixes, so later turns reuse them) and generator targets are joined to the response
by utterance id. Invalid input fails the run with every problem listed; ``--skip-invalid`` skips the bad
dialogues instead and lists them in ``SHARDS/skipped_report.txt`` and the manifest. Shards are written
under temporary names and renamed; ``manifest.json`` is written last, so an interrupted run leaves a
folder that `verify_shards` and the input pipeline refuse.

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
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from empatheia_jax.assets import atomic_write, sha256_file
from empatheia_jax.data import schema
from empatheia_jax.data.encoders import Encoder, get_encoder
from empatheia_jax.data.schema import STANDARD_SPLITS, discover_splits
from empatheia_jax.data.shard_format import (
    ARRAY_RECORD_OPTIONS,
    MANIFEST,
    MANIFEST_FORMAT,
    SHARD_RECORD_FIELDS,
    encode_shard_record,
    make_shard_record,
    shard_filename,
    verify_shards,
)
from empatheia_jax.data.targets import (
    STAND_IN,
    STANDIN_KINDS,
    TargetReader,
    make_standin_targets,
    read_targets_meta,
)

__all__ = [
    "MEDIA_MODES",
    "InvalidInputError",
    "PreparedRaw",
    "STANDARD_SPLITS",
    "SHARD_RECORD_FIELDS",
    "cached_text_only_shards",
    "dialogue_records",
    "discover_splits",
    "extract_features",
    "load_raw",
    "make_shard_record",
    "prepare",
    "verify_shards",
]

SKIPPED_REPORT = "skipped_report.txt"
# required: every utterance has its .wav and .mp4 (today's AvaMERG); none: text only, no media read, no
# encoder; optional: per dialogue, none of its media files = text-only, any of them = all of them.
MEDIA_MODES = ("required", "optional", "none")
_MEDIA_KEYS = tuple(f".media{ext}" for ext in schema.MEDIA_EXTENSIONS)


class InvalidInputError(ValueError):
    """RAW data that fails validation; `problems` holds every problem found (not just the first)."""

    def __init__(self, problems: list[str], hint: str = ""):
        self.problems = problems
        head = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"{len(problems)} problem(s) in the input{hint}:\n{head}")


@dataclass
class PreparedRaw:
    """Validated dialogues per split, plus what was skipped and why."""

    raw: Path
    splits: dict[str, list[schema.Dialogue]]
    skipped: list[dict[str, Any]] = field(default_factory=list)  # {split, conversation_id, problems}
    text_only: set[str] = field(default_factory=set)  # conversation ids prepared without media

    @property
    def media_dir(self) -> Path:
        return Path(schema.media_dir_of(self.raw))


def _conv_label(obj: Any, i: int) -> str:
    cid = obj.get("conversation_id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) and cid else f"#{i}"


def _has_no_media(obj: Any, names: frozenset[str] | None) -> bool:
    """True when none of the dialogue's media files exist (`names`: the media folder's listing, None when
    there is no media folder). A dialogue that cannot be parsed is not text-only: its problems stand."""
    if names is None:
        return True
    try:
        d = schema.Dialogue.from_json(obj)
        uids = [u for u, _, _ in schema.dialogue_utterances(d)]
    except (schema.SchemaError, ValueError, TypeError, KeyError, AttributeError):
        return False
    return not any(u + ext in names for u in uids for ext in schema.MEDIA_EXTENSIONS)


def load_raw(
    raw: str | os.PathLike,
    *,
    splits: list[str] | None = None,
    emotion_map: schema.EmotionMap,
    skip_invalid: bool = False,
    check_media_readable: bool = True,
    media: str = "required",
) -> PreparedRaw:
    """Validate every split file (records and media) and build the dialogues.

    Without `skip_invalid` any problem raises InvalidInputError listing all of them. With it, dialogues
    with problems are skipped and recorded; problems that cannot be pinned to one dialogue (unreadable
    JSON) and conversations that appear in more than one split are always fatal (a split leak would
    silently inflate evaluation).

    `media` (MEDIA_MODES): "required" checks every utterance's media; "none" checks none and marks every
    dialogue text-only; "optional" marks a dialogue text-only when none of its media files exist (no
    media folder: all of them) and checks the others as "required" does, so one missing file of a
    dialogue that has media is still a problem naming that file.
    """
    if media not in MEDIA_MODES:
        raise ValueError(f"media={media!r}: expected one of {MEDIA_MODES}")
    raw = Path(raw)
    splits = splits or discover_splits(raw)
    media_dir, names = _media_to_check(raw, media)
    fatal: list[str] = []
    skipped: list[dict[str, Any]] = []
    out: dict[str, list[schema.Dialogue]] = {}
    owner: dict[str, str] = {}
    text_only: set[str] = set()
    for split in splits:
        path = schema.split_json_path(raw, split)
        by_conv, objs, no_media = _split_problems(
            path, media_dir, names, media=media, emotion_map=emotion_map,
            check_media_readable=check_media_readable,
        )
        if None in by_conv:  # file-level (JSON) problems: nothing can be salvaged
            fatal += by_conv.pop(None)
            continue
        if objs is None:
            objs = _read_json(path)
        if by_conv and not skip_invalid:
            fatal += [p for ps in by_conv.values() for p in ps]
            continue
        out[split], split_skipped, split_fatal, split_text_only = _split_dialogues(
            split, path, objs, by_conv, no_media, owner
        )
        skipped += split_skipped
        fatal += split_fatal
        text_only |= split_text_only
    if fatal:
        hint = "" if skip_invalid else " (use --skip-invalid to skip the bad dialogues and report them)"
        raise InvalidInputError(fatal, hint)
    return PreparedRaw(raw, out, skipped, text_only)


def _read_json(path: str | os.PathLike) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _media_to_check(raw: Path, media: str) -> tuple[str | None, frozenset[str] | None]:
    """(media folder to validate against, listing of it): no folder when nothing is checked, and the
    listing only for "optional", which decides per dialogue from one scan instead of a stat per file."""
    media_dir: str | None = schema.media_dir_of(raw)
    names: frozenset[str] | None = None
    if media == "none" or (media == "optional" and not Path(media_dir).is_dir()):
        media_dir = None
    elif media == "optional":
        names = frozenset(e.name for e in os.scandir(media_dir) if e.is_file())
    return media_dir, names


def _split_problems(
    path: str,
    media_dir: str | None,
    names: frozenset[str] | None,
    *,
    media: str,
    emotion_map: schema.EmotionMap,
    check_media_readable: bool,
) -> tuple[dict[str | None, list[str]], list[Any] | None, set[str]]:
    """(problems by conversation, the parsed split file or None, labels of its text-only dialogues).

    Problems are grouped per conversation (None: the file itself) because a dialogue is skipped or kept
    as a whole. Outside "required" media, the missing-file problems of dialogues that have none of their
    media are dropped: such a dialogue is prepared text-only rather than reported.
    """
    problems = schema.validate_file(
        path, media_dir, emotion_map=emotion_map, check_media_readable=check_media_readable
    )
    objs = None
    no_media: set[str] = set()  # labels of the dialogues prepared text-only
    if media != "required" and not any(p.conversation_id is None for p in problems):
        objs = _read_json(path)
        no_media = {_conv_label(o, i) for i, o in enumerate(objs) if _has_no_media(o, names)}
        # a dialogue with none of its files claims no media: its "missing media file" lines go
        problems = [
            p for p in problems if not (p.conversation_id in no_media and p.key.endswith(_MEDIA_KEYS))
        ]
    by_conv: dict[str | None, list[str]] = defaultdict(list)
    for p in problems:
        by_conv[p.conversation_id].append(str(p))
    return by_conv, objs, no_media


def _split_dialogues(
    split: str,
    path: str,
    objs: list[Any],
    by_conv: dict[str | None, list[str]],
    no_media: set[str],
    owner: dict[str, str],
) -> tuple[list[schema.Dialogue], list[dict[str, Any]], list[str], set[str]]:
    """(dialogues, skipped, fatal problems, text-only conversation ids) of one validated split file.

    `owner` (conversation id -> split, shared by all splits and updated here) catches a conversation
    in two splits, which is fatal even with --skip-invalid: a split leak silently inflates evaluation.
    """
    dialogues: list[schema.Dialogue] = []
    skipped: list[dict[str, Any]] = []
    fatal: list[str] = []
    text_only: set[str] = set()
    for i, obj in enumerate(objs):
        label = _conv_label(obj, i)
        if label in by_conv:
            skipped.append({"split": split, "conversation_id": label, "problems": by_conv[label]})
            continue
        d = schema.Dialogue.from_json(obj, source=path)
        if d.conversation_id in owner:
            fatal.append(
                f"{split}.json: conversation {d.conversation_id} is also in "
                f"{owner[d.conversation_id]}.json; a conversation must not span splits "
                "(--split-by conversation)"
            )
            continue
        owner[d.conversation_id] = split
        dialogues.append(d)
        if label in no_media:
            text_only.add(d.conversation_id)
    return dialogues, skipped, fatal, text_only


def history_utterances(dialogue: schema.Dialogue) -> list[str]:
    """Distinct utterance ids that occur in some turn's history (the ones that need features)."""
    seen: dict[str, None] = {}
    for t in dialogue.turns:
        for uid, _, _ in schema.turn_utterances(dialogue, t):
            seen.setdefault(uid, None)
    return list(seen)


def extract_features(
    encoder: Encoder, utt_ids: list[str], media_dir: str | os.PathLike
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """utt_id -> (audio [k,d_a], video [k,d_v]); errors name the utterance and the file."""
    media_dir = Path(media_dir)
    feats = {}
    for uid in utt_ids:
        wav, mp4 = media_dir / f"{uid}.wav", media_dir / f"{uid}.mp4"
        try:
            a = encoder.encode_audio(wav)
        except Exception as e:
            raise RuntimeError(f"utterance {uid}: audio features of {wav} failed: {e}") from e
        try:
            v = encoder.encode_video(mp4)
        except Exception as e:
            raise RuntimeError(f"utterance {uid}: video features of {mp4} failed: {e}") from e
        feats[uid] = (a, v)
    return feats


def dialogue_records(
    dialogue: schema.Dialogue,
    *,
    split: str,
    feats: dict[str, tuple[np.ndarray, np.ndarray]],
    emotion_map: schema.EmotionMap,
    targets: TargetReader | None,
    audio_dim: int,
    video_dim: int,
    k: int,
    text_only: bool = False,
) -> list[dict[str, Any]]:
    """One shard record per turn of `dialogue`; features looked up in `feats`, targets by response id.

    `text_only`: no features at all, i.e. zero vectors per utterance (`[n_hist, 0, dim]`), so a record
    never pretends to hold media it was prepared without."""
    recs = []
    for j, t in enumerate(dialogue.turns):
        uids = [u for u, _, _ in schema.turn_utterances(dialogue, t)]
        if text_only:
            audio = np.zeros((len(uids), 0, audio_dim), np.float32)
            video = np.zeros((len(uids), 0, video_dim), np.float32)
        elif uids:
            audio = np.stack([feats[u][0] for u in uids])
            video = np.stack([feats[u][1] for u in uids])
        else:
            audio = np.zeros((0, k, audio_dim), np.float32)
            video = np.zeros((0, k, video_dim), np.float32)
        tg = {}
        if targets is not None:
            resp = schema.response_utterance_id(dialogue, j)
            for kind in targets.kinds:
                a = targets.get(kind, resp)
                if a is not None:
                    tg[kind] = a
        recs.append(
            make_shard_record(
                dialogue,
                j,
                split=split,
                emotion_map=emotion_map,
                audio_feats=audio,
                video_feats=video,
                targets=tg,
            )
        )
    return recs


# ----------------------------------------------------------------------------------------------
# feature workers

_ENC: Encoder | None = None


def _worker_init(name: str, kwargs: dict[str, Any]) -> None:
    global _ENC
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _ENC = get_encoder(name, **kwargs)


def _worker_features(job: tuple[int, list[str], str]) -> tuple[int, dict[str, Any] | None, str | None]:
    i, uids, media = job
    assert _ENC is not None
    try:
        return i, extract_features(_ENC, uids, media), None
    except Exception as e:  # noqa: BLE001 - returned to the parent, which decides (skip or fail)
        return i, None, str(e)


class _FeaturePool:
    """Features per dialogue job, in job order: in-process, or one spawn pool (no forked JAX state) kept for
    all splits, since starting workers that load a transformers encoder costs seconds each."""

    def __init__(self, encoder: Encoder, name: str, kwargs: dict[str, Any], workers: int):
        self.encoder, self.pool = encoder, None
        if workers > 1:
            import multiprocessing as mp

            self.pool = mp.get_context("spawn").Pool(workers, _worker_init, (name, kwargs))

    def __enter__(self) -> _FeaturePool:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.pool is not None:
            if exc_type is None:
                self.pool.close()
            else:
                self.pool.terminate()
            self.pool.join()

    def stream(
        self, jobs: list[tuple[int, list[str], str]]
    ) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
        if self.pool is not None:
            yield from self.pool.imap(_worker_features, jobs, chunksize=4)
            return
        for i, uids, media in jobs:
            try:
                yield i, extract_features(self.encoder, uids, media), None
            except Exception as e:  # noqa: BLE001 - the caller skips or fails, naming the dialogue
                yield i, None, str(e)


# ----------------------------------------------------------------------------------------------
# shard writing


class _ShardSetWriter:
    """Writes one split's records into shards of `per_shard` records, under temporary names.

    Final names need the shard count, known only at the end (a dialogue may still be skipped), so
    shards are renamed by `finish()`; `abort()` removes the temporaries.
    """

    def __init__(self, out: Path, split: str, per_shard: int):
        from array_record.python.array_record_module import ArrayRecordWriter

        self._writer_cls = ArrayRecordWriter
        self.dir = out / split
        self.dir.mkdir(parents=True, exist_ok=True)
        self.split, self.per_shard = split, per_shard
        self.tmp: list[tuple[Path, int]] = []
        self._w: Any = None
        self._n = 0

    def write(self, data: bytes) -> None:
        if self._w is None or self._n >= self.per_shard:
            self._close_current()
            fd, path = tempfile.mkstemp(dir=self.dir, prefix=f".{self.split}-", suffix=".array_record.tmp")
            os.close(fd)
            self._w = self._writer_cls(path, ARRAY_RECORD_OPTIONS)
            self.tmp.append((Path(path), 0))
            self._n = 0
        self._w.write(data)
        self._n += 1
        self.tmp[-1] = (self.tmp[-1][0], self._n)

    def _close_current(self) -> None:
        if self._w is not None:
            self._w.close()
            self._w = None

    def finish(self, out: Path) -> list[dict[str, Any]]:
        self._close_current()
        n = len(self.tmp)
        shards = []
        for i, (tmp, count) in enumerate(self.tmp):
            final = self.dir / shard_filename(self.split, i, n)
            os.replace(tmp, final)
            shards.append(
                {"path": str(final.relative_to(out)), "records": count, "sha256": sha256_file(final)}
            )
        self.tmp = []
        return shards

    def abort(self) -> None:
        self._close_current()
        for tmp, _ in self.tmp:
            tmp.unlink(missing_ok=True)
        self.tmp = []


def _clean_stale(out: Path, keep: set[Path]) -> None:
    """Remove shards (and temporaries) of earlier runs: only files named like ours, in split folders."""
    for p in list(out.glob("*/*-?????-of-?????.array_record")) + list(out.glob("*/.*.array_record.tmp")):
        if p.name.startswith((f"{p.parent.name}-", f".{p.parent.name}-")) and p.resolve() not in keep:
            p.unlink()


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
class _SplitRun:
    """What writing every split of one `prepare` run shares, so the per-split steps take one argument
    instead of a dozen."""

    out: Path
    data: PreparedRaw  # `skipped` grows when a dialogue's features fail under --skip-invalid
    emotion_map: schema.EmotionMap
    targets: TargetReader | None
    audio_dim: int
    video_dim: int
    k: int
    records_per_shard: int
    skip_invalid: bool
    require_targets: bool
    progress: bool
    log: Callable[[str], None]


@dataclass
class _Written:
    """What the split writers report back for the manifest and for the sweep of stale shards."""

    split_info: dict[str, Any] = field(default_factory=dict)
    coverage: dict[str, dict[str, int]] = field(default_factory=dict)
    keep: set[Path] = field(default_factory=set)  # shard files of this run (resolved)
    utterances: int = 0
    feature_seconds: float = 0.0


def _write_splits(run: _SplitRun, features: _FeaturePool) -> _Written:
    """Every split's shards in turn, checking target coverage after each so a run with
    `require_targets` stops at the first split that lacks some."""
    written = _Written()
    for split, dialogues in run.data.splits.items():
        info, cov, feature_seconds = _write_split(run, features, split, dialogues)
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


def _write_split(
    run: _SplitRun, features: _FeaturePool, split: str, dialogues: list[schema.Dialogue]
) -> tuple[dict[str, Any], dict[str, int], float]:
    """(split info for the manifest, records per target kind, feature seconds) of one split.

    Records are written as each dialogue's features arrive, so a split's features are never all held at
    once; any failure removes this split's temporary shards, leaving no half-written shard behind.
    """
    from tqdm import tqdm

    writer = _ShardSetWriter(run.out, split, run.records_per_shard)
    cov: dict[str, int] = defaultdict(int)
    n_rec = n_dia = n_split_utts = n_text_rec = n_text_dia = 0
    jobs = [
        (i, [] if d.conversation_id in run.data.text_only else history_utterances(d), str(run.data.media_dir))
        for i, d in enumerate(dialogues)
    ]
    total_utts = sum(len(j[1]) for j in jobs)
    if total_utts:
        bar = tqdm(total=total_utts, desc=f"{split}: utterances", unit="utt", disable=not run.progress)
    else:  # nothing to encode: count dialogues
        bar = tqdm(total=len(jobs), desc=f"{split}: dialogues", unit="dia", disable=not run.progress)
    try:
        t0 = time.perf_counter()
        for i, feats, err in features.stream(jobs):
            d = dialogues[i]
            bar.update(len(jobs[i][1]) if total_utts else 1)
            recs = _dialogue_records_or_skip(run, split, d, feats, err)
            if recs is None:
                continue
            for r in recs:
                writer.write(encode_shard_record(r))
                for kind in r["targets"]:
                    cov[kind] += 1
            text_only = d.conversation_id in run.data.text_only
            n_rec += len(recs)
            n_dia += 1
            n_text_rec += len(recs) if text_only else 0
            n_text_dia += int(text_only)
            n_split_utts += len(jobs[i][1])
        feature_seconds = time.perf_counter() - t0
        shards = writer.finish(run.out)
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    info = {
        "records": n_rec,
        "dialogues": n_dia,
        "utterances": n_split_utts,
        "text_only_records": n_text_rec,
        "text_only_dialogues": n_text_dia,
        "shards": shards,
    }
    return info, cov, feature_seconds


def _dialogue_records_or_skip(
    run: _SplitRun, split: str, d: schema.Dialogue, feats: dict[str, Any] | None, err: str | None
) -> list[dict[str, Any]] | None:
    """The dialogue's records, or None when its features failed and --skip-invalid skips it (recorded
    like a validation skip, so the report lists every dialogue left out, whatever the reason)."""
    if err is not None:
        if not run.skip_invalid:
            raise InvalidInputError([f"{split}.json: conversation {d.conversation_id}: {err}"])
        run.data.skipped.append({"split": split, "conversation_id": d.conversation_id, "problems": [err]})
        run.log(f"SKIPPING {split}/{d.conversation_id}: {err}")
        return None
    return dialogue_records(
        d,
        split=split,
        feats=feats,
        emotion_map=run.emotion_map,
        targets=run.targets,
        audio_dim=run.audio_dim,
        video_dim=run.video_dim,
        k=run.k,
        text_only=d.conversation_id in run.data.text_only,
    )


def _write_skipped_report(out: Path, skipped: list[dict[str, Any]]) -> None:
    """SKIPPED_REPORT lists the skipped dialogues with every problem; a run that skipped nothing removes
    an earlier run's report, which would otherwise describe other shards."""
    report = out / SKIPPED_REPORT
    if skipped:
        lines = [f"# {len(skipped)} dialogue(s) skipped by data/prepare.py --skip-invalid", ""]
        for s in skipped:
            lines.append(f"{s['split']}\t{s['conversation_id']}")
            lines += [f"    {p}" for p in s["problems"]]
        report.write_text("\n".join(lines) + "\n")
    else:
        report.unlink(missing_ok=True)


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
    total_records: int,
    seconds: float,
    workers: int,
) -> dict[str, Any]:
    """The manifest.json content (docs/design.md "Shards and manifest"); its key order is the file's."""
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

    data = load_raw(raw, splits=splits, emotion_map=em, skip_invalid=skip_invalid, media=media)
    if data.skipped:
        log(f"SKIPPING {len(data.skipped)} invalid dialogue(s); see {out / SKIPPED_REPORT}")
    if media == "optional" and data.text_only:
        log(f"{len(data.text_only)} dialogue(s) have none of their media files: prepared text-only "
            "(--media optional)")
    if make_standin:
        _make_missing_standins(raw, targets, data, workers=workers, progress=progress, log=log)
    reader = _open_targets(targets, media, log)

    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # from here on the folder is "unfinished"
    run = _SplitRun(
        out=out, data=data, emotion_map=em, targets=reader, audio_dim=audio_dim, video_dim=video_dim, k=k,
        records_per_shard=records_per_shard, skip_invalid=skip_invalid, require_targets=require_targets,
        progress=progress, log=log,
    )
    # text-only dialogues have no utterance to encode; a text-only run needs no pool (and has no encoder)
    pool_workers = workers if enc is not None else 1
    with _FeaturePool(enc, encoder, encoder_kwargs, pool_workers) as features:
        written = _write_splits(run, features)
    _clean_stale(out, written.keep)
    _write_skipped_report(out, data.skipped)

    total_records = sum(s["records"] for s in written.split_info.values())
    seconds = time.perf_counter() - t_start
    tsum = _targets_summary(reader, targets, written.coverage)
    manifest = _manifest(
        command=command, raw=raw, split_by=split_by, em=em, media=media, enc=enc,
        features={"k": k, "audio_dim": audio_dim, "video_dim": video_dim}, targets=tsum, written=written,
        skipped=data.skipped, total_records=total_records, seconds=seconds, workers=workers,
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
    path = Path(schema.split_json_path(raw, split))
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
