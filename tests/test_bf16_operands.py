"""Matmul precision "bfloat16" on the CPU (`bf16_operands.einsum_f32`, `dense_dot_general`): XLA:CPU ignores
a dot's precision, so under `jax_default_matmul_precision="bfloat16"` the backbone's dense projections and LM
head cast their float32 operands to bfloat16 themselves, and their gradients cast the cotangent, with
float32 accumulation: what a TPU's one bf16 pass computes. Checked against float64 numpy on the rounded
operands, and in the model: which dots take the bf16 path, and how near the float32 model it stays. The
attention's two einsums take it too (scores, probabilities x values), as on a TPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from empatheia_jax.models.bf16_operands import einsum_f32
from empatheia_jax.models.llama import Llama, LlamaConfig
from empatheia_jax.models.lora import LoraConfig, apply_lora, set_lora_b
from tests.helpers import jaxpr_eqns

CFG = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
                  extra_vocab=3)


def _bf16(x) -> np.ndarray:
    """float64 copy of x rounded to bfloat16 (round to nearest even, as the cast does)."""
    return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)


@pytest.mark.parametrize("spec, a_shape, b_shape", [
    ("...i,io->...o", (3, 5, 24), (24, 7)),  # nnx.Linear's dot
    ("btd,vd->btv", (2, 5, 24), (11, 24)),  # the tied LM head
    ("btd,dv->btv", (2, 5, 24), (24, 11)),  # the untied one
])
def test_bf16_operands_round_the_inputs_and_the_cotangent_and_accumulate_in_float32(spec, a_shape, b_shape):
    ka, kb, kg = jax.random.split(jax.random.key(0), 3)
    a, b = jax.random.normal(ka, a_shape), jax.random.normal(kb, b_shape)
    with jax.default_matmul_precision("bfloat16"):
        y, vjp = jax.vjp(lambda a, b: einsum_f32(spec, a, b), a, b)
        g = jax.random.normal(kg, y.shape)
        da, db = vjp(g)
    ra, rb, rg = _bf16(a), _bf16(b), _bf16(g)
    ref_spec = spec.replace("...", "xy")  # numpy sums over no ellipsis dimension: name the two leading ones
    inputs, out = ref_spec.split("->")
    sa, sb = inputs.split(",")
    want = np.einsum(ref_spec, ra, rb)
    assert y.dtype == da.dtype == db.dtype == jnp.float32
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(da, np.einsum(f"{out},{sb}->{sa}", rg, rb), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db, np.einsum(f"{sa},{out}->{sb}", ra, rg), rtol=1e-5, atol=1e-5)
    # the float32 product is a different function: without the cast the check above fails
    exact = np.einsum(ref_spec, np.asarray(a, np.float64), np.asarray(b, np.float64))
    assert np.abs(want - exact).max() > 1e-3
    with jax.default_matmul_precision("float32"):
        np.testing.assert_allclose(einsum_f32(spec, a, b), exact, rtol=1e-5, atol=1e-5)


def _lora_model() -> Llama:
    model = apply_lora(Llama(CFG, rngs=nnx.Rngs(0)), LoraConfig(rank=4, alpha=8.0), rngs=nnx.Rngs(1))
    set_lora_b(model, jax.random.key(2), std=0.05)
    return model


def _bf16_dots(jaxpr) -> int:
    """Dots of a jaxpr (recursively) whose operands are both bfloat16."""
    return sum(eqn.primitive.name == "dot_general" and all(v.aval.dtype == jnp.bfloat16 for v in eqn.invars)
               for eqn in jaxpr_eqns(jaxpr))


def test_every_projection_attention_and_the_head_take_bf16_operands_lora_does_not():
    model = _lora_model()
    ids = jnp.arange(12).reshape(2, 6) % CFG.total_vocab
    graphdef, state = nnx.split(model)
    fwd = lambda s: nnx.merge(graphdef, s)(ids)  # noqa: E731
    with jax.default_matmul_precision("bfloat16"):
        jaxpr = jax.make_jaxpr(fwd)(state).jaxpr
    # q, k, v, o, gate, up, down (the LoRA-wrapped ones too), scores and their values per layer; the head
    # and its added rows; LoRA's rank-r dots stay float32
    assert _bf16_dots(jaxpr) == 9 * CFG.num_hidden_layers + 2
    with jax.default_matmul_precision("float32"):
        assert _bf16_dots(jax.make_jaxpr(fwd)(state).jaxpr) == 0


def test_the_lora_gradient_under_bf16_operands_stays_near_the_float32_one():
    """The same LoRA loss and gradient within bf16's rounding (8 significant bits), not equal."""
    model = _lora_model()
    ids = jax.random.randint(jax.random.key(3), (2, 10), 0, CFG.vocab_size)
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)

    def loss(lora_state):
        logits = nnx.merge(graphdef, lora_state, rest)(ids[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], -1))

    results = {}
    for precision in ("float32", "bfloat16"):
        with jax.default_matmul_precision(precision):
            value, grads = jax.jit(jax.value_and_grad(loss))(lora)
        results[precision] = (float(value), np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)]))
    (v32, g32), (v16, g16) = results["float32"], results["bfloat16"]
    assert v16 != v32 and abs(v16 - v32) < 2e-2 * abs(v32)
    cosine = g16 @ g32 / (np.linalg.norm(g16) * np.linalg.norm(g32))
    assert 0.995 < cosine < 1.0, cosine


