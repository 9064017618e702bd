"""Generator-target files: the gold features the Content Synchronizer and Style Disentangler regress to.

Layout (docs/design.md, "Generator-target files")::

    TARGETS/meta.json                                   {kind: {"dim", "source", "files", ...}}
    TARGETS/{kind}-{i:05d}-of-{n:05d}.safetensors       float32 tensors keyed by utterance id

kinds: speech_content [T_ph,1024] (StyleTTS2 t_en ++ d_en), video_content [T_frames,256] (DreamTalk
audio content, 25 fps), speech_style [256] (StyleTTS2 ref_s), video_style [256] (DreamTalk style code).

Exporters (converters/*_targets.py) write them with `TargetWriter`; `data/prepare.py` joins them to
the response utterance of every example through `TargetReader`. For the embedded sample, where the real
generators are unavailable, `make_standin_targets` derives deterministic, learnable stand-ins from the
sample's media and text; they are labelled ``"source": "stand-in"`` everywhere they travel.

CLI: ``python -m data.targets standin --raw RAW --out TARGETS`` and
``python -m data.targets info TARGETS``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from empatheia_jax.assets import atomic_write

# kind -> (rank, standard last dim). Rank 2 = one row per position, rank 1 = one vector per utterance.
TARGET_KINDS: dict[str, tuple[int, int]] = {
    "speech_content": (2, 1024),
    "video_content": (2, 256),
    "speech_style": (1, 256),
    "video_style": (1, 256),
    "video_units": (2, 1),
}
UNIT_KINDS = ("video_units",)
"""Kinds that label rows instead of being regressed: `video_units` [T_frames, 1] holds, per video_content
row, the speech generator's content-unit id of the frame (`visemes.frame_units`; integers stored exactly in
float32), written next to video_content by `converters.face_targets --mouth phonemes` and read by a
unit-aligned video block (`EmpatheiaConfig.cv_units`). No stand-in exists for them, no loss or baseline
reads them as a target."""
STANDIN_KINDS = tuple(k for k in TARGET_KINDS if k not in UNIT_KINDS)
SOURCES = ("styletts2", "kokoro", "dreamtalk", "face_render", "stand-in")
"""Who made a target: StyleTTS2 (the user's checkpoint), Kokoro-82M (the embedded StyleTTS2-family model,
empatheia_jax/generators/kokoro.py), DreamTalk (the user's checkpoint), the procedural face generator's
controls
(empatheia_jax/generators/face_render.py, converters/face_targets.py), or the sample's stand-in functions."""
STAND_IN = "stand-in"
META = "meta.json"
VIDEO_FPS = 25


class TargetFormatError(ValueError):
    """A target folder or tensor that does not match meta.json (names the file and the key)."""


def shard_name(kind: str, i: int, n: int) -> str:
    return f"{kind}-{i:05d}-of-{n:05d}.safetensors"


def expected_shape(kind: str, dim: int) -> list[Any]:
    """Shape as recorded in meta.json: ``["T", dim]`` for per-position kinds, ``[dim]`` otherwise."""
    rank, _ = TARGET_KINDS[kind]
    return ["T", dim] if rank == 2 else [dim]


@contextlib.contextmanager
def _meta_lock(directory: Path) -> Iterator[None]:
    """Serialise meta.json updates of writers of different kinds running in separate processes."""
    with open(directory / ".meta.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_targets_meta(directory: Path) -> dict[str, Any]:
    p = directory / META
    if not p.exists():
        return {}
    try:
        meta = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise TargetFormatError(f"{p}: not valid JSON ({e})") from e
    if not isinstance(meta, dict):
        raise TargetFormatError(f"{p}: top level must be an object keyed by kind")
    return meta


def _write_json_atomic(path: Path, obj: Any) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())

    atomic_write(path, write)


class TargetWriter:
    """Write one kind of target, atomically: nothing is visible until `close()` (or a clean ``with`` exit).

    Shards are written under temporary names; on commit the kind is first removed from meta.json
    (readers then refuse it instead of mixing old and new files), the shards are renamed to
    ``{kind}-{i}-of-{n}``, stale shards of the kind are deleted, and meta.json is written last. An
    exception inside the ``with`` block deletes the temporary files and leaves the folder as it was.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        kind: str,
        source: str,
        dim: int | None = None,
        shard_size: int = 512,
        extra_meta: dict[str, Any] | None = None,
    ):
        if kind not in TARGET_KINDS:
            raise ValueError(f"unknown target kind {kind!r}; expected one of {sorted(TARGET_KINDS)}")
        if source not in SOURCES:
            raise ValueError(f"unknown target source {source!r}; expected one of {SOURCES}")
        if shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {shard_size}")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.kind, self.source = kind, source
        self.rank, std = TARGET_KINDS[kind]
        self.dim = int(std if dim is None else dim)
        self.shard_size = int(shard_size)
        self.extra_meta = dict(extra_meta or {})
        self._buf: dict[str, np.ndarray] = {}
        self._tmp_files: list[Path] = []
        self._keys: set[str] = set()
        self._closed = False

    def __enter__(self) -> TargetWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, utt_id: str, array: np.ndarray) -> None:
        """Queue the target of one utterance; checks rank, last dim, finiteness and duplicate ids."""
        if self._closed:
            raise RuntimeError("TargetWriter is closed")
        if not isinstance(utt_id, str) or not utt_id:
            raise ValueError(f"utterance id must be a non-empty string, got {utt_id!r}")
        if utt_id in self._keys:
            raise ValueError(f"{self.kind}: duplicate utterance id {utt_id!r}")
        a = np.ascontiguousarray(array, dtype=np.float32)
        if a.ndim != self.rank or a.shape[-1] != self.dim or (self.rank == 2 and a.shape[0] < 1):
            raise TargetFormatError(
                f"{self.kind} target of {utt_id!r} has shape {list(a.shape)}, expected "
                f"{expected_shape(self.kind, self.dim)}"
            )
        if not np.isfinite(a).all():
            raise TargetFormatError(f"{self.kind} target of {utt_id!r} has non-finite values")
        self._keys.add(utt_id)
        self._buf[utt_id] = a
        if len(self._buf) >= self.shard_size:
            self._flush()

    def _flush(self) -> None:
        from safetensors.numpy import save_file

        if not self._buf:
            return
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{self.kind}-", suffix=".safetensors.tmp")
        os.close(fd)
        self._tmp_files.append(Path(tmp))
        save_file(self._buf, tmp, metadata={"kind": self.kind, "source": self.source, "dim": str(self.dim)})
        self._buf = {}

    def abort(self) -> None:
        """Delete everything written so far; the folder keeps its previous state."""
        self._closed = True
        self._buf = {}
        for p in self._tmp_files:
            p.unlink(missing_ok=True)
        self._tmp_files = []

    def close(self) -> None:
        """Commit: rename the shards into place and record the kind in meta.json (last)."""
        if self._closed:
            return
        self._flush()
        self._closed = True
        if not self._tmp_files:
            raise ValueError(f"{self.kind}: no targets were added; refusing to write an empty kind")
        n = len(self._tmp_files)
        names = [shard_name(self.kind, i, n) for i in range(n)]
        with _meta_lock(self.dir):
            meta = read_targets_meta(self.dir)
            if self.kind in meta:  # readers must not see old meta with new files during the swap
                del meta[self.kind]
                _write_json_atomic(self.dir / META, meta)
            for tmp, name in zip(self._tmp_files, names, strict=True):
                os.replace(tmp, self.dir / name)
            for stale in self.dir.glob(f"{self.kind}-*-of-*.safetensors"):
                if stale.name not in names:
                    stale.unlink()
            entry = {
                **self.extra_meta,
                "dim": self.dim,
                "source": self.source,
                "shape": expected_shape(self.kind, self.dim),
                "dtype": "float32",
                "files": names,
                "count": len(self._keys),
                "shard_size": self.shard_size,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            meta[self.kind] = entry
            _write_json_atomic(self.dir / META, meta)
        self._tmp_files = []


def remove_kind(directory: str | os.PathLike, kind: str) -> bool:
    """Remove `kind` from a target folder: meta.json first (readers then refuse it), then its files, under
    the writers' lock. True when there was one. For a re-export that no longer makes the kind (video_units
    after a speech-mouth export), so no stale tensor is read beside the new ones."""
    d = Path(directory)
    with _meta_lock(d):
        meta = read_targets_meta(d)
        if kind not in meta:
            return False
        del meta[kind]
        _write_json_atomic(d / META, meta)
        for f in d.glob(f"{kind}-*-of-*.safetensors"):
            f.unlink()
    return True


class TargetReader:
    """Lazy, keyed access to a target folder; dims and ranks are checked against meta.json.

    A folder without meta.json is refused: either it is not a target folder, or a writer was interrupted
    before its commit. File handles (`safetensors.safe_open`) are opened on first use per kind, so
    a reader is cheap to create in each worker process (it pickles as its path).
    """

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        meta_path = self.dir / META
        if not meta_path.is_file():
            raise FileNotFoundError(
                f"{meta_path} does not exist: {self.dir} is not a target folder, or a target write was "
                "interrupted before it committed (meta.json is written last)"
            )
        self.meta = read_targets_meta(self.dir)
        for kind, entry in self.meta.items():
            self._check_entry(meta_path, kind, entry)
        self._handles: dict[str, list[Any]] = {}
        self._index: dict[str, dict[str, int]] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"dir": self.dir}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["dir"])

    @staticmethod
    def _check_entry(meta_path: Path, kind: str, entry: Any) -> None:
        if kind not in TARGET_KINDS:
            raise TargetFormatError(f"{meta_path}: unknown kind {kind!r}; expected {sorted(TARGET_KINDS)}")
        if not isinstance(entry, dict) or not isinstance(entry.get("dim"), int) or entry["dim"] < 1:
            raise TargetFormatError(f"{meta_path}: entry {kind!r} needs an integer 'dim'")
        if not isinstance(entry.get("source"), str):
            raise TargetFormatError(f"{meta_path}: entry {kind!r} needs a 'source'")
        files = entry.get("files")
        if not isinstance(files, list) or not files:
            raise TargetFormatError(f"{meta_path}: entry {kind!r} needs a non-empty 'files' list")
        for name in files:
            if not (meta_path.parent / name).is_file():
                raise TargetFormatError(f"{meta_path}: {kind} file {name} is missing")

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(k for k in TARGET_KINDS if k in self.meta)

    def dim(self, kind: str) -> int:
        return int(self._entry(kind)["dim"])

    def source(self, kind: str) -> str:
        return str(self._entry(kind)["source"])

    def is_stand_in(self, kind: str) -> bool:
        return self.source(kind) == STAND_IN

    def summary(self) -> dict[str, dict[str, Any]]:
        """{kind: {dim, source, count, stand_in}}: what a manifest records about the targets."""
        return {
            k: {
                "dim": self.dim(k),
                "source": self.source(k),
                "count": self.meta[k].get("count"),
                "stand_in": self.is_stand_in(k),
            }
            for k in self.kinds
        }

    def _entry(self, kind: str) -> dict[str, Any]:
        if kind not in self.meta:
            raise KeyError(f"{self.dir}: no {kind!r} targets (meta.json has {list(self.kinds)})")
        return self.meta[kind]

    def _open(self, kind: str) -> None:
        from safetensors import safe_open

        entry = self._entry(kind)
        handles, index = [], {}
        for i, name in enumerate(entry["files"]):
            path = self.dir / name
            try:
                h = safe_open(str(path), framework="np")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise TargetFormatError(f"{path}: cannot open as safetensors ({e})") from e
            handles.append(h)
            for key in h.keys():  # noqa: SIM118 - safe_open is not iterable
                if key in index:
                    raise TargetFormatError(f"{path}: key {key!r} also in {entry['files'][index[key]]}")
                index[key] = i
        self._handles[kind], self._index[kind] = handles, index

    def keys(self, kind: str) -> list[str]:
        if kind not in self._index:
            self._open(kind)
        return list(self._index[kind])

    def __contains__(self, item: tuple[str, str]) -> bool:
        kind, utt_id = item
        if kind not in self.meta:
            return False
        if kind not in self._index:
            self._open(kind)
        return utt_id in self._index[kind]

    def get(self, kind: str, utt_id: str) -> np.ndarray | None:
        """The float32 target of `utt_id`, or None when this utterance has none of that kind."""
        if kind not in self._index:
            self._open(kind)
        i = self._index[kind].get(utt_id)
        if i is None:
            return None
        name = self._entry(kind)["files"][i]
        h = self._handles[kind][i]
        shape = h.get_slice(utt_id).get_shape()
        dim, (rank, _) = self.dim(kind), TARGET_KINDS[kind]
        if len(shape) != rank or shape[-1] != dim or (rank == 2 and shape[0] < 1):
            raise TargetFormatError(
                f"{self.dir / name}: key {utt_id!r} ({kind}) has shape {list(shape)}, but meta.json says "
                f"{expected_shape(kind, dim)}"
            )
        return np.asarray(h.get_tensor(utt_id), dtype=np.float32)

    def verify(self) -> list[str]:
        """Check every tensor's shape and dtype against meta.json and the counts; returns problems."""
        problems = []
        for kind in self.kinds:
            try:
                keys = self.keys(kind)
            except TargetFormatError as e:
                problems.append(str(e))
                continue
            if self.meta[kind].get("count") not in (None, len(keys)):
                problems.append(
                    f"{self.dir}: {kind} has {len(keys)} tensors, meta.json says {self.meta[kind]['count']}"
                )
            for key in keys:
                try:
                    self.get(kind, key)
                except TargetFormatError as e:
                    problems.append(str(e))
        return problems


