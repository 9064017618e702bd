"""AvaMERG records: label vocabularies, emotion maps, dataclasses, labels and validation.

Every other data module (importers, sample generator, shard preparation, input pipeline, evaluation)
codes against the names here, so the record layout and the label indices are defined once (the RAW
folder's file names and utterance ids: `raw_layout.py`). The validator reports every problem in a file at
once, because a dataset that fails one check at a time costs a full preparation run per fix.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import string
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from empatheia_jax.data.problems import (
    Problem,
    Reporter,
    conv_label,
    is_int,
    need_field,
    read_json_list,
    type_name,
)
from empatheia_jax.data.raw_layout import (
    MEDIA_EXTENSIONS,
    check_conversation_id,
    media_unreadable,
    utterance_id,
)

SCHEMA_VERSION = 1

# Index order of the organisers' table (AvaMERG-Pipeline all_dataset.py): happy 0 ... contempt 6.
EMOTIONS_7: tuple[str, ...] = ("happy", "surprised", "angry", "fear", "sad", "disgusted", "contempt")
ED_EMOTIONS_32: tuple[str, ...] = tuple(
    sorted(
        (
            "afraid", "angry", "annoyed", "anticipating", "anxious", "apprehensive", "ashamed", "caring",
            "confident", "content", "devastated", "disappointed", "disgusted", "embarrassed", "excited",
            "faithful", "furious", "grateful", "guilty", "hopeful", "impressed", "jealous", "joyful",
            "lonely", "nostalgic", "prepared", "proud", "sad", "sentimental", "surprised", "terrified",
            "trusting",
        )
    )
)  # fmt: skip
AGES: tuple[str, ...] = ("child", "young", "middle-aged", "elderly")
GENDERS: tuple[str, ...] = ("male", "female")
TIMBRES: tuple[str, ...] = ("low", "mid", "high")
ROLES: tuple[str, ...] = ("speaker", "listener")

_ED_INDEX = {w: i for i, w in enumerate(ED_EMOTIONS_32)}
_STRIP_CHARS = string.whitespace + string.punctuation.replace("-", "")


def normalize_word(word: Any) -> str | None:
    """Canonical form of a label word: lower case, single spaces, no surrounding punctuation.

    Free-text emotion words in AvaMERG come as "Worried", " sad ", "anxious." and so on; they must all
    hit the same table entry. Returns None for non-strings.
    """
    if not isinstance(word, str):
        return None
    return " ".join(word.split()).lower().strip(_STRIP_CHARS)


# --------------------------------------------------------------------------------------------------
# Emotion maps
# --------------------------------------------------------------------------------------------------


def _read_resource(filename: str) -> dict[str, Any]:
    with resources.files("empatheia_jax").joinpath("resources", filename).open("r", encoding="utf-8") as f:
        return json.load(f)


@dataclass(frozen=True, eq=False)
class EmotionMap:
    """Projection of free emotion words onto a fixed set of classes.

    Resolution of a word: a class name maps to itself; an ED label follows the table; a free-text
    alias (e.g. "worried") maps to an ED label first and then follows the table. The alias table is
    the organisers' and is shared by every map, because it resolves words to ED labels, not classes.
    """

    name: str
    classes: tuple[str, ...]
    table: Mapping[str, str]  # ED label (or other word) -> class name
    aliases: Mapping[str, str]  # free-text word -> ED label (or class name)
    _index: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {c: i for i, c in enumerate(self.classes)})

    @classmethod
    def load(cls, name: str = "avamerg7") -> EmotionMap:
        """Load a packaged map: "avamerg7" (organisers' 7 classes) or "e3rg8" (E3RG, + neutral at 7)."""
        return _load_emotion_map(name)

    def class_name(self, word: Any) -> str | None:
        """The class a word projects to, or None when it cannot be resolved."""
        idx = self.project(word)
        return None if idx is None else self.classes[idx]

    def project(self, word: Any) -> int | None:
        """Class index of `word`, or None for an unknown word (the caller reports it)."""
        w = normalize_word(word)
        index = self._index
        seen: set[str] = set()
        while w and w not in seen:
            seen.add(w)
            if w in index:
                return index[w]
            if w in self.table:
                w = self.table[w]
            elif w in self.aliases:
                w = self.aliases[w]
            else:
                return None
        return None

    def fine_index(self, word: Any) -> int:
        """Index of `word` in ED_EMOTIONS_32 after alias resolution, or -1."""
        w = normalize_word(word)
        seen: set[str] = set()
        while w and w not in seen:
            seen.add(w)
            if w in _ED_INDEX:
                return _ED_INDEX[w]
            if w not in self.aliases:
                return -1
            w = self.aliases[w]
        return -1


EMOTION_MAP_NAMES: tuple[str, ...] = ("avamerg7", "e3rg8")


@functools.cache
def _load_emotion_map(name: str) -> EmotionMap:
    ed = _read_resource("ed_emotion_projection.json")
    aliases = {k: v for k, v in ed["fine_grained_aliases"].items() if v is not None}
    if name == "avamerg7":
        order = ed["emotion_projection_7class"]
        classes = tuple(sorted(order, key=order.__getitem__))
        if classes != EMOTIONS_7:
            raise ValueError(f"packaged 7-class table order {classes} differs from EMOTIONS_7")
        table = {k: v for k, v in ed["ed32_to_7class"].items() if v is not None}
    elif name == "e3rg8":
        classes = EMOTIONS_7 + ("neutral",)
        table = dict(_read_resource("e3rg_emotion_projection.json")["mapping"])
    else:
        raise ValueError(f"unknown emotion map {name!r}; choose one of {EMOTION_MAP_NAMES}")
    bad = sorted(k for k, v in table.items() if v not in classes)
    if bad:
        raise ValueError(f"emotion map {name}: entries {bad} point outside the classes {classes}")
    return EmotionMap(name=name, classes=classes, table=table, aliases=aliases)


# --------------------------------------------------------------------------------------------------
# Record dataclasses
# --------------------------------------------------------------------------------------------------


class SchemaError(ValueError):
    """Raised by the `from_json`/`load_dialogues` constructors; carries every structural problem."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        head = "\n".join(str(p) for p in problems[:20])
        more = f"\n... and {len(problems) - 20} more" if len(problems) > 20 else ""
        super().__init__(f"{len(problems)} schema problem(s):\n{head}{more}")


def _extra(obj: Mapping[str, Any], known: Iterable[str]) -> dict[str, Any]:
    known = set(known)
    return {k: v for k, v in obj.items() if k not in known}


@dataclass
class Profile:
    """Avatar profile; `ID` names the recorded person/avatar and appears in media file names."""

    age: str
    gender: str
    timbre: str
    ID: int
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Profile:
        return cls(obj["age"], obj["gender"], obj["timbre"], obj["ID"], _extra(obj, _PROFILE_KEYS))

    def to_json(self) -> dict[str, Any]:
        return {"age": self.age, "gender": self.gender, "timbre": self.timbre, "ID": self.ID, **self.extra}


@dataclass
class Utterance:
    index: int
    role: str
    utterance: str
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Utterance:
        return cls(obj["index"], obj["role"], obj["utterance"], _extra(obj, _UTTERANCE_KEYS))

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "role": self.role, "utterance": self.utterance, **self.extra}


@dataclass
class ChainOfEmpathy:
    speaker_emotion: str = ""
    event_scenario: str = ""
    emotion_cause: str = ""
    goal_to_response: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any] | None) -> ChainOfEmpathy:
        obj = obj or {}
        vals = {k: obj.get(k) or "" for k in _COE_KEYS}
        return cls(**vals, extra=_extra(obj, _COE_KEYS))

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _COE_KEYS} | self.extra


@dataclass
class Turn:
    """One example: the dialogue so far (`dialogue_history`) and the listener's `response`."""

    context: str
    dialogue_history: list[Utterance]
    response: str
    chain_of_empathy: ChainOfEmpathy
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Turn:
        return cls(
            context=obj["context"],
            dialogue_history=[Utterance.from_json(u) for u in obj["dialogue_history"]],
            response=obj["response"],
            chain_of_empathy=ChainOfEmpathy.from_json(obj.get("chain_of_empathy")),
            extra=_extra(obj, _TURN_KEYS),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "context": self.context,
            "dialogue_history": [u.to_json() for u in self.dialogue_history],
            "response": self.response,
            "chain_of_empathy": self.chain_of_empathy.to_json(),
            **self.extra,
        }


@dataclass
class Dialogue:
    """One AvaMERG dialogue (DESIGN §4); unknown keys (e.g. the paper's `turn_id`) survive in `extra`."""

    conversation_id: str
    speaker_profile: Profile
    listener_profile: Profile
    topic: str
    turns: list[Turn]
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], *, source: str = "<memory>") -> Dialogue:
        """Build from the json object; raises SchemaError listing every structural problem.

        Only structure is enforced here (presence and types); vocabulary, emotion words, index order and
        media are reported by `validate_dialogues`, so a slightly wrong file can still be loaded and fixed.
        """
        problems = _check_structure(obj, source=source, index=0)
        if problems:
            raise SchemaError(problems)
        return cls(
            conversation_id=obj["conversation_id"],
            speaker_profile=Profile.from_json(obj["speaker_profile"]),
            listener_profile=Profile.from_json(obj["listener_profile"]),
            topic=obj["topic"],
            turns=[Turn.from_json(t) for t in obj["turns"]],
            extra=_extra(obj, _DIALOGUE_KEYS),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "conversation_id": self.conversation_id,
            "speaker_profile": self.speaker_profile.to_json(),
            "listener_profile": self.listener_profile.to_json(),
            "topic": self.topic,
            "turns": [t.to_json() for t in self.turns],
            **self.extra,
        }

    def profile_of(self, role: str) -> Profile:
        """The profile of whoever speaks in `role`."""
        if role == "speaker":
            return self.speaker_profile
        if role == "listener":
            return self.listener_profile
        raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")


