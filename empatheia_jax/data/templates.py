"""The D.1 input templates of the four training stages, the CoE target text and its parser.

Everything the LLM reads or writes as text is produced here, from raw record text, so that a template
change needs no re-preparation of shards (the input pipeline calls these functions per example). The
exact layout (whitespace, newlines, placeholder spelling) is a contract with generation and evaluation,
and is written down in docs/design.md "## Templates"; the tests pin it character by character.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

STAGES: tuple[str, ...] = ("coe", "ccl", "sac", "overall")

AUD_PLACEHOLDER = "<Aud>"
VID_PLACEHOLDER = "<Vid>"

INSTRUCTION_TEXT = "Provide an empathetic response based on the given dialogue context below."
INSTRUCTION_MULTIMODAL = "Provide a multimodal empathetic response based on the given dialogue context below."
STEP_BY_STEP = "Don't rush to give the response, thinking step by step."

# (record field, ordinal word, phrase) of the five CoE steps of D.1, in order.
COE_STEPS: tuple[tuple[str, str, str], ...] = (
    ("event_scenario", "Firstly", "the event scenario of this conversation is"),
    ("speaker_emotion", "Secondly", "the emotion of the speaker is"),
    ("emotion_cause", "Thirdly", "the emotion cause is"),
    ("goal_to_response", "Fourthly", "the goal to response is"),
    ("response", "Finally", "the response is"),
)
COE_FIELDS: tuple[str, ...] = tuple(f for f, _, _ in COE_STEPS)

_ROLE_LABELS = {"speaker": "Speaker", "listener": "Listener"}
_CHAT_FORMATS = ("auto", "chat_template", "vicuna", "plain")
_VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)
# Any spelling of an added token inside raw text; it would otherwise become a placeholder/signal token.
_ADDED_TOKEN_RE = re.compile(r"<(?:Aud|Vid|AUD\d+|VID\d+)>")
_SIGNAL_RE = re.compile(r"<(?:Aud|Vid|AUD\d*|VID\d*)>", re.IGNORECASE)


# --------------------------------------------------------------------------------------------------
# Added tokens
# --------------------------------------------------------------------------------------------------


def signal_tokens(n_signal: int = 16) -> tuple[list[str], list[str]]:
    """The output signal tokens: (["<AUD1>".."<AUDn>"], ["<VID1>".."<VIDn>"])."""
    if n_signal < 1:
        raise ValueError(f"n_signal must be >= 1, got {n_signal}")
    return [f"<AUD{i}>" for i in range(1, n_signal + 1)], [f"<VID{i}>" for i in range(1, n_signal + 1)]


def signal_text(n_signal: int = 16) -> str:
    """The signal-token block of a target: all <AUDi> then all <VIDi>, no separators (one token each)."""
    aud, vid = signal_tokens(n_signal)
    return "".join(aud) + "".join(vid)


def added_tokens(n_signal: int = 16) -> list[str]:
    """Tokens the model adds to the vocabulary, in id order: <Aud>, <Vid>, <AUD1..n>, <VID1..n>.

    The order is the contract with the model's extra embedding rows (docs/design.md "Backbone").
    """
    aud, vid = signal_tokens(n_signal)
    return [AUD_PLACEHOLDER, VID_PLACEHOLDER, *aud, *vid]


CONVERTED_MARKER = "COMPLETE"  # the file that ends a finished converted checkpoint (weights.checkpoint_io)


def load_tokenizer(source: Any) -> Any:
    """An HF tokenizer: `source` itself, or the one saved in a folder (a converted checkpoint, an export or
    an HF model folder). The data pipeline's grain workers re-load it from the folder's path.

    A converted checkpoint's config.json is ours, not an HF config: AutoTokenizer would parse it as one
    (and warn about its `rope_scaling` key on every load), so it is given an empty config instead.

    A folder whose tokenizer_config.json names transformers' generic `TokenizersBackend` and holds no HF
    model config (a converted checkpoint, an export, a saved tokenizer: what our own tools write) is read by
    that class directly, the class AutoTokenizer resolves there too. AutoTokenizer's model registry imports
    torch (through `modeling_rope_utils`): 2-3 s of every command and grain worker that loads a tokenizer.
    Any other folder (an HF model's, a model-specific class) goes through AutoTokenizer.
    """
    if not isinstance(source, str | os.PathLike):
        return source
    folder = Path(source)
    converted = (folder / CONVERTED_MARKER).is_file()
    if _generic_backend(folder) and (converted or not (folder / "config.json").is_file()):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(os.fspath(source))
    from transformers import AutoTokenizer, PretrainedConfig

    kw = {"config": PretrainedConfig()} if converted else {}
    return AutoTokenizer.from_pretrained(os.fspath(source), **kw)


def _generic_backend(folder: Path) -> bool:
    """Whether `folder` holds a tokenizer.json that its tokenizer_config.json gives to the generic class."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    generic = isinstance(config, dict) and config.get("tokenizer_class") == "TokenizersBackend"
    return generic and not config.get("auto_map") and (folder / "tokenizer.json").is_file()


def extend_tokenizer(tokenizer: Any, n_signal: int = 16) -> dict[str, int]:
    """Add `added_tokens(n_signal)` as special tokens (idempotent) and return {token: id}.

    Special so that they are never split or normalised and placeholders stay one token each. A tokenizer
    that already knows some of them keeps their ids; the rest are appended. Raises if the ids of the
    added tokens are not consecutive in `added_tokens` order, since the model maps them to extra rows.
    """
    toks = added_tokens(n_signal)
    missing = [t for t in toks if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
    if missing:
        tokenizer.add_tokens(missing, special_tokens=True)
    ids = {t: int(tokenizer.convert_tokens_to_ids(t)) for t in toks}
    first = ids[toks[0]]
    if [ids[t] - first for t in toks] != list(range(len(toks))):
        raise ValueError(
            f"added tokens have non-consecutive ids {ids}; the tokenizer already held some of them in a "
            "different order - rebuild it from the base tokenizer"
        )
    return ids


# --------------------------------------------------------------------------------------------------
# Template variants
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TemplateSpec:
    """Which prompt and target a stage uses, including the paper's ablations and baseline.

    stage: "coe" (1), "ccl" (2), "sac" (3) or "overall" (4).
    use_coe: False is the "w/o CoE" ablation: the target is the bare response (+ signal tokens).
    media_input: False is the "w/o speech & video input" ablation of stage 4 (no placeholders).
    pipeline_baseline: the paper's Pipeline baseline: text-only context, target
        "Emotion: ..\\nProfile: ..\\nResponse: ..", no signal tokens.
    n_signal: signal tokens per modality.
    """

    stage: str
    use_coe: bool = True
    media_input: bool = True
    pipeline_baseline: bool = False
    n_signal: int = 16

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"unknown stage {self.stage!r}; expected one of {STAGES}")
        if self.pipeline_baseline and self.stage == "sac":
            raise ValueError("the pipeline baseline needs text input; stage 'sac' has none")
        if self.n_signal < 1:
            raise ValueError(f"n_signal must be >= 1, got {self.n_signal}")

    @property
    def has_text(self) -> bool:
        """Whether history lines carry the utterance text."""
        return self.stage != "sac"

    @property
    def has_media(self) -> bool:
        """Whether history lines carry <Aud>/<Vid> placeholders."""
        if self.pipeline_baseline:
            return False
        return self.stage == "sac" or (self.stage == "overall" and self.media_input)

    @property
    def has_signal(self) -> bool:
        """Whether the target ends with the <AUDi>/<VIDi> signal tokens."""
        return self.stage in ("sac", "overall") and not self.pipeline_baseline

    @property
    def has_response(self) -> bool:
        """Whether the target contains the response text (and hence a response span for r^t)."""
        return self.stage != "sac"

    def instruction(self) -> str:
        """The first paragraph of the prompt (D.1; step-by-step only when a CoE trace is the target)."""
        if self.pipeline_baseline:
            return INSTRUCTION_TEXT
        if self.stage == "sac":
            return INSTRUCTION_MULTIMODAL
        head = INSTRUCTION_MULTIMODAL if self.stage == "overall" else INSTRUCTION_TEXT
        return f"{head} {STEP_BY_STEP}" if self.use_coe else head


# --------------------------------------------------------------------------------------------------
# Prompt
# --------------------------------------------------------------------------------------------------


def clean_text(text: Any, forbidden: Iterable[str] = ()) -> str:
    """Raw text made safe for a template: added-token spellings and `forbidden` strings removed,
    line breaks and runs of whitespace collapsed to one space, ends stripped.

    One line per utterance and one line per CoE step is what makes the layout parseable; a stray
    "<Aud>" in user text would add a placeholder without features.
    """
    s = "" if text is None else str(text)
    for f in forbidden:
        if f:
            s = s.replace(f, " ")
    s = _ADDED_TOKEN_RE.sub(" ", s)
    return " ".join(s.split())


def role_label(role: str) -> str:
    """ "Speaker" / "Listener" for the history roles "speaker" / "listener"."""
    try:
        return _ROLE_LABELS[role]
    except KeyError:
        raise ValueError(f"unknown dialogue role {role!r}; expected one of {tuple(_ROLE_LABELS)}") from None


def media_text(k_aud: int = 1, k_vid: int = 1) -> str:
    """Placeholders of one utterance: k_aud <Aud>, a space, k_vid <Vid>, a full stop (D.1 stage 3/4)."""
    return AUD_PLACEHOLDER * k_aud + " " + VID_PLACEHOLDER * k_vid + "."


def prompt_head(spec: TemplateSpec) -> str:
    """Prompt text before the first history line."""
    return f"{spec.instruction()}\n\nDialogue Context:\n{{\n"


PROMPT_TAIL = "}"


def history_line(role: str, text: str, spec: TemplateSpec, *, k_aud: int = 1, k_vid: int = 1) -> str:
    """One history line: two-space indent, role label, colon, text, placeholders, newline."""
    body = text if spec.has_text else ""
    media = media_text(k_aud, k_vid) if spec.has_media else ""
    return f"  {role_label(role)}:{body}{media}\n"


def format_prompt(
    history: Sequence[Mapping[str, Any]], spec: TemplateSpec, *, k_aud: int = 1, k_vid: int = 1
) -> str:
    """The full D.1 prompt for a history list of {"role", "utterance"} dicts (text is cleaned)."""
    lines = "".join(
        history_line(u["role"], clean_text(u.get("utterance")), spec, k_aud=k_aud, k_vid=k_vid)
        for u in history
    )
    return prompt_head(spec) + lines + PROMPT_TAIL


# --------------------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
    """A target text and the [start, end) character span of the response inside it (None if absent)."""

    text: str
    response_span: tuple[int, int] | None


def format_coe(coe: Mapping[str, Any], response: str) -> str:
    """The five-step CoE text of D.1; steps whose field is empty are left out, ordinals are kept.

    Keeping each step's own ordinal ("Firstly", ..., "Finally") even when a step is missing makes the
    parse unambiguous and never invents text for fields the data lacks (the ED importer has no cause
    or goal). Field values are `clean_text`ed so a step never spans lines.
    """
    return _format_coe(coe, response)[0]


def _format_coe(coe: Mapping[str, Any], response: str) -> tuple[str, tuple[int, int]]:
    parts: list[str] = []
    pos = 0
    span = (0, 0)
    for fld, ordinal, phrase in COE_STEPS:
        value = clean_text(response if fld == "response" else coe.get(fld))
        if not value and fld != "response":
            continue
        head = f"{ordinal}, {phrase}: "
        if parts:
            pos += 2  # the "\n\n" separator
        if fld == "response":
            span = (pos + len(head), pos + len(head) + len(value))
        parts.append(head + value)
        pos += len(head) + len(value)
    return "\n\n".join(parts), span


def format_pipeline_target(coe: Mapping[str, Any], profile: Mapping[str, Any], response: str) -> Target:
    """Pipeline-baseline target: "Emotion: {e}\\nProfile: {age}, {gender}, {timbre}\\nResponse: {r}".

    The emotion is the annotated speaker_emotion word, the profile the listener's (whose avatar speaks).
    """

    def word(v: Any) -> str:
        return clean_text(v) or "unknown"

    head = (
        f"Emotion: {word(coe.get('speaker_emotion'))}\n"
        f"Profile: {word(profile.get('age'))}, {word(profile.get('gender'))}, {word(profile.get('timbre'))}\n"
        "Response: "
    )
    r = clean_text(response)
    return Target(head + r, (len(head), len(head) + len(r)))


def format_target(
    spec: TemplateSpec,
    *,
    coe: Mapping[str, Any] | None = None,
    response: str = "",
    listener_profile: Mapping[str, Any] | None = None,
) -> Target:
    """The target text of `spec` (without eos; the pipeline appends the eos token id).

    coe/ccl: CoE text (or the bare response without CoE). sac: the signal tokens only. overall: CoE text
    (or response) + "\\n" + signal tokens. Pipeline baseline: `format_pipeline_target`.
    """
    coe = coe or {}
    if spec.pipeline_baseline:
        return format_pipeline_target(coe, listener_profile or {}, response)
    if spec.stage == "sac":
        return Target(signal_text(spec.n_signal), None)
    if spec.use_coe:
        text, span = _format_coe(coe, response)
    else:
        text = clean_text(response)
        span = (0, len(text))
    if spec.has_signal:
        text = f"{text}\n{signal_text(spec.n_signal)}"
    return Target(text, span)


# --------------------------------------------------------------------------------------------------
# Chat wrapping
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """How a D.1 prompt is wrapped for an instruct model: prefix + prompt + suffix, then the target.

    `target_prefix` belongs to the target segment (trained on): the Vicuna format's space before the
    reply, which SentencePiece fuses into the reply's first token.
    """

    prefix: str
    suffix: str
    target_prefix: str = ""
    name: str = "plain"

    def wrap(self, prompt: str) -> str:
        return self.prefix + prompt + self.suffix


_SENTINEL = "\x00EMPATHEIA_PROMPT\x00"


def chat_format(tokenizer: Any = None, kind: str = "auto") -> ChatFormat:
    """The chat wrapping for `tokenizer`.

    "chat_template": the tokenizer's own template with the prompt as the single user turn and
    add_generation_prompt=True (SmolLM2 adds its default system turn); "vicuna": the Vicuna v1.1
    conversation format (the paper's backbone ships no chat template); "plain": prompt + "\\n".
    "auto" picks chat_template when the tokenizer has one, else vicuna.
    """
    if kind not in _CHAT_FORMATS:
        raise ValueError(f"unknown chat format {kind!r}; expected one of {_CHAT_FORMATS}")
    if kind == "auto":
        kind = "chat_template" if getattr(tokenizer, "chat_template", None) else "vicuna"
    if kind == "plain":
        return ChatFormat("", "\n", "", "plain")
    if kind == "vicuna":
        return ChatFormat(f"{_VICUNA_SYSTEM} USER: ", " ASSISTANT:", " ", "vicuna")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat format 'chat_template' needs a tokenizer with a chat template")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=True
    )
    if not isinstance(text, str) or text.count(_SENTINEL) != 1:
        raise ValueError("the tokenizer's chat template does not render the user message verbatim")
    prefix, suffix = text.split(_SENTINEL)
    return ChatFormat(prefix, suffix, "", "chat_template")