# ----------------------------------------------------------------------------------------------
# stand-in targets


STANDIN_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789' .,!?"
STANDIN_METHOD = {
    "speech_content": "one row per character of standin_units(text) (lower-cased letters, digits, "
    "' .,!? with spaces collapsed): fixed seeded random projection of [one-hot(c_i), 0.5*one-hot(c_i-1), "
    "0.5*one-hot(c_i+1), sinusoidal position(i), relative position] to 1024",
    "video_content": "one row per 25-fps frame of the utterance wav: fixed seeded random projection of "
    "[40 normalised log-mels, RMS dB/20, their deltas] to 256",
    "speech_style": "fixed seeded random projection of the lite encoder's audio features (log-mel mean/std, "
    "pitch/energy/rate statistics; scalars weighted x2) to 256",
    "video_style": "fixed seeded random projection of the lite encoder's video features (face thumbnail "
    "mean/std, colour, mouth motion) to 256",
}


def standin_units(text: str) -> str:
    """The character sequence whose length is T_ph of a stand-in speech_content target.

    The inference bridge uses the same function to know how many rows to read for a generated reply.
    """
    out: list[str] = []
    for ch in text.lower():
        if ch.isspace():
            ch = " "
        if ch in STANDIN_CHARS and not (ch == " " and (not out or out[-1] == " ")):
            out.append(ch)
    s = "".join(out).strip()
    return s or " "


