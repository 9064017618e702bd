"""Batched generation with a KV cache: one compiled prefill + decode-loop program per shape bucket.

Why it is shaped this way:
- The whole decode runs inside ONE `jax.jit` (`lax.while_loop` over steps, the KV cache a loop carry), so
  there is no per-token Python, no per-token host<->device traffic, and the cache is updated in place.
- Prompts are LEFT-padded, so every row's next token is written at the same cache slot; padding is masked
  through `KVCache.valid` and positions are `cumsum(mask) - 1`, hence a padded row decodes exactly as it
  would alone.
- The prompt length and the number of new tokens are rounded up to buckets (powers of two, at least
  `MIN_BUCKET`), and the loop stops early once every row has produced an end-of-sequence token, so a new
  prompt length rarely compiles a new program. Programs are cached per (graphdef, sampling mode, eos
  count); jax caches the shapes underneath.
- `temperature`/`top_p`/`repetition_penalty` are traced scalars: changing them never recompiles. Greedy
  (temperature 0) is its own program, with no nucleus filter; so is each `no_repeat_ngram_size`
  (the n-gram windows are shapes), and a penalty of 1.0 compiles a program without the penalty.
- The repetition controls follow transformers' logits processors (`RepetitionPenaltyLogitsProcessor`,
  `NoRepeatNGramLogitsProcessor`, applied before temperature and top-p, as HF orders them), so a
  setting means what it means in HF. The one difference: HF also counts a batch's left padding as
  "seen" tokens; here only the tokens a row attends to count, so a padded row decodes as it would alone.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from empatheia_jax.models.bf16_operands import with_float32_operands
from empatheia_jax.models.llama import KVCache, Llama

MIN_BUCKET = 16


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """The next power of two >= n (and >= minimum): the lengths programs are compiled for."""
    n = max(int(n), minimum, 1)
    return 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Generation:
    """What a decode produced, kept whole so later stages can re-read hidden states of the sequences.

    `sequences` = left-padded prompt columns followed by the generated columns; after a row's end token
    the generated columns hold `pad_token_id`. `attention_mask` marks the real prompt tokens and the
    generated tokens up to and including the end token, i.e. exactly what a forward pass should attend to.
    """

    sequences: np.ndarray  # [B, P + N] int32
    attention_mask: np.ndarray  # [B, P + N] bool
    prompt_length: int  # P: the prompt columns (including left padding)
    num_new: np.ndarray  # [B] generated tokens per row, end token included

    @property
    def new_tokens(self) -> np.ndarray:
        """[B, N] the generated ids (pad after each row's end token)."""
        return self.sequences[:, self.prompt_length:]

    @property
    def positions(self) -> np.ndarray:
        """[B, P + N] the RoPE positions the decode used (cumsum(mask) - 1, clipped at 0)."""
        return np.maximum(np.cumsum(self.attention_mask, axis=1) - 1, 0).astype(np.int32)


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int, length: int | None = None):
    """Left-pads ragged token lists to `length` (default: the bucket of the longest); returns (ids, mask)."""
    if not prompts:
        raise ValueError("no prompts given")
    longest = max(len(p) for p in prompts)
    if longest == 0:
        raise ValueError("every prompt must have at least one token")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: every prompt must have at least one token")
    length = bucket(longest) if length is None else length
    if length < longest:
        raise ValueError(f"length={length} is shorter than the longest prompt ({longest} tokens)")
    ids = np.full((len(prompts), length), pad_token_id, np.int32)
    mask = np.zeros((len(prompts), length), bool)
    for i, p in enumerate(prompts):
        if len(p):
            ids[i, length - len(p):] = np.asarray(p, np.int32)
            mask[i, length - len(p):] = True
    return ids, mask


# ----------------------------------------------------------------------------------------------------------
# The compiled program
# ----------------------------------------------------------------------------------------------------------


NUCLEUS_CANDIDATES = 512  # the top logits the nucleus is looked for among first (`_nucleus`)


