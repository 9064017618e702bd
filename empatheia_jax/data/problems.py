"""Validation findings: the `Problem` record, a reporter that collects one dialogue's problems, the presence
and type check of one field, and a split file read into its dialogue objects or the problem why not.

Below the record schema (`schema.py`), whose structure check, content checks and file reading all report
through these, so every problem of a file is listed at once, in one format, rather than raised.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One validation finding. `conversation_id` is `#i` (list position) when the record has no usable id;
    `turn` is None for dialogue-level problems; `key` is the json path inside the dialogue."""

    file: str
    conversation_id: str | None
    turn: int | None
    key: str
    message: str

    def __str__(self) -> str:
        conv = "-" if self.conversation_id is None else self.conversation_id
        turn = "-" if self.turn is None else str(self.turn)
        return f"{self.file}: conversation {conv} turn {turn} [{self.key}]: {self.message}"


def type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class Reporter:
    """Collects the problems of one dialogue of one file: `rep(turn, key, message)`."""

    def __init__(self, source: str, conversation_id: str | None):
        self.source = source
        self.conversation_id = conversation_id
        self.problems: list[Problem] = []

    def __call__(self, turn: int | None, key: str, message: str) -> None:
        self.problems.append(Problem(self.source, self.conversation_id, turn, key, message))


def conv_label(obj: Any, index: int) -> str:
    cid = obj.get("conversation_id") if isinstance(obj, Mapping) else None
    return cid if isinstance(cid, str) and cid else f"#{index}"


def need_field(
    rep: Reporter, obj: Mapping[str, Any], key: str, typ: type, path: str, turn: int | None
) -> bool:
    """Report a missing or wrongly typed field; True when the field is present with the right type."""
    if key not in obj:
        rep(turn, path, "missing field")
        return False
    v = obj[key]
    ok = is_int(v) if typ is int else isinstance(v, typ)
    if not ok:
        rep(turn, path, f"expected {typ.__name__}, got {type_name(v)}")
    return ok


def read_json_list(path: str) -> tuple[list[Any], list[Problem]]:
    """(the dialogue objects of a split file, []) or ([], the one problem why it cannot be read)."""
    name = os.path.basename(path)

    def fail(key: str, message: str) -> tuple[list[Any], list[Problem]]:
        return [], [Problem(name, None, None, key, message)]

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return fail("file", f"no such file: {path}")
    except json.JSONDecodeError as e:
        return fail("json", f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}")
    except (UnicodeDecodeError, OSError) as e:
        return fail("file", f"cannot read {path}: {e}")
    if not isinstance(data, list):
        return fail("json", f"top level must be a list of dialogues, got {type_name(data)}")
    return data, []


__all__ = ["Problem", "Reporter", "conv_label", "is_int", "need_field", "read_json_list", "type_name"]