def format_chat(prompt: str, tokenizer: Any = None, kind: str = "auto") -> str:
    """`prompt` wrapped as one user turn, ending where the assistant's reply (the target) begins."""
    return chat_format(tokenizer, kind).wrap(prompt)


# --------------------------------------------------------------------------------------------------
# Parsing generated text
# --------------------------------------------------------------------------------------------------

_ORDINALS = "firstly|secondly|thirdly|fourthly|fifthly|finally|lastly|first|second|third|fourth|fifth"
_ORD = r"(?:" + _ORDINALS + r")\s*[,:.]?\s*"
# A step header starts a line (optionally after an ordinal) or follows an ordinal anywhere; "the
# response is" in the middle of a sentence is not a header.
_COE_HEAD_RE = re.compile(
    r"(?:^[ \t]*(?:" + _ORD + r")?|\b" + _ORD + r")"
    r"(?P<phrase>"
    r"the\s+event\s+scenario(?:\s+of\s+(?:this|the)\s+conversation)?"
    r"|the\s+emotion\s+of\s+the\s+speaker"
    r"|the\s+emotion\s+cause"
    r"|the\s+goal\s+(?:to|of(?:\s+the)?)\s+response"
    r"|the\s+response)"
    r"\s+is\s*:?[ \t]*",
    re.IGNORECASE | re.MULTILINE,
)
_PHRASE_FIELD = (
    ("event", "event_scenario"),
    ("speaker", "speaker_emotion"),
    ("cause", "emotion_cause"),
    ("goal", "goal_to_response"),
    ("response", "response"),
)


