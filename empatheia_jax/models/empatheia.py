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

Parameters live in named sub-modules so a training stage selects them by name (`models.trainable`
groups): `llm` (LoRA: "lora"; added rows: "added_rows"), `aud_proj`/`vid_proj` ("proj"), `content_sync`
("cs"), `style_dis` ("sd").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from empatheia_jax.data.templates import AUD_PLACEHOLDER, VID_PLACEHOLDER, extend_tokenizer, signal_tokens
from empatheia_jax.models import trainable
from empatheia_jax.models.llama import Llama, LlamaConfig, base_shapes_only, init_added_rows, is_shape_only
from empatheia_jax.models.lora import LoraConfig, apply_lora, lora_config_of, lora_layers
from empatheia_jax.models.vae import TransformerVAE, VAEConfig, VAEOutput, as_key, split_keys
from empatheia_jax.sharding import shard_model

if TYPE_CHECKING:
    pass

# Trainable groups of the modules defined here (the LLM's "lora" and "added_rows" are in trainable.py).
trainable.register_group("cs", nnx.All(nnx.Param, nnx.PathContains("content_sync")))
trainable.register_group("sd", nnx.All(nnx.Param, nnx.PathContains("style_dis")))
trainable.register_group(
    "proj", nnx.All(nnx.Param, nnx.Any(nnx.PathContains("aud_proj"), nnx.PathContains("vid_proj")))
)

HEADS = ("cs", "sd")  # optional heads of the forward pass; a stage asks only for what its losses read
CS_VAES = ("cs_speech", "cs_video")
SD_VAES = ("sd_speech_emotion", "sd_speech_profile", "sd_video_emotion", "sd_video_profile")


# ----------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------


# EmpatheiaConfig / LlamaConfig fields that trade memory for compute and leave the function unchanged.
EXECUTION_FIELDS = ("ce_chunk", "ce_targets")
LLM_EXECUTION_FIELDS = ("remat", "attention")


