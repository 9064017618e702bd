"""Empatheia: the backbone LLM plus splicing, signal tokens, Content Synchronizer and Style Disentangler.

Data flows one way through `Empatheia.__call__` (paper §4, DESIGN §2):

    input_ids -> embeddings, with each <Aud>/<Vid> embedding replaced by aud_proj/vid_proj(feature)
              -> LLM layers -> final norm -> hidden [B, T, d] -> logits
    hidden at the n <AUDi> positions   -> r^s [B, n, d] -> SD (emotion VAE, profile VAE) -> E^s, P^s -> S^s
    hidden at the n <VIDi> positions   -> r^v [B, n, d] -> SD                            -> E^v, P^v -> S^v
    hidden over the response span      -> r^t [B, T, d] + mask -> CS (one VAE per modality) -> C^s, C^v
    E^s ⊕ E^v -> E -> emotion classifier;  P^s ⊕ P^v -> P -> age / gender / timbre classifiers

Gather position (the NExT-GPT off-by-one): r^s_i is the final-normed hidden state at the position whose
INPUT token is <AUDi>, i.e. the state that has read <AUDi> (and predicts the token after it). Teacher
forcing and generation agree on it, because after generation one forward pass over prompt + generated
tokens is run and gathered the same way (`generate` never feeds its last token back, so the hidden state
of a generated signal token only exists after that re-run). r^t likewise uses positions whose input token
lies in the response span (`response_mask` of the batch).

The modules read here live apart: the config in `models/empatheia_config.py`, the CS and SD (and
`run_vaes`, which batches their equal blocks) in `models/heads.py`. This module is the model's story:
splice the media features in, run the backbone, gather the signal states and hand them to the heads.

Parameters live in named sub-modules so a training stage selects them by name (`models.trainable`
groups): `llm` (LoRA: "lora"; added rows: "added_rows"), `aud_proj`/`vid_proj` ("proj"), `content_sync`
("cs"), `style_dis` ("sd").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from empatheia_jax.data.templates import AUD_PLACEHOLDER, VID_PLACEHOLDER, extend_tokenizer, signal_tokens
from empatheia_jax.models import trainable
from empatheia_jax.models.empatheia_config import EmpatheiaConfig
from empatheia_jax.models.heads import ContentSynchronizer, StyleDisentangler, partitioned_dense
from empatheia_jax.models.llama import Llama, base_shapes_only, init_added_rows, is_shape_only
from empatheia_jax.models.lora import LoraConfig, apply_lora, lora_config_of, lora_layers
from empatheia_jax.models.vae import TransformerVAE, VAEOutput, as_key, split_keys
from empatheia_jax.sharding import shard_model

# Trainable groups of the sub-modules Empatheia names (the LLM's "lora" and "added_rows" are in trainable.py).
trainable.register_group("cs", nnx.All(nnx.Param, nnx.PathContains("content_sync")))
trainable.register_group("sd", nnx.All(nnx.Param, nnx.PathContains("style_dis")))
trainable.register_group(
    "proj", nnx.All(nnx.Param, nnx.Any(nnx.PathContains("aud_proj"), nnx.PathContains("vid_proj")))
)

# ----------------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------------


class Empatheia(nnx.Module):
    """The backbone LLM with input projections, CS and SD; see the module docstring for the data flow."""

    def __init__(self, cfg: EmpatheiaConfig, *, rngs: nnx.Rngs):
        with nnx.use_eager_sharding(False):
            self.config = cfg
            self.llm = Llama(cfg.llm, rngs=rngs)
            init_added_rows(self.llm)
            if cfg.lora is not None:
                apply_lora(self.llm, cfg.lora, rngs=rngs)
            d = cfg.llm.hidden_size
            pdt = jnp.dtype(cfg.llm.param_dtype)
            if cfg.has_media:
                cdt = cfg.llm.compute_dtype
                self.aud_proj = partitioned_dense(cfg.audio_dim, d, ("features", "embed"), rngs, cdt, pdt)
                self.vid_proj = partitioned_dense(cfg.video_dim, d, ("features", "embed"), rngs, cdt, pdt)
            if cfg.has_cs:
                self.content_sync = ContentSynchronizer(cfg, rngs=rngs)
            if cfg.has_sd:
                self.style_dis = StyleDisentangler(cfg, rngs=rngs)
            if cfg.vae_logvar_init is not None:
                # Start every posterior narrow (sigma = exp(logvar_init / 2)): with the blocks' own sigma ~ 1
                # the sampled latent drowns the signal and the SD classifiers stayed at chance for hundreds of
                # steps in the stage tests; the KL term still pulls logvar towards 0 over training.
                for _, block in self.iter_modules():
                    if isinstance(block, TransformerVAE):
                        bias = block.logvar_head.bias
                        bias[...] = jnp.full(bias.shape, cfg.vae_logvar_init, bias.dtype)

    # -- inputs ---------------------------------------------------------------------------------------------

    def embed_inputs(
        self,
        input_ids: jax.Array,
        aud_feats: jax.Array | None = None,
        aud_mask: jax.Array | None = None,
        vid_feats: jax.Array | None = None,
        vid_mask: jax.Array | None = None,
    ) -> jax.Array:
        """Token embeddings [B, T, d] with the j-th <Aud> of row b replaced by aud_proj(aud_feats[b, j]).

        Same for <Vid>. A placeholder whose feature row is beyond the mask (or beyond the feature array) keeps
        its own <Aud>/<Vid> embedding; feature rows beyond the mask are never read. Usable for generation:
        pass the left-padded prompt ids and give the result to `generation.generate_tokens(inputs_embeds=)`.
        """
        cfg = self.config
        x = self.llm.embed(input_ids)
        if not cfg.has_media:
            return x
        for tok, feats, feat_mask, proj in (
            (cfg.aud_token_id, aud_feats, aud_mask, self.aud_proj),
            (cfg.vid_token_id, vid_feats, vid_mask, self.vid_proj),
        ):
            if feats is None or feats.shape[1] == 0:
                continue
            n = feats.shape[1]
            if feat_mask is None:
                feat_mask = jnp.ones(feats.shape[:2], bool)
            is_ph = input_ids == tok
            j = jnp.cumsum(is_ph, axis=1) - 1  # occurrence index of each placeholder in its row
            jc = jnp.clip(j, 0, n - 1)
            projected = proj(feats.astype(cfg.llm.compute_dtype))  # [B, n, d]
            rows = jnp.take_along_axis(projected, jc[..., None], axis=1)  # [B, T, d]
            ok = is_ph & (j < n) & jnp.take_along_axis(feat_mask.astype(bool), jc, axis=1)
            x = jnp.where(ok[..., None], rows.astype(x.dtype), x)
        return x

    def gather_signal_states(
        self, hidden: jax.Array, input_ids: jax.Array, attention_mask: jax.Array
    ) -> dict[str, jax.Array]:
        """r^s, r^v [B, n, d] at the positions whose input token is <AUDi> / <VIDi>, with masks [B, n].

        The first occurrence of each token counts; a token absent from a row (or only under padding) gives
        a zero row and mask False.
        """
        cfg = self.config
        out = {}
        attended = attention_mask.astype(bool)[:, :, None]
        for key, ids in (("r_s", cfg.aud_signal_ids), ("r_v", cfg.vid_signal_ids)):
            hit = (input_ids[:, :, None] == jnp.asarray(ids, input_ids.dtype)) & attended  # [B, T, n]
            pos = jnp.argmax(hit, axis=1)  # first hit (0 when absent)
            present = jnp.any(hit, axis=1)
            r = jnp.take_along_axis(hidden, pos[..., None], axis=1)
            out[key] = jnp.where(present[..., None], r, jnp.zeros((), r.dtype))
            out[f"{key}_mask"] = present
            out[f"{key}_positions"] = jnp.where(present, pos, -1).astype(jnp.int32)
        return out

    # -- forward --------------------------------------------------------------------------------------------

    def _backbone(self, batch: Mapping[str, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(hidden [B,T,d], attention mask [B,T] bool, r^t mask [B,T] bool) of a batch: the spliced inputs
        through the LLM; r^t is the hidden state at the response tokens."""
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        mask = jnp.ones(ids.shape, bool) if mask is None else mask.astype(bool)
        positions = batch.get("positions")
        if positions is None:
            positions = jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)
        x = self.embed_inputs(ids, batch.get("aud_feats"), batch.get("aud_mask"), batch.get("vid_feats"),
                              batch.get("vid_mask"))
        hidden, _ = self.llm.decode(x, positions=positions, attention_mask=mask,
                                    segment_ids=batch.get("segment_ids"))
        response = batch.get("response_mask")
        r_t_mask = (jnp.zeros(ids.shape, bool) if response is None else response.astype(bool)) & mask
        return hidden, mask, r_t_mask

    def __call__(
        self,
        batch: Mapping[str, jax.Array],
        *,
        train: bool = False,
        rng: jax.Array | None = None,
        heads: frozenset[str] | set[str] | None = None,
        video: bool = True,
    ) -> dict[str, Any]:
        """All model outputs for a pipeline batch (docs/design.md "Batch layout").

        Needs `input_ids`; `attention_mask` (default all 1), `positions` (default cumsum(mask) - 1),
        `segment_ids` (packed text rows: attention stays inside each segment), `response_mask`, and the
        feature keys are read when present. `heads` picks the optional heads to
        run (default: all the model has); a stage passes only what its losses read. train=True samples
        the VAE latents (needs `rng`); train=False uses z = mu. `video=False` leaves the CS's video block
        out (no `video_content`; evaluation only): the first pass of inference with a unit-aligned video
        block (`cv_units`), whose frame units exist once the reply's speech rows have been spoken; the
        second pass is `video_content`.

        `rng` is one key (shape []) or one key per example (shape [B]). With per-example keys every draw
        of example b (VAE noise and dropout) comes from rng[b] alone: `cs_key, sd_key = split(rng[b])`, then
        `run_vaes` splits each into one key per block and `TransformerVAE` draws per example. So example b
        gets the same noise in a batch of 1 or of 4, which gradient accumulation needs (a trainer passes
        `rng[b] = fold_in(step_key, global index of example b)`). One key keeps the whole-batch draws.

        Returns: logits f32 [B,T,V]; hidden [B,T,d]; r_s/r_v [B,n,d] + *_mask/*_positions; r_t (= hidden)
        + r_t_mask; with CS: speech_content [B,L_s,1024], video_content [B,L_v,256]; with SD: speech_style,
        video_style [B,256], speech/video_emotion/profile (E^m, P^m), emotion_features (E),
        profile_features (P), emotion/age/gender/timbre_logits; and `vae`: {block name: VAEOutput}.
        """
        heads = self._heads_to_run(heads)
        ids = batch["input_ids"]
        cs_key, sd_key = self._head_keys(rng, ids.shape[0], needed=bool(train and heads))
        hidden, mask, r_t_mask = self._backbone(batch)
        out: dict[str, Any] = {"logits": self.llm.logits(hidden), "hidden": hidden}
        out.update(self.gather_signal_states(hidden, ids, mask))
        out["r_t"] = hidden
        out["r_t_mask"] = r_t_mask
        vae: dict[str, VAEOutput] = {}
        if "cs" in heads:
            content, blocks = self._content_outputs(batch, out, sample=bool(train), rng=cs_key, video=video)
            out.update(content)
            vae.update(blocks)
        if "sd" in heads:
            style, blocks = self._style_outputs(out, sample=bool(train), rng=sd_key)
            out.update(style)
            vae.update(blocks)
        out["vae"] = vae
        return out

    def _heads_to_run(self, heads: frozenset[str] | set[str] | None) -> frozenset[str]:
        """The heads a call asks for (default: all this model has); asking for one it lacks is an error."""
        cfg = self.config
        heads = cfg.heads if heads is None else frozenset(heads)
        missing = sorted(heads - cfg.heads)
        if missing:
            raise ValueError(f"heads {missing} requested but this model has only {sorted(cfg.heads)}")
        return heads

    def _content_outputs(
        self, batch: Mapping[str, jax.Array], out: Mapping[str, Any], *, sample: bool, rng: jax.Array | None,
        video: bool,
    ) -> tuple[dict[str, jax.Array], dict[str, VAEOutput]]:
        """({speech_content, video_content (with `video`)}, the CS blocks' VAE outputs) over r^t."""
        cs = self._content(batch, out["r_t"], out["r_t_mask"], sample=sample, rng=rng, video=video)
        content = {"speech_content": cs["cs_speech"].out}
        if "cs_video" in cs:
            content["video_content"] = cs["cs_video"].out
        return content, cs

    def _style_outputs(self, out: Mapping[str, Any], *, sample: bool, rng: jax.Array | None
                       ) -> tuple[dict[str, Any], dict[str, VAEOutput]]:
        """(the SD's outputs over r^s, r^v: styles, fused features, classifier logits, then E^m and P^m as
        speech/video_emotion/profile; the SD blocks' VAE outputs)."""
        style = self.style_dis(out["r_s"], out["r_s_mask"], out["r_v"], out["r_v_mask"], sample=sample,
                               rng=rng)
        blocks = style.pop("vae")
        style["speech_emotion"] = blocks["sd_speech_emotion"].out
        style["speech_profile"] = blocks["sd_speech_profile"].out
        style["video_emotion"] = blocks["sd_video_emotion"].out
        style["video_profile"] = blocks["sd_video_profile"].out
        return style, blocks

    @staticmethod
    def _head_keys(rng: jax.Array | None, batch_size: int, *, needed: bool
                   ) -> tuple[jax.Array | None, jax.Array | None]:
        """(CS key, SD key) of `rng` (one key, or one per example: their count is checked), or (None, None);
        `needed`: the heads sample their latents, so an rng must be given."""
        if rng is None:
            if needed:
                raise ValueError("train=True samples the VAE latents and needs an rng")
            return None, None
        rng = as_key(rng)
        if rng.ndim == 1 and rng.shape[0] != batch_size:
            raise ValueError(f"{rng.shape[0]} per-example keys for a batch of {batch_size} examples")
        cs_key, sd_key = split_keys(rng)
        return cs_key, sd_key

    def _content(
        self, batch: Mapping[str, jax.Array], r_t: jax.Array, r_t_mask: jax.Array, *, sample: bool,
        rng: jax.Array | None, video: bool = True,
    ) -> dict[str, VAEOutput]:
        """The CS's blocks over r^t, each told its units when it is unit-aligned: {"cs_speech", "cs_video"}
        ("cs_video" only with `video`)."""
        cfg = self.config
        units = batch.get("speech_units") if cfg.cs_units else None
        if cfg.cs_units and units is None:
            raise ValueError("this model's Content Synchronizer is unit-aligned (cs_units="
                             f"{cfg.cs_units}): the batch needs speech_units [B, {cfg.max_speech_len}]")
        if not video:
            if sample:
                raise ValueError("video=False is for inference (train=False): training reads C^v")
            return {"cs_speech": self.content_sync.speech_block(r_t, r_t_mask, units)}
        frame_units = batch.get("video_units") if cfg.cv_units else None
        if cfg.cv_units and frame_units is None:
            raise ValueError("this model's video block is unit-aligned (cv_units="
                             f"{cfg.cv_units}): the batch needs video_units [B, {cfg.max_video_len}] "
                             "(at inference: video=False, speak the reply, then video_content)")
        return self.content_sync(r_t, r_t_mask, sample=sample, rng=rng, speech_units=units,
                                 video_units=frame_units)

    def content_from_units(
        self, batch: Mapping[str, jax.Array], *, train: bool = False, rng: jax.Array | None = None
    ) -> dict[str, Any]:
        """The CS's outputs from the units alone: the backbone does not run and r^t is empty, so each
        block's cross-attention reads nothing and its rows come from its units (stage ccl_units).

        A fraction of a ccl step's cost (no LLM forward), for pre-training a CS whose blocks are all
        unit-aligned; its outputs are those of `__call__(heads={"cs"})` for a batch whose r^t is masked out
        (the same keys: `rng` as there). Returns speech_content, video_content and `vae`."""
        cfg = self.config
        if not (cfg.has_cs and cfg.cs_units and cfg.cv_units):
            raise ValueError("content from units alone needs a CS whose speech and video blocks are both "
                             f"unit-aligned (cs_units={cfg.cs_units}, cv_units={cfg.cv_units}): a "
                             "position-only block has nothing to read without r^t")
        b = batch["input_ids"].shape[0]
        keys = self._head_keys(rng, b, needed=bool(train))
        r_t = jnp.zeros((b, 1, cfg.llm.hidden_size), cfg.llm.compute_dtype)
        cs = self._content(batch, r_t, jnp.zeros((b, 1), bool), sample=bool(train), rng=keys[0])
        return {"speech_content": cs["cs_speech"].out, "video_content": cs["cs_video"].out, "vae": cs}

    def video_content(self, batch: Mapping[str, jax.Array], video_units: jax.Array) -> jax.Array:
        """C^v [B, max_video_len, d] (z = mu) of a batch whose frame units are known only after its speech
        rows were spoken: the second inference pass of a unit-aligned video block (`cv_units`; the first is
        `__call__(video=False)`). The backbone runs again over the same batch for r^t (one forward, cheap
        next to speaking the reply), so the result is what `__call__` gives with `video_units` in the
        batch."""
        if not self.config.has_cs:
            raise ValueError("this model has no Content Synchronizer")
        hidden, _, r_t_mask = self._backbone(batch)
        units = video_units if self.config.cv_units else None
        return self.content_sync.video_block(hidden, r_t_mask, units).out

    # -- construction from a pretrained backbone ----------------------------------------------------------

    @classmethod
    def from_llm(
        cls,
        llm: Llama,
        tokenizer: Any,
        cfg_overrides: Mapping[str, Any] | None = None,
        *,
        rngs: nnx.Rngs | None = None,
        mesh: Mesh | None = None,
    ) -> Empatheia:
        """Empatheia around a converted/pretrained backbone; extends `tokenizer` in place.

        `cfg_overrides` are EmpatheiaConfig fields (audio_dim and video_dim are required; "llm" may be a
        dict of LlamaConfig overrides such as dtype or remat). The tokenizer gets the added tokens
        (`templates.extend_tokenizer`), `extra_vocab` grows to cover them, every pretrained parameter is
        copied (LoRA too when both sides have it), the added rows start at the mean of the pretrained rows,
        and rows the backbone already had in `*_extra` keep their values.

        The new backbone's pretrained weights are never drawn (`llama.base_shapes_only`): they are `llm`'s
        own arrays, so a backbone restored into its shards (`checkpoint_io.load_checkpoint(mesh=)`) stays
        there and only the small rest (LoRA, added rows, projections, CS, SD) is built on the host. With a
        `mesh` every parameter then ends on the sharding the logical-axis rules give it: no host ever holds
        the whole model, which a 7B backbone needs.
        """
        over = dict(cfg_overrides or {})
        n_signal = int(over.get("n_signal", 16))
        ids = extend_tokenizer(tokenizer, n_signal)
        base = llm.config
        llm_over = over.pop("llm", None) or {}
        llm_cfg = base.replace(**llm_over) if llm_over else base
        low = sorted(t for t, i in ids.items() if i < base.vocab_size)
        if low:
            raise ValueError(
                f"the tokenizer gave {low} ids below the model's vocab_size={base.vocab_size} (the tokenizer "
                f"has {len(tokenizer)} tokens, fewer than the embedding rows): those rows are pretrained and "
                "frozen, so the added tokens could never train; use a tokenizer whose length is vocab_size"
            )
        aud, vid = signal_tokens(n_signal)
        if "lora" not in over:
            over["lora"] = lora_config_of(llm) or LoraConfig()
        cfg = EmpatheiaConfig(
            llm=llm_cfg,
            aud_token_id=ids[AUD_PLACEHOLDER],
            vid_token_id=ids[VID_PLACEHOLDER],
            aud_signal_ids=tuple(ids[t] for t in aud),
            vid_signal_ids=tuple(ids[t] for t in vid),
            **over,
        )
        with base_shapes_only():  # the backbone's weights are `llm`'s: drawing them would be wasted
            model = cls(cfg, rngs=rngs or nnx.Rngs(0))
        copy_backbone(llm, model.llm)
        if mesh is not None:
            shard_model(model, mesh)
        return model


