"""KV-cache decoding and `generate`: exact against the full forward pass and against HF `generate`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import tiny_hf_model, tiny_tokenizer

import empatheia_jax
from empatheia_jax.models.llama import KVCache
from empatheia_jax.serve import generation
from empatheia_jax.serve.generation import bucket, generate_tokens, left_pad
from empatheia_jax.weights.hf_to_flax import load_hf_model_into_flax

EOS = 2


@pytest.fixture(autouse=True)
def _exact_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="module")
def pair():
    """(HF model, our model with the same weights): tiny, GQA, untied."""
    hf = tiny_hf_model(seed=1)
    return hf, load_hf_model_into_flax(hf)


def _prompts(lengths, vocab=128, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


def test_bucket():
    assert [bucket(n) for n in (1, 16, 17, 64, 65, 1000)] == [16, 16, 32, 64, 128, 1024]


def _jitted(model):
    """model(ids, **kw) under jax.jit (eager op-by-op dispatch would dominate these tests' time)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def call(state, ids, kw):
        return nnx.merge(graphdef, state)(ids, **kw)

    return lambda ids, **kw: call(state, ids, kw)


def test_kv_cache_steps_equal_full_forward(pair):
    _, model = pair
    fwd = _jitted(model)
    ids = jnp.asarray(_prompts([20, 20], seed=1))
    full = np.asarray(fwd(ids))
    prefill = 7
    logits, cache = fwd(ids[:, :prefill], cache=KVCache.init(model.config, 2, 32))
    steps = [np.asarray(logits)]
    for t in range(prefill, ids.shape[1]):
        logits, cache = fwd(ids[:, t:t + 1], positions=jnp.full((2, 1), t), cache=cache)
        steps.append(np.asarray(logits))
    assert int(cache.index) == 20 and bool(cache.valid[:, :20].all()) and not bool(cache.valid[:, 20:].any())
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5, rtol=0)


def test_left_padded_cache_equals_unpadded(pair):
    """A left-padded row, positions cumsum(mask)-1, gives the logits of the same prompt alone."""
    _, model = pair
    fwd = _jitted(model)
    prompts = _prompts([5, 11], seed=2)
    ids, mask = left_pad(prompts, pad_token_id=0)
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    padded, _ = fwd(jnp.asarray(ids), positions=jnp.asarray(positions), attention_mask=jnp.asarray(mask),
                    cache=KVCache.init(model.config, 2, ids.shape[1]))
    for row, p in enumerate(prompts):
        alone = np.asarray(fwd(jnp.asarray([p])))[0]
        np.testing.assert_allclose(np.asarray(padded)[row, -len(p):], alone, atol=1e-5, rtol=0)


def _hf_generate(hf, prompts, max_new, eos=EOS, **controls):
    ids, mask = left_pad(prompts, pad_token_id=0, length=max(map(len, prompts)))
    with torch.no_grad():
        out = hf.generate(torch.from_numpy(ids.astype(np.int64)), attention_mask=torch.from_numpy(mask.astype(
            np.int64)), max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=0, **controls)
    return out[:, ids.shape[1]:].numpy()


def _has_repeated_ngram(tokens, n: int) -> bool:
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(grams) != len(set(grams))


@pytest.mark.parametrize("controls", [dict(repetition_penalty=1.6), dict(no_repeat_ngram_size=2),
                                      dict(repetition_penalty=0.7, no_repeat_ngram_size=3)])
def test_repetition_controls_equal_hf_generate(pair, controls):
    """Greedy decoding under HF's repetition controls gives HF's tokens (the prompt counts, as in HF)."""
    hf, model = pair
    prompts = _prompts([5, 12], seed=5)
    for p in prompts:
        plain = _hf_generate(hf, [p], 40, eos=None)[0]
        expected = _hf_generate(hf, [p], 40, eos=None, **controls)[0]
        assert not np.array_equal(plain, expected), "the controls must change this decode to be tested"
        ours = generate_tokens(model, [p], 40, eos_ids=[], pad_token_id=0, **controls)
        np.testing.assert_array_equal(ours.new_tokens[0], expected)
        if controls.get("no_repeat_ngram_size"):
            n = controls["no_repeat_ngram_size"]
            assert _has_repeated_ngram(list(plain), n)
            assert not _has_repeated_ngram(list(p) + ours.new_tokens[0].tolist(), n)
    # Left padding is not "seen": a padded row decodes as it would alone.
    batch = generate_tokens(model, prompts, 40, eos_ids=[], pad_token_id=0, **controls)
    for i, p in enumerate(prompts):
        alone = generate_tokens(model, [p], 40, eos_ids=[], pad_token_id=0, **controls)
        np.testing.assert_array_equal(batch.new_tokens[i], alone.new_tokens[0])