@dataclasses.dataclass(frozen=True)
class EmpatheiaConfig:
    """Everything that shapes an Empatheia model; `to_dict`/`from_dict` round-trip it through JSON.

    Token ids: `<Aud>`, `<Vid>`, `<AUD1..n>`, `<VID1..n>` as `templates.extend_tokenizer` assigns them. When
    left None they are the ids that function gives a tokenizer of exactly `llm.vocab_size` tokens
    (vocab_size + i in `templates.added_tokens` order). Every id must be >= vocab_size, i.e. an added row
    that may train; `llm.extra_vocab` is grown to cover the largest id.

    VAE blocks: `cs_speech`/`cs_video` (Q = max_speech_len / max_video_len target rows of
    speech_content_dim / video_content_dim) and the four SD blocks (Q = sd_queries rows of sd_code_dim).
    When left None they are built from the scalar knobs below; explicit ones must agree with the knobs.

    Ablations: `media_input=False` (w/o speech & video input: no projections, nothing spliced);
    `use_cs=False` (w/o CS) and `use_sd=False` (w/o SD) drop the module and its losses;
    `pipeline_baseline=True` is the paper's Pipeline baseline: the bare LLM (+ LoRA), no heads, no media.
    `use_coe` is a template matter only and is kept here so a run's config says what it trained.
    """

    llm: LlamaConfig
    audio_dim: int
    video_dim: int
    n_signal: int = 16
    aud_token_id: int | None = None
    vid_token_id: int | None = None
    aud_signal_ids: tuple[int, ...] | None = None
    vid_signal_ids: tuple[int, ...] | None = None
    k: int = 1  # encoder vectors per utterance = <Aud>/<Vid> placeholders per utterance (pipeline contract)
    lora: LoraConfig | None = dataclasses.field(default_factory=LoraConfig)
    # Targets and classes.
    max_speech_len: int = 256
    max_video_len: int = 256
    speech_content_dim: int = 1024
    video_content_dim: int = 256
    style_dim: int = 256
    num_emotions: int = 7
    num_ages: int = 4
    num_genders: int = 2
    num_timbres: int = 3
    # VAE knobs (used where an explicit VAEConfig is None).
    vae_d_model: int = 256
    vae_heads: int = 4
    vae_layers: int = 4
    cs_latent: int = 64
    sd_queries: int = 4
    sd_code_dim: int = 64
    sd_latent: int = 32
    vae_dropout: float = 0.0
    vae_logvar_init: float | None = -4.0  # initial logvar of every VAE block (None: the block's own init)
    fuse_dim: int = 256
    # Unit alignment of the CS's speech rows: the size of the speech generator's unit vocabulary (Kokoro:
    # its phoneme token ids), 0 = the paper's position-only queries. The batch then carries speech_units.
    cs_units: int = 0
    # The same for the CS's video rows (25-fps frames): the batch then carries video_units, each frame's
    # unit id on the timeline its gold clip was drawn with (`visemes.frame_units`); at inference the
    # durations Kokoro spoke the reply with give them (`Empatheia.video_content`). 0 = position-only.
    cv_units: int = 0
    # The leading dims of a video content row the face generator reads (the embedded one: 2, mouth and
    # eyelids, `face_render.CONTENT_USED`); the video block's rows are 0 beyond them (`VAEConfig.d_used`).
    # 0 = every one of video_content_dim (a generator whose whole row is control, e.g. DreamTalk's).
    cv_dims: int = 0
    # Width of the depthwise row convolution in every layer of both CS blocks (0 = none, the paper's block):
    # a content row depends on its neighbours (`VAEConfig.conv_kernel`, docs/design.md "Aligned Content
    # Synchronizer").
    cs_conv: int = 0
    # Read the units of each unit-aligned CS block in context (`VAEConfig.unit_context`: convolutions and a
    # BiLSTM over the unit rows, Kokoro's text-encoder shape) instead of one table row per unit.
    cs_unit_context: bool = False
    # The width of the speech block's unit reader (`VAEConfig.context_width`; 0 = vae_d_model). What a
    # listener hears is Kokoro's t_en, its 512-wide text encoder's reading of the phonemes; the video
    # block's reader keeps vae_d_model (its mouth is a simpler function of the frame's phoneme).
    cs_context_width: int = 0
    # The speech block's reader also reaches its output rows directly (`VAEConfig.context_skip`), past the
    # vae_d_model-wide stacks: a row that leaves a 128-wide layer is heard worse than Kokoro's own.
    cs_context_skip: bool = False
    cs_speech: VAEConfig | None = None
    cs_video: VAEConfig | None = None
    sd_speech_emotion: VAEConfig | None = None
    sd_speech_profile: VAEConfig | None = None
    sd_video_emotion: VAEConfig | None = None
    sd_video_profile: VAEConfig | None = None
    # Ablations.
    use_coe: bool = True
    media_input: bool = True
    use_cs: bool = True
    use_sd: bool = True
    pipeline_baseline: bool = False
    # Sequence positions whose logits the token loss holds at once (`Llama.token_nll`); 0 = all T at once.
    # A memory/compute trade (one more output projection per step), not part of the model's function.
    ce_chunk: int = 0
    # Target-only logits (`Llama.target_nll`): the token loss projects only the positions it reads, up to
    # ce_targets x rows of the (micro-)batch at once; a batch with more takes the whole projection
    # (exact either way). 0 = project every position. Also an execution field.
    ce_targets: int = 0

    def __post_init__(self):
        problems = self._scalar_problems()
        if problems:
            raise ValueError("invalid EmpatheiaConfig: " + "; ".join(problems))
        problems = self._resolve_token_ids() + self._resolve_blocks()
        if self.lora is not None and isinstance(self.lora, Mapping):
            object.__setattr__(self, "lora", LoraConfig.from_dict(self.lora))
        if problems:
            raise ValueError("invalid EmpatheiaConfig: " + "; ".join(problems))

    def _scalar_problems(self) -> list[str]:
        problems = []
        for name in ("audio_dim", "video_dim", "n_signal", "k", "max_speech_len", "max_video_len",
                     "speech_content_dim", "video_content_dim", "style_dim", "num_emotions", "num_ages",
                     "num_genders", "num_timbres", "vae_d_model", "vae_heads", "vae_layers", "cs_latent",
                     "sd_queries", "sd_code_dim", "sd_latent", "fuse_dim"):
            if getattr(self, name) <= 0:
                problems.append(f"{name}={getattr(self, name)} must be positive")
        if not 0 <= self.cv_dims <= self.video_content_dim:
            problems.append(f"cv_dims={self.cv_dims} must be in [0, video_content_dim="
                            f"{self.video_content_dim}] (0 = every dim)")
        for name in ("cs_units", "cv_units"):
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)} must be >= 0 (0 = position-only queries)")
        if self.cs_conv < 0 or (self.cs_conv and self.cs_conv % 2 == 0):
            problems.append(f"cs_conv={self.cs_conv} must be 0 (none) or a positive odd width")
        if self.cs_unit_context and not (self.cs_units or self.cv_units):
            problems.append("cs_unit_context=True reads content units: set cs_units and/or cv_units")
        if self.cs_context_width and not (self.cs_unit_context and self.cs_units):
            problems.append(f"cs_context_width={self.cs_context_width} is the speech block's unit reader's "
                            "width: set cs_units and cs_unit_context=True")
        if self.cs_context_skip and not (self.cs_unit_context and self.cs_units):
            problems.append("cs_context_skip=True sends the speech block's unit reader to its rows: set "
                            "cs_units and cs_unit_context=True")
        if self.ce_chunk < 0:
            problems.append(f"ce_chunk={self.ce_chunk} must be >= 0 (0: the whole logits at once)")
        if self.ce_targets < 0:
            problems.append(f"ce_targets={self.ce_targets} must be >= 0 (0: every position's logits)")
        return problems

    def _resolve_token_ids(self) -> list[str]:
        """Fills in the added token ids (after the vocabulary: <Aud>, <Vid>, then the signal tokens) and
        grows the LLM's extra rows to cover them; returns what is wrong with ids given explicitly."""
        problems = []
        v = self.llm.vocab_size
        n = self.n_signal
        set_ = object.__setattr__
        if self.aud_token_id is None:
            set_(self, "aud_token_id", v)
        if self.vid_token_id is None:
            set_(self, "vid_token_id", v + 1)
        if self.aud_signal_ids is None:
            set_(self, "aud_signal_ids", tuple(range(v + 2, v + 2 + n)))
        if self.vid_signal_ids is None:
            set_(self, "vid_signal_ids", tuple(range(v + 2 + n, v + 2 + 2 * n)))
        set_(self, "aud_signal_ids", tuple(int(i) for i in self.aud_signal_ids))
        set_(self, "vid_signal_ids", tuple(int(i) for i in self.vid_signal_ids))
        ids = self.added_ids
        if len(self.aud_signal_ids) != n or len(self.vid_signal_ids) != n:
            problems.append(f"need {n} <AUDi> and {n} <VIDi> ids, got {len(self.aud_signal_ids)} and "
                            f"{len(self.vid_signal_ids)}")
        if len(set(ids)) != len(ids):
            problems.append(f"added token ids are not distinct: {ids}")
        if min(ids) < v:
            problems.append(
                f"added token ids {sorted(i for i in ids if i < v)} are < vocab_size={v}: they would use "
                "frozen pretrained rows; the added tokens must map to the trainable extra rows"
            )
        need = max(ids) + 1 - v
        if self.llm.extra_vocab < need:  # grow the extra rows to cover every added id
            set_(self, "llm", self.llm.replace(extra_vocab=need))
        return problems

    def _resolve_blocks(self) -> list[str]:
        """Builds each VAE block's config from the scalars, or checks one given (a stored config) against
        them; returns the disagreements, each naming the block and the field."""
        problems = []
        d = self.llm.hidden_size
        dtypes = {"dtype": self.llm.dtype, "param_dtype": self.llm.param_dtype}

        def vae(q: int, latent: int, out: int, units: int, conv: int, used: int, width: int, skip: bool
                ) -> VAEConfig:
            return VAEConfig(d_in=d, d_model=self.vae_d_model, num_queries=q, d_latent=latent, d_out=out,
                             num_heads=self.vae_heads, enc_layers=self.vae_layers, dec_layers=self.vae_layers,
                             dropout=self.vae_dropout, num_units=units, conv_kernel=conv,
                             unit_context=bool(units) and self.cs_unit_context, context_width=width,
                             context_skip=skip, d_used=used, **dtypes)

        conv = self.cs_conv
        wanted = {
            "cs_speech": (self.max_speech_len, self.cs_latent, self.speech_content_dim, self.cs_units, conv,
                          0, self.cs_context_width, self.cs_context_skip),
            "cs_video": (self.max_video_len, self.cs_latent, self.video_content_dim, self.cv_units, conv,
                         self.cv_dims, 0, False),
            **{name: (self.sd_queries, self.sd_latent, self.sd_code_dim, 0, 0, 0, 0, False)
               for name in SD_VAES},
        }
        for name, (q, latent, out, units, conv, used, width, skip) in wanted.items():
            c = getattr(self, name)
            if c is None:
                object.__setattr__(self, name, vae(q, latent, out, units, conv, used, width, skip))
                continue
            if isinstance(c, Mapping):
                c = VAEConfig(**c)
                object.__setattr__(self, name, c)
            if c.d_in != d:
                problems.append(f"{name}.d_in={c.d_in} != llm.hidden_size={d}")
            if c.num_units != units:
                problems.append(f"{name}.num_units={c.num_units} but cs_units={self.cs_units}, cv_units="
                                f"{self.cv_units} (the block should have {units})")
            if c.conv_kernel != conv:
                problems.append(f"{name}.conv_kernel={c.conv_kernel} but cs_conv={self.cs_conv} (the block "
                                f"should have {conv})")
            if c.context_width != width:
                problems.append(f"{name}.context_width={c.context_width} but the block should have {width} "
                                f"(cs_context_width={self.cs_context_width})")
            if c.context_skip != skip:
                problems.append(f"{name}.context_skip={c.context_skip} but the block should have {skip} "
                                f"(cs_context_skip={self.cs_context_skip})")
            if c.d_used != used:
                problems.append(f"{name}.d_used={c.d_used} but the block should have {used} (cv_dims="
                                f"{self.cv_dims})")
            if c.unit_context != (bool(units) and self.cs_unit_context):
                problems.append(f"{name}.unit_context={c.unit_context} but cs_unit_context="
                                f"{self.cs_unit_context} with {units} units")
            if name.startswith("cs_") and (c.num_queries, c.d_out) != (q, out):
                problems.append(
                    f"{name} has {c.num_queries} queries x {c.d_out}; the targets are {q} x {out}"
                )
        return problems

    # -- derived --------------------------------------------------------------------------------------------

    @property
    def added_ids(self) -> tuple[int, ...]:
        """Ids in `templates.added_tokens` order: <Aud>, <Vid>, <AUD1..n>, <VID1..n>."""
        return (self.aud_token_id, self.vid_token_id, *self.aud_signal_ids, *self.vid_signal_ids)

    @property
    def signal_ids(self) -> tuple[int, ...]:
        return (*self.aud_signal_ids, *self.vid_signal_ids)

    @property
    def token_ids(self) -> dict[str, int]:
        """{token: id}, the same mapping `templates.extend_tokenizer` returns."""
        aud, vid = signal_tokens(self.n_signal)
        return dict(zip([AUD_PLACEHOLDER, VID_PLACEHOLDER, *aud, *vid], self.added_ids, strict=True))

    @property
    def has_media(self) -> bool:
        return self.media_input and not self.pipeline_baseline

    @property
    def has_cs(self) -> bool:
        return self.use_cs and not self.pipeline_baseline

    @property
    def has_sd(self) -> bool:
        return self.use_sd and not self.pipeline_baseline

    @property
    def heads(self) -> frozenset[str]:
        """The optional heads this model has (subset of `HEADS`)."""
        return frozenset(h for h, on in (("cs", self.has_cs), ("sd", self.has_sd)) if on)

    def replace(self, **kw) -> EmpatheiaConfig:
        return dataclasses.replace(self, **kw)

    # -- serialisation --------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, LlamaConfig | LoraConfig):
                v = v.to_dict()
            elif isinstance(v, VAEConfig):
                v = dataclasses.asdict(v)
            elif isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        return out

    def function_dict(self) -> dict[str, Any]:
        """`to_dict()` less the fields that say how a step is computed, not what the model computes
        (`ce_chunk`, the backbone's `remat`): a stage may change them from the checkpoint it resumes or
        starts from."""
        d = {k: v for k, v in self.to_dict().items() if k not in EXECUTION_FIELDS}
        d["llm"] = {k: v for k, v in d["llm"].items() if k not in LLM_EXECUTION_FIELDS}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EmpatheiaConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown EmpatheiaConfig keys: {unknown}")
        d = dict(d)
        d["llm"] = d["llm"] if isinstance(d["llm"], LlamaConfig) else LlamaConfig.from_dict(d["llm"])
        if isinstance(d.get("lora"), Mapping):
            d["lora"] = LoraConfig.from_dict(d["lora"])
        for name in (*CS_VAES, *SD_VAES):
            if isinstance(d.get(name), Mapping):
                d[name] = VAEConfig(**d[name])
        for name in ("aud_signal_ids", "vid_signal_ids"):
            if d.get(name) is not None:
                d[name] = tuple(d[name])
        return cls(**d)