# ----------------------------------------------------------------------------------------------------------
# Copying a pretrained backbone
# ----------------------------------------------------------------------------------------------------------


def copy_backbone(src: Llama, dst: Llama) -> None:
    """Copies every parameter of `src` into `dst` (same architecture, `dst` may have more added rows).

    Base parameters must match in shape. LoRA parameters are copied when both have them with the same
    shape. Added rows: `dst`'s start at the mean of the (copied) pretrained rows, then the rows `src`
    already had are copied over the first ones.
    """
    extras = ("embed_extra", "lm_head_extra")
    if any(m.merged for m in lora_layers(src)):
        raise ValueError("the backbone's LoRA is merged into its kernels; unmerge it (unmerge_lora) first")
    src_flat = {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(src, nnx.Param))}
    dst_state = nnx.state(dst, nnx.Param)
    dst_flat = {tuple(p): v for p, v in nnx.to_flat_state(dst_state)}
    for path, var in src_flat.items():
        if path[-1] in extras:
            continue
        if path not in dst_flat:
            hint = " (the new model has no LoRA: set cfg.lora)" if isinstance(var, nnx.LoRAParam) else ""
            name = "/".join(map(str, path))
            raise ValueError(f"backbone parameter {name} has no place in the new model{hint}")
        target = dst_flat[path]
        if target.shape != var.shape:
            raise ValueError(f"backbone parameter {'/'.join(map(str, path))}: {var.shape} vs {target.shape}")
        target.set_value(jnp.asarray(var.get_value(), target.dtype))
    unset = ["/".join(map(str, p)) for p, v in dst_flat.items() if is_shape_only(v)]
    if unset:
        raise ValueError(f"the backbone has no values for {unset} (built with base_shapes_only)")
    init_added_rows(dst)
    for name, axis in (("embed_extra", 0), ("lm_head_extra", 1)):  # rows the backbone already had
        if hasattr(src, name) and hasattr(dst, name):
            old, new = getattr(src, name)[...], getattr(dst, name)
            rows = min(old.shape[axis], new.shape[axis])
            idx = (slice(0, rows),) if axis == 0 else (slice(None), slice(0, rows))
            new[...] = new[...].at[idx].set(old[idx].astype(new.dtype))


__all__ = [
    "Empatheia",
    "copy_backbone",
]