def test_repetition_processors_equal_hf_logits_processors():
    """The in-jit processors on random logits and sequences equal transformers' processors, with the
    penalty applied before the n-gram ban as HF orders them (negative logits included)."""
    from transformers import NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(0)
    seq = rng.integers(0, 6, (4, 30)).astype(np.int32)  # a small alphabet: many repeated n-grams
    logits = rng.normal(size=(4, 12)).astype(np.float32)
    for length in (1, 2, 3, 17, 30):
        for penalty, n in ((1.3, 0), (1.0, 2), (0.8, 3), (2.0, 4)):
            ids = torch.from_numpy(seq[:, :length].astype(np.int64))
            want = RepetitionPenaltyLogitsProcessor(penalty)(ids, torch.from_numpy(logits.copy()))
            if n:
                want = NoRepeatNGramLogitsProcessor(n)(ids, want)
            got = generation._process(jnp.asarray(logits), jnp.asarray(seq), jnp.ones(seq.shape, bool),
                                      jnp.int32(length), jnp.float32(penalty), n)
            np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-6, err_msg=f"{length=} {n=}")


def test_greedy_equals_hf_generate(pair):
    hf, model = pair
    prompts = _prompts([6, 13, 9], seed=3)
    # Pick as end token one that the first row produces mid-way, so early stopping is exercised.
    free = _hf_generate(hf, prompts[:1], 24, eos=None)[0]
    eos = int(free[5])
    expected = _hf_generate(hf, prompts, 24, eos=eos)
    ours = generate_tokens(model, prompts, 24, eos_ids=[eos], pad_token_id=0)
    assert ours.new_tokens.shape == expected.shape
    np.testing.assert_array_equal(ours.new_tokens, expected)
    first_eos = list(free).index(eos)
    assert ours.num_new[0] == first_eos + 1 and (ours.new_tokens[0, first_eos + 1:] == 0).all()
    # The sequence + mask are what a later forward pass over the generation needs.
    assert ours.sequences.shape[1] == ours.prompt_length + ours.new_tokens.shape[1]
    assert ours.attention_mask[0].sum() == len(prompts[0]) + ours.num_new[0]


def test_batch_equals_each_prompt_alone(pair):
    _, model = pair
    prompts = _prompts([3, 17, 8, 30], seed=4)
    batch = generate_tokens(model, prompts, 20, eos_ids=[EOS], pad_token_id=0)
    for i, p in enumerate(prompts):
        alone = generate_tokens(model, [p], 20, eos_ids=[EOS], pad_token_id=0)
        n = alone.num_new[0]
        assert batch.num_new[i] == n
        np.testing.assert_array_equal(batch.new_tokens[i, :n], alone.new_tokens[0, :n])


def test_inputs_embeds_replace_the_prompt_embeddings(pair):
    """Empatheia splices encoder features into the prompt embeddings; the token path must agree."""
    _, model = pair
    prompts = _prompts([4, 9], seed=7)
    ids, _ = left_pad(prompts, pad_token_id=0)
    by_ids = generate_tokens(model, prompts, 8, eos_ids=[], pad_token_id=0)
    by_embeds = generate_tokens(model, prompts, 8, eos_ids=[], pad_token_id=0,
                                inputs_embeds=model.embed(jnp.asarray(ids)))
    np.testing.assert_array_equal(by_embeds.new_tokens, by_ids.new_tokens)
    shifted = generate_tokens(model, prompts, 8, eos_ids=[], pad_token_id=0,
                              inputs_embeds=model.embed(jnp.asarray(ids)) * 3.0)
    assert (shifted.new_tokens != by_ids.new_tokens).any()
    with pytest.raises(ValueError, match="inputs_embeds has shape"):
        generate_tokens(model, prompts, 8, inputs_embeds=jnp.zeros((2, 5, 32)))