def strip_signal_tokens(text: str) -> str:
    """Text with every <AUDi>/<VIDi>/<Aud>/<Vid> (any case, any index) removed and ends stripped."""
    return _SIGNAL_RE.sub("", text).strip()


def _clean_value(v: str) -> str:
    return " ".join(v.split())


def parse_coe(text: str) -> dict[str, str]:
    """The five CoE fields from generated text; a missing step gives "".

    Tolerant of generation noise: ordinals may be missing or different, case and spacing vary, the
    colon may be missing, signal tokens and chat end markers are ignored. A step's value runs to the
    next recognised step header. Text without any header is taken as the bare response (the "w/o CoE"
    output), so evaluation can use one parser for both.
    """
    text = strip_signal_tokens(_strip_end_markers(text))
    out = dict.fromkeys(COE_FIELDS, "")
    heads = list(_COE_HEAD_RE.finditer(text))
    if not heads:
        out["response"] = _clean_value(text)
        return out
    for i, m in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        phrase = m.group("phrase").lower()
        fld = next(f for key, f in _PHRASE_FIELD if key in phrase)  # "goal" is tested before "response"
        if not out[fld]:  # first occurrence wins; models sometimes repeat a step
            out[fld] = _clean_value(text[m.end() : end])
    return out


def emotion_step_prefix(text: str) -> str | None:
    """Generated CoE text up to where the step-2 emotion word begins, for scoring labels there.

    With a step-2 header: the text through it ("... Secondly, the emotion of the speaker is:"). Without one
    (the model skipped the step): the text before the first header after step 1, followed by the canonical
    step-2 header, so the label is still chosen after the model's own event scenario. None when the text
    has no CoE header at all (a bare reply: nothing to condition the step on).
    """
    heads = list(_COE_HEAD_RE.finditer(text))
    for m in heads:
        if "speaker" in m.group("phrase").lower():
            return text[: m.end()].rstrip(" \t")
    if not heads:
        return None
    _, ordinal, phrase = COE_STEPS[1]
    later = [m for m in heads if "event" not in m.group("phrase").lower()]
    before = text[: later[0].start()] if later else text
    return f"{before.rstrip()}\n\n{ordinal}, {phrase}:"