def _nucleus(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """Masks logits [B, V] outside the smallest set of top tokens whose probability reaches top_p.

    A token is kept when the mass of the tokens ranked above it is < top_p, so the best token always stays
    (top_p -> 0 is greedy), as in HF's TopPLogitsWarper with min_tokens_to_keep=1.

    Why not one sort of the vocabulary: on XLA:CPU it costs ~0.7-1.3 s per decode step at 128 rows x 49,152
    (the consensus of 16 draws of a batch of 8), several times the model's own step, where `lax.top_k` of
    512 costs ~40 ms. So the nucleus is looked for among the top `NUCLEUS_CANDIDATES` logits, and the
    vocabulary is sorted only when some row's candidates hold less than top_p of its mass (a flat
    distribution; the kept set is then the same either way).
    """
    top, idx = jax.lax.top_k(logits, min(NUCLEUS_CANDIDATES, logits.shape[-1]))
    top_probs = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), idx, axis=-1)
    threshold = jax.lax.cond(jnp.all(jnp.sum(top_probs, axis=-1) >= top_p),
                             lambda: _nucleus_threshold(top, top_probs, top_p),
                             lambda: _sorted_nucleus_threshold(logits, top_p))
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def _sorted_nucleus_threshold(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """`_nucleus_threshold` over the whole vocabulary, sorted (the flat rows' path)."""
    sorted_desc = -jnp.sort(-logits, axis=-1)
    return _nucleus_threshold(sorted_desc, jax.nn.softmax(sorted_desc, axis=-1), top_p)


def _nucleus_threshold(sorted_desc: jax.Array, probs: jax.Array, top_p: jax.Array) -> jax.Array:
    """[B, 1]: the smallest logit kept, from logits sorted in descending order and their probabilities."""
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    n_keep = jnp.maximum(jnp.sum(mass_before < top_p, axis=-1), 1)
    return jnp.take_along_axis(sorted_desc, (n_keep - 1)[:, None], axis=-1)


def _seen_tokens(logits: jax.Array, seq: jax.Array, valid: jax.Array) -> jax.Array:
    """[B, V] bool: the tokens that occur among the attended columns of each row."""
    rows = jnp.arange(seq.shape[0])[:, None]
    return jnp.zeros(logits.shape, bool).at[rows, seq].max(valid)


def _penalize_repeats(logits: jax.Array, seen: jax.Array, penalty) -> jax.Array:
    """HF's repetition penalty: a seen token's logit is divided by `penalty` when positive, multiplied
    when negative (CTRL, Keskar et al. 2019); 1.0 leaves the logits as they are."""
    return jnp.where(seen, jnp.where(logits < 0, logits * penalty, logits / penalty), logits)


def _ban_repeated_ngrams(logits: jax.Array, seq: jax.Array, valid: jax.Array, length, n: int) -> jax.Array:
    """HF's no_repeat_ngram_size: a token that would complete an n-gram already in the row's first
    `length` columns is banned. Windows that touch an unattended column (left padding) never match."""
    b, t = seq.shape
    if t < n:
        return logits
    starts = t - n + 1
    windows = jnp.stack([seq[:, k:k + starts] for k in range(n)], axis=-1)  # [B, starts, n]
    window_ok = jnp.stack([valid[:, k:k + starts] for k in range(n)], axis=-1).all(-1)
    prefix = jax.lax.dynamic_slice_in_dim(seq, length - (n - 1), n - 1, axis=1)  # the last n-1 tokens
    same = jnp.all(windows[:, :, : n - 1] == prefix[:, None, :], axis=-1)
    complete = jnp.arange(starts) + n - 1 < length  # the window's last token is already written
    banned = same & window_ok & complete[None, :] & (length >= n - 1)
    rows = jnp.arange(b)[:, None]
    mask = jnp.zeros(logits.shape, bool).at[rows, windows[:, :, -1]].max(banned)
    return jnp.where(mask, -jnp.inf, logits)


def _process(logits, seq, valid, length, repetition_penalty, no_repeat_ngram_size: int) -> jax.Array:
    """The repetition controls over the columns written so far (`seq[:, :length]`, `valid` marks them).

    A `repetition_penalty` of None (not merely 1.0) leaves the penalty out of the program: the default
    decode pays nothing for it."""
    valid = valid & (jnp.arange(seq.shape[1]) < length)[None, :]
    if repetition_penalty is not None:
        logits = _penalize_repeats(logits, _seen_tokens(logits, seq, valid), repetition_penalty)
    if no_repeat_ngram_size > 0:
        logits = _ban_repeated_ngrams(logits, seq, valid, length, no_repeat_ngram_size)
    return logits


def _select(logits: jax.Array, key: jax.Array, temperature, top_p, do_sample: bool) -> jax.Array:
    if not do_sample:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    logits = jax.lax.cond(top_p < 1.0, _nucleus, lambda x, _: x, logits, top_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _prefill(model: Llama, input_ids, attention_mask, inputs_embeds, max_len: int):
    """Runs left-padded prompts into a fresh cache of `max_len` slots: (hidden [B, P, D], cache)."""
    cache = KVCache.init(model.config, input_ids.shape[0], max_len)
    positions = jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=1) - 1, 0)
    x = model.embed(input_ids) if inputs_embeds is None else inputs_embeds
    return model.decode(x, positions=positions, attention_mask=attention_mask, cache=cache)


