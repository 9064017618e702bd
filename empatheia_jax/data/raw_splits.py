"""RAW split files validated and built into dialogues per split: the input of `prepare` and the TFDS builder.

Every split file is validated (records and, per media mode, media) before anything is encoded, so a bad
dataset fails with every problem listed; with `skip_invalid` the bad dialogues are left out and recorded
instead. A conversation in two splits is always fatal: a split leak silently inflates evaluation.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from empatheia_jax.data import raw_layout, schema
from empatheia_jax.data.problems import conv_label

# required: every utterance has its .wav and .mp4 (today's AvaMERG); none: text only, no media read, no
# encoder; optional: per dialogue, none of its media files = text-only, any of them = all of them.
MEDIA_MODES = ("required", "optional", "none")
_MEDIA_KEYS = tuple(f".media{ext}" for ext in raw_layout.MEDIA_EXTENSIONS)


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
        return Path(raw_layout.media_dir_of(self.raw))


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
    return not any(u + ext in names for u in uids for ext in raw_layout.MEDIA_EXTENSIONS)


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
    splits = splits or raw_layout.discover_splits(raw)
    media_dir, names = _media_to_check(raw, media)
    fatal: list[str] = []
    skipped: list[dict[str, Any]] = []
    out: dict[str, list[schema.Dialogue]] = {}
    owner: dict[str, str] = {}
    text_only: set[str] = set()
    for split in splits:
        path = raw_layout.split_json_path(raw, split)
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
    media_dir: str | None = raw_layout.media_dir_of(raw)
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
        no_media = {conv_label(o, i) for i, o in enumerate(objs) if _has_no_media(o, names)}
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
        label = conv_label(obj, i)
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


__all__ = ["MEDIA_MODES", "InvalidInputError", "PreparedRaw", "load_raw"]
