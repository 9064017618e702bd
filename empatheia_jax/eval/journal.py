"""A generation journal: an evaluation's finished batches on disk, so a killed eval resumes where it stopped.

Generating the dev split's Chain of Empathy and 16 drawn replies per turn takes hours on a CPU, longer than a
session or a preemptible slot. `generation_pass.generate_predictions(journal=PATH)` appends each finished
batch's predictions here; run again with the same model, data and settings, it reads them back and generates
only the batches that are missing. Batches are formed and seeded the same way on every run (length-sorted
windows; the reply draws seeded from the batch's first record), so the resumed predictions equal an
uninterrupted run's, line for line.

The first line is a header holding the run's fingerprint: a digest of every model weight, of the emotion head
and of the settings the generations depend on (`fingerprint`). A journal written by another model or other
settings is not read: it is started over, with a note on stderr. A line cut short by a kill (the last one) is
dropped, and its batch generated again. JSON lines rather than a checkpoint library: the records are small
dicts appended one batch at a time, and a person can read the file while the eval runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

VERSION = 1  # of the line format; a journal of another version is started over


def fingerprint(arrays: Any, settings: Mapping[str, Any]) -> str:
    """sha256 of every array leaf of `arrays` (any pytree: the model's state, the head's tensors) with its
    path, dtype and shape, and of `settings` (JSON-able: data, template, decoding)."""
    h = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    for path, leaf in jax.tree_util.tree_leaves_with_path(arrays):
        a = np.asarray(leaf)
        h.update(f"{jax.tree_util.keystr(path)}:{a.dtype}:{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


class Journal:
    """The predictions of the batches a run finished (`done`, by record index), appended batch by batch."""

    def __init__(self, path: str | os.PathLike, run_fingerprint: str) -> None:
        self.path = Path(path)
        self.fingerprint = run_fingerprint
        self.done: dict[int, dict[str, Any]] = self._read()
        # written again whole (atomically), so a line a kill cut short is not continued by the next batch
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        header = {"journal": VERSION, "fingerprint": run_fingerprint}
        lines = [header, *self.done.values()]
        tmp.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in lines))
        os.replace(tmp, self.path)

    def _read(self) -> dict[int, dict[str, Any]]:
        if not self.path.is_file():
            return {}
        lines = self.path.read_text().splitlines()
        try:
            header = json.loads(lines[0]) if lines else {}
        except json.JSONDecodeError:
            header = {}
        if header != {"journal": VERSION, "fingerprint": self.fingerprint}:
            print(f"note: {self.path} was written by another model, data or settings: generating again",
                  file=sys.stderr)
            return {}
        done = {}
        for n, line in enumerate(lines[1:], start=2):
            try:
                pred = json.loads(line)
            except json.JSONDecodeError:
                if n == len(lines):  # the line a kill cut short: its batch is generated again
                    break
                raise ValueError(f"{self.path} line {n}: not JSON (a damaged journal: delete it to start "
                                 "over)") from None
            done[int(pred["record_index"])] = pred
        if done:
            print(f"resuming from {self.path}: {len(done)} predictions already generated", file=sys.stderr)
        return done

    def complete(self, record_indices: Iterable[int]) -> bool:
        """Whether every one of these records is journaled (a batch to skip)."""
        return all(int(i) in self.done for i in record_indices)

    def append(self, predictions: Iterable[Mapping[str, Any]]) -> None:
        """Writes one finished batch, flushed to disk before generation goes on."""
        batch = [dict(p) for p in predictions]
        with self.path.open("a") as f:
            f.writelines(json.dumps(p, ensure_ascii=False) + "\n" for p in batch)
            f.flush()
            os.fsync(f.fileno())
        self.done.update({int(p["record_index"]): p for p in batch})


__all__ = ["Journal", "fingerprint"]
