"""EmpatheticDialogues csv -> AvaMERG-format JSON (`DIR/{split}.json` + `DIR/{split}.import_report.txt`).

ED is the text corpus AvaMERG was built from, so converting it gives real dialogues for training and
development in the exact record layout the rest of the project reads. The conversion is deterministic
(same csv -> same bytes) and never invents annotations ED does not have: emotion_cause,
goal_to_response and topic stay "". Broken csv rows are reported and skipped, never fatal.

Usage: python -m data.import_ed --csv FILE --out DIR [--split NAME]

Decisions (see docs/design.md):
- conversation_id: ED `hit:H_conv:C` -> `edHcC` (e.g. `hit:3_conv:6` -> `ed3c6`); other ids are
  sanitised to `ed-...`. Injective, filename-safe and stable across runs and splits.
- Roles: utterance 0 is the speaker's; a row is the speaker's iff its speaker_idx equals the first
  row's. Each listener utterance becomes one turn whose history is everything before it.
- Gaps: a conversation keeps the longest run of utterance_idx 1..m; rows after a gap are dropped.
- Profiles: the kept conversations, in natural (hit, conv) order, get avatar combos round-robin over
  AGES x GENDERS x TIMBRES (24 combos, profile ID = combo index) so every combo is used within +-1;
  the listener's combo is offset by 1..23 (changing every 24 conversations), so it always differs from
  the speaker's and listener counts are balanced within +-1 too.
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from empatheia_jax.data.raw_layout import check_conversation_id
from empatheia_jax.data.schema import (
    AGES,
    GENDERS,
    TIMBRES,
    EmotionMap,
    normalize_word,
)

COLUMNS = ("conv_id", "utterance_idx", "context", "prompt", "speaker_idx", "utterance")
# Profile ID = index in this list: age-major, then gender, then timbre.
PROFILE_COMBOS: tuple[tuple[str, str, str], ...] = tuple(itertools.product(AGES, GENDERS, TIMBRES))
_ED_CONV_RE = re.compile(r"hit:(\d+)_conv:(\d+)")
_RAW_LINE_RE = re.compile(r"(hit:\d+_conv:\d+),(\d+),")


# Report order within a conversation: row-level findings first, the verdict ("dropped") last.
_KIND_ORDER = (
    "bad-row",
    "merged-row",
    "duplicate-row",
    "lost-in-merge",
    "index-gap",
    "empty-utterance",
    "speaker-order",
    "inconsistent-context",
    "dropped",
)


@dataclass(frozen=True)
class Quirk:
    """One irregularity in the csv: what (kind), which conversation, where (1-based physical line)."""

    kind: str
    conv_id: str
    line: int | None
    message: str
    row: int | None = None  # 1-based data row (header excluded), when the quirk is about one row

    def __str__(self) -> str:
        where = "" if self.line is None else f" line {self.line}"
        where += "" if self.row is None else f" (row {self.row})"
        return f"{self.kind}: conv_id={self.conv_id}{where}: {self.message}"


@dataclass
class ImportResult:
    """Output of `convert_ed_csv`: AvaMERG dialogue objects plus the report of what was skipped."""

    dialogues: list[dict[str, Any]]
    quirks: list[str]
    details: list[Quirk] = field(default_factory=list)
    rows_read: int = 0
    conversations_in: int = 0

    @property
    def num_turns(self) -> int:
        return sum(len(d["turns"]) for d in self.dialogues)


@dataclass
class _Row:
    line: int
    row: int
    idx: int
    speaker: str
    context: str
    prompt: str
    text: str


def clean_text(s: str) -> str:
    """ED escapes commas as `_comma_`; undo it and trim the whitespace annotators left."""
    return s.replace("_comma_", ",").strip()


def ed_conversation_id(conv_id: str) -> str:
    """Filename-safe AvaMERG conversation id for an ED conv_id (`hit:3_conv:6` -> `ed3c6`)."""
    m = _ED_CONV_RE.fullmatch(conv_id)
    if m:
        return f"ed{int(m.group(1))}c{int(m.group(2))}"
    safe = re.sub(r"[^A-Za-z0-9]+", "-", conv_id).strip("-")
    safe = re.sub("utt", "u-tt", safe, flags=re.IGNORECASE)
    return f"ed-{safe}" if safe else "ed-"


def _natural_key(conv_id: str) -> tuple[int, int, int, str]:
    m = _ED_CONV_RE.fullmatch(conv_id)
    return (0, int(m.group(1)), int(m.group(2)), "") if m else (1, 0, 0, conv_id)


def split_from_filename(path: str) -> str:
    """`empathetic_dialogues_validation.csv` -> `valid`; likewise train/test; else the file stem."""
    stem = os.path.splitext(os.path.basename(path))[0].lower()
    for split, words in (("train", ("train",)), ("valid", ("valid", "dev")), ("test", ("test",))):
        if any(w in stem for w in words):
            return split
    return re.sub(r"[^A-Za-z0-9_-]+", "_", stem) or "data"


def profile_json(combo_index: int) -> dict[str, Any]:
    """AvaMERG profile object of avatar combo `combo_index` (its ID is the index)."""
    age, gender, timbre = PROFILE_COMBOS[combo_index]
    return {"age": age, "gender": gender, "timbre": timbre, "ID": combo_index}


def combo_index(age: str, gender: str, timbre: str) -> int:
    """The profile ID this corpus (and the sample built from it) gives every avatar of that profile: one
    identity per (age, gender, timbre). A pinned `--listener` is drawn as that avatar."""
    try:
        return PROFILE_COMBOS.index((age, gender, timbre))
    except ValueError:
        raise ValueError(f"no avatar combo ({age}, {gender}, {timbre})") from None


def profile_pair(i: int) -> tuple[int, int]:
    """(speaker, listener) combo of the i-th kept conversation; always distinct, each balanced within +-1."""
    n = len(PROFILE_COMBOS)
    speaker = i % n
    listener = (speaker + 1 + (i // n) % (n - 1)) % n
    return speaker, listener


def _rows_with_lines(f: Iterable[str]) -> Iterator[tuple[int, list[str]]]:
    """csv rows with the 1-based physical line each starts on (rows may span lines)."""
    reader = csv.reader(f)
    start = 1
    for row in reader:
        yield start, row
        start = reader.line_num + 1


def _read_rows(
    path: str, quirks: list[Quirk], progress: bool
) -> tuple[dict[str, list[_Row]], int, int, dict[str, list[str]]]:
    """Group well-formed rows by conv_id; report and skip the rest. Also returns, per merged row's conv_id,
    the conv_ids of the raw lines swallowed into it (to name the conversations lost in the merge)."""
    convs: dict[str, list[_Row]] = {}
    all_ids: set[str] = set()
    n_rows = 0
    with open(path, encoding="utf-8", newline="") as f:
        rows = _rows_with_lines(f)
        checks = _RowChecks(_columns(path, rows), quirks)
        if progress:
            from tqdm import tqdm

            rows = tqdm(rows, desc=f"reading {os.path.basename(path)}", unit=" rows", mininterval=0.5)
        for line, row in rows:
            n_rows += 1
            conv_id = row[checks.col["conv_id"]] if len(row) > checks.col["conv_id"] else ""
            all_ids.add(conv_id)
            r = checks.parse(line, n_rows, row, conv_id)
            if r is not None:
                convs.setdefault(conv_id, []).append(r)
    return convs, n_rows, len(all_ids), checks.swallowed


def _columns(path: str, rows: Iterator[tuple[int, list[str]]]) -> list[str]:
    """The header row (read from `rows`), which must name every column of COLUMNS."""
    try:
        _, header = next(rows)
    except StopIteration:
        raise ValueError(f"{path}: empty file, expected an ED csv header") from None
    header = [h.strip().lstrip("\ufeff") for h in header]
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise ValueError(f"{path}: not an EmpatheticDialogues csv, missing columns {missing}")
    return header


@dataclass
class _RowChecks:
    """The checks of one csv's rows: its header, the (conv_id, utterance_idx) pairs seen, the conv_ids each
    merged row swallowed, and the quirks list the skipped rows are reported to."""

    header: list[str]
    quirks: list[Quirk]
    seen: set[tuple[str, int]] = field(default_factory=set)
    swallowed: dict[str, list[str]] = field(default_factory=dict)
    col: dict[str, int] = field(init=False)  # column name -> index

    def __post_init__(self) -> None:
        self.col = {c: self.header.index(c) for c in COLUMNS}

    def parse(self, line: int, n_rows: int, row: list[str], conv_id: str) -> _Row | None:
        """The row, or None when it is skipped (wrong width, an embedded newline, a bad or repeated index)."""
        col = self.col
        if len(row) != len(self.header):
            msg = f"{len(row)} fields, expected {len(self.header)}; skipped"
            self.quirks.append(Quirk("bad-row", conv_id, line, msg, n_rows))
            return None
        if any("\n" in v or "\r" in v for v in row):
            self.quirks.append(self._merged(line, n_rows, row, conv_id))
            return None
        try:
            idx = int(row[col["utterance_idx"]])
        except ValueError:
            msg = f"utterance_idx {row[col['utterance_idx']]!r} is not an integer; skipped"
            self.quirks.append(Quirk("bad-row", conv_id, line, msg, n_rows))
            return None
        if (conv_id, idx) in self.seen:
            msg = f"utterance_idx {idx} repeated; skipped"
            self.quirks.append(Quirk("duplicate-row", conv_id, line, msg, n_rows))
            return None
        self.seen.add((conv_id, idx))
        return _Row(line=line, row=n_rows, idx=idx, speaker=row[col["speaker_idx"]].strip(),
                    context=row[col["context"]], prompt=row[col["prompt"]],
                    text=clean_text(row[col["utterance"]]))

    def _merged(self, line: int, n_rows: int, row: list[str], conv_id: str) -> Quirk:
        """The quirk of a row that swallowed raw csv lines after an embedded newline, naming their ids."""
        embedded = [v for v in row if "\n" in v or "\r" in v]
        raw_lines = [ln for v in embedded for ln in v.splitlines()[1:]]
        ids = [m.group(1) for ln in raw_lines if (m := _RAW_LINE_RE.match(ln))]
        self.swallowed[conv_id] = list(dict.fromkeys(ids))
        of = ", ".join(self.swallowed[conv_id]) or "unknown conversations"
        msg = (
            f"utterance_idx {row[self.col['utterance_idx']]} holds {len(raw_lines)} more raw csv line(s) "
            f"after an embedded newline (of {of}); skipped"
        )
        return Quirk("merged-row", conv_id, line, msg, n_rows)


def _drop(quirks: list[Quirk], conv_id: str, why: str, r: _Row | None) -> None:
    quirks.append(Quirk("dropped", conv_id, None if r is None else r.line, why, None if r is None else r.row))


def _leading_rows(conv_id: str, rows: list[_Row], quirks: list[Quirk]) -> list[_Row]:
    """The rows (sorted by utterance_idx) before the first index gap or empty utterance, which is reported."""
    kept: list[_Row] = []
    for r in rows:
        if r.idx != len(kept) + 1:
            break
        kept.append(r)
    if len(kept) < len(rows):
        r = rows[len(kept)]
        msg = (
            f"utterance_idx {[r.idx for r in rows]} is not 1..{len(rows)}; kept the {len(kept)} row(s) before"
        )
        quirks.append(Quirk("index-gap", conv_id, r.line, msg, r.row))
    for n, r in enumerate(kept):
        if not r.text:
            msg = f"empty utterance_idx {r.idx}; kept the {n} row(s) before it"
            quirks.append(Quirk("empty-utterance", conv_id, r.line, msg, r.row))
            return kept[:n]
    return kept


def _roles(conv_id: str, kept: list[_Row], quirks: list[Quirk]) -> list[str] | None:
    """Each row's role (the first speaker_idx is the speaker), or None (dropped) for more than two speakers;
    roles that do not alternate are reported and kept."""
    speakers = list(dict.fromkeys(r.speaker for r in kept))
    if len(speakers) > 2:
        quirks.append(Quirk("speaker-order", conv_id, kept[0].line, f"speaker_idx values {speakers}"))
        _drop(quirks, conv_id, f"{len(speakers)} speakers, roles are undefined", kept[0])
        return None
    roles = ["speaker" if r.speaker == speakers[0] else "listener" for r in kept]
    if any(a == b for a, b in itertools.pairwise(roles)):
        quirks.append(
            Quirk(
                "speaker-order",
                conv_id,
                kept[0].line,
                f"speaker_idx {[r.speaker for r in kept]} does not alternate; roles follow speaker_idx",
            )
        )
    return roles


def _turns(kept: list[_Row], roles: list[str], emotion: str, scenario: str) -> list[dict[str, Any]]:
    """One turn per listener utterance, with every earlier utterance as its history."""
    coe = {"speaker_emotion": emotion, "event_scenario": scenario}
    coe |= {"emotion_cause": "", "goal_to_response": ""}  # ED has no such annotation; never invented
    history = [
        {"index": k, "role": role, "utterance": r.text}
        for k, (r, role) in enumerate(zip(kept, roles, strict=True))
    ]
    return [
        {
            "context": scenario,
            "dialogue_history": [dict(u) for u in history[:k]],
            "response": kept[k].text,
            "chain_of_empathy": dict(coe),
        }
        for k in range(1, len(kept))
        if roles[k] == "listener"
    ]


def _conversation(conv_id: str, rows: list[_Row], emap: EmotionMap, quirks: list[Quirk]) -> dict | None:
    """One ED conversation as an AvaMERG dialogue without profiles, or None (with a `dropped` quirk)."""
    rows = sorted(rows, key=lambda r: r.idx)
    kept = _leading_rows(conv_id, rows, quirks)
    if not kept:
        _drop(quirks, conv_id, "no rows left after the gap", rows[0])
        return None
    roles = _roles(conv_id, kept, quirks)
    if roles is None:
        return None
    first = kept[0]
    if any(r.context != first.context or r.prompt != first.prompt for r in kept):
        msg = "rows disagree on context/prompt; used the first row's"
        quirks.append(Quirk("inconsistent-context", conv_id, first.line, msg))
    emotion = normalize_word(first.context) or ""
    if emap.project(emotion) is None:
        _drop(quirks, conv_id, f"unknown emotion label {first.context!r}", first)
        return None
    turns = _turns(kept, roles, emotion, clean_text(first.prompt))
    if not turns:
        _drop(quirks, conv_id, f"no listener reply ({len(kept)} speaker utterance(s) only)", first)
        return None
    return {
        "conversation_id": ed_conversation_id(conv_id),
        "speaker_profile": None,  # assigned by convert_ed_csv, which sees all conversations
        "listener_profile": None,
        "topic": "",
        "turns": turns,
    }


def convert_ed_csv(
    path: str, *, emotion_map: EmotionMap | None = None, progress: bool = False
) -> ImportResult:
    """Convert an EmpatheticDialogues csv into AvaMERG dialogue objects; quirks are reported, not fatal."""
    emap = emotion_map or EmotionMap.load("avamerg7")
    quirks: list[Quirk] = []
    convs, n_rows, n_convs, swallowed = _read_rows(path, quirks, progress)
    for conv_id, ids in swallowed.items():
        lost = [c for c in ids if c != conv_id and c not in convs]
        if lost:
            msg = f"its merged row swallows conversations with no row of their own: {', '.join(lost)}"
            quirks.append(Quirk("lost-in-merge", conv_id, None, msg))
        if conv_id not in convs:
            quirks.append(Quirk("dropped", conv_id, None, "all of its rows were skipped"))
    dialogues: list[dict[str, Any]] = []
    used: dict[str, str] = {}
    for conv_id in sorted(convs, key=_natural_key):
        d = _conversation(conv_id, convs[conv_id], emap, quirks)
        if d is None:
            continue
        why = check_conversation_id(d["conversation_id"])
        if why or d["conversation_id"] in used:
            other = used.get(d["conversation_id"])
            quirks.append(
                Quirk("dropped", conv_id, None, why or f"id {d['conversation_id']} also used by {other}")
            )
            continue
        used[d["conversation_id"]] = conv_id
        sp, lp = profile_pair(len(dialogues))
        d["speaker_profile"], d["listener_profile"] = profile_json(sp), profile_json(lp)
        dialogues.append(d)
    quirks.sort(key=lambda q: (_natural_key(q.conv_id), _KIND_ORDER.index(q.kind), q.line or 0))
    return ImportResult(
        dialogues=dialogues,
        quirks=[str(q) for q in quirks],
        details=quirks,
        rows_read=n_rows,
        conversations_in=n_convs,
    )


def dumps(dialogues: list[dict[str, Any]]) -> str:
    """The canonical byte layout of `{split}.json` (stable across runs and Python versions)."""
    return json.dumps(dialogues, ensure_ascii=False, indent=1) + "\n"


def write_atomic(path: str, text: str) -> None:
    """`text` to `path` through a temporary name, so a reader never sees half a file (the CLI's hold-out
    split is written the same way)."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    os.replace(tmp, path)


