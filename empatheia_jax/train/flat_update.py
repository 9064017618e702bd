"""The optimizer update on one vector: the same optax transformation, a fraction of the program.

Why: a stage trains hundreds of small leaves (LoRA factors, VAE layers, norms, heads), and optax applies
clipping, AdamW and the EMA leaf by leaf, some 40 HLO operations per leaf. In the tiny overall step that was
a third of the program's 39.5k operations (29.2k on one vector), and XLA's compile time grows faster than
the operation count (docs/benchmarks.md "The optimizer update on one vector"). `on_one_vector`
concatenates the leaves, runs the very transformation `make` builds on that vector and splits the results
back. Its state at rest is the per-leaf state of `make(...)`'s own `init`:
checkpoints, a resume on another mesh and the EMA item read exactly what they read before.

Only where every trained leaf is replicated (`replicated`: one device, or data parallelism). The vector of
FSDP- or tensor-sharded leaves would be gathered onto every device, so those keep the per-leaf update.

AdamW's decay mask (matrices decay, vectors do not) becomes a per-element weight-decay vector: the leaves
are laid out matrices first, so the vector is `weight_decay` on a prefix and 0 after it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

# make(weight_decay, decay_mask) -> the transformation; decay_mask gives a pytree of bools over the params
MakeTx = Callable[[Any, Callable[[optax.Params], Any]], optax.GradientTransformation]


def decays(params: optax.Params) -> Any:
    """AdamW's mask: weight decay on matrices, none on vectors (norm scales, biases)."""
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def replicated(params: Any) -> bool:
    """Whether every leaf is whole on every device (where `on_one_vector` gathers nothing)."""
    return all(getattr(x, "sharding", None) is None or x.sharding.is_fully_replicated
               for x in jax.tree.leaves(params))


def on_one_vector(make: MakeTx, weight_decay: float) -> optax.GradientTransformation:
    """`make(weight_decay, decays)`, its update computed on the concatenated leaves (state kept per leaf)."""
    tree_tx = make(weight_decay, decays)

    def update(updates: optax.Updates, state: Any, params: optax.Params | None = None):
        leaves, treedef = jax.tree.flatten(params)
        if len(leaves) < 2 or len({x.dtype for x in leaves}) > 1:
            return tree_tx.update(updates, state, params)
        decayed_leaf = treedef.flatten_up_to(decays(params))  # the one mask rule, read per leaf
        order = sorted(range(len(leaves)), key=lambda i: not decayed_leaf[i])  # decayed leaves first
        sizes = [leaves[i].size for i in order]
        decayed = sum(leaves[i].size for i in order if decayed_leaf[i])

        def is_tree(x: Any) -> bool:  # a subtree shaped like the params (AdamW's mu and nu, the EMA)
            return jax.tree.structure(x) == treedef

        def ravel(tree: Any) -> jax.Array:
            parts = treedef.flatten_up_to(tree)
            return jnp.concatenate([jnp.ravel(parts[i]) for i in order])

        def unravel(vector: jax.Array) -> Any:
            out: list[Any] = [None] * len(leaves)
            pieces = jnp.split(vector, np.cumsum(sizes[:-1]).tolist())
            for piece, i in zip(pieces, order, strict=True):
                out[i] = piece.reshape(jnp.shape(leaves[i]))
            return treedef.unflatten(out)

        vector_decay = jnp.where(jnp.arange(sum(sizes)) < decayed, weight_decay, 0.0).astype(leaves[0].dtype)
        flat_tx = make(vector_decay, lambda p: True)
        flat_state = jax.tree.map(lambda x: ravel(x) if is_tree(x) else x, state, is_leaf=is_tree)
        flat_updates, new_flat = flat_tx.update(ravel(updates), flat_state, ravel(params))
        new_state = jax.tree.map(lambda old, new: unravel(new) if is_tree(old) else new, state, new_flat,
                                 is_leaf=is_tree)
        return unravel(flat_updates), new_state

    return optax.GradientTransformation(tree_tx.init, update)


__all__ = ["decays", "on_one_vector", "replicated"]