def _projection(seed: int, name: str, out_dim: int, in_dim: int) -> np.ndarray:
    tag = sum((i + 1) * ord(c) for i, c in enumerate(name))
    rng = np.random.default_rng([seed, tag, out_dim, in_dim])
    return (rng.standard_normal((out_dim, in_dim)) / math.sqrt(in_dim)).astype(np.float32)


class StandinTargets:
    """Deterministic stand-ins for the four target kinds of one utterance (see `STANDIN_METHOD`).

    They are functions of the text (speech_content) and of the media (the rest), so the model can learn
    them from the same inputs the real generator features would come from; they are NOT generator features.
    """

    def __init__(self, seed: int = 0):
        from empatheia_jax.data.encoders.lite import LiteEncoder

        self.seed = int(seed)
        self.lite = LiteEncoder(k=1)
        v = len(STANDIN_CHARS)
        self._char_in = 3 * v + 16 + 2
        self.p_speech = _projection(self.seed, "speech_content", 1024, self._char_in)
        self.p_vcontent = _projection(self.seed, "video_content", 256, 2 * 41)
        self.p_sstyle = _projection(self.seed, "speech_style", 256, self.lite.audio_dim)
        self.p_vstyle = _projection(self.seed, "video_style", 256, self.lite.video_dim)
        self._fb: np.ndarray | None = None

    def config(self) -> dict[str, Any]:
        return {"seed": self.seed, "method": STANDIN_METHOD, "lite": self.lite.config()}

    def speech_content(self, text: str) -> np.ndarray:
        units = standin_units(text)
        v, t = len(STANDIN_CHARS), len(units)
        idx = np.array([STANDIN_CHARS.index(c) for c in units])
        x = np.zeros((t, self._char_in), np.float32)
        x[np.arange(t), idx] = 1.0
        x[np.arange(1, t), v + idx[:-1]] = 0.5
        x[np.arange(t - 1), 2 * v + idx[1:]] = 0.5
        pos = np.arange(t)[:, None] / (10.0 ** (np.arange(8)[None, :] / 2.0))
        x[:, 3 * v : 3 * v + 8] = np.sin(pos)
        x[:, 3 * v + 8 : 3 * v + 16] = np.cos(pos)
        rel = (np.arange(t) + 0.5) / t
        x[:, -2], x[:, -1] = np.sin(np.pi * rel), np.cos(np.pi * rel)
        return x @ self.p_speech.T

    def video_content(self, wav: str | os.PathLike) -> np.ndarray:
        from empatheia_jax.data.encoders.dsp import frame_signal, mel_filterbank, stft_power
        from empatheia_jax.data.encoders.media import load_audio

        sr = 16000
        y = load_audio(wav, sr)
        hop = sr // VIDEO_FPS
        n_frames = max(1, int(round(len(y) / hop)))
        if self._fb is None:
            self._fb = mel_filterbank(sr, 2 * hop, 40, 50.0, sr / 2)
        frames = frame_signal(y, 2 * hop, hop)[:n_frames]
        if len(frames) < n_frames:
            frames = np.pad(frames, ((0, n_frames - len(frames)), (0, 0)))
        logmel = (np.log(1e-5 + stft_power(frames) @ self._fb.T) + 4.0) / 4.0
        rms = (20 * np.log10(np.sqrt((frames**2).mean(1)) + 1e-5) / 20.0)[:, None]
        f = np.concatenate([logmel, rms], axis=1)
        d = np.diff(f, axis=0, prepend=f[:1])
        return (np.concatenate([f, d], axis=1) @ self.p_vcontent.T).astype(np.float32)

    def speech_style(self, wav: str | os.PathLike) -> np.ndarray:
        a = self.lite.encode_audio(wav)[0].copy()
        a[2 * self.lite.n_mels :] *= 2.0
        return a @ self.p_sstyle.T

    def video_style(self, mp4: str | os.PathLike) -> np.ndarray:
        return self.lite.encode_video(mp4)[0] @ self.p_vstyle.T

    def compute(self, text: str, wav: str | os.PathLike, mp4: str | os.PathLike) -> dict[str, np.ndarray]:
        return {
            "speech_content": self.speech_content(text),
            "video_content": self.video_content(wav),
            "speech_style": self.speech_style(wav),
            "video_style": self.video_style(mp4),
        }


