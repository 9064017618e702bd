"""The VAE heads of Empatheia: the Content Synchronizer (CS) and the Style Disentangler (SD), paper §4.

Each head is transformer-VAE blocks (`models/vae.py`) over hidden states the model gathers
(`models/empatheia.py`): the CS reads r^t, the hidden states over the reply, and gives the content rows
C^s, C^v; the SD reads r^s, r^v, the states at the signal tokens, and gives the emotion and profile codes,
the style codes S^s, S^v and the classifiers' logits. They live apart from the model because they are
functions of those states alone: the model decides where the states come from, the heads what is read out
of them. `run_vaes` runs equal blocks as one batched program (the SD's four), which both heads use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from empatheia_jax.models.empatheia_config import SD_VAES, EmpatheiaConfig
from empatheia_jax.models.vae import TransformerVAE, VAEConfig, VAEOutput, split_keys


def partitioned_dense(d_in: int, d_out: int, axes: tuple[str, str], rngs: nnx.Rngs, dtype, param_dtype
                      ) -> nnx.Linear:
    """A Linear whose kernel and bias carry logical axes `axes` (xavier-uniform kernel, zero bias): the
    heads' layers and the model's input projections."""
    return nnx.Linear(
        d_in,
        d_out,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=nnx.with_partitioning(nnx.initializers.xavier_uniform(), axes),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), axes[1:]),
        rngs=rngs,
    )


def _flat(x: jax.Array) -> jax.Array:
    return x.reshape(x.shape[0], -1)


def run_vaes(
    blocks: Sequence[TransformerVAE],
    inputs: Sequence[tuple[jax.Array, jax.Array]],
    *,
    sample: bool,
    rng: jax.Array | None,
    units: Sequence[jax.Array | None] | None = None,
) -> list[VAEOutput]:
    """Runs each block on its (h, h_mask); blocks with equal configs and input shapes run as ONE program.

    Such a group is `jax.vmap` over the blocks' stacked `nnx.split` states (no NNX transform): the SD's four
    equal blocks become one batched VAE, which cuts the traced program (and its XLA compile time) about 4x
    and batches the small matmuls. Numerically it is the same as calling the blocks one by one with
    `rng` split into one key per block: `jax.random.split(rng, len(blocks))[i]` for one key, and with
    per-example keys [B] block i gets `split(rng[b], len(blocks))[i]` for example b (`vae.split_keys`).
    """
    keys = None if rng is None else split_keys(rng, len(blocks))
    units = [None] * len(blocks) if units is None else list(units)
    groups: dict[Any, list[int]] = {}
    for i, (block, (h, m)) in enumerate(zip(blocks, inputs, strict=True)):
        # unit-aligned blocks run alone (the CS's speech block is the only one)
        key = i if units[i] is not None else (block.config, h.shape, h.dtype, m.shape)
        groups.setdefault(key, []).append(i)
    out: list[Any] = [None] * len(blocks)
    for idx in groups.values():
        if len(idx) == 1:
            i = idx[0]
            out[i] = blocks[i](*inputs[i], sample=sample, rng=None if keys is None else keys[i],
                               units=units[i])
            continue
        graphdef = nnx.graphdef(blocks[idx[0]])
        states = [nnx.state(blocks[i]) for i in idx]
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
        hs = jnp.stack([inputs[i][0] for i in idx])
        ms = jnp.stack([inputs[i][1] for i in idx])
        ks = None if keys is None else keys[jnp.asarray(idx)]

        def one(state, h, m, k, graphdef=graphdef):
            return nnx.merge(graphdef, state)(h, m, sample=sample, rng=k)

        res = jax.vmap(one)(stacked, hs, ms, ks)
        for j, i in enumerate(idx):
            out[i] = jax.tree.map(lambda x, j=j: x[j], res)
    return out


class ContentSynchronizer(nnx.Module):
    """CS (eqs 1-2): one transformer VAE per modality over r^t; row i of C^m predicts target row i.

    With `cs_units` the speech block's rows are aligned to the reply's content units (`speech_units`
    [B, max_speech_len]: the speech generator's ids of the units its content rows stand for, Kokoro's
    phoneme tokens with the two pads), so row i is told which phoneme it renders instead of having to find
    it in r^t by position (docs/design.md "Aligned Content Synchronizer"). With `cv_units` the video
    block's rows (25-fps frames) are aligned the same way to `video_units` [B, max_video_len], each
    frame's unit on its clip's timeline; `video` runs that block alone, for inference, where the frame
    units exist only after the speech block's rows have been spoken."""

    def __init__(self, cfg: EmpatheiaConfig, *, rngs: nnx.Rngs):
        self.speech = TransformerVAE(cfg.cs_speech, rngs=rngs)
        self.video = TransformerVAE(cfg.cs_video, rngs=rngs)

    def __call__(
        self, r_t: jax.Array, r_t_mask: jax.Array, *, sample: bool, rng: jax.Array | None,
        speech_units: jax.Array | None = None, video_units: jax.Array | None = None,
    ) -> dict[str, VAEOutput]:
        speech, video = run_vaes([self.speech, self.video], [(r_t, r_t_mask)] * 2, sample=sample, rng=rng,
                                 units=[speech_units, video_units])
        return {"cs_speech": speech, "cs_video": video}

    def speech_block(self, r_t: jax.Array, r_t_mask: jax.Array, speech_units: jax.Array | None
                     ) -> VAEOutput:
        """The speech block alone, deterministic (z = mu), as `__call__(sample=False)` gives "cs_speech"."""
        return self.speech(r_t, r_t_mask, sample=False, units=speech_units)

    def video_block(self, r_t: jax.Array, r_t_mask: jax.Array, video_units: jax.Array | None) -> VAEOutput:
        """The video block alone, deterministic (z = mu): what `__call__(sample=False)` gives as
        "cs_video" for the same units (run_vaes runs a unit-aligned block alone, so nothing is shared)."""
        return self.video(r_t, r_t_mask, sample=False, units=video_units)


