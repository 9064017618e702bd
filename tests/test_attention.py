"""`LlamaConfig.attention`: jax.nn.dot_product_attention ("auto", "xla") computes what our einsum attention
computes, in float32 on the CPU, with GQA, left and right padding, packed segments and a KV cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from empatheia_jax.models.llama import KVCache, Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)  # GQA: 2 query heads per K/V
B, T = 3, 10


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def _model(attention: str) -> Llama:
    return Llama(CFG.replace(attention=attention), rngs=nnx.Rngs(0))  # same seed: same weights


def _inputs():
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(1, 64, (B, T)), jnp.int32)
    right = np.ones((B, T), np.int32)
    right[1, 6:] = 0  # right padding
    left = np.ones((B, T), np.int32)
    left[2, :4] = 0  # left padding (generation's prompts)
    return ids, jnp.asarray(right), jnp.asarray(left)


def test_the_config_refuses_an_unknown_implementation():
    with pytest.raises(ValueError, match="attention='flash'"):
        CFG.replace(attention="flash")


@pytest.mark.parametrize("attention", ["auto", "xla"])
def test_dot_product_attention_equals_the_einsum_attention(attention):
    ids, right, left = _inputs()
    ref, got = _model("einsum"), _model(attention)
    for mask in (right, left):
        positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
        want = ref(ids, positions=positions, attention_mask=mask)
        have = got(ids, positions=positions, attention_mask=mask)
        real = np.asarray(mask).astype(bool)
        np.testing.assert_allclose(np.asarray(have)[real], np.asarray(want)[real], rtol=1e-5, atol=1e-5)
    # packed rows: two segments in each row
    segments = jnp.asarray(np.repeat([[1] * 6 + [2] * 4], B, axis=0), jnp.int32)
    positions = jnp.asarray(np.repeat([list(range(6)) + list(range(4))], B, axis=0), jnp.int32)
    want, _ = ref.decode(ref.embed(ids), positions=positions, segment_ids=segments)
    have, _ = got.decode(got.embed(ids), positions=positions, segment_ids=segments)
    np.testing.assert_allclose(np.asarray(have), np.asarray(want), rtol=1e-5, atol=1e-5)
    # a KV cache: a left-padded prompt, then two decode steps
    outs = {}
    for name, model in (("einsum", ref), (attention, got)):
        cache = KVCache.init(CFG, B, T + 2)
        positions = jnp.maximum(jnp.cumsum(left, axis=1) - 1, 0)
        logits, cache = model(ids, positions=positions, attention_mask=left, cache=cache)
        steps = [logits[:, -1]]
        nxt, pos = jnp.argmax(logits[:, -1], -1)[:, None], positions[:, -1:] + 1
        for _ in range(2):
            logits, cache = model(nxt, positions=pos, attention_mask=jnp.ones((B, 1), jnp.int32), cache=cache)
            steps.append(logits[:, -1])
            nxt, pos = jnp.argmax(logits[:, -1], -1)[:, None], pos + 1
        outs[name] = np.stack([np.asarray(s) for s in steps])
    np.testing.assert_allclose(outs[attention], outs["einsum"], rtol=1e-5, atol=1e-5)