_WORKER: StandinTargets | None = None


def _standin_init(seed: int) -> None:
    global _WORKER
    _WORKER = StandinTargets(seed)


def _standin_one(job: tuple[str, str, str, str, tuple[str, ...]]
                 ) -> tuple[str, dict[str, np.ndarray] | None, str | None]:
    utt_id, text, wav, mp4, kinds = job
    assert _WORKER is not None
    try:
        return utt_id, {k: getattr(_WORKER, k)(text if k == "speech_content" else mp4 if k == "video_style"
                                               else wav) for k in kinds}, None
    except Exception as e:  # noqa: BLE001 - collected and reported with the utterance id
        return utt_id, None, f"{utt_id}: {e}"


def standin_jobs(
    raw: str | os.PathLike,
    splits: list[str] | None = None,
    dialogues: Iterable[Any] | None = None,
) -> list[tuple[str, str, str, str]]:
    """(utt_id, text, wav, mp4) for every distinct utterance (histories and responses).

    From `dialogues` (schema.Dialogue objects, e.g. the ones that passed validation) when given, else from
    every dialogue of the RAW split files.
    """
    from empatheia_jax.data import raw_layout, schema

    raw = Path(raw)
    if dialogues is None:
        dialogues = [
            d
            for split in (splits or raw_layout.discover_splits(raw))
            for d in schema.load_dialogues(raw_layout.split_json_path(raw, split))
        ]
    media = Path(raw_layout.media_dir_of(raw))
    jobs, seen = [], set()
    for d in dialogues:
        for uid, _role, text in schema.dialogue_utterances(d):
            if uid not in seen:
                seen.add(uid)
                jobs.append((uid, text, str(media / f"{uid}.wav"), str(media / f"{uid}.mp4")))
    return jobs