def test_score_continuations_equals_hf_log_likelihoods(pair):
    """Rank classification: log P(continuation | prefix) from one cached prefill per prefix equals the sum of
    HF's log-softmax over each concatenated sequence run alone (ragged prefixes and continuations)."""
    hf, model = pair
    prefixes = _prompts([5, 12, 9], seed=3)
    continuations = _prompts([1, 3, 2, 4], seed=4)
    got = generation.score_continuations(model, prefixes, continuations, pad_token_id=0)
    want = np.zeros((len(prefixes), len(continuations)))
    for b, p in enumerate(prefixes):
        for k, c in enumerate(continuations):
            with torch.no_grad():
                logits = hf(torch.tensor([p + c])).logits[0].double()
            logp = torch.log_softmax(logits, -1)
            want[b, k] = sum(float(logp[len(p) - 1 + i, t]) for i, t in enumerate(c))
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)
    assert len({int(np.argmax(r)) for r in want}) > 1 or np.ptp(want) > 0.1  # the scores discriminate
    # inputs_embeds aligned with the padded prefixes give the same scores as the token ids
    ids, _ = left_pad(prefixes, 0)
    embeds = model.embed(jnp.asarray(ids))
    via_embeds = generation.score_continuations(model, prefixes, continuations, inputs_embeds=embeds)
    np.testing.assert_allclose(via_embeds, got, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="at least one token"):
        generation.score_continuations(model, prefixes, [[5], []])


def test_prompt_summaries_are_hfs_last_and_mean_hidden_states(pair):
    """The emotion head's features: HF's final-normed hidden state at each prompt's last token, and its mean
    over the prompt, each prompt run alone; ragged prompts left-padded together read as they would alone."""
    hf, model = pair
    prompts = _prompts([5, 12, 9], seed=6)
    got = generation.prompt_summaries(model, prompts, pad_token_id=0)
    d = model.config.hidden_size
    assert got.shape == (3, 2 * d) and got.dtype == np.float32
    for b, p in enumerate(prompts):
        with torch.no_grad():
            h = hf.model(torch.tensor([p])).last_hidden_state[0].double().numpy()
        np.testing.assert_allclose(got[b, :d], h[-1], atol=2e-4, rtol=0)
        np.testing.assert_allclose(got[b, d:], h.mean(0), atol=2e-4, rtol=0)
    assert np.abs(got[:, :d] - got[:, d:]).max() > 1e-2  # the two halves are different readings
    ids, _ = left_pad(prompts, 0)
    via_embeds = generation.prompt_summaries(model, prompts, inputs_embeds=model.embed(jnp.asarray(ids)))
    np.testing.assert_allclose(via_embeds, got, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="inputs_embeds has shape"):
        generation.prompt_summaries(model, prompts, inputs_embeds=jnp.zeros((3, 5, d)))


def test_sampling_seeded_temperature_and_top_p(pair):
    _, model = pair
    prompts = _prompts([7, 4], seed=5)

    def sample(**kw):
        return generate_tokens(model, prompts, 16, eos_ids=[], pad_token_id=0, **kw).new_tokens

    greedy = sample()
    a = sample(temperature=1.0, top_p=0.9, seed=3)
    np.testing.assert_array_equal(a, sample(temperature=1.0, top_p=0.9, seed=3))  # same seed, same ids
    assert (a != sample(temperature=1.0, top_p=0.9, seed=4)).any()
    assert (a != greedy).any()
    # A nucleus of one token is greedy; so is a near-zero temperature.
    np.testing.assert_array_equal(sample(temperature=1.5, top_p=1e-6, seed=9), greedy)
    np.testing.assert_array_equal(sample(temperature=1e-4, seed=1), greedy)
    # A high temperature makes the draws near-uniform: 96 uniform draws from 128 ids give ~68 distinct.
    hot = np.concatenate([sample(temperature=50.0, seed=s) for s in range(3)])
    assert len(np.unique(hot)) > 55


def test_samples_share_one_prefill_and_draw_what_repeated_prompts_draw(pair):
    """num_samples repeats each prompt's prefilled cache; the draws must be those of the prompts repeated in
    the batch (same rows, same key), with padding, a repetition control and media embeddings."""
    _, model = pair
    prompts = _prompts([7, 3, 5], seed=8)
    repeated = [p for p in prompts for _ in range(4)]
    kw = dict(eos_ids=[2], pad_token_id=0, temperature=1.2, top_p=0.95, seed=11, repetition_penalty=1.3)
    many = generate_tokens(model, prompts, 12, num_samples=4, **kw)
    alone = generate_tokens(model, repeated, 12, **kw)
    np.testing.assert_array_equal(many.sequences, alone.sequences)
    np.testing.assert_array_equal(many.attention_mask, alone.attention_mask)
    np.testing.assert_array_equal(many.num_new, alone.num_new)
    assert len({tuple(r) for r in many.new_tokens[:4]}) > 1  # the samples of one prompt differ
    ids, _ = left_pad(prompts, 0)
    embeds = model.embed(jnp.asarray(ids)) * 1.5  # not the ids' own embeddings: the samples must read these
    ids_r, _ = left_pad(repeated, 0)
    embeds_r = jnp.repeat(embeds, 4, axis=0)
    np.testing.assert_array_equal(
        generate_tokens(model, prompts, 12, num_samples=4, inputs_embeds=embeds, **kw).sequences,
        generate_tokens(model, repeated, 12, inputs_embeds=embeds_r, **kw).sequences)
    assert ids_r.shape == embeds_r.shape[:2]
    with pytest.raises(ValueError, match="num_samples"):
        generate_tokens(model, prompts, 4, num_samples=0)


