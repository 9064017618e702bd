"""How a reply is decoded: `Decoding` (the budget, the sampling, HF's repetition controls, the reply drawn
again) and `ReplySampling` (that draw), the settings chat, serve and eval share.

Why one object: the same seven settings used to be spelt out as keyword arguments on every path from the
command line to the decode (`chat.respond`, `chat.warm_up`, `turn.run_turn`, `Replier.warm_up`, the server's
options, `evaluate.evaluate`, `generate_predictions`, the CLI's eval options), each with its own copy of
the defaults, so a new setting meant seven signatures and a default could drift between chat and eval.
Here they are one frozen value with one set of defaults, checked once when it is built (a bad value is a
`ValueError` naming the field, before a model loads or a prompt is built); the command line builds it from
its flags (`cli._decoding_from_flags`). The low-level decoders (`serve.generation.generate`, `generate_ids`,
`generate_tokens`) keep their plain arguments: they are the public API, and this is read into them.

Pure data: nothing here imports jax, so the command line and eval can build one before anything heavy loads.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class ReplySampling:
    """Draw the reply, not the reasoning: after the greedy Chain of Empathy, each reply is generated again
    from the prompt + the greedy text through the step-5 header ("Finally, the response is:", found in token
    space: `reply_choice.reply_header_tokens`) with temperature + nucleus sampling. Why: greedy decoding
    returns the mode, and the mode of an empathetic reply is the same few sentences for every dialogue ("I'm
    sorry to hear that."); sampling the reply alone spreads the replies while the event, emotion, cause and
    goal steps, and every emotion figure, stay the greedy ones. A text without the header keeps its greedy
    reply. `candidates` > 1 draws that many replies per turn from one prefill and keeps their consensus
    (`reply_choice.consensus_index`); the decode then holds batch x candidates rows. The mechanism is
    `reply_choice.redraw_replies`."""

    temperature: float = 0.8
    top_p: float = 0.95
    seed: int = 0
    candidates: int = 1

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"reply sampling: temperature={self.temperature} must be > 0 (0 is greedy: "
                             "leave sampling off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"reply sampling: top_p={self.top_p} must be in (0, 1]")
        if not _is_int(self.seed):
            raise ValueError(f"reply sampling: seed={self.seed!r} must be an integer")
        if not _is_int(self.candidates) or self.candidates < 1:
            raise ValueError(f"reply sampling: candidates={self.candidates} must be an integer >= 1")


@dataclasses.dataclass(frozen=True)
class Decoding:
    """The settings of one decode (`chat.respond`, the eval's generation pass), defaults those of the
    command line's flags: greedy, a 160-token budget, no repetition control, the greedy reply.

    max_new_tokens: the generation budget (new tokens, the end token included). temperature: 0 is greedy,
    above it sampled with `top_p` (the nucleus, HF's semantics) and `seed`. repetition_penalty /
    no_repeat_ngram_size: HF's controls over the prompt and the reply (1.0 / 0 = off;
    `serve.generation.generate_tokens`). reply_sampling: draw the reply again after the greedy Chain of
    Empathy (`ReplySampling`), None for the greedy reply. Values are kept as given (not cast), so settings
    recorded from them (the eval journal's fingerprint) are those the caller gave."""

    max_new_tokens: int = 160
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    reply_sampling: ReplySampling | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"decoding: max_new_tokens={self.max_new_tokens!r} must be an integer >= 1")
        if not isinstance(self.temperature, numbers.Real) or not self.temperature >= 0:
            raise ValueError(f"decoding: temperature={self.temperature!r} must be >= 0 (0 = greedy)")
        if not isinstance(self.top_p, numbers.Real) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"decoding: top_p={self.top_p!r} must be in (0, 1]")
        if not _is_int(self.seed):
            raise ValueError(f"decoding: seed={self.seed!r} must be an integer")
        if not isinstance(self.repetition_penalty, numbers.Real) or not self.repetition_penalty > 0:
            raise ValueError(f"decoding: repetition_penalty={self.repetition_penalty!r} must be > 0 "
                             "(1.0 = no penalty)")
        if not _is_int(self.no_repeat_ngram_size) or self.no_repeat_ngram_size < 0:
            raise ValueError(f"decoding: no_repeat_ngram_size={self.no_repeat_ngram_size!r} must be an "
                             "integer >= 0 (0 = off)")
        if self.reply_sampling is not None and not isinstance(self.reply_sampling, ReplySampling):
            raise ValueError(f"decoding: reply_sampling={self.reply_sampling!r} must be a ReplySampling or "
                             "None (the greedy reply)")

    @property
    def greedy(self) -> bool:
        """Whether the decode itself is greedy (temperature 0); a drawn reply may still follow it."""
        return self.temperature == 0


__all__ = ["Decoding", "ReplySampling"]