_PROFILE_KEYS = ("age", "gender", "timbre", "ID")
_UTTERANCE_KEYS = ("index", "role", "utterance")
_COE_KEYS = tuple(f.name for f in dataclasses.fields(ChainOfEmpathy) if f.name != "extra")
_TURN_KEYS = ("context", "dialogue_history", "response", "chain_of_empathy")
_DIALOGUE_KEYS = ("conversation_id", "speaker_profile", "listener_profile", "topic", "turns")


def load_dialogues(path: str | os.PathLike[str]) -> list[Dialogue]:
    """Read `RAW/{split}.json` into dataclasses; raises SchemaError with every structural problem."""
    src = os.fspath(path)
    objs, problems = read_json_list(src)
    for i, obj in enumerate(objs):
        problems += _check_structure(obj, source=src, index=i)
    if problems:
        raise SchemaError(problems)
    return [Dialogue.from_json(o, source=src) for o in objs]


# --------------------------------------------------------------------------------------------------
# Utterances of a dialogue
# --------------------------------------------------------------------------------------------------

def _turn(dialogue: Dialogue, turn: Turn | int) -> Turn:
    return dialogue.turns[turn] if isinstance(turn, int) else turn


def turn_utterances(dialogue: Dialogue, turn: Turn | int) -> list[tuple[str, str, str]]:
    """(utterance_id, role, text) for each history utterance of a turn; k is the utterance's `index`."""
    t = _turn(dialogue, turn)
    return [
        (utterance_id(dialogue.conversation_id, u.index, dialogue.profile_of(u.role).ID), u.role, u.utterance)
        for u in t.dialogue_history
    ]


