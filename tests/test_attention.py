"""`LlamaConfig.attention`: jax.nn.dot_product_attention's XLA kernel, given the arguments the cuDNN kernel
gets (`attention_choice.dot_product_attention`: causal flag, mask, own-slot guard), computes what our einsum
attention computes, in float32 on the CPU, with GQA, left and right padding, packed segments and a KV cache;
"auto" chooses per call (`attention_choice.choose`) and says each decision once."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from empatheia_jax.models import attention_choice
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


@pytest.mark.parametrize("attention", ["xla"])
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


def test_auto_runs_the_einsum_on_a_cpu_bit_for_bit():
    ids, right, _ = _inputs()
    positions = jnp.maximum(jnp.cumsum(right, axis=1) - 1, 0)
    want = _model("einsum")(ids, positions=positions, attention_mask=right)
    have = _model("auto")(ids, positions=positions, attention_mask=right)
    np.testing.assert_array_equal(np.asarray(have), np.asarray(want))


def test_a_query_with_no_visible_key_sees_its_own_slot_and_real_queries_are_unchanged():
    """Left padding: query 0 of row 0 sees no real key. The guard gives it its own slot (a finite row, what
    cuDNN's bias-only rows are not promised to be); every query that sees a real key keeps its mask."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 4, 2, 8)), jnp.float32) for _ in range(3))
    valid = jnp.asarray([[False, True, True, True]])
    causal = jnp.tril(jnp.ones((4, 4), bool))
    mask = valid[:, None, :] & causal[None]
    out = attention_choice.dot_product_attention(q, k, v, mask, 0, cached=False, implementation="xla")
    np.testing.assert_allclose(np.asarray(out[0, 0]), np.asarray(v[0, 0]), rtol=1e-6)  # its own value
    want = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation="xla")
    np.testing.assert_allclose(np.asarray(out[0, 1:]), np.asarray(want[0, 1:]), rtol=1e-6)


SHAPE = attention_choice.Shape(t=512, s=512, heads=32, kv_heads=32, head_dim=128, dtype="bfloat16")


@pytest.mark.parametrize(("kwargs", "kernel", "why"), [
    ({"cached": True, "platform": "gpu"}, "einsum", "KV-cache"),
    ({"cached": False, "platform": "cpu"}, "einsum", "backend is cpu"),
    ({"cached": False, "platform": "tpu"}, "einsum", "backend is tpu"),
    ({"cached": False, "platform": "gpu", "probe": lambda s: None}, "cudnn", "flash"),
    ({"cached": False, "platform": "gpu", "probe": lambda s: "NotImplementedError: head dim"}, "einsum",
     "refused the shape: NotImplementedError: head dim"),
])
def test_auto_chooses_cudnn_only_where_it_can_run(kwargs, kernel, why):
    choice = attention_choice.choose(SHAPE, **kwargs)
    assert choice.kernel == kernel and why in choice.reason, choice
    f32 = attention_choice.choose(SHAPE._replace(dtype="float32"), cached=False, platform="gpu",
                                  probe=lambda s: None)
    assert f32.kernel == "einsum" and "not float32" in f32.reason


def test_the_real_probe_turns_a_refusal_into_the_einsum():
    """On this CPU cuDNN cannot compile: the probe's error becomes the reason, not a crash of the step."""
    choice = attention_choice.choose(SHAPE._replace(t=64, s=64), cached=False, platform="gpu")
    assert choice.kernel == "einsum" and "cuDNN refused the shape" in choice.reason, choice


def test_each_decision_is_said_once(monkeypatch, caplog):
    monkeypatch.setattr(attention_choice, "_SAID", {})
    with caplog.at_level(logging.INFO, logger=attention_choice.__name__):
        for _ in range(3):  # three layers of one forward
            attention_choice.choose(SHAPE, cached=False, platform="gpu", probe=lambda s: None)
        attention_choice.choose(SHAPE, cached=True, platform="gpu")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "cudnn (flash" in lines[0] and "cached: einsum" in lines[1], lines
    assert len(attention_choice.decisions()) == 2
