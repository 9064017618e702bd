"""The jitted train step and the teacher-forced evaluation: one program per step, its loss and its noise.

A step takes the whole step's batch `[grad_accum, micro_batch, ...]` and runs ONE jitted program: a
`lax.scan` over the micro-batches accumulates gradients, each micro-batch's loss normalised by the whole
step's counts (`objective.loss_counts`) and its VAE noise drawn from per-example keys (`example_keys`), so
the update equals the one of a single big batch. A non-finite loss or gradient norm leaves parameters and
optimizer state untouched inside the program (the host then applies `train.nan_policy`). The evaluation
uses the same loss, deterministic, normalised over the whole split.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx
from jax.sharding import Mesh

from empatheia_jax.data import target_stats
from empatheia_jax.models.empatheia import Empatheia
from empatheia_jax.models.trainable import trainable_filter
from empatheia_jax.train import losses, objective, stages
from empatheia_jax.train.pipelines import eval_batches


def example_keys(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """One key per example: `fold_in(key, row)` with row the example's index in the flattened step batch."""
    n = math.prod(shape)
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(n)).reshape(shape)


CONTENT_KINDS = ("speech_content", "video_content")


def loss_weights(config: ml_collections.ConfigDict) -> losses.LossWeights:
    """The run's `LossWeights`: config.loss's alpha, beta and kl, and with `loss.ccl_scale = "balanced"` the
    content loss's per-dimension weights from the spread of the train split's targets
    (`target_stats.row_variance`, `losses.balanced_dim_weights`); "none" is eq 9's plain sum."""
    loss = dict(config.loss)
    scale = loss.pop("ccl_scale", "none")
    dims = []
    if scale == "balanced":
        for kind in CONTENT_KINDS:
            var = target_stats.row_variance(config.data.shards, config.data.train_split, kind)
            if var is not None:
                dims.append((kind, tuple(float(w) for w in losses.balanced_dim_weights(var))))
    return losses.LossWeights(**loss, ccl_dims=tuple(dims))


# Compiled with flushed denormals on CPU: SiLU of very negative gates feeds denormals into the matmuls
# (see docs/design.md, "CPU speed"); accelerators flush them anyway.
_CPU_COMPILER_OPTIONS = {"xla_cpu_ftz": True}


def make_step(stage: stages.Stage, weights: losses.LossWeights) -> stages.TrainStep:
    """`step(graphs, params, frozen, opt_state, batch [A, m, ...], key) -> (params, opt_state, metrics)`.

    Micro-batch losses are normalised by the counts of the whole step, so the summed gradients (and the
    summed metrics) are those of one batch of A*m examples. The update is skipped in-program (params and
    optimizer state returned unchanged) when the loss or gradient norm is not finite; `nonfinite` reports it.
    """
    loss_fn = objective.make_loss_fn(stage, weights)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step(graphs: stages.StepGraphs, params, frozen, opt_state, batch, key):
        accum, micro = batch["input_ids"].shape[:2]
        flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), batch)
        counts = objective.loss_counts(nnx.merge(graphs.model, params, frozen).config, flat)
        keys = example_keys(key, (accum, micro))

        def micro_step(acc, xs):
            # One barrier over the weights AND this micro-batch: its outputs depend on the loop, so XLA
            # cannot treat the weights as loop-invariant; otherwise its loop-invariant code motion hoists
            # every layer's FSDP all-gather (and dtype cast) out of the micro-batch loop and keeps all of
            # them alive for the whole step (docs/design.md, "Hoisted weight gathers").
            p, f, (mb, k) = jax.lax.optimization_barrier((params, frozen, xs))
            (_, metrics), grads = grad_fn(p, graphs.model, f, mb, k, counts=counts)
            return jax.tree.map(jnp.add, acc, grads), metrics

        # The gradients are summed in the carry (they have the parameters' structure, so their zeros need no
        # trace); the metrics come out per micro-batch and are summed after, in order, to the same values:
        # starting the carry from their zeros instead would trace the whole forward and backward once more
        # only for their shapes (the tiny overall step's trace: 6.0 s with it, 4.8 s without).
        grads, per_micro = jax.lax.scan(micro_step, jax.tree.map(jnp.zeros_like, params), (batch, keys))
        metrics = jax.tree.map(lambda m: functools.reduce(jnp.add, list(m)), per_micro)

        grad_norm = optax.global_norm(grads)
        ok = jnp.isfinite(metrics["total"]) & jnp.isfinite(grad_norm)
        new_params, new_opt_state = stages.apply_update(graphs, params, frozen, opt_state, grads)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)  # noqa: E731
        metrics = dict(metrics, grad_norm=grad_norm, nonfinite=(~ok).astype(jnp.float32))
        return keep(new_params, params), keep(new_opt_state, opt_state), metrics

    return step


def jit_step(
    stage: stages.Stage,
    weights: losses.LossWeights,
    params: nnx.State,
    opt_state: nnx.State,
    *,
    compiler_options: Mapping[str, Any] | None = None,
) -> stages.TrainStep:
    """`make_step` under jit: graphs static, params/opt_state donated and kept on their shardings."""
    shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
    options = dict(_CPU_COMPILER_OPTIONS) if jax.default_backend() == "cpu" else {}
    options = {**options, **(compiler_options or {})} or None
    return jax.jit(
        make_step(stage, weights),
        static_argnums=0,
        donate_argnums=(1, 3),
        out_shardings=(shardings(params), shardings(opt_state), None),
        compiler_options=options,
    )


def make_eval_step(stage: stages.Stage, weights: losses.LossWeights):
    """`eval_step(graphdef, params, frozen, batch, counts) -> metrics` (deterministic: z = mu)."""

    @jax.jit
    def counts_of(graphdef, params, frozen, batch):
        return objective.loss_counts(nnx.merge(graphdef, params, frozen).config, batch)

    def eval_step(graphdef, params, frozen, batch, counts):
        model = nnx.merge(graphdef, params, frozen)
        outputs = objective.forward(model, batch, stage, train=False)
        return objective.stage_loss(model, batch, outputs, stage, weights, counts=counts)[1]

    return counts_of, jax.jit(eval_step, static_argnums=0)


def evaluate_loss(
    config: ml_collections.ConfigDict,
    stage: stages.Stage,
    model: Empatheia,
    tokenizer: Any,
    mesh: Mesh,
    *,
    split: str | None = None,
    max_batches: int = 0,
) -> dict[str, float]:
    """Teacher-forced loss terms of `stage` over an eval split, normalised over the whole split.

    Two passes over the (small) split: the counts first, so every batch's sums share one denominator and
    the result is the split's exact mean, not a mean of batch means.
    """
    weights = loss_weights(config)
    graphdef, params, frozen = nnx.split(model, trainable_filter(stage.trainable_groups), ...)
    counts_of, eval_step = make_eval_step(stage, weights)

    def batches() -> Iterator[dict[str, jax.Array]]:
        return eval_batches(config, stage, model, tokenizer, mesh, split=split, max_batches=max_batches)

    total = None
    for b in batches():
        c = counts_of(graphdef, params, frozen, b)
        total = c if total is None else jax.tree.map(jnp.add, total, c)
    if total is None:
        return {}
    sums = None
    for b in batches():
        m = eval_step(graphdef, params, frozen, b, total)
        sums = m if sums is None else jax.tree.map(jnp.add, sums, m)
    return {k: float(v) for k, v in jax.device_get(sums).items()}