def _repeat_rows(tree: Any, k: int) -> Any:
    """Every batched array of `tree` with each row repeated k times (row b * k + j), scalars as they are: one
    prefill's cache shared by k continuations."""
    return jax.tree.map(lambda a: jnp.repeat(a, k, axis=0) if a.ndim else a, tree)


@with_float32_operands
def _program(graphdef, state, input_ids, attention_mask, inputs_embeds, max_new_tokens, temperature, top_p,
             repetition_penalty, key, eos_ids, pad_token_id, *, new_bucket: int, do_sample: bool,
             penalize: bool, no_repeat_ngram_size: int, num_samples: int = 1):
    """Prefill the left-padded prompt, then decode up to `max_new_tokens` (<= new_bucket) in a while_loop.

    The repetition controls read `seq`/`valid`: the prompt columns followed by the tokens written so far.
    `num_samples` > 1 prefills each prompt once and repeats its cache: row b * num_samples + j decodes the
    j-th sample of prompt b.
    """
    model: Llama = nnx.merge(graphdef, state)
    b, p = input_ids.shape
    hidden, cache = _prefill(model, input_ids, attention_mask, inputs_embeds, p + new_bucket)
    hidden = hidden[:, -1:]
    if num_samples > 1:
        hidden, cache, input_ids, attention_mask = _repeat_rows(
            (hidden, cache, input_ids, attention_mask), num_samples)
        b *= num_samples
    seq = jnp.concatenate([input_ids, jnp.full((b, new_bucket), pad_token_id, jnp.int32)], axis=1)
    valid = jnp.concatenate([attention_mask, jnp.ones((b, new_bucket), bool)], axis=1)

    def pick(logits, seq, step, key):
        logits = _process(logits, seq, valid, p + step, repetition_penalty if penalize else None,
                          no_repeat_ngram_size)
        return _select(logits, key, temperature, top_p, do_sample)

    first = pick(model.logits(hidden)[:, 0], seq, 0, jax.random.fold_in(key, 0))
    next_position = jnp.sum(attention_mask, axis=1, dtype=jnp.int32)  # position of the first new token

    def is_eos(tok):
        return jnp.any(tok[:, None] == eos_ids[None, :], axis=-1)

    seq = seq.at[:, p].set(first)
    ones = jnp.ones((b, 1), bool)

    def cond(carry):
        step, _, done, _, _ = carry
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        step, last, done, cache, seq = carry
        pos = (next_position + step - 1)[:, None]
        logits, cache = model(last[:, None], positions=pos, attention_mask=ones, cache=cache)
        tok = pick(logits[:, 0], seq, step, jax.random.fold_in(key, step))
        tok = jnp.where(done, pad_token_id, tok)
        seq = jax.lax.dynamic_update_slice(seq, tok[:, None], (0, p + step))
        return step + 1, tok, done | is_eos(tok), cache, seq

    carry = (jnp.ones((), jnp.int32), first, is_eos(first), cache, seq)
    steps, _, _, _, seq = jax.lax.while_loop(cond, body, carry)
    tokens = seq[:, p:]
    # Tokens up to and including each row's first end token (or all `steps` when it never ended).
    hit = is_eos(tokens.reshape(-1)).reshape(b, new_bucket) & (jnp.arange(new_bucket) < steps)
    first_eos = jnp.where(jnp.any(hit, axis=1), jnp.argmax(hit, axis=1) + 1, steps)
    return tokens, steps, first_eos.astype(jnp.int32)


_PROGRAMS: dict[tuple, Any] = {}
_LOCK = threading.Lock()

