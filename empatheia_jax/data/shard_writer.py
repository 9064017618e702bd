"""Writing one split's shards: records encoded as each dialogue's features arrive, into shards of N
records under temporary names, renamed when the split is complete; plus the sweep of an earlier run's
shards and the skipped-dialogues report.

A failure removes the split's temporary shards, so no half-written shard is left behind; `prepare` writes
the manifest only after every split, so an interrupted run leaves a folder that readers refuse.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from empatheia_jax.assets import sha256_file
from empatheia_jax.data import schema
from empatheia_jax.data.dialogue_records import FeaturePool, dialogue_records, history_utterances
from empatheia_jax.data.raw_splits import InvalidInputError, PreparedRaw
from empatheia_jax.data.shard_format import ARRAY_RECORD_OPTIONS, encode_shard_record, shard_filename
from empatheia_jax.data.targets import TargetReader

SKIPPED_REPORT = "skipped_report.txt"



class ShardSetWriter:
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


def clean_stale(out: Path, keep: set[Path]) -> None:
    """Remove shards (and temporaries) of earlier runs: only files named like ours, in split folders."""
    for p in list(out.glob("*/*-?????-of-?????.array_record")) + list(out.glob("*/.*.array_record.tmp")):
        if p.name.startswith((f"{p.parent.name}-", f".{p.parent.name}-")) and p.resolve() not in keep:
            p.unlink()


@dataclass
class SplitRun:
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


def write_split(
    run: SplitRun, features: FeaturePool, split: str, dialogues: list[schema.Dialogue]
) -> tuple[dict[str, Any], dict[str, int], float]:
    """(split info for the manifest, records per target kind, feature seconds) of one split.

    Records are written as each dialogue's features arrive, so a split's features are never all held at
    once; any failure removes this split's temporary shards, leaving no half-written shard behind.
    """
    from tqdm import tqdm

    writer = ShardSetWriter(run.out, split, run.records_per_shard)
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
    run: SplitRun, split: str, d: schema.Dialogue, feats: dict[str, Any] | None, err: str | None
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


def write_skipped_report(out: Path, skipped: list[dict[str, Any]]) -> None:
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


__all__ = [
    "SKIPPED_REPORT", "ShardSetWriter", "SplitRun", "clean_stale", "write_skipped_report", "write_split",
]