class SignalStandardizer(nnx.Module):
    """`(r - shift[position]) * scale` over the n signal-token states [B, n, d] that feed the SD.

    Across examples those states differ by ~10 % of their magnitude; the identity of each signal token
    dominates, and raw the SD cannot learn from them (design.md "SD input standardisation"). Starts as the
    identity; `calibrate_sd_inputs` sets it from data before the SD first trains.
    """

    def __init__(self, n: int, d: int, param_dtype):
        self.shift = nnx.Param(jnp.zeros((n, d), param_dtype), out_sharding=(None, "embed"))
        self.scale = nnx.Param(jnp.ones((d,), param_dtype), out_sharding=("embed",))

    def __call__(self, r: jax.Array) -> jax.Array:
        return (r - self.shift[...].astype(r.dtype)) * self.scale[...].astype(r.dtype)

    def is_identity(self) -> bool:
        return bool(jnp.all(self.shift[...] == 0) & jnp.all(self.scale[...] == 1))


class StyleDisentangler(nnx.Module):
    """SD (eqs 3-7) and the style classifiers.

    Per modality m, r^m is first standardised (`SignalStandardizer`, set from data by `calibrate_sd_inputs`).
    Then E^m = emotion VAE(r^m), P^m = profile VAE(r^m), each [B, sd_queries, sd_code_dim];
    S^m = style layer(flat(E^m) ⊕ flat(P^m)) [B, style_dim] (eq 7's concatenation, then one affine map to
    the generator's 256-d style code). Fusion: E = gelu(Linear(flat(E^s) ⊕ flat(E^v))) [B, fuse_dim] feeds the
    emotion classifier; P likewise feeds the age, gender and timbre classifiers (each one Linear).
    """

    def __init__(self, cfg: EmpatheiaConfig, *, rngs: nnx.Rngs):
        pdt = jnp.dtype(cfg.llm.param_dtype)
        f32 = jnp.float32

        def dense(d_in, d_out, axes):
            return partitioned_dense(d_in, d_out, axes, rngs, f32, pdt)

        self.speech_in = SignalStandardizer(cfg.n_signal, cfg.llm.hidden_size, pdt)
        self.video_in = SignalStandardizer(cfg.n_signal, cfg.llm.hidden_size, pdt)
        self.speech_emotion = TransformerVAE(cfg.sd_speech_emotion, rngs=rngs)
        self.speech_profile = TransformerVAE(cfg.sd_speech_profile, rngs=rngs)
        self.video_emotion = TransformerVAE(cfg.sd_video_emotion, rngs=rngs)
        self.video_profile = TransformerVAE(cfg.sd_video_profile, rngs=rngs)

        def width(c: VAEConfig) -> int:
            return c.num_queries * c.d_out

        se, sp = width(cfg.sd_speech_emotion), width(cfg.sd_speech_profile)
        ve, vp = width(cfg.sd_video_emotion), width(cfg.sd_video_profile)
        self.speech_style = dense(se + sp, cfg.style_dim, ("features", "features"))
        self.video_style = dense(ve + vp, cfg.style_dim, ("features", "features"))
        self.emotion_fuse = dense(se + ve, cfg.fuse_dim, ("features", "features"))
        self.profile_fuse = dense(sp + vp, cfg.fuse_dim, ("features", "features"))
        self.emotion_head = dense(cfg.fuse_dim, cfg.num_emotions, ("features", "classes"))
        self.age_head = dense(cfg.fuse_dim, cfg.num_ages, ("features", "classes"))
        self.gender_head = dense(cfg.fuse_dim, cfg.num_genders, ("features", "classes"))
        self.timbre_head = dense(cfg.fuse_dim, cfg.num_timbres, ("features", "classes"))

    def __call__(
        self,
        r_s: jax.Array,
        r_s_mask: jax.Array,
        r_v: jax.Array,
        r_v_mask: jax.Array,
        *,
        sample: bool,
        rng: jax.Array | None,
    ) -> dict[str, Any]:
        r_s, r_v = self.speech_in(r_s), self.video_in(r_v)
        blocks = [self.speech_emotion, self.speech_profile, self.video_emotion, self.video_profile]
        inputs = [(r_s, r_s_mask), (r_s, r_s_mask), (r_v, r_v_mask), (r_v, r_v_mask)]
        vae = dict(zip(SD_VAES, run_vaes(blocks, inputs, sample=sample, rng=rng), strict=True))
        e_s, p_s = _flat(vae["sd_speech_emotion"].out), _flat(vae["sd_speech_profile"].out)
        e_v, p_v = _flat(vae["sd_video_emotion"].out), _flat(vae["sd_video_profile"].out)
        emotion = jax.nn.gelu(self.emotion_fuse(jnp.concatenate([e_s, e_v], -1)))
        profile = jax.nn.gelu(self.profile_fuse(jnp.concatenate([p_s, p_v], -1)))
        return {
            "vae": vae,
            "speech_style": self.speech_style(jnp.concatenate([e_s, p_s], -1)),
            "video_style": self.video_style(jnp.concatenate([e_v, p_v], -1)),
            "emotion_features": emotion,
            "profile_features": profile,
            "emotion_logits": self.emotion_head(emotion),
            "age_logits": self.age_head(profile),
            "gender_logits": self.gender_head(profile),
            "timbre_logits": self.timbre_head(profile),
        }


__all__ = [
    "ContentSynchronizer",
    "SignalStandardizer",
    "StyleDisentangler",
    "partitioned_dense",
    "run_vaes",
]