# Flush denormals to zero on CPU. SiLU of a very negative gate underflows to denormals, which then enter
# the down-projection matmul; denormal arithmetic is slow on x86 and made batch-8 decode ~35% slower
# (measured on SmolLM2). Values below 1.2e-38 do not change any logit we can observe.
_CPU_COMPILER_OPTIONS = {"xla_cpu_ftz": True}


def _compiled(graphdef, new_bucket: int, do_sample: bool, penalize: bool = False,
              no_repeat_ngram_size: int = 0, num_samples: int = 1):
    key = (graphdef, new_bucket, do_sample, penalize, no_repeat_ngram_size, num_samples)
    with _LOCK:
        fn = _PROGRAMS.get(key)
        if fn is None:
            def run(*args):
                return _program(graphdef, *args, new_bucket=new_bucket, do_sample=do_sample,
                                penalize=penalize, no_repeat_ngram_size=no_repeat_ngram_size,
                                num_samples=num_samples)

            options = _CPU_COMPILER_OPTIONS if jax.default_backend() == "cpu" else None
            fn = _PROGRAMS[key] = jax.jit(run, compiler_options=options)
    return fn


# ----------------------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------------------


def eos_token_ids(model: Llama, tokenizer: Any = None) -> tuple[int, ...]:
    """End tokens: the config's eos_token_id (int or tuple) plus the tokenizer's, deduplicated."""
    ids: list[int] = []
    eos = model.config.eos_token_id
    for e in (eos if isinstance(eos, tuple | list) else (eos,)):
        if e is not None and int(e) not in ids:
            ids.append(int(e))
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if tok_eos is not None and int(tok_eos) not in ids:
        ids.append(int(tok_eos))
    return tuple(ids)


