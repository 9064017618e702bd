"""One Empatheia reply to a (multimodal) utterance: the CoE, the text reply, and the generator features.

`respond` is the library behind `empatheia chat` (and, through `serve.turn`, the server). Its steps are named
helpers: the conversation (`serve.history`: validated, transcribed where it has only audio) -> the prompt
(`serve.prompt`: training's template and tokenisation, features from the shards' encoder) -> generation ->
the signal tokens -> the heads -> the `ChatResult`. Writing the result to files is `serve.outputs`. Why the
steps after the prompt work the way they do:

- Generation uses the KV cache (`generation.generate_tokens`, media spliced through `inputs_embeds`); then ONE
  deterministic forward (z = mu) over the generated sequence, with the decode's own attention mask and
  positions, gathers r^t / r^s / r^v at the positions whose INPUT token is the response / `<AUDi>` /
  `<VIDi>` (docs/design.md "Gather position"), and runs CS and SD on them.
- A model that has an SD but did not write every signal token (an untrained model, or a reply cut by
  `max_new_tokens`) gets the missing ones appended after its text, in order (after a newline when it wrote
  none, as in the training target), followed by the end token; `signal_tokens_forced` says so. Without that
  the SD would read zero rows and return the same style for every input.
- r^t is the span of the parsed reply ("Finally, the response is: ...", or the whole text without CoE) in
  the generated tokens; if it cannot be located, the CS reads no row and a note says so.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from empatheia_jax.data import encoders as enc_lib
from empatheia_jax.data import parse, schema
from empatheia_jax.data.targets import STAND_IN
from empatheia_jax.generators import registry
from empatheia_jax.generators.registry import content_rows
from empatheia_jax.generators.speech_synth import listener_style
from empatheia_jax.models.empatheia import Empatheia
from empatheia_jax.models.empatheia_config import EmpatheiaConfig
from empatheia_jax.serve import forward
from empatheia_jax.serve.decoding import Decoding
from empatheia_jax.serve.generation import bucket, eos_token_ids, generate_tokens, left_pad
from empatheia_jax.serve.history import ChatInputError, conversation, transcribe_utterances
from empatheia_jax.serve.prompt import ChatPrompt, build_prompt
from empatheia_jax.serve.reply_choice import redraw_replies


@dataclasses.dataclass
class ChatResult:
    """What `respond` produced. Arrays are float32 numpy.

    text: the generated text (special tokens kept, up to the end token); coe: the five CoE fields
    (`templates.parse_coe`); reply: the response step; emotion / emotion_probs: the SD emotion classifier
    (argmax name, softmax over `emotion_classes`; "" / empty without SD); emotion_text: CoE step 2 mapped
    to the classes (None when it does not map); profile: {"age", "gender", "timbre": names,
    "age_probs", "gender_probs", "timbre_probs": softmax}; features: speech_content [max_speech_len, 1024],
    video_content [max_video_len, 256], speech_style [256], video_style [256] (present heads only; a
    generator reads the first T content rows, T from the phonemised reply / the speech length, see
    `speech_content_units` for stand-in targets); signal_tokens_forced: missing signal tokens were appended;
    input_ids / response_mask: the unpadded sequence the heads read and its r^t mask; prompt_length: its
    prompt tokens; notes: anything the caller should know; input_transcripts: per utterance whose text was
    transcribed from its audio, {utterance_index (0-based, history first, the latest last), transcript,
    confidence}.
    """

    text: str
    coe: dict[str, str]
    reply: str
    emotion: str
    emotion_probs: np.ndarray
    profile: dict[str, Any]
    features: dict[str, np.ndarray]
    signal_tokens_forced: bool
    emotion_text: str | None = None
    emotion_classes: tuple[str, ...] = ()
    input_ids: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    response_mask: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    prompt_length: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)
    speech_targets: str = STAND_IN
    video_targets: str = STAND_IN
    input_transcripts: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def speech_content_units(self) -> int | None:
        """T_ph of the reply: the speech_content rows a generator reads (`registry.content_rows` of the
        source of the speech targets the model was trained on; None where it cannot be counted)."""
        return content_rows(self.reply, self.speech_targets)



def class_names(n: int) -> tuple[str, ...]:
    """Names of an emotion classifier's n outputs: 7 (avamerg7), 8 (e3rg8), 32 (ED), else "0".."n-1"."""
    if n == len(schema.EMOTIONS_7):
        return schema.EMOTIONS_7
    if n == len(schema.EMOTIONS_7) + 1:
        return (*schema.EMOTIONS_7, "neutral")
    if n == len(schema.ED_EMOTIONS_32):
        return schema.ED_EMOTIONS_32
    return tuple(str(i) for i in range(n))