def response_utterance_id(dialogue: Dialogue, turn_index: int) -> str:
    """Utterance id of turn `turn_index`'s response: k = len(history), spoken by the listener."""
    t = dialogue.turns[turn_index]
    return utterance_id(dialogue.conversation_id, len(t.dialogue_history), dialogue.listener_profile.ID)


def dialogue_utterances(dialogue: Dialogue) -> list[tuple[str, str, str]]:
    """Every distinct utterance of a dialogue (histories and responses), as (id, role, text) sorted by k.

    Turns are growing prefixes, so one utterance appears in several turns; feature extraction wants
    each once. Where turns disagree, the first occurrence wins (the validator does not merge them).
    """
    by_k: dict[int, tuple[str, str, str]] = {}
    for j, t in enumerate(dialogue.turns):
        for (uid, role, text), u in zip(turn_utterances(dialogue, t), t.dialogue_history, strict=True):
            by_k.setdefault(u.index, (uid, role, text))
        by_k.setdefault(len(t.dialogue_history), (response_utterance_id(dialogue, j), "listener", t.response))
    return [by_k[k] for k in sorted(by_k)]


# --------------------------------------------------------------------------------------------------
# Labels
# --------------------------------------------------------------------------------------------------


def _vocab_index(value: Any, vocab: tuple[str, ...]) -> int:
    w = normalize_word(value)
    return vocab.index(w) if w in vocab else -1


