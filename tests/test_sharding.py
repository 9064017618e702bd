"""Sharding on 8 fake CPU devices: a (data=2, fsdp=2, tensor=2) mesh must not change the numbers.

The forward pass and a jitted LoRA train step under the mesh are compared with the same computation on one
device; the parameters are checked to be really split, so the comparison is not of two replicated runs.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import skip_or_fail

from empatheia_jax import sharding
from empatheia_jax.models.llama import Llama, LlamaConfig
from empatheia_jax.models.lora import LoraConfig, apply_lora, set_lora_b

CFG = LlamaConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
)
LORA = LoraConfig(rank=4, alpha=8.0)


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="module")
def sharded_model(mesh) -> Llama:
    return sharding.create_sharded(factory, mesh)


def factory() -> Llama:
    model = Llama(CFG, rngs=nnx.Rngs(0))
    apply_lora(model, LORA, rngs=nnx.Rngs(1))
    set_lora_b(model, jax.random.key(2), std=0.05)
    return model


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) != 8:
        skip_or_fail(f"needs the 8 fake CPU devices tests/conftest.py sets up, found {len(jax.devices())}")
    return sharding.make_mesh(2, 2, 2)


def batch() -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (8, 16)), jnp.int32)


def make_step(graphdef):
    """SGD with momentum on the LoRA parameters only; jax.jit over the split state, no NNX transforms.

    Not Adam: its first step is ~lr*sign(g), which turns float rounding in near-zero gradients into
    lr-sized differences and would hide real errors behind a loose tolerance.
    """
    tx = optax.sgd(0.5, momentum=0.9)

    def step(lora, rest, opt_state, ids):
        def loss_fn(lora):
            logits = nnx.merge(graphdef, lora, rest)(ids[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(lora)
        updates, opt_state = tx.update(grads, opt_state, lora)
        return loss, optax.apply_updates(lora, updates), opt_state

    return tx, jax.jit(step)


def test_make_mesh_rejects_sizes_that_do_not_fit_the_devices(mesh):
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    with pytest.raises(ValueError, match="needs 12 devices"):
        sharding.make_mesh(3, 2, 2)
    with pytest.raises(ValueError, match="do not divide"):
        sharding.make_mesh(3, -1, 1)
    with pytest.raises(ValueError, match="at most one"):
        sharding.make_mesh(-1, -1, 2)


def test_sharded_forward_matches_unsharded(mesh, sharded_model):
    ids = batch()
    expected = np.asarray(jax.jit(lambda m, x: m(x))(factory(), ids))

    model = sharded_model
    q = model.layers[0].self_attn.q_proj
    for var in (q.kernel, q.lora.lora_b, model.embed_tokens.embedding, model.lm_head.kernel):
        assert not var[...].sharding.is_fully_replicated, var[...].sharding
    assert q.kernel[...].sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    with jax.set_mesh(mesh):
        x = jax.device_put(ids, sharding.batch_sharding(mesh, 2))
        got = jax.jit(lambda m, x: m(x))(model, x)
    np.testing.assert_allclose(np.asarray(got), expected, atol=1e-5, rtol=0)


def test_sharded_lora_train_step_matches_unsharded(mesh, sharded_model):
    ids = batch()
    graphdef, lora, rest = nnx.split(factory(), nnx.LoRAParam, ...)
    tx, step = make_step(graphdef)
    loss_1, lora_1, _ = step(lora, rest, tx.init(lora), ids)

    with jax.set_mesh(mesh):
        graphdef_s, lora_s, rest_s = nnx.split(sharded_model, nnx.LoRAParam, ...)
        tx, step_s = make_step(graphdef_s)
        opt_state = jax.jit(tx.init)(lora_s)
        x = jax.device_put(ids, sharding.batch_sharding(mesh, 2))
        loss_8, lora_8, _ = step_s(lora_s, rest_s, opt_state, x)

    np.testing.assert_allclose(float(loss_8), float(loss_1), atol=1e-5, rtol=0)
    flat_1 = dict(nnx.to_flat_state(lora_1))
    flat_8 = dict(nnx.to_flat_state(lora_8))
    assert flat_1.keys() == flat_8.keys() and len(flat_1) == 2 * 2 * 4
    for path, v1 in flat_1.items():
        v0 = dict(nnx.to_flat_state(lora))[path][...]
        assert np.abs(np.asarray(v1[...]) - np.asarray(v0)).max() > 0, f"{path} did not move"
        np.testing.assert_allclose(np.asarray(flat_8[path][...]), np.asarray(v1[...]), atol=1e-5, rtol=0,
                                   err_msg=str(path))


def test_activations_keep_the_batch_layout_on_an_fsdp_mesh():
    """`sharding.constrain` pins hidden states and logits to the batch layout: the LoRA step compiled for
    an fsdp=8 mesh under `jax.set_mesh` needs well under the temporary memory of the same step traced
    without it, where the constraints are no-ops and GSPMD follows the FSDP weights into the activations
    (the 7B memory plan's finding: every device held the whole micro-batch's activations)."""
    fsdp = sharding.make_mesh(1, 8, 1)
    cfg = dataclasses.replace(CFG, vocab_size=512)

    def build() -> Llama:
        model = Llama(cfg, rngs=nnx.Rngs(0))
        apply_lora(model, LORA, rngs=nnx.Rngs(1))
        return model

    graphdef, lora, rest = nnx.split(sharding.create_sharded(build, fsdp), nnx.LoRAParam, ...)
    tx, step = make_step(graphdef)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (16, 256))
    ids = jax.device_put(jnp.asarray(ids, jnp.int32), sharding.batch_sharding(fsdp, 2))
    with jax.set_mesh(fsdp):
        opt_state = jax.jit(tx.init)(lora)

    def temp(on_mesh: bool) -> int:
        with jax.set_mesh(fsdp) if on_mesh else contextlib.nullcontext():
            compiled = step.lower(lora, rest, opt_state, ids).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    constrained, free = temp(True), temp(False)
    assert constrained < 0.6 * free, (constrained, free)  # measured: 14.6 vs 34.9 MiB