# ----------------------------------------------------------------------------------------------------------
# Heads
# ----------------------------------------------------------------------------------------------------------


def _dense(d_in: int, d_out: int, axes: tuple[str, str], rngs: nnx.Rngs, dtype, param_dtype) -> nnx.Linear:
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
            return _dense(d_in, d_out, axes, rngs, f32, pdt)

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
                self.aud_proj = _dense(cfg.audio_dim, d, ("features", "embed"), rngs, cdt, pdt)
                self.vid_proj = _dense(cfg.video_dim, d, ("features", "embed"), rngs, cdt, pdt)
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
        cfg = self.config
        heads = cfg.heads if heads is None else frozenset(heads)
        missing = sorted(heads - cfg.heads)
        if missing:
            raise ValueError(f"heads {missing} requested but this model has only {sorted(cfg.heads)}")
        ids = batch["input_ids"]
        keys = self._head_keys(rng, ids.shape[0], needed=bool(train and heads))
        hidden, mask, r_t_mask = self._backbone(batch)
        out: dict[str, Any] = {"logits": self.llm.logits(hidden), "hidden": hidden}
        out.update(self.gather_signal_states(hidden, ids, mask))
        out["r_t"] = hidden
        out["r_t_mask"] = r_t_mask
        vae: dict[str, VAEOutput] = {}
        sample = bool(train)
        if "cs" in heads:
            cs = self._content(batch, out["r_t"], out["r_t_mask"], sample=sample, rng=keys[0], video=video)
            vae.update(cs)
            out["speech_content"] = cs["cs_speech"].out
            if "cs_video" in cs:
                out["video_content"] = cs["cs_video"].out
        if "sd" in heads:
            sd = self.style_dis(out["r_s"], out["r_s_mask"], out["r_v"], out["r_v_mask"], sample=sample,
                                rng=keys[1])
            vae.update(sd.pop("vae"))
            out.update(sd)
            out["speech_emotion"] = vae["sd_speech_emotion"].out
            out["speech_profile"] = vae["sd_speech_profile"].out
            out["video_emotion"] = vae["sd_video_emotion"].out
            out["video_profile"] = vae["sd_video_profile"].out
        out["vae"] = vae
        return out

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
# Loss denominators (gradient accumulation)
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
    "CS_VAES",
    "HEADS",
    "SD_VAES",
    "ContentSynchronizer",
    "Empatheia",
    "EmpatheiaConfig",
    "StyleDisentangler",
    "SignalStandardizer",
    "copy_backbone",
    "run_vaes",
]
