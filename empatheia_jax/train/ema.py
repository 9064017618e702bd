"""An exponential moving average of the trained parameters, kept in the optimizer state.

Why: the LoRA of a short, high-learning-rate run wanders from step to step; an average of its recent
iterates is the usual cheap remedy (Polyak averaging; big_vision and MaxText keep one), and issue-level
figures (the 32-class emotion on the dev part) are chosen on it. optax has no parameter EMA (`optax.ema`
averages the *updates*), so `ema_params` is a small GradientTransformation: chained last, after AdamW, it
passes the updates through unchanged and folds the parameters they produce into its state:

    ema_t = d_t * ema_{t-1} + (1 - d_t) * (params_{t-1} + updates_t),   ema_0 = the initial parameters,
    d_t   = min(decay, (1 + t) / (10 + t))

The warm-up of d_t (TensorFlow's `ExponentialMovingAverage(num_updates=)`) keeps the first steps' average
from being mostly the initial weights. The average is float32 whatever the parameters' dtype.

Living in the optimizer state, the EMA is saved, restored and sharded with it, so a resumed run continues
it exactly. Consumers of the trained weights (evaluation, export, chat, the next stage's `init_from`) read
the `ema` item a checkpoint of such a run also holds (`trainer._save`, `checkpoint.TrainCheckpointer`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx


class EmaState(NamedTuple):
    count: jax.Array  # updates folded in so far
    ema: optax.Params  # float32, the parameters' structure


def decay_at(decay: float, count: jax.Array) -> jax.Array:
    """d_t of the module docstring for the t-th update (count = t)."""
    return jnp.minimum(decay, (1.0 + count) / (10.0 + count))


def ema_params(decay: float) -> optax.GradientTransformation:
    """The parameter EMA as the last link of an optax chain (module docstring); decay in (0, 1)."""
    if not 0.0 < decay < 1.0:
        raise ValueError(f"ema decay must be in (0, 1), got {decay}")

    def init(params: optax.Params) -> EmaState:
        # a copy, never the parameter's own buffer: the train step donates params and opt_state, and two
        # donated arguments sharing one buffer crash XLA
        return EmaState(jnp.zeros([], jnp.int32),
                        jax.tree.map(lambda p: jnp.array(p, dtype=jnp.float32, copy=True), params))

    def update(updates: optax.Updates, state: EmaState, params: optax.Params | None = None):
        if params is None:
            raise ValueError("ema_params needs the parameters: call update(updates, state, params)")
        count = state.count + 1
        d = decay_at(decay, count)
        new = optax.apply_updates(params, updates)
        ema = jax.tree.map(lambda e, p: d * e + (1.0 - d) * p.astype(jnp.float32), state.ema, new)
        return updates, EmaState(count, ema)

    return optax.GradientTransformation(init, update)


def find_ema(opt_state: Any) -> EmaState | None:
    """The EmaState inside an optimizer's (possibly chained) state, None when it has none."""
    if isinstance(opt_state, EmaState):
        return opt_state
    if isinstance(opt_state, tuple):
        for part in opt_state:
            found = find_ema(part)
            if found is not None:
                return found
    return None


def averaged(params: nnx.State, optimizer: nnx.Optimizer) -> nnx.State:
    """`params` (a state of the optimizer's model) with every parameter the optimizer trains replaced by
    its EMA, cast to the parameter's dtype; the other entries are `params`' own. Raises when the optimizer
    keeps no EMA."""
    found = find_ema(optimizer.opt_state)
    if found is None:
        raise ValueError("the optimizer keeps no parameter EMA (optim.ema_decay = 0)")
    ema = {tuple(map(str, path)): var for path, var in nnx.to_flat_state(found.ema)}
    out = {}
    for path, var in nnx.to_flat_state(params):
        avg = ema.get(tuple(map(str, path)))
        out[path] = var if avg is None else var.replace(avg[...].astype(var[...].dtype))
    return nnx.from_flat_state(out)
