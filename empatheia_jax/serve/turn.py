"""One turn of a conversation with a loaded model: the reply (CoE, emotion, features) and, when asked, its
speech and its avatar video. The per-turn code behind both `empatheia chat` and `empatheia serve`.

`Replier` is what a turn needs from a checkpoint besides the model: the encoder of its training shards
(features must be computed as training computed them, so a checkpoint without that entry is refused), the
target sources its speech/video heads were trained on (which generators can read them), and the prompt
budget (config.data.max_len). `run_turn` calls `chat.respond`, writes OUT.npz/OUT.json
(`outputs.write_outputs`), then speaks the reply with Kokoro (`avatar.synthesize_reply`) and draws the face
(`avatar.render_avatar`), the listener avatar pinned when one is given, timing each part.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from empatheia_jax.data.targets import STAND_IN
from empatheia_jax.serve import avatar, chat, outputs
from empatheia_jax.serve.decoding import Decoding
from empatheia_jax.serve.history import ChatInputError
from empatheia_jax.serve.prompt import EncoderManifestError, PromptTooLongError, encoder_from_manifest
from empatheia_jax.train.checkpoint import CheckpointError

RENDERS = ("text", "speech", "avatar")  # what a turn produces: the reply only, + its speech, + the video


@dataclasses.dataclass
class Replier:
    """A loaded model and what its checkpoint says about how to talk with it."""

    model: Any
    tokenizer: Any
    max_len: int  # the training prompt budget (config.data.max_len)
    encoder: Any
    speech_targets: str = STAND_IN
    video_targets: str = STAND_IN
    where: str = "the checkpoint"
    compiler_options: Mapping[str, Any] | None = None

    def check_can_render(self, render: str) -> None:
        """Refuses, before any reply is generated, a render this checkpoint's targets cannot give."""
        if render not in RENDERS:
            raise ValueError(f"render {render!r}: expected one of {', '.join(RENDERS)}")
        if render != "text":
            avatar.check_can_speak(self.speech_targets, self.video_targets, self.where,
                                   video=avatar.VIDEO_GENERATOR if render == "avatar" else None)

    def warm_up(self, decoding: Decoding = Decoding(), *, progress: Any = None) -> list[int]:
        """`chat.warm_up` over this model's prompt budget, with the `decoding` `run_turn` will be given: a
        server compiles once at start, and no user's turn waits for a compile."""
        return chat.warm_up(self.model, self.tokenizer, max_len=self.max_len, decoding=decoding,
                            encoder=self.encoder, speech_targets=self.speech_targets,
                            compiler_options=self.compiler_options, progress=progress)


def replier_from_loaded(model: Any, tokenizer: Any, config: Any, meta: Mapping[str, Any], where: str,
                        compiler_options: Mapping[str, Any] | None = None) -> Replier:
    """The `Replier` of `serve.load.load_trained`'s (model, tokenizer, config, meta); `where` names the
    checkpoint in errors (`CheckpointError`)."""
    if not meta.get("encoder"):
        raise CheckpointError(f"{where}: its meta has no 'encoder' entry (the encoder of its training "
                              "shards), so chat cannot compute speech/video features the way training did")
    try:
        encoder = encoder_from_manifest(meta["encoder"])
    except EncoderManifestError as e:
        raise CheckpointError(f"{where}: {e}") from e
    targets = meta.get("targets") or {}
    return Replier(model=model, tokenizer=tokenizer, max_len=int(config.data.max_len), encoder=encoder,
                   speech_targets=targets.get("speech_content", {}).get("source", STAND_IN),
                   video_targets=targets.get("video_content", {}).get("source", STAND_IN), where=where,
                   compiler_options=compiler_options)


@dataclasses.dataclass
class Turn:
    """What `run_turn` produced: the reply, its files (None where not rendered), notes of each part, and
    the seconds each part took (decode: features + prompt + generation + heads; speech; video)."""

    result: chat.ChatResult
    npz: Path
    json: Path
    wav: Path | None = None
    speech_seconds: float = 0.0
    mp4: Path | None = None
    frames: int = 0
    speech_notes: list[str] = dataclasses.field(default_factory=list)
    video_notes: list[str] = dataclasses.field(default_factory=list)
    heard: dict[str, Any] | None = None
    speaker_text: str = ""  # the latest utterance as the model read it (its transcript when only audio)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)



def run_turn(
    replier: Replier,
    *,
    text: str,
    out: str | os.PathLike,
    audio: str | os.PathLike | None = None,
    video: str | os.PathLike | None = None,
    history: Sequence[Mapping[str, Any]] | None = None,
    render: str = "text",
    listener: Mapping[str, str] | None = None,
    hear: bool = False,
    decoding: Decoding = Decoding(),
    text_name: str = "--text",
    written: str | None = None,
) -> Turn:
    """One reply to `text` (with its optional `audio` .wav / `video` .mp4) after `history`, written to
    OUT.npz/OUT.json; `render` "speech" adds OUT.wav (Kokoro), "avatar" also OUT.mp4 (the face with that
    speech); `hear` has Whisper tiny.en transcribe the speech into OUT.json (`outputs.hear_reply`).
    `decoding` (`serve.decoding.Decoding`: the budget, sampling, repetition controls, a reply drawn after the
    greedy CoE) is `chat.respond`'s; `written` (a CoE text) is read instead of generated (`chat.respond`).

    The prompt gets the training budget and the reply (with its signal tokens) comes on top of it; a latest
    utterance that alone does not fit is a `ChatInputError` naming `text_name` and the limit.
    """
    replier.check_can_render(render)
    model = replier.model
    t0 = time.perf_counter()
    try:
        result = chat.respond(
            model, replier.tokenizer, text=text or "", audio=audio, video=video, history=history,
            encoder=replier.encoder, decoding=decoding,
            max_len=replier.max_len + decoding.max_new_tokens + 2 * model.config.n_signal + 2,
            speech_targets=replier.speech_targets, video_targets=replier.video_targets,
            compiler_options=replier.compiler_options, listener=listener, written=written,
        )
    except PromptTooLongError as e:
        raise ChatInputError(
            f"{text_name}: the latest utterance makes a {e.prompt_tokens}-token prompt, more than the "
            f"{replier.max_len} tokens the model was trained with (config.data.max_len)"
        ) from e
    npz, js = outputs.write_outputs(result, out)
    turn = Turn(result=result, npz=npz, json=js, timings={"decode": time.perf_counter() - t0})
    latest = len(history or [])
    heard = [t["transcript"] for t in result.input_transcripts if t["utterance_index"] == latest]
    turn.speaker_text = heard[0] if heard else (text or "")
    if render == "text":
        return turn
    listener = dict(listener) if listener is not None else None
    if listener is not None:
        outputs.update_outputs(js, {"listener": listener})
    t0 = time.perf_counter()
    turn.wav, turn.speech_seconds, turn.speech_notes = avatar.synthesize_reply(npz, npz.with_suffix(".wav"),
                                                                               listener=listener)
    turn.timings["speech"] = time.perf_counter() - t0
    if hear:
        turn.heard = outputs.hear_reply(js, turn.wav)
    if render == "avatar":
        t0 = time.perf_counter()
        turn.mp4, turn.frames, turn.video_notes = avatar.render_avatar(npz, turn.wav, npz.with_suffix(".mp4"),
                                                                       listener=listener)
        turn.timings["video"] = time.perf_counter() - t0
    return turn


__all__ = ["RENDERS", "Replier", "Turn", "replier_from_loaded", "run_turn"]
