"""The optimizer update on one vector (train/flat_update.py) is the per-leaf optax update, state and all."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from configs import tiny
from empatheia_jax.train import config as config_lib
from empatheia_jax.train import flat_update, init


def _params(dtype=jnp.float32) -> dict:
    """Vectors before matrices in the tree's order (a/b < a/w), so the decay prefix needs the reordering."""
    rng = np.random.default_rng(0)
    shapes = {"a": {"b": (4,), "w": (3, 4)}, "c": (2, 2, 2), "d": (5,), "e": (1,)}
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s), dtype), shapes,
                        is_leaf=lambda x: isinstance(x, tuple))


def _tx(params=None, **optim):
    c = tiny.get_config()
    c.optim.update(optim)
    return init.make_tx(c, config_lib.stage_schedule(c), params)[0]


@pytest.mark.parametrize("optim", [
    {"weight_decay": 0.1, "clip_norm": 1.0},  # the gradients below are ~10: clipping bites
    {"weight_decay": 0.1, "clip_norm": 0.0, "ema_decay": 0.9},
    {"weight_decay": 0.0, "clip_norm": 100.0},
])
def test_the_update_on_one_vector_is_the_per_leaf_update(optim):
    params = _params()
    leafwise, flat = _tx(**optim), _tx(params, **optim)
    s1, s2 = leafwise.init(params), flat.init(params)
    assert jax.tree.structure(s1) == jax.tree.structure(s2)  # a checkpoint of either restores into the other
    p1 = p2 = params
    rng = np.random.default_rng(1)
    for _ in range(4):
        grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 10, jnp.float32), params)
        u1, s1 = leafwise.update(grads, s1, p1)
        u2, s2 = jax.jit(flat.update)(grads, s2, p2)
        p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
        assert jax.tree.structure(s1) == jax.tree.structure(s2)
        for a, b in zip(jax.tree.leaves((p1, s1)), jax.tree.leaves((p2, s2)), strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    moved = jax.tree.map(lambda a, b: bool(np.any(a != b)), params, p2)
    assert all(jax.tree.leaves(moved))


def test_weight_decay_reaches_the_matrices_only():
    """With zero gradients AdamW's step is the decay alone: matrices shrink, vectors stay where they are."""
    params = _params()
    tx = _tx(params, weight_decay=0.5)
    state = tx.init(params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    for _ in range(3):  # past the warm-up's first step, at lr 0
        updates, state = jax.jit(tx.update)(zeros, state, params)
    for path, u in jax.tree_util.tree_flatten_with_path(updates)[0]:
        p = params
        for key in path:
            p = p[key.key]
        if p.ndim >= 2:
            assert np.all(np.sign(u) == -np.sign(p)) and np.any(u != 0), path
        else:
            np.testing.assert_array_equal(u, 0, err_msg=str(path))


def _concatenates(tx, params) -> bool:
    grads = jax.tree.map(jnp.ones_like, params)
    jaxpr = jax.make_jaxpr(tx.update)(grads, tx.init(params), params)
    return "concatenate" in str(jaxpr)


def test_sharded_or_mixed_leaves_keep_the_per_leaf_update():
    """Only replicated leaves of one dtype go on one vector: an FSDP-sharded leaf would be gathered whole."""
    params = _params()
    assert _concatenates(_tx(params), params) and not _concatenates(_tx(), params)

    mesh = Mesh(np.asarray(jax.devices()[:2]), ("fsdp",))
    placed = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    assert flat_update.replicated(placed) and _concatenates(_tx(placed), placed)
    placed["a"]["w"] = jax.device_put(params["a"]["w"], NamedSharding(mesh, PartitionSpec(None, "fsdp")))
    assert not flat_update.replicated(placed)
    assert not _concatenates(_tx(placed), placed)

    mixed = dict(params, d=params["d"].astype(jnp.bfloat16))
    assert not _concatenates(_tx(mixed), mixed)