def test_nucleus_matches_hf_top_p_warper():
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = np.random.default_rng(0).normal(size=(4, 50)).astype(np.float32) * 3
    for top_p in (0.1, 0.5, 0.9):
        ours = np.isfinite(np.asarray(generation._nucleus(jnp.asarray(logits), jnp.float32(top_p))))
        theirs = np.isfinite(TopPLogitsWarper(top_p)(None, torch.from_numpy(logits)).numpy())
        np.testing.assert_array_equal(ours, theirs)


def test_nucleus_among_the_top_candidates_or_the_whole_vocabulary(monkeypatch):
    """The nucleus is looked for among the top NUCLEUS_CANDIDATES logits and the vocabulary sorted only when
    they hold less than top_p of some row's mass: either way the kept set is HF's. Peaked rows (the nucleus
    within 8 candidates) and a flat one (it needs more) in one batch, and the peaked rows alone."""
    from transformers.generation.logits_process import TopPLogitsWarper

    monkeypatch.setattr(generation, "NUCLEUS_CANDIDATES", 8)
    rng = np.random.default_rng(1)
    peaked = rng.normal(size=(3, 200)).astype(np.float32) * 6
    flat = rng.normal(size=(1, 200)).astype(np.float32) * 0.1
    for logits in (peaked, np.concatenate([peaked, flat])):
        for top_p in (0.3, 0.9):
            ours = np.isfinite(np.asarray(generation._nucleus(jnp.asarray(logits), jnp.float32(top_p))))
            theirs = np.isfinite(TopPLogitsWarper(top_p)(None, torch.from_numpy(logits)).numpy())
            np.testing.assert_array_equal(ours, theirs)
    kept = np.isfinite(np.asarray(generation._nucleus(jnp.asarray(flat), jnp.float32(0.9)))).sum()
    assert kept > 8  # the flat row's nucleus is beyond the candidates: the whole-vocabulary path decided it
    kept = np.isfinite(np.asarray(generation._nucleus(jnp.asarray(peaked), jnp.float32(0.9)))).sum(-1)
    assert (kept <= 8).all() and (kept > 1).any()  # within the candidates, and not merely the best token


def test_generate_strings_and_compile_cache():
    tok = tiny_tokenizer()
    # A vocab covering the tokenizer, end token = the tokenizer's </s>.
    model = load_hf_model_into_flax(tiny_hf_model(seed=2, vocab_size=len(tok), eos_token_id=None))
    prompts = ["i am so sad today", "my dog died and i feel alone you know"]
    ids = empatheia_jax.generate_ids(model, tok, prompts, max_new_tokens=12)
    texts = empatheia_jax.generate(model, tok, prompts, max_new_tokens=12)
    assert ids.dtype == np.int32 and ids.shape[0] == 2 and ids.shape[1] <= 12
    for row, text in zip(ids, texts, strict=True):
        row = row.tolist()
        upto = row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row
        assert text == tok.decode(upto, skip_special_tokens=True)
        assert "</s>" not in text
    # Prompts and budgets inside one bucket reuse the compiled program.
    fn = generation._compiled(*_graphdef_key(model), do_sample=False)
    before = fn._cache_size()
    empatheia_jax.generate(model, tok, ["i am here"], max_new_tokens=9)
    empatheia_jax.generate(model, tok, ["you are not alone and it is hard"], max_new_tokens=15)
    assert fn._cache_size() == before + 1  # a new batch size compiles once, then is reused


def _graphdef_key(model):
    return nnx.split(model)[0], bucket(12)


def test_rejects_bad_arguments(pair):
    _, model = pair
    with pytest.raises(ValueError, match="repetition_penalty"):
        generate_tokens(model, [[5]], 4, repetition_penalty=0.0)
    with pytest.raises(ValueError, match="no_repeat_ngram_size"):
        generate_tokens(model, [[5]], 4, no_repeat_ngram_size=-1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_tokens(model, [[5]], 0)
    with pytest.raises(ValueError, match="top_p"):
        generate_tokens(model, [[5]], 4, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="empty prompt"):
        generate_tokens(model, [[5], []], 4)
    with pytest.raises(TypeError, match="list of strings"):
        empatheia_jax.generate(model, tiny_tokenizer(), "one string", 4)