def test_decoding_keeps_float32_operands_under_bfloat16_precision():
    """serve/generation's programs trace with float32 operands (`with_float32_operands`): XLA:CPU's DotThunk
    has no BF16 x BF16 = F32 kernel, which crashed a decode loop. Same scores and tokens as float32; the
    model's own forward under the same precision does differ, so the equality is not vacuous."""
    from empatheia_jax.serve.generation import generate_tokens, score_continuations

    model = _lora_model()
    prompts = [[5, 9, 11, 4], [7, 3, 2, 8]]
    conts = [[1, 2, 3], [4, 5]]
    got = {}
    for precision in ("float32", "bfloat16"):
        with jax.default_matmul_precision(precision):
            got[precision] = (score_continuations(model, prompts, conts),
                              generate_tokens(model, prompts, 6, eos_ids=()).new_tokens,
                              np.asarray(model(jnp.asarray(prompts))))
    np.testing.assert_array_equal(got["bfloat16"][0], got["float32"][0])
    np.testing.assert_array_equal(got["bfloat16"][1], got["float32"][1])
    assert np.abs(got["bfloat16"][2] - got["float32"][2]).max() > 0


_DIMS = dict(b=2, t=4, k=2, g=2, s=4, d=8, i=8, o=6, v=5)


@pytest.mark.parametrize("spec", ["...i,io->...o", "btd,vd->btv", "btd,dv->btv", "btkgd,bksd->bkgts",
                                  "bkgts,bksd->btkgd"])
def test_every_dot_of_the_model_and_of_its_gradient_runs_on_xla_cpu(spec):
    """A BF16 x BF16 = F32 dot in an order XLA:CPU must permute ('bkgts,bksd->btkgd', or its transpose
    'btkgd,bkgts->bksd' under jit) lands on its DotThunk: UNIMPLEMENTED at run time. Each spec, forward
    and both cotangents, eager and jitted, against float64 numpy."""
    from empatheia_jax.models.bf16_operands import _bf16_dot, _transposed_specs

    for sp in (spec, *_transposed_specs(spec)):
        ref_spec = sp.replace("...", "xy")
        sa, sb = ref_spec.split("->")[0].split(",")
        shape = lambda s: tuple(3 if c in "xy" else _DIMS[c] for c in s)  # noqa: E731
        a = jax.random.normal(jax.random.key(0), shape(sa)).astype(jnp.bfloat16)
        b = jax.random.normal(jax.random.key(1), shape(sb)).astype(jnp.bfloat16)
        want = np.einsum(ref_spec, np.asarray(a, np.float64), np.asarray(b, np.float64))
        for fn in (_bf16_dot, jax.jit(_bf16_dot, static_argnums=0)):
            np.testing.assert_allclose(np.asarray(fn(sp, a, b)), want, rtol=1e-5, atol=1e-5, err_msg=sp)