def labels_for(dialogue: Dialogue, turn: Turn | int, emotion_map: EmotionMap) -> dict[str, int]:
    """Classifier labels of one example (docs/design.md): -1 marks unknown and is masked in the loss.

    Emotion comes from the turn's `speaker_emotion` (AvaMERG's only emotion annotation); age, gender
    and timbre come from the LISTENER profile, whose avatar speaks the response the SD styles.
    """
    t = _turn(dialogue, turn)
    emo = emotion_map.project(t.chain_of_empathy.speaker_emotion)
    lp = dialogue.listener_profile
    return {
        "emotion": -1 if emo is None else emo,
        "emotion_fine": emotion_map.fine_index(t.chain_of_empathy.speaker_emotion),
        "age": _vocab_index(lp.age, AGES),
        "gender": _vocab_index(lp.gender, GENDERS),
        "timbre": _vocab_index(lp.timbre, TIMBRES),
    }


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


def _check_structure(obj: Any, *, source: str, index: int) -> list[Problem]:
    """Presence and types only: what `Dialogue.from_json` needs to build the dataclasses."""
    rep = Reporter(source, conv_label(obj, index))
    if not isinstance(obj, Mapping):
        rep(None, "", f"dialogue must be an object, got {type_name(obj)}")
        return rep.problems
    need_field(rep, obj, "conversation_id", str, "conversation_id", None)
    need_field(rep, obj, "topic", str, "topic", None)
    for pkey in ("speaker_profile", "listener_profile"):
        if need_field(rep, obj, pkey, dict, pkey, None):
            prof = obj[pkey]
            for k in ("age", "gender", "timbre"):
                need_field(rep, prof, k, str, f"{pkey}.{k}", None)
            need_field(rep, prof, "ID", int, f"{pkey}.ID", None)
    if not need_field(rep, obj, "turns", list, "turns", None):
        return rep.problems
    for j, t in enumerate(obj["turns"]):
        tp = f"turns[{j}]"
        if not isinstance(t, Mapping):
            rep(j, tp, f"turn must be an object, got {type_name(t)}")
            continue
        need_field(rep, t, "context", str, f"{tp}.context", j)
        need_field(rep, t, "response", str, f"{tp}.response", j)
        coe = t.get("chain_of_empathy")
        if coe is not None and not isinstance(coe, Mapping):
            rep(j, f"{tp}.chain_of_empathy", f"expected dict, got {type_name(coe)}")
        elif coe is not None:
            for k in _COE_KEYS:
                if k in coe and not isinstance(coe[k], str):
                    rep(j, f"{tp}.chain_of_empathy.{k}", f"expected str, got {type_name(coe[k])}")
        if need_field(rep, t, "dialogue_history", list, f"{tp}.dialogue_history", j):
            for i, u in enumerate(t["dialogue_history"]):
                up = f"{tp}.dialogue_history[{i}]"
                if not isinstance(u, Mapping):
                    rep(j, up, f"utterance must be an object, got {type_name(u)}")
                    continue
                need_field(rep, u, "index", int, f"{up}.index", j)
                need_field(rep, u, "role", str, f"{up}.role", j)
                need_field(rep, u, "utterance", str, f"{up}.utterance", j)
    return rep.problems


@dataclass
class _Media:
    """Where media live, the file names present (one listdir instead of a stat per file), and policy."""

    dir: str
    names: frozenset[str]
    readable: bool


def _check_media(rep: Reporter, turn: int, key: str, uid: str, media: _Media, seen: set[str]) -> None:
    if uid in seen:
        return
    seen.add(uid)
    for ext in MEDIA_EXTENSIONS:
        path = os.path.join(media.dir, uid + ext)
        if uid + ext not in media.names:
            rep(turn, f"{key}.media{ext}", f"missing media file {path}")
        elif media.readable:
            why = media_unreadable(path, ext)
            if why:
                rep(turn, f"{key}.media{ext}", f"unreadable media file {path}: {why}")