def _standin_writers(stack: contextlib.ExitStack, raw: str | os.PathLike, out: str | os.PathLike,
                     kinds: list[str], *, seed: int, shard_size: int) -> dict[str, TargetWriter]:
    """One open writer per kind, closed by `stack`: committed when it exits cleanly, discarded otherwise."""
    extra = {
        "seed": seed,
        "raw": str(Path(raw).resolve()),
        "note": "stand-in targets, "
        "deterministic functions of the sample's text/media; not generator features",
    }
    return {
        k: stack.enter_context(
            TargetWriter(
                out, k, STAND_IN, TARGET_KINDS[k][1], shard_size, {**extra, "method": STANDIN_METHOD[k]}
            )
        )
        for k in kinds
    }


def _standin_results(
    stack: contextlib.ExitStack, jobs: list[tuple[str, str, str, str]], kinds: list[str], *, seed: int,
    workers: int,
) -> Iterator[tuple[str, dict[str, np.ndarray] | None, str | None]]:
    """(utt_id, arrays by kind or None, error or None) per job, in job order: in a spawn pool closed by
    `stack` when ``workers > 1``, else in this process."""
    if workers > 1:
        import multiprocessing as mp

        pool = stack.enter_context(mp.get_context("spawn").Pool(workers, _standin_init, (seed,)))
        return pool.imap(_standin_one, [(*j, tuple(kinds)) for j in jobs], chunksize=8)
    _standin_init(seed)
    return map(_standin_one, [(*j, tuple(kinds)) for j in jobs])


