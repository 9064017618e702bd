"""The Style Disentangler's start: its inputs standardised from data, then a warm-up on cached signal states.

The SD reads the LLM's hidden states at the signal tokens, whose scale is set by the backbone, not by the
SD's initialisation (docs/design.md "SD input standardisation"). Before the SD first trains, one frozen
forward per batch collects those states (`collect_sd_inputs`), `calibrate_sd_inputs` sets the SD's input
affines from them, and the warm-up trains the SD alone on the cache (`train.trainer.warmup_sd`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from empatheia_jax.models.empatheia import Empatheia


def sd_inputs_calibrated(model: Empatheia) -> bool:
    """False while the SD input affines are still the identity they start as."""
    sd = model.style_dis
    return not (sd.speech_in.is_identity() and sd.video_in.is_identity())


SD_INPUT_KEYS = ("r_s", "r_s_mask", "r_v", "r_v_mask")


SD_TARGET_KEYS = ("speech_style", "video_style", "style_mask", "emotion", "age", "gender", "timbre")


def collect_sd_inputs(model: Empatheia, batches: Iterable[Mapping[str, jax.Array]]) -> dict[str, jax.Array]:
    """The SD's inputs (`SD_INPUT_KEYS`, from one frozen forward per batch) and targets (`SD_TARGET_KEYS`,
    those the batches hold), concatenated over the examples of `batches`.

    A few MB per thousand examples (n_signal x d per modality). It feeds `calibrate_sd_inputs` and the SD
    warm-up (`sd_head_loss`). Under a mesh the batches are global arrays and so are the results.
    """
    graphdef, state = nnx.split(model)

    @jax.jit
    def signal_states(state, batch):
        out = nnx.merge(graphdef, state)(batch, train=False, heads=frozenset())
        return {k: out[k] for k in SD_INPUT_KEYS}

    got = [{**signal_states(state, b), **{k: b[k] for k in SD_TARGET_KEYS if k in b}} for b in batches]
    if not got:
        raise ValueError("collect_sd_inputs: no batches")
    return {k: jnp.concatenate([g[k] for g in got]) for k in got[0]}


def calibrate_sd_inputs(model: Empatheia, inputs: Mapping[str, jax.Array]) -> int:
    """Sets the SD input affines from `collect_sd_inputs` output; returns the number of examples used.

    shift = the mean of r^m at each signal position over the examples where the signal token is present;
    scale = 1 / the per-dimension std over those examples, averaged over the positions (docs/design.md,
    "SD input standardisation"). Two-pass mean/variance: the spread of the states is ~1e-2 of their mean,
    where the one-pass E[r^2] - E[r]^2 loses most of its digits in float32. Deterministic given the inputs;
    under a mesh the sums are global reductions and every process sets the same values.
    """
    n_examples = 0
    for key, norm in (("r_s", model.style_dis.speech_in), ("r_v", model.style_dis.video_in)):
        r = inputs[key].astype(jnp.float32)  # [N, n_signal, d]
        w = inputs[f"{key}_mask"].astype(jnp.float32)[..., None]
        n = jnp.sum(w, 0)  # [n_signal, 1]
        seen = n > 0
        if not bool(jnp.any(seen)):
            raise ValueError(f"calibrate_sd_inputs: no example has a {key} signal token")
        mean = jnp.sum(r * w, 0) / jnp.maximum(n, 1.0)
        std = jnp.sqrt(jnp.sum(jnp.square(r - mean) * w, 0) / jnp.maximum(n, 1.0))
        std_d = jnp.sum(jnp.where(seen, std, 0.0), 0) / jnp.sum(seen)
        floor = 1e-3 * jnp.max(std_d) + 1e-12  # a constant dimension must not be blown up
        norm.shift[...] = jnp.where(seen, mean, 0.0).astype(norm.shift.dtype)
        norm.scale[...] = (1.0 / jnp.maximum(std_d, floor)).astype(norm.scale.dtype)
        n_examples = max(n_examples, int(jnp.max(n)))
    return n_examples