def _check_profile_values(rep: Reporter, obj: Mapping[str, Any]) -> dict[str, int | None]:
    ids: dict[str, int | None] = {}
    for pkey in ("speaker_profile", "listener_profile"):
        prof = obj.get(pkey)
        ids[pkey] = None
        if not isinstance(prof, Mapping):
            continue
        for k, vocab in (("age", AGES), ("gender", GENDERS), ("timbre", TIMBRES)):
            v = prof.get(k)
            if isinstance(v, str) and _vocab_index(v, vocab) < 0:
                rep(None, f"{pkey}.{k}", f"{v!r} is not one of {vocab}")
        if is_int(prof.get("ID")):
            if prof["ID"] < 0:
                rep(None, f"{pkey}.ID", f"profile ID must be >= 0, got {prof['ID']}")
            else:
                ids[pkey] = prof["ID"]
    return ids


def _check_text(rep: Reporter, turn: int, key: str, v: Any, what: str) -> None:
    if isinstance(v, str) and not v.strip():
        rep(turn, key, f"empty {what}")


@dataclass
class _DialogueMedia:
    """The media checks of one dialogue: its conversation id, profile IDs, the media, the ids checked."""

    cid: str
    ids: dict[str, int | None]
    media: _Media
    seen: set[str] = field(default_factory=set)

    def check(self, rep: Reporter, turn: int, key: str, k: int, profile_id: int) -> None:
        _check_media(rep, turn, key, utterance_id(self.cid, k, profile_id), self.media, self.seen)


def _media_cid(rep: Reporter, cid: Any) -> str | None:
    """The conversation id when it can name media files, else None (reported when it is a string)."""
    if not isinstance(cid, str):
        return None
    why = check_conversation_id(cid)
    if why:
        rep(None, "conversation_id", f"cannot name media files: {why}")
        return None
    return cid


def _check_coe(rep: Reporter, turn: int, tp: str, coe: Any, emotion_map: EmotionMap) -> None:
    """Every CoE step present, and a speaker emotion that the map resolves."""
    if coe is None:
        rep(turn, f"{tp}.chain_of_empathy", "missing field")
    elif isinstance(coe, Mapping):
        for k in _COE_KEYS:
            if k not in coe:
                rep(turn, f"{tp}.chain_of_empathy.{k}", "missing field")
    if isinstance(coe, Mapping) and isinstance(coe.get("speaker_emotion"), str):
        word = coe["speaker_emotion"]
        if emotion_map.project(word) is None:
            rep(
                turn,
                f"{tp}.chain_of_empathy.speaker_emotion",
                f"unknown emotion word {word!r} (no class, ED label or alias in map {emotion_map.name})",
            )


def _check_utterance(
    rep: Reporter, turn: int, up: str, u: Mapping[str, Any], media: _DialogueMedia | None
) -> Any:
    """Role, text and media of one history utterance; returns its `index` (any type) for the order check."""
    role = u.get("role")
    if isinstance(role, str) and role not in ROLES:
        rep(turn, f"{up}.role", f"unknown role {role!r}; expected one of {ROLES}")
    _check_text(rep, turn, f"{up}.utterance", u.get("utterance"), "utterance")
    idx = u.get("index")
    pid = media.ids.get(f"{role}_profile") if media is not None and role in ROLES else None
    if media is not None and is_int(idx) and idx >= 0 and pid is not None:
        media.check(rep, turn, up, idx, pid)
    return idx


def _check_turn(
    rep: Reporter, j: int, t: Mapping[str, Any], emotion_map: EmotionMap, media: _DialogueMedia | None
) -> None:
    """The values of turn j: response, CoE, each history utterance, history order, the response's media."""
    tp = f"turns[{j}]"
    _check_text(rep, j, f"{tp}.response", t.get("response"), "response")
    _check_coe(rep, j, tp, t.get("chain_of_empathy"), emotion_map)
    hist = t.get("dialogue_history")
    if not isinstance(hist, list):
        return
    if not hist:
        rep(j, f"{tp}.dialogue_history", "empty dialogue history")
    indices = [
        _check_utterance(rep, j, f"{tp}.dialogue_history[{i}]", u, media)
        for i, u in enumerate(hist)
        if isinstance(u, Mapping)
    ]
    if all(is_int(x) for x in indices) and indices != list(range(len(hist))):
        rep(j, f"{tp}.dialogue_history", f"history indices {indices} are not 0..{len(hist) - 1}")
    if media is not None and media.ids["listener_profile"] is not None and isinstance(t.get("response"), str):
        media.check(rep, j, f"{tp}.response", len(hist), media.ids["listener_profile"])