def _softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max())
    return (e / e.sum()).astype(np.float32)


_SIGNAL_TEXT = r"<(?:Aud|Vid|AUD\d+|VID\d+)>"


def _span(text: str, value: str) -> tuple[int, int] | None:
    """[start, end) of `value` (whitespace-collapsed, signal tokens removed) inside raw `text`, or None."""
    parts = value.split()
    if not parts:
        return None
    sep = r"(?:\s|" + _SIGNAL_TEXT + r")+"
    m = re.search(sep.join(re.escape(p) for p in parts), text)
    return None if m is None else (m.start(), m.end())


def _token_ends(tokenizer: Any, ids: Sequence[int]) -> list[int]:
    """Character end offset of each token in `decode(ids)` (prefix decoding; no space clean-up)."""
    kw = {"skip_special_tokens": False, "clean_up_tokenization_spaces": False}
    return [len(tokenizer.decode(list(ids[: i + 1]), **kw)) for i in range(len(ids))]


def emotion_map_name(cfg: Any) -> str:
    """The emotion map whose classes the model's heads predict (8 classes: E3RG's, else AvaMERG's 7)."""
    return "e3rg8" if cfg.num_emotions == 8 else "avamerg7"


def respond(
    model: Empatheia,
    tokenizer: Any,
    *,
    text: str,
    audio: str | os.PathLike | None = None,
    video: str | os.PathLike | None = None,
    history: Sequence[Mapping[str, Any]] | None = None,
    encoder: str | enc_lib.Encoder = "lite",
    encoder_kwargs: Mapping[str, Any] | None = None,
    decoding: Decoding = Decoding(),
    max_len: int = 1024,
    chat_format: str = "auto",
    compiler_options: Mapping[str, Any] | None = None,
    speech_targets: str = STAND_IN,
    video_targets: str = STAND_IN,
    asr_threads: int = 2,
    listener: Mapping[str, str] | None = None,
    written: str | None = None,
) -> ChatResult:
    """The model's reply to `text` (the speaker's latest utterance; `audio`/`video` its media files) after
    `history` (`load_history` entries, oldest first). See the module docstring for the steps.

    encoder: the name (with `encoder_kwargs`) or an instance; it must be the encoder of the training shards
    (`encoder_from_manifest(shards_dir)`). `decoding` (`serve.decoding.Decoding`): the budget
    (`max_new_tokens`), greedy at temperature 0, else sampled with its `seed`/`top_p`; its
    `repetition_penalty`/`no_repeat_ngram_size` are HF's, over the prompt and the reply (generation.py); its
    `reply_sampling` draws the reply again after the CoE's step-5 header, the consensus of its candidates
    (`reply_choice`, as `empatheia eval --reply_temperature` measures it), seeded with its own seed.
    Missing media raise `FileNotFoundError`, unreadable media and a latest utterance that cannot fit in
    `max_len` `ChatInputError` (`PromptTooLongError`), each naming the file or the limit.
    speech_targets / video_targets: the sources of the targets the model was trained on (checkpoint meta
    "targets"); the first decides how many speech_content rows the reply has
    (`ChatResult.speech_content_units`), both which generator can render the features (recorded in OUT.json).
    An utterance with audio and no text (`text=""` for the latest) is transcribed first
    (`transcribe_utterances`, `asr_threads` CTranslate2 threads); one with neither is a `ChatInputError`.
    A unit-aligned video block (`cv_units`) runs after the speech rows are known: its frame units are the
    reply's content units on the durations its speech will be spoken with, in the pinned `listener` voice
    when one is given (the same voice `serve.avatar.synthesize_reply` then speaks), else the predicted S^s.
    `written` (a CoE text, `templates.format_coe`) stands for the generation: the heads read it as if the
    model had written it, as training's teacher forcing does, so a chosen reply is voiced and drawn by the
    model's own CS/SD (what tests/test_reference_model.py hears).
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a string, got {type(text).__name__}")
    cfg = model.config
    utterances, transcripts = transcribe_utterances(conversation(text, audio, video, history),
                                                    threads=asr_threads)
    if isinstance(encoder, str):
        encoder = enc_lib.get_encoder(encoder, **dict(encoder_kwargs or {}))
    prompt = build_prompt(cfg, tokenizer, utterances, encoder=encoder, max_len=max_len,
                          reserve=decoding.max_new_tokens + _forced_room(cfg), chat_format=chat_format)
    eos, pad = _eos_and_pad(model, tokenizer)
    feats = _feature_batch(cfg, prompt)
    if written is not None:
        new = [*tokenizer(written, add_special_tokens=False)["input_ids"], eos[0]]
    else:
        new = _generate(model, tokenizer, prompt, feats, eos=eos, pad=pad, decoding=decoding,
                        compiler_options=compiler_options)
    reading = _read_reply(cfg, tokenizer, new, eos, notes=list(prompt.notes))
    result = _run_heads(model, prompt, feats, reading, pad=pad, speech_targets=speech_targets,
                        video_targets=video_targets, listener=listener, compiler_options=compiler_options)
    result.input_transcripts = transcripts
    return result


def _forced_room(cfg: EmpatheiaConfig) -> int:
    """The tokens forced signal tokens may add to a reply (2 n_signal, a newline, the end token)."""
    return 2 * cfg.n_signal + 2 if cfg.has_sd else 0


def _eos_and_pad(model: Empatheia, tokenizer: Any) -> tuple[tuple[int, ...], int]:
    """(the end tokens, the pad token: the tokenizer's, else the first end token)."""
    eos = eos_token_ids(model.llm, tokenizer)
    pad = int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else eos[0]
    return eos, pad


def _video_after_speech_needed(cfg: EmpatheiaConfig) -> bool:
    """Whether C^v runs after the speech rows are known: a unit-aligned video block reads the spoken reply's
    frame units."""
    return cfg.has_cs and bool(cfg.cv_units)


@dataclasses.dataclass
class _Reading:
    """The generated reply as the heads read it: its raw text, the tokens with any forced signal tokens, its
    parse, the r^t mask over those tokens, and the notes so far."""

    raw: str
    final: list[int]
    forced: bool
    parsed: dict[str, Any]
    response: np.ndarray
    notes: list[str]


def _read_reply(cfg: EmpatheiaConfig, tokenizer: Any, new: list[int], eos: Sequence[int], *, notes: list[str]
                ) -> _Reading:
    """The new tokens decoded and parsed, the missing signal tokens appended, and r^t located."""
    raw = tokenizer.decode(new, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    final, forced = _with_signal_tokens(cfg, tokenizer, new, eos, notes)
    parsed = parse.parse_generation(raw, schema.EmotionMap.load(emotion_map_name(cfg)),
                                    pipeline_baseline=cfg.pipeline_baseline)
    response = _reply_mask(cfg, tokenizer, final, parsed["reply"], notes)
    return _Reading(raw=raw, final=final, forced=forced, parsed=parsed, response=response, notes=notes)


def _run_heads(model: Empatheia, prompt: ChatPrompt, feats: tuple[np.ndarray, ...], reading: _Reading, *,
               pad: int, speech_targets: str, video_targets: str, listener: Mapping[str, str] | None,
               compiler_options: Mapping[str, Any] | None) -> ChatResult:
    """The heads' one deterministic forward over [prompt | reply] and the `ChatResult` they give, with a
    unit-aligned video block run after the speech rows are known."""
    cfg = model.config
    ids, mask = left_pad([prompt.ids], pad)
    units = _speech_units(cfg, reading.parsed["reply"], speech_targets)
    batch = _heads_batch(cfg, ids, mask, reading.final, reading.response, feats, pad, units)
    after_speech = _video_after_speech_needed(cfg)  # C^v needs the spoken reply's frame units
    out = forward.model_outputs(model, batch, compiler_options=compiler_options,
                                video=not after_speech) if cfg.heads else {}
    keep = mask[0].astype(bool)
    result = _assemble_result(
        cfg, out, reading.parsed, raw=reading.raw, forced=reading.forced, notes=reading.notes,
        prompt_length=len(prompt.ids),
        input_ids=np.concatenate([ids[0][keep], np.asarray(reading.final, np.int32)]).astype(np.int32),
        response_mask=np.concatenate([np.zeros(int(keep.sum()), np.int32), reading.response]),
        speech_targets=speech_targets, video_targets=video_targets)
    if after_speech:
        video, more = _video_after_speech(model, batch, out, result, listener, compiler_options)
        result.features["video_content"] = np.asarray(video[0], np.float32)
        result.notes.extend(more)
    return result


def warm_up(
    model: Empatheia,
    tokenizer: Any,
    *,
    max_len: int,
    decoding: Decoding = Decoding(),
    encoder: str | enc_lib.Encoder = "lite",
    speech_targets: str = STAND_IN,
    compiler_options: Mapping[str, Any] | None = None,
    chat_format: str = "auto",
    progress: Callable[[int], None] | None = None,
) -> list[int]:
    """Compiles, before anyone waits for them, the programs a text turn of `respond` can need: the decode
    for every prompt bucket from the shortest prompt to `max_len` (the prompt budget), then the heads (and
    a unit-aligned video block) for every sequence bucket that prompt plus up to `decoding.max_new_tokens`
    (and any forced signal tokens) can reach. The calls are respond's own with dummy ids of each bucket's
    length, so the shapes are those a real turn compiles; a turn with media also compiles its feature-row
    bucket. The decode is `decoding`'s (greedy or sampled, its repetition controls), as a server runs it; a
    reply drawn again (`decoding.reply_sampling`) is not warmed. Returns the prompt buckets; `progress` is
    called with each once it is compiled."""
    cfg = model.config
    if isinstance(encoder, str):
        encoder = enc_lib.get_encoder(encoder)
    room = _forced_room(cfg)
    shortest = build_prompt(cfg, tokenizer, [{"role": "speaker", "utterance": "Hi."}], encoder=encoder,
                            max_len=max_len + decoding.max_new_tokens + room, chat_format=chat_format)
    eos, pad = _eos_and_pad(model, tokenizer)
    empty = ChatPrompt(ids=[], aud_feats=np.zeros((0, cfg.audio_dim), np.float32),
                       vid_feats=np.zeros((0, cfg.video_dim), np.float32), notes=[])
    feats = _feature_batch(cfg, empty)  # a text turn's (empty) feature rows
    units = _speech_units(cfg, "", speech_targets)
    token = int(shortest.ids[-1])
    first_pass = dataclasses.replace(decoding, reply_sampling=None)  # dummy ids write no step-5 header
    warmed = []
    for b in _powers_of_two(bucket(len(shortest.ids)), bucket(max_len)):
        ids = [token] * b
        _generate(model, tokenizer, dataclasses.replace(empty, ids=ids), feats, eos=eos, pad=pad,
                  decoding=first_pass, compiler_options=compiler_options)
        if cfg.heads:
            ids_np, mask = left_pad([ids], pad)
            for length in _powers_of_two(2 * b, bucket(b + decoding.max_new_tokens + room)):
                final = [token] * (length - b)
                batch = _heads_batch(cfg, ids_np, mask, final, np.zeros(len(final), np.int32), feats, pad,
                                     units)
                _compile_heads(model, batch, compiler_options)
        warmed.append(b)
        if progress is not None:
            progress(b)
    return warmed


def _compile_heads(model: Empatheia, batch: Mapping[str, np.ndarray],
                   compiler_options: Mapping[str, Any] | None) -> None:
    """Runs the heads (and a unit-aligned video block) once on `batch`'s shape, compiling what a turn runs."""
    cfg = model.config
    after_speech = _video_after_speech_needed(cfg)
    forward.model_outputs(model, batch, compiler_options=compiler_options, video=not after_speech)
    if after_speech:
        forward.video_outputs(model, batch, np.zeros((1, cfg.max_video_len), np.int32),
                              compiler_options=compiler_options)


def _powers_of_two(low: int, high: int) -> list[int]:
    """low, 2 low, ... up to high (both powers of two)."""
    out = [low]
    while out[-1] < high:
        out.append(out[-1] * 2)
    return out


def _generate(
    model: Empatheia,
    tokenizer: Any,
    prompt: ChatPrompt,
    feats: tuple[np.ndarray, ...],
    *,
    eos: Sequence[int],
    pad: int,
    decoding: Decoding,
    compiler_options: Mapping[str, Any] | None,
) -> list[int]:
    """The new token ids (up to and including the end token), decoded with the KV cache as `decoding` says;
    a model with media gets its features spliced through `inputs_embeds`, as in the eval generation pass.
    `decoding.reply_sampling` then draws the reply again after the CoE's step-5 header (`redraw_replies`),
    the media spliced alike."""

    def embed(prompts: list[list[int]]) -> Any:
        if not model.config.has_media:
            return None
        return forward.embed_prompts(model, left_pad(prompts, pad)[0], *feats,
                                     compiler_options=compiler_options)

    d = decoding
    gen = generate_tokens(model.llm, [prompt.ids], d.max_new_tokens, d.temperature, d.top_p, seed=d.seed,
                          eos_ids=eos, pad_token_id=pad, inputs_embeds=embed([prompt.ids]),
                          repetition_penalty=d.repetition_penalty,
                          no_repeat_ngram_size=d.no_repeat_ngram_size)
    new = [int(t) for t in gen.new_tokens[0, : gen.num_new[0]]]
    if d.reply_sampling is None:
        return new
    return redraw_replies(model.llm, tokenizer, [prompt.ids], [new], d, seed=d.reply_sampling.seed, eos=eos,
                          pad_token_id=pad, embed=embed)[0][0]


def _with_signal_tokens(cfg: EmpatheiaConfig, tokenizer: Any, new: list[int], eos: Sequence[int],
                        notes: list[str]) -> tuple[list[int], bool]:
    """(the tokens the heads read, whether signal tokens were forced): the generation, plus any missing
    signal tokens before the end token; without them the SD would read zero rows and give every input the
    same style (module docstring). A forced append adds a note."""
    final = list(new)
    forced = False
    if cfg.has_sd:
        ended = bool(new) and new[-1] in eos
        body = new[:-1] if ended else new
        missing = [s for s in cfg.signal_ids if s not in body]
        if missing:
            forced = True
            nl = [] if any(s in body for s in cfg.signal_ids) else list(
                tokenizer("\n", add_special_tokens=False)["input_ids"])
            final = body + nl + missing + [new[-1] if ended else eos[0]]
            # Only stage overall's targets end in them (templates.format_target): a model whose last stage
            # is another (the reference model: coe, ccl, sac) never emits them.
            notes.append(f"the generation lacked {len(missing)} of the {2 * cfg.n_signal} signal tokens; "
                         "they were appended after the reply (only stage overall teaches the model to emit "
                         "them; after it, max_new_tokens may be too small)")
    return final, forced


def _reply_mask(cfg: EmpatheiaConfig, tokenizer: Any, final: list[int], reply: str, notes: list[str]
                ) -> np.ndarray:
    """r^t over `final`: the tokens that overlap the parsed reply's characters. Located in the decoded text,
    because the reply is parsed from text, not tokens; all zeros (and a note, where a CS reads it) when the
    reply cannot be found."""
    response = np.zeros(len(final), np.int32)
    if final:
        ends = _token_ends(tokenizer, final)
        span = _span(tokenizer.decode(final, skip_special_tokens=False, clean_up_tokenization_spaces=False),
                     reply)
        if span is None:
            if cfg.has_cs:
                notes.append("could not locate the reply in the generated tokens: the CS read no token")
        else:
            starts = [0, *ends[:-1]]
            response = np.array([int(s < span[1] and e > span[0]) for s, e in zip(starts, ends, strict=True)],
                                np.int32)
    return response


def _speech_units(cfg: EmpatheiaConfig, reply: str, speech_targets: str) -> np.ndarray | None:
    """[1, max_speech_len] content units of the reply for a unit-aligned CS (what its rows render), None
    for the paper's CS; a reply without units (empty) gives pads only."""
    fn = registry.units_for(cfg.cs_units, speech_targets) if cfg.has_cs else None
    if cfg.has_cs and cfg.cs_units and fn is None:
        raise ChatInputError(f"the model's Content Synchronizer is unit-aligned but its speech targets "
                             f"({speech_targets}) come from no generator with content units")
    if fn is None:
        return None
    units = np.zeros((1, cfg.max_speech_len), np.int32)
    row = np.asarray(fn(reply), np.int32)[: cfg.max_speech_len] if reply.strip() else np.zeros(0, np.int32)
    units[0, : len(row)] = row
    return units


def _heads_batch(cfg: EmpatheiaConfig, ids: np.ndarray, mask: np.ndarray, final: list[int],
                 response: np.ndarray, feats: tuple[np.ndarray, ...], pad: int,
                 speech_units: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The batch the heads read: [left padding | prompt | generated (+ forced)] with the decode's own
    attention mask and positions, right-padded to a bucket (few compiled shapes)."""
    n_prompt = ids.shape[1]
    length = bucket(n_prompt + len(final))
    seq = np.full((1, length), pad, np.int32)
    seq[0, :n_prompt] = ids[0]
    seq[0, n_prompt : n_prompt + len(final)] = final
    attn = np.zeros((1, length), np.int32)
    attn[0, :n_prompt] = mask[0]
    attn[0, n_prompt : n_prompt + len(final)] = 1
    resp = np.zeros((1, length), np.int32)
    resp[0, n_prompt : n_prompt + len(final)] = response
    positions = np.maximum(np.cumsum(attn, axis=1) - 1, 0).astype(np.int32)
    batch = {"input_ids": seq, "attention_mask": attn, "positions": positions, "response_mask": resp}
    if speech_units is not None:
        batch["speech_units"] = speech_units
    if cfg.has_media:
        batch.update(zip(("aud_feats", "aud_mask", "vid_feats", "vid_mask"), feats, strict=True))
    return batch


def _video_after_speech(model: Empatheia, batch: Mapping[str, np.ndarray], out: Mapping[str, Any],
                        result: ChatResult, listener: Mapping[str, str] | None,
                        compiler_options: Mapping[str, Any] | None) -> tuple[np.ndarray, list[str]]:
    """(C^v [1, max_video_len, d], notes) of a unit-aligned video block (`cv_units`): the reply's own
    content units laid on the durations the speech generator speaks its predicted rows with, in the voice
    the bridge will use (`serve.avatar.synthesize_reply`: the pinned `listener` avatar's vector and rate,
    else the predicted S^s at speed 1), so the mouth is in sync with the audio by construction."""
    cfg = model.config
    source = result.speech_targets
    rows = min(result.speech_content_units or 0, cfg.max_speech_len)
    if listener is not None:
        style, speed, _ = pinned_style(source, dict(listener), {"emotion_text": result.emotion_text,
                                                                 "emotion": result.emotion})
    elif "speech_style" in out:
        style, speed = np.asarray(out["speech_style"][0], np.float32), 1.0
    else:
        raise ChatInputError("the model's video block is unit-aligned (cv_units) and needs the voice the "
                             "reply is spoken in: this model has no Style Disentangler; pin one with "
                             "--listener")
    units = np.zeros((1, cfg.max_video_len), np.int32)
    notes = []
    row_units = registry.generator_class(source).content_units(result.reply) if result.reply.strip() else None
    if rows >= 3 and row_units is not None:
        speaker = registry.get(source)
        frames = speaker.frame_units(np.asarray(out["speech_content"][0], np.float32), style, rows, speed,
                                     np.asarray(row_units)[:rows], fps=25)
        if frames is None:
            raise ChatInputError(f"the model's video block is unit-aligned (cv_units) but {source} speech "
                                 "cannot say when each content row sounds")
        if len(frames) > cfg.max_video_len:
            notes.append(f"the reply lasts {len(frames)} frames; the video block predicts "
                         f"{cfg.max_video_len} (config.data.max_video_len)")
        units[0, : min(len(frames), cfg.max_video_len)] = frames[: cfg.max_video_len]
        notes.append(f"video rows timed by the {len(frames)} frames {source} speaks the reply's "
                     f"{rows} content rows in")
    else:
        notes.append("no reply to speak: the video block renders pads (a closed mouth)")
    return forward.video_outputs(model, batch, units, compiler_options=compiler_options), notes


def reply_emotion(meta: Mapping[str, Any]) -> str | None:
    """The emotion the reply answers, as a class of EMOTIONS_7: CoE step 2 when it names one (the reasoning
    the reply was written from), else the SD classifier's; None when neither resolves."""
    emap = schema.EmotionMap.load("avamerg7")
    for word in (meta.get("emotion_text"), meta.get("emotion")):
        if word and emap.class_name(word):
            return emap.class_name(word)
    return None


def pinned_style(generator: str, listener: dict[str, str], meta: Mapping[str, Any]
                 ) -> tuple[np.ndarray, float, str]:
    """(style vector, speaking rate, note) of the pinned listener avatar for generator `generator`."""
    emotion = reply_emotion(meta)
    style = listener_style(emotion)
    vector, rate = registry.generator_class(generator).avatar_style(listener, style)
    who = "/".join(listener[k] for k in ("age", "gender", "timbre"))
    return vector, rate, f"listener avatar {who} pinned, in the {style} style (reply emotion: {emotion})"


def _sd_readout(cfg: EmpatheiaConfig, out: Mapping[str, Any], parsed: Mapping[str, Any],
                classes: Sequence[str]) -> tuple[np.ndarray, str, dict[str, Any]]:
    """(emotion_probs, emotion, profile) from the SD classifiers; without an SD, empty, except that the
    Pipeline baseline writes its profile in the text, so it is read from there."""
    if "emotion_logits" in out:
        probs = _softmax(out["emotion_logits"][0])
        emotion = classes[int(np.argmax(probs))]
        profile: dict[str, Any] = {}
        for name, vocab in (("age", schema.AGES), ("gender", schema.GENDERS), ("timbre", schema.TIMBRES)):
            p = _softmax(out[f"{name}_logits"][0])
            names = vocab if len(vocab) == len(p) else tuple(str(i) for i in range(len(p)))
            profile[name] = names[int(np.argmax(p))]
            profile[f"{name}_probs"] = p
    else:
        probs, emotion, profile = np.zeros(0, np.float32), "", {}
        if cfg.pipeline_baseline:
            for name, vocab in (("age", schema.AGES), ("gender", schema.GENDERS), ("timbre", schema.TIMBRES)):
                profile[name] = vocab[parsed[name]] if parsed.get(name, -1) >= 0 else ""
    return probs, emotion, profile


def _assemble_result(
    cfg: EmpatheiaConfig,
    out: Mapping[str, Any],
    parsed: Mapping[str, Any],
    *,
    raw: str,
    forced: bool,
    notes: list[str],
    prompt_length: int,
    input_ids: np.ndarray,
    response_mask: np.ndarray,
    speech_targets: str,
    video_targets: str,
) -> ChatResult:
    """The `ChatResult` of the head outputs and the parsed text: the heads' one row as float32 numpy (what
    `write_outputs` stores), the SD readout, and CoE step 2 in the model's classes, so the text's emotion and
    the classifier's can be compared."""
    features = {k: np.asarray(out[k][0], np.float32) for k in
                ("speech_content", "video_content", "speech_style", "video_style") if k in out}
    classes = class_names(cfg.num_emotions)
    probs, emotion, profile = _sd_readout(cfg, out, parsed, classes)
    emotion_text = classes[parsed["emotion"]] if 0 <= parsed["emotion"] < len(classes) else None
    return ChatResult(
        text=raw,
        coe=parsed["coe"],
        reply=parsed["reply"],
        emotion=emotion,
        emotion_probs=probs,
        profile=profile,
        features=features,
        signal_tokens_forced=forced,
        emotion_text=emotion_text,
        emotion_classes=tuple(classes),
        input_ids=input_ids,
        response_mask=response_mask,
        prompt_length=prompt_length,
        notes=notes,
        speech_targets=speech_targets,
        video_targets=video_targets,
    )


def _feature_batch(cfg: EmpatheiaConfig, prompt: ChatPrompt) -> tuple[np.ndarray, ...]:
    """[1, rows, d] feature arrays + masks, rows padded to a power of two (few compiled shapes)."""
    out = []
    for x, d in ((prompt.aud_feats, cfg.audio_dim), (prompt.vid_feats, cfg.video_dim)):
        rows = bucket(len(x), 8)
        f = np.zeros((1, rows, d), np.float32)
        f[0, : len(x)] = x
        m = np.zeros((1, rows), np.int32)
        m[0, : len(x)] = 1
        out += [f, m]
    return tuple(out)


__all__ = [
    "ChatResult",
    "class_names",
    "emotion_map_name",
    "pinned_style",
    "reply_emotion",
    "respond",
    "warm_up",
]