def make_standin_targets(
    raw: str | os.PathLike,
    out: str | os.PathLike,
    *,
    splits: list[str] | None = None,
    dialogues: Iterable[Any] | None = None,
    seed: int = 0,
    shard_size: int = 512,
    workers: int = 1,
    progress: bool = True,
    kinds: Iterable[str] | None = None,
) -> dict[str, int]:
    """Compute stand-in targets of `kinds` (default the four `STANDIN_KINDS`) for every utterance of RAW;
    counts per kind.

    Every utterance must have its media; failures are collected and raised together (nothing is
    committed then). Uses a process pool when ``workers > 1``.
    """
    from tqdm import tqdm

    kinds = list(STANDIN_KINDS if kinds is None else kinds)
    unknown = sorted(set(kinds) - set(STANDIN_KINDS))
    if unknown:
        raise ValueError(f"no stand-in for target kind(s) {unknown}; expected some of {list(STANDIN_KINDS)}")
    jobs = standin_jobs(raw, splits, dialogues)
    print(
        f"[targets] computing STAND-IN targets ({', '.join(kinds)}) for {len(jobs)} utterances of "
        f"{raw} -> {out}; these are NOT StyleTTS2/DreamTalk features",
        file=sys.stderr,
    )
    errors: list[str] = []
    with contextlib.ExitStack() as stack:
        writers = _standin_writers(stack, raw, out, kinds, seed=seed, shard_size=shard_size)
        results = _standin_results(stack, jobs, kinds, seed=seed, workers=workers)
        for uid, arrays, err in tqdm(results, total=len(jobs), desc="stand-in targets", disable=not progress):
            if err:
                errors.append(err)
                continue
            for k in kinds:
                writers[k].add(uid, arrays[k])
        if errors:
            raise RuntimeError(
                f"{len(errors)} utterance(s) failed; no targets written:\n" + "\n".join(errors)
            )
    return {k: len(w) for k, w in writers.items()}