def _check_dialogue(
    obj: Any,
    index: int,
    *,
    source: str,
    media: _Media | None,
    emotion_map: EmotionMap,
) -> list[Problem]:
    """Structure first, then the values: conversation id, profiles, each turn (`_check_turn`)."""
    problems = _check_structure(obj, source=source, index=index)
    if not isinstance(obj, Mapping):
        return problems
    rep = Reporter(source, conv_label(obj, index))
    cid = _media_cid(rep, obj.get("conversation_id"))
    ids = _check_profile_values(rep, obj)
    turns = obj.get("turns")
    if not isinstance(turns, list):
        return problems + rep.problems
    if not turns:
        rep(None, "turns", "dialogue has no turns")
    dialogue_media = None if media is None or cid is None else _DialogueMedia(cid, ids, media)
    for j, t in enumerate(turns):
        if isinstance(t, Mapping):
            _check_turn(rep, j, t, emotion_map, dialogue_media)
    return problems + rep.problems


def validate_dialogues(
    objs: list[dict[str, Any]],
    *,
    source: str,
    media_dir: str | None,
    emotion_map: EmotionMap,
    check_media_readable: bool = True,
) -> list[Problem]:
    """Every problem in a list of AvaMERG dialogue objects; never stops at the first.

    Checks structure and types, label vocabularies, emotion words (against `emotion_map`), empty
    dialogues/turns/utterances, history indices 0..n-1, duplicate conversation ids and, when
    `media_dir` is given, that each utterance's .wav and .mp4 exist and (cheaply) decode.
    """
    problems: list[Problem] = []
    media = None
    if media_dir is not None:
        try:
            names = frozenset(e.name for e in os.scandir(media_dir) if e.is_file())
            media = _Media(media_dir, names, check_media_readable)
        except OSError as e:  # one line for the root cause instead of one per utterance
            problems.append(Problem(source, None, None, "media_dir", f"cannot list media directory: {e}"))
    first_seen: dict[str, int] = {}
    for i, obj in enumerate(objs):
        problems += _check_dialogue(obj, i, source=source, media=media, emotion_map=emotion_map)
        cid = obj.get("conversation_id") if isinstance(obj, Mapping) else None
        if isinstance(cid, str):
            if cid in first_seen:
                problems.append(
                    Problem(source, cid, None, "conversation_id", f"duplicate of dialogue #{first_seen[cid]}")
                )
            else:
                first_seen[cid] = i
    return problems


def validate_file(
    path: str | os.PathLike[str],
    media_dir: str | os.PathLike[str] | None = None,
    *,
    emotion_map: EmotionMap | None = None,
    check_media_readable: bool = True,
) -> list[Problem]:
    """`validate_dialogues` on `RAW/{split}.json`, plus unreadable-file and JSON parse errors.

    Problems name the file by its base name. `media_dir=None` skips media checks; pass
    `media_dir_of(RAW)` for the standard layout.
    """
    src = os.fspath(path)
    objs, problems = read_json_list(src)
    if problems:
        return problems
    return validate_dialogues(
        objs,
        source=os.path.basename(src),
        media_dir=None if media_dir is None else os.fspath(media_dir),
        emotion_map=emotion_map or EmotionMap.load(),
        check_media_readable=check_media_readable,
    )


__all__ = [
    "AGES",
    "ED_EMOTIONS_32",
    "EMOTIONS_7",
    "EMOTION_MAP_NAMES",
    "GENDERS",
    "ROLES",
    "SCHEMA_VERSION",
    "TIMBRES",
    "ChainOfEmpathy",
    "Dialogue",
    "EmotionMap",
    "Profile",
    "SchemaError",
    "Turn",
    "Utterance",
    "dialogue_utterances",
    "labels_for",
    "load_dialogues",
    "normalize_word",
    "response_utterance_id",
    "turn_utterances",
    "validate_dialogues",
    "validate_file",
]