def response_header_end(text: str) -> int | None:
    """Where the reply begins in generated CoE text: the index just after the step-5 header ("Finally, the
    response is:", spaces after it not included), None when the text has no such header."""
    for m in _COE_HEAD_RE.finditer(text):
        phrase = m.group("phrase").lower()
        if "response" in phrase and "goal" not in phrase:
            return len(text[: m.end()].rstrip(" \t"))
    return None


_PIPE_RE = {
    "emotion": re.compile(r"^\s*emotion\s*:\s*(.*)$", re.IGNORECASE | re.MULTILINE),
    "profile": re.compile(r"^\s*profile\s*:\s*(.*)$", re.IGNORECASE | re.MULTILINE),
    "response": re.compile(r"^\s*response\s*:\s*(.*)", re.IGNORECASE | re.MULTILINE | re.DOTALL),
}


def parse_pipeline_output(text: str) -> dict[str, str]:
    """Fields of a pipeline-baseline generation: emotion, age, gender, timbre, response ("" if missing)."""
    text = strip_signal_tokens(_strip_end_markers(text))
    out = dict.fromkeys(("emotion", "age", "gender", "timbre", "response"), "")
    if m := _PIPE_RE["emotion"].search(text):
        out["emotion"] = _clean_value(m.group(1))
    if m := _PIPE_RE["profile"].search(text):
        vals = [_clean_value(v) for v in m.group(1).split(",")]
        for key, v in zip(("age", "gender", "timbre"), vals, strict=False):
            out[key] = v
    if m := _PIPE_RE["response"].search(text):
        out["response"] = _clean_value(m.group(1))
    return out


_END_MARKERS_RE = re.compile(r"<\|im_end\|>|<\|endoftext\|>|<\|eot_id\|>|</s>")


def _strip_end_markers(text: str) -> str:
    m = _END_MARKERS_RE.search(text)
    return text if m is None else text[: m.start()]


__all__ = [
    "AUD_PLACEHOLDER",
    "CONVERTED_MARKER",
    "COE_FIELDS",
    "COE_STEPS",
    "STAGES",
    "VID_PLACEHOLDER",
    "ChatFormat",
    "Target",
    "TemplateSpec",
    "added_tokens",
    "chat_format",
    "clean_text",
    "emotion_step_prefix",
    "extend_tokenizer",
    "load_tokenizer",
    "format_chat",
    "format_coe",
    "format_pipeline_target",
    "format_prompt",
    "format_target",
    "history_line",
    "media_text",
    "parse_coe",
    "parse_pipeline_output",
    "prompt_head",
    "role_label",
    "signal_text",
    "signal_tokens",
    "strip_signal_tokens",
]
