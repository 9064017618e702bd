"""The jitted forward programs that chat and evaluation share, compiled once per shape and option set.

A process-wide cache keyed by (program, compiler options, static args), guarded by a lock so eval's
threads and chat reuse one compilation.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from empatheia_jax.models.empatheia import Empatheia

# Outputs the host needs from the forward pass (logits and hidden states stay on the device).
KEEP = ("speech_content", "video_content", "speech_style", "video_style", "emotion_logits", "age_logits",
         "gender_logits", "timbre_logits", "r_s_mask", "r_v_mask", "r_s_positions", "r_v_positions")


_JITS: dict[tuple, Any] = {}


_LOCK = threading.Lock()


def _options_key(options: Mapping[str, Any] | None) -> tuple:
    return tuple(sorted((options or {}).items()))


def cached_jit(name: str, fn, options: Mapping[str, Any] | None, **static):
    key = (name, _options_key(options), tuple(sorted(static.items())))
    with _LOCK:
        f = _JITS.get(key)
        if f is None:
            opts = dict(options) if options else None
            f = _JITS[key] = jax.jit(fn, static_argnums=0, compiler_options=opts)
    return f


def _outputs(graphdef, state, batch, heads, video=True):
    out = nnx.merge(graphdef, state)(batch, train=False, heads=heads, video=video)
    return {k: out[k] for k in KEEP if k in out}


def _video(graphdef, state, batch, video_units):
    return nnx.merge(graphdef, state).video_content(batch, video_units)


def _embed(graphdef, state, ids, aud_feats, aud_mask, vid_feats, vid_mask):
    return nnx.merge(graphdef, state).embed_inputs(ids, aud_feats, aud_mask, vid_feats, vid_mask)


def model_outputs(
    model: Empatheia,
    batch: Mapping[str, np.ndarray],
    *,
    heads: Iterable[str] | None = None,
    compiler_options: Mapping[str, Any] | None = None,
    video: bool = True,
) -> dict[str, np.ndarray]:
    """Deterministic (z = mu) forward of `batch`; the head outputs and signal masks as numpy (no logits).
    `video=False` leaves the CS video block out (`Empatheia.__call__`): chat's first pass with `cv_units`."""
    heads = model.config.heads if heads is None else frozenset(heads)
    graphdef, state = nnx.split(model)
    fn = cached_jit("outputs", lambda g, s, b, h=heads, v=video: _outputs(g, s, b, h, v), compiler_options,
                    heads=heads, video=video)
    out = fn(graphdef, state, {k: jnp.asarray(v) for k, v in batch.items()})
    return {k: np.asarray(v) for k, v in jax.device_get(out).items()}


def video_outputs(
    model: Empatheia,
    batch: Mapping[str, np.ndarray],
    video_units: np.ndarray,
    *,
    compiler_options: Mapping[str, Any] | None = None,
) -> np.ndarray:
    """`Empatheia.video_content` jitted: C^v [B, max_video_len, d] of a unit-aligned video block from the
    frame units the reply's spoken durations gave."""
    graphdef, state = nnx.split(model)
    fn = cached_jit("video", _video, compiler_options)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    out = fn(graphdef, state, batch, jnp.asarray(video_units, jnp.int32))
    return np.asarray(jax.device_get(out))


def embed_prompts(
    model: Empatheia,
    ids: np.ndarray,
    aud_feats: np.ndarray,
    aud_mask: np.ndarray,
    vid_feats: np.ndarray,
    vid_mask: np.ndarray,
    *,
    compiler_options: Mapping[str, Any] | None = None,
) -> jax.Array:
    """`model.embed_inputs` jitted: the spliced prompt embeddings for `generate_tokens(inputs_embeds=)`."""
    graphdef, state = nnx.split(model)
    fn = cached_jit("embed", _embed, compiler_options)
    return fn(graphdef, state, *(jnp.asarray(x) for x in (ids, aud_feats, aud_mask, vid_feats, vid_mask)))