def generate_tokens(
    model: Llama,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    *,
    seed: int = 0,
    eos_ids: Sequence[int] = (),
    pad_token_id: int | None = None,
    inputs_embeds: jax.Array | None = None,
    repetition_penalty: float = 1.0,
    no_repeat_ngram_size: int = 0,
    num_samples: int = 1,
) -> Generation:
    """Generates from token-id prompts; returns the whole `Generation` (prompt + new tokens + mask).

    `inputs_embeds` [B, P, D], aligned with `left_pad(prompts, pad, bucket(longest))`, replaces the token
    embeddings of the prompt (how Empatheia splices encoder features into `<Aud>`/`<Vid>` slots).
    `repetition_penalty` (> 0, 1 = off) and `no_repeat_ngram_size` (0 = off) have HF's meaning and count
    the prompt as HF does for a decoder-only model.
    `num_samples` continuations per prompt (HF's num_return_sequences) share one prefill: the result has
    len(prompts) * num_samples rows, row b * num_samples + j the j-th of prompt b, and draws exactly what
    the prompts repeated num_samples times in the batch would.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    if not repetition_penalty > 0:
        raise ValueError(f"repetition_penalty={repetition_penalty} must be > 0 (1.0 = no penalty)")
    if no_repeat_ngram_size < 0:
        raise ValueError(f"no_repeat_ngram_size={no_repeat_ngram_size} must be >= 0 (0 = off)")
    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples} must be >= 1")
    eos_ids = tuple(int(e) for e in eos_ids) or (-1,)  # -1: no end token, never produced
    if pad_token_id is None:
        pad_token_id = eos_ids[0] if eos_ids[0] >= 0 else 0
    ids, mask = left_pad(prompts, pad_token_id)
    if inputs_embeds is not None and tuple(inputs_embeds.shape[:2]) != ids.shape:
        raise ValueError(f"inputs_embeds has shape {tuple(inputs_embeds.shape)}, expected {ids.shape} + (D,)")
    new_bucket = bucket(max_new_tokens)
    do_sample = temperature > 0
    graphdef, state = nnx.split(model)
    fn = _compiled(graphdef, new_bucket, do_sample, repetition_penalty != 1.0, int(no_repeat_ngram_size),
                   int(num_samples))
    tokens, steps, lengths = fn(
        state, jnp.asarray(ids), jnp.asarray(mask), inputs_embeds,
        jnp.int32(max_new_tokens), jnp.float32(max(temperature, 1e-6)), jnp.float32(top_p),
        jnp.float32(repetition_penalty), jax.random.key(seed), jnp.asarray(eos_ids, jnp.int32),
        jnp.int32(pad_token_id),
    )
    steps = int(steps)
    new = np.asarray(tokens)[:, :steps]
    lengths = np.asarray(lengths)
    gen_mask = np.arange(steps)[None, :] < lengths[:, None]
    ids, mask = np.repeat(ids, num_samples, axis=0), np.repeat(mask, num_samples, axis=0)
    return Generation(
        sequences=np.concatenate([ids, new], axis=1),
        attention_mask=np.concatenate([mask, gen_mask], axis=1),
        prompt_length=ids.shape[1],
        num_new=lengths,
    )


@with_float32_operands
def _score_program(graphdef, state, prefix_ids, prefix_mask, inputs_embeds, cont_ids, cont_mask):
    """log P(continuation k | prefix b) for every pair: [B, K].

    One prefill per prefix writes the KV cache; the cache is then repeated K times and all continuations are
    read teacher-forced in one call, so a prefix is never run K times.
    """
    model: Llama = nnx.merge(graphdef, state)
    b, p = prefix_ids.shape
    k, c = cont_ids.shape
    hidden, cache = _prefill(model, prefix_ids, prefix_mask, inputs_embeds, p + c)
    first = jax.nn.log_softmax(model.logits(hidden[:, -1:])[:, 0], axis=-1)[:, cont_ids[:, 0]]  # [B, K]
    if c == 1:
        return first
    rows = _repeat_rows(cache, k)  # row b*K + j
    tokens = jnp.tile(cont_ids[:, :-1], (b, 1))  # [B*K, C-1]: each continuation but its last token
    start = jnp.repeat(jnp.sum(prefix_mask, axis=1, dtype=jnp.int32), k)[:, None]
    logits, _ = model(tokens, positions=start + jnp.arange(c - 1, dtype=jnp.int32),
                      attention_mask=jnp.ones_like(tokens, bool), cache=rows)
    logp = jax.nn.log_softmax(logits, axis=-1)
    targets = jnp.tile(cont_ids[:, 1:], (b, 1))
    rest = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0] * jnp.tile(cont_mask[:, 1:], (b, 1))
    return first + rest.sum(-1).reshape(b, k)


_SCORERS: dict[Any, Any] = {}


def score_continuations(
    model: Llama,
    prefixes: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    *,
    pad_token_id: int = 0,
    inputs_embeds: jax.Array | None = None,
) -> np.ndarray:
    """Log-likelihood of each continuation after each prefix, [len(prefixes), len(continuations)] float32.

    Rank classification (choosing among fixed answers by likelihood, e.g. the 32 ED emotion labels after
    the CoE's step-2 header) without running a prefix once per answer. Prefixes are left-padded to a
    bucket like `generate_tokens` prompts (`inputs_embeds` aligned with them replaces their embeddings);
    continuations are right-padded and only their own tokens are summed. The cache is repeated once per
    continuation, so memory grows with len(prefixes) x len(continuations): callers batch a few prefixes
    (SmolLM2-135M, 2 prefixes x 32 labels at 512 slots: ~1.5 GB of float32 cache; a 7B model would need
    the labels in chunks over one prefill, which is not written yet).
    """
    if not continuations or any(len(c) == 0 for c in continuations):
        raise ValueError("every continuation needs at least one token")
    ids, mask = left_pad(prefixes, pad_token_id)
    if inputs_embeds is not None and tuple(inputs_embeds.shape[:2]) != ids.shape:
        raise ValueError(f"inputs_embeds has shape {tuple(inputs_embeds.shape)}, expected {ids.shape} + (D,)")
    width = max(len(c) for c in continuations)
    cont = np.full((len(continuations), width), pad_token_id, np.int32)
    cont_mask = np.zeros((len(continuations), width), np.float32)
    for j, c in enumerate(continuations):
        cont[j, : len(c)] = c
        cont_mask[j, : len(c)] = 1.0
    graphdef, state = nnx.split(model)
    with _LOCK:
        fn = _SCORERS.get(graphdef)
        if fn is None:
            options = _CPU_COMPILER_OPTIONS if jax.default_backend() == "cpu" else None
            fn = _SCORERS[graphdef] = jax.jit(partial(_score_program, graphdef), compiler_options=options)
    return np.asarray(fn(state, jnp.asarray(ids), jnp.asarray(mask), inputs_embeds, jnp.asarray(cont),
                         jnp.asarray(cont_mask)))


@with_float32_operands
def _summary_program(graphdef, state, ids, mask, inputs_embeds):
    """[B, 2D]: the final hidden state at each prompt's last token beside its mean over the prompt."""
    model: Llama = nnx.merge(graphdef, state)
    positions = jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)
    x = model.embed(ids) if inputs_embeds is None else inputs_embeds
    hidden, _ = model.decode(x, positions=positions, attention_mask=mask)
    hidden = hidden.astype(jnp.float32)
    weights = mask.astype(jnp.float32)[..., None]
    mean = jnp.sum(hidden * weights, axis=1) / jnp.maximum(jnp.sum(weights, axis=1), 1.0)
    return jnp.concatenate([hidden[:, -1], mean], axis=-1)


