"""EmpatheiaConfig: everything that shapes an Empatheia model, resolved and validated once.

Kept apart from the modules (`models/empatheia.py`, `models/heads.py`) because far more code reads a config
than builds a model: training validates and stores it, the weights layer writes it beside an export, serving
and evaluation read it back, and none of them needs the forward pass to do so. The config fills in what it
derives (the added token ids after the vocabulary, each VAE block's `VAEConfig` from the scalar knobs) and
reports every problem at once, naming the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

from empatheia_jax.data.templates import AUD_PLACEHOLDER, VID_PLACEHOLDER, signal_tokens
from empatheia_jax.models.llama import LlamaConfig
from empatheia_jax.models.lora import LoraConfig
from empatheia_jax.models.vae import VAEConfig

HEADS = ("cs", "sd")  # optional heads of the forward pass; a stage asks only for what its losses read
CS_VAES = ("cs_speech", "cs_video")
SD_VAES = ("sd_speech_emotion", "sd_speech_profile", "sd_video_emotion", "sd_video_profile")

# EmpatheiaConfig / LlamaConfig fields that trade memory for compute and leave the function unchanged.
EXECUTION_FIELDS = ("ce_chunk", "ce_targets")
LLM_EXECUTION_FIELDS = ("remat", "attention")


class _BlockSpec(NamedTuple):
    """What one VAE block must be, as the config's scalar knobs give it (`EmpatheiaConfig._block_specs`)."""

    queries: int  # rows out (Q)
    latent: int
    out: int  # width of each row out
    units: int  # unit vocabulary of a unit-aligned block (0: position-only queries)
    conv: int  # width of the depthwise row convolution (0: none)
    used: int  # leading dims of a row the generator reads (0: all)
    width: int  # width of the unit reader (0: vae_d_model)
    skip: bool  # the unit reader also reaches the rows directly


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
        for name, spec in self._block_specs().items():
            c = getattr(self, name)
            if c is None:
                object.__setattr__(self, name, self._block_config(spec))
                continue
            if isinstance(c, Mapping):
                c = VAEConfig(**c)
                object.__setattr__(self, name, c)
            problems += self._block_problems(name, c, spec)
        return problems

    def _block_specs(self) -> dict[str, _BlockSpec]:
        """Each VAE block as the scalars give it: the CS blocks' rows are the targets' and only they read
        units or convolve rows (a unit reader's width and skip: the speech block's); the SD blocks give
        sd_queries codes."""
        conv = self.cs_conv
        return {
            "cs_speech": _BlockSpec(self.max_speech_len, self.cs_latent, self.speech_content_dim,
                                    self.cs_units, conv, 0, self.cs_context_width, self.cs_context_skip),
            "cs_video": _BlockSpec(self.max_video_len, self.cs_latent, self.video_content_dim,
                                   self.cv_units, conv, self.cv_dims, 0, False),
            **{name: _BlockSpec(self.sd_queries, self.sd_latent, self.sd_code_dim, 0, 0, 0, 0, False)
               for name in SD_VAES},
        }

    def _block_config(self, spec: _BlockSpec) -> VAEConfig:
        """The VAEConfig of a block built from the scalars: the shared knobs, then the block's own spec."""
        return VAEConfig(d_in=self.llm.hidden_size, d_model=self.vae_d_model, num_queries=spec.queries,
                         d_latent=spec.latent, d_out=spec.out, num_heads=self.vae_heads,
                         enc_layers=self.vae_layers, dec_layers=self.vae_layers, dropout=self.vae_dropout,
                         num_units=spec.units, conv_kernel=spec.conv,
                         unit_context=bool(spec.units) and self.cs_unit_context, context_width=spec.width,
                         context_skip=spec.skip, d_used=spec.used, dtype=self.llm.dtype,
                         param_dtype=self.llm.param_dtype)

    def _block_problems(self, name: str, c: VAEConfig, spec: _BlockSpec) -> list[str]:
        """Where a given block config `c` disagrees with the scalars, each naming the block and the field."""
        problems = []
        d = self.llm.hidden_size
        q, out, units = spec.queries, spec.out, spec.units
        if c.d_in != d:
            problems.append(f"{name}.d_in={c.d_in} != llm.hidden_size={d}")
        if c.num_units != units:
            problems.append(f"{name}.num_units={c.num_units} but cs_units={self.cs_units}, cv_units="
                            f"{self.cv_units} (the block should have {units})")
        if c.conv_kernel != spec.conv:
            problems.append(f"{name}.conv_kernel={c.conv_kernel} but cs_conv={self.cs_conv} (the block "
                            f"should have {spec.conv})")
        if c.context_width != spec.width:
            problems.append(f"{name}.context_width={c.context_width} but the block should have {spec.width} "
                            f"(cs_context_width={self.cs_context_width})")
        if c.context_skip != spec.skip:
            problems.append(f"{name}.context_skip={c.context_skip} but the block should have {spec.skip} "
                            f"(cs_context_skip={self.cs_context_skip})")
        if c.d_used != spec.used:
            problems.append(f"{name}.d_used={c.d_used} but the block should have {spec.used} (cv_dims="
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


__all__ = [
    "CS_VAES",
    "EXECUTION_FIELDS",
    "HEADS",
    "LLM_EXECUTION_FIELDS",
    "SD_VAES",
    "EmpatheiaConfig",
]