def holdout(dialogues: list[dict[str, Any]], fraction: float, seed: int = 0
            ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(kept, held): a conversation-level hold-out of about `fraction` of the dialogues.

    A dialogue is held when sha256("{seed}:{conversation_id}") read as a number in [0, 1) is below
    `fraction`: every turn of a conversation lands on one side (no context leaks into the dev part), the
    choice of one conversation never depends on the others (adding a file does not reshuffle it), and the
    same seed gives the same split on any machine. Order is kept on both sides.
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"holdout fraction must be in (0, 1), got {fraction}")
    kept, held = [], []
    for d in dialogues:
        h = hashlib.sha256(f"{seed}:{d['conversation_id']}".encode()).digest()
        (held if int.from_bytes(h[:8], "big") / 2**64 < fraction else kept).append(d)
    return kept, held


def write_outputs(result: ImportResult, csv_path: str, out_dir: str, split: str) -> tuple[str, str]:
    """Write `{split}.json` and `{split}.import_report.txt`; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, f"{split}.json")
    report_path = os.path.join(out_dir, f"{split}.import_report.txt")
    with open(csv_path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    kinds: dict[str, int] = {}
    for q in result.details:
        kinds[q.kind] = kinds.get(q.kind, 0) + 1
    lines = [
        f"source: {os.path.basename(csv_path)} sha256={sha}",
        f"split: {split}",
        f"csv rows read: {result.rows_read}",
        f"conversations in csv: {result.conversations_in}",
        f"dialogues written: {len(result.dialogues)}",
        f"turns written: {result.num_turns}",
        f"quirks: {len(result.quirks)} " + " ".join(f"{k}={v}" for k, v in sorted(kinds.items())),
        "",
        *result.quirks,
    ]
    write_atomic(json_path, dumps(result.dialogues))
    write_atomic(report_path, "\n".join(lines) + "\n")
    return json_path, report_path