_SUMMARIZERS: dict[Any, Any] = {}


def prompt_summaries(
    model: Llama,
    prompts: Sequence[Sequence[int]],
    *,
    pad_token_id: int = 0,
    inputs_embeds: jax.Array | None = None,
) -> np.ndarray:
    """How the model reads each prompt, [len(prompts), 2 * hidden] float32: the final-normed hidden state at
    its last token (where a causal model has read all of it, and where the reply starts) beside the mean over
    its tokens. Features for a probe over the dialogue (`eval.emotion_head`), read with the positions and
    padding `generate_tokens` uses, so a padded row reads as it would alone."""
    ids, mask = left_pad(prompts, pad_token_id)
    if inputs_embeds is not None and tuple(inputs_embeds.shape[:2]) != ids.shape:
        raise ValueError(f"inputs_embeds has shape {tuple(inputs_embeds.shape)}, expected {ids.shape} + (D,)")
    graphdef, state = nnx.split(model)
    with _LOCK:
        fn = _SUMMARIZERS.get(graphdef)
        if fn is None:
            options = _CPU_COMPILER_OPTIONS if jax.default_backend() == "cpu" else None
            fn = jax.jit(partial(_summary_program, graphdef), compiler_options=options)
            _SUMMARIZERS[graphdef] = fn
    return np.asarray(fn(state, jnp.asarray(ids), jnp.asarray(mask), inputs_embeds))


def _encode(tokenizer: Any, prompts: Sequence[str]) -> list[list[int]]:
    if isinstance(prompts, str):
        raise TypeError("prompts must be a list of strings, not one string")
    # Prompts are already templated: the template put any special tokens in, so add none here.
    return [list(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]


def _pad_id(tokenizer: Any, eos: tuple[int, ...]) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad) if pad is not None else (eos[0] if eos else 0)


def generate_ids(
    model: Llama,
    tokenizer: Any,
    prompts: Sequence[str],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    *,
    seed: int = 0,
    repetition_penalty: float = 1.0,
    no_repeat_ngram_size: int = 0,
) -> np.ndarray:
    """New token ids [B, N] for already-templated prompts; after a row's end token the ids are the pad id.

    N is the number of decode steps actually run (<= max_new_tokens; fewer when every row ended early).
    """
    eos = eos_token_ids(model, tokenizer)
    out = generate_tokens(model, _encode(tokenizer, prompts), max_new_tokens, temperature, top_p, seed=seed,
                          eos_ids=eos, pad_token_id=_pad_id(tokenizer, eos),
                          repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size)
    return out.new_tokens


def generate(
    model: Llama,
    tokenizer: Any,
    prompts: list[str],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    *,
    seed: int = 0,
    repetition_penalty: float = 1.0,
    no_repeat_ngram_size: int = 0,
) -> list[str]:
    """Replies to already-templated prompts (batched, left-padded); greedy at temperature 0, else
    temperature + nucleus sampling seeded by `seed`, with HF's repetition controls (see `generate_tokens`).
    Returns the new text without special tokens."""
    eos = eos_token_ids(model, tokenizer)
    out = generate_tokens(model, _encode(tokenizer, prompts), max_new_tokens, temperature, top_p, seed=seed,
                          eos_ids=eos, pad_token_id=_pad_id(tokenizer, eos),
                          repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size)
    new = out.new_tokens
    return [
        tokenizer.decode(new[i, : out.num_new[i]].tolist(), skip_special_tokens=True) for i in range(len(new))
    ]
