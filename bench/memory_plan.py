"""Memory plan of the real training step: bytes per device for parameters, optimizer state, batch and
activations/temporaries, from the trainer's own jitted step compiled for a fake mesh of CPU devices.

    python bench/memory_plan.py --config configs/vicuna7b.py --stage overall \
        [--layers 32 | --layers 2,4] [--meshes fsdp=8 fsdp=4,tensor=2 ...] [--micro 1] [--seq 1024,2048] \
        [--remat none,dots,full] [--param-dtype float32] [--override model.lora.rank=8 ...] [--json OUT]

Why: a 7B run that does not fit is found out after minutes of model loading on expensive machines; the
plan answers "which mesh, micro-batch, sequence length and remat policy fit in 80 GB (H100) or 16 / 95 GB
(TPU v5e / v5p)?" on a CPU box, before any of that is rented.

How: the model is built abstractly (`nnx.eval_shape`: shapes, dtypes and logical axes, no weights), split
and given the rule shardings exactly as the trainer does (`stages.make_optimizer`, `stages.split_for_step`,
`sharding.state_shardings`), and the trainer's own step (`step.jit_step`: the scan over micro-batches,
the gradient, the optax update, the non-finite guard) is lowered and compiled for a mesh of
`--xla_force_host_platform_device_count` fake CPU devices. Nothing is allocated or run.

Columns (per device, GiB = 2**30 bytes):
- params: the parameters (frozen backbone + trainable), sum over leaves of the per-device shard,
  `prod(sharding.shard_shape(shape)) * itemsize`, from the sharded abstract state. Cross-checked against a
  hand count from the config (`hand_count`: every weight listed from the architecture, sharded by the
  logical-axis rules); the two must be equal to the byte.
- opt: the optimizer state (`nnx.Optimizer` over the stage's trainable groups: AdamW mu + nu per trainable
  leaf, the step counter and two optax counts), measured the same way and cross-checked the same way.
- batch: one step's input batch `[grad_accum, micro, ...]` (`batching.batch_spec` of the stage, micro
  axis sharded over data x fsdp as `pipelines.step_batch` does) plus the step key.
- temp: `compiled.memory_analysis().temp_size_in_bytes`: everything XLA allocates besides arguments and
  outputs: activations saved for the backward pass, gradient accumulators, all-gathered weights, logits
  and every other temporary, after XLA's buffer sharing. XLA does not label them; docs/design.md gives the
  hand split.
- total: `argument + output - alias + temp` from `memory_analysis()` (donated params / optimizer state alias
  their outputs, so they count once). The fit columns compare it with 80 GiB (H100), 16 GiB (v5e) and
  95 GiB (v5p): "yes" below 90 % of the memory, "tight" up to 100 % (runtime reserve, fragmentation), else
  "no".
- FLOPs per optimizer step: `compiled.cost_analysis()["flops"]` of the partitioned (per-device) program times
  devices times grad_accum, because XLA's cost analysis counts a while-loop body (the micro-batch scan) once.
  It includes rematerialised forwards and work replicated over the tensor axis. Beside it the trainer's MFU
  convention (`metrics.flops_per_token`: 4N + 2 N_trainable + attention) and the textbook 6N, both times
  the step's tokens (grad_accum x micro x seq, every position counted).

Caveats: the numbers are XLA:CPU's buffer assignment of the SPMD-partitioned program. GPU and TPU compile the
same HLO with other fusion and scheduling decisions, so temp is an estimate there (params, opt and batch are
exact). `--layers A,B` compiles two depths and extrapolates temp and FLOPs linearly to the full depth
(params/opt/batch are computed at the full depth, not extrapolated); rows say so.

Findings it led to (docs/design.md, "Memory plan of the 7B step"): without activation constraints GSPMD
all-gathered the micro-batch onto every device (fixed by `sharding.constrain`), and XLA hoisted every
layer's FSDP weight gather out of the micro-batch loop (fixed by the barrier in `step.make_step`);
the 7B overall step at fsdp=8, full remat went from 63 to 8 GiB of temporaries. `residuals` (the
JAX-level saved values per shard) is what the remat policy keeps between forward and backward.
Extrapolate the overall stage from 4 and 8 layers (`--layers 4,8`): at 2 layers its peak falls at another
point of the program than at 4, and the line through 2 and 4 overstates 32 layers (15.5 vs 8.0 GiB).
"""

from __future__ import annotations

import os
import sys

# Before jax is imported: CPU only, offline, quiet C++ logging (XLA's "Very slow compile?" alarm fires on
# every 7B compile here; real errors still raise in Python).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse  # noqa: E402
import ast  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterable, Iterator, Mapping, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GiB = 2**30
# Device memory the fit columns compare against (what the chip has; the runtime keeps some of it).
DEVICES = {"H100 80G": 80 * GiB, "v5e 16G": 16 * GiB, "v5p 95G": 95 * GiB}
TIGHT = 0.9  # above this fraction of a device's memory a row is "tight", not "yes"

DEFAULT_MESHES = ("fsdp=8", "fsdp=4,tensor=2", "data=2,fsdp=4", "fsdp=16", "fsdp=32")
# lmsys/vicuna-7b-v1.5 config.json: the backbone of configs/vicuna7b.py when no converted folder is given.
VICUNA_7B = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
# Default feature widths when no shards manifest is given: the paper's encoders (HuBERT-large, CLIP ViT-L/14).
AUDIO_DIM, VIDEO_DIM = 1024, 1024
# XLA:CPU options of the plan's compiles. The scheduler: XLA:CPU's default orders the program for thread
# concurrency and keeps ~1.5x the live bytes of its memory-minimising scheduler (8-layer tiny step: 22.4 vs
# 12.6 MB), which no accelerator run would see; GPU/TPU schedulers minimise memory. The two LLVM options
# only cut codegen time: buffer assignment (memory_analysis) and cost analysis run on the optimised HLO
# before LLVM (checked on the 2-layer 7B step: every byte and FLOP equal).
SCHEDULERS = {"memory": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED", "default": "CPU_SCHEDULER_TYPE_DEFAULT"}
FAST_CODEGEN = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def compiler_options(scheduler: str = "memory", fast: bool = True) -> dict[str, Any]:
    return {"xla_cpu_scheduler_type": SCHEDULERS[scheduler], **(FAST_CODEGEN if fast else {})}


# optax / nnx scalars of the trainer's optimizer: nnx.Optimizer.step (uint32), ScaleByAdamState.count and
# the schedule's ScaleByScheduleState.count (int32). Clipping and the weight-decay mask hold no state.
OPT_SCALAR_BYTES = 3 * 4


# ----------------------------------------------------------------------------------------------------------
# Config: which model, which meshes
# ----------------------------------------------------------------------------------------------------------


def load_config(spec: str, stage: str | None, overrides: Sequence[str] = ()) -> Any:
    """`path.py[:arg]` -> its `get_config(arg)`, with `stage` and `KEY=VALUE` overrides applied (values are
    Python literals, else strings), as `empatheia train --config` reads it."""
    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location(f"_plan_config_{Path(path).stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise SystemExit(f"--config {path}: not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    config = module.get_config(arg or None)
    if stage:
        config.stage = stage
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--override {item!r}: expected KEY=VALUE")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        *parents, leaf = key.split(".")
        node = config
        for p in parents:
            node = node[p]
        node[leaf] = value
    return config


def parse_mesh(text: str) -> dict[str, int]:
    """`fsdp=4,tensor=2` (also `fsdp=4xtensor=2`) -> {"data": 1, "fsdp": 4, "tensor": 2}."""
    sizes = {"data": 1, "fsdp": 1, "tensor": 1}
    for part in text.replace("x", ",").split(","):
        name, sep, value = part.strip().partition("=")
        if not sep or name not in sizes or not value.isdigit() or int(value) < 1:
            raise SystemExit(f"mesh {text!r}: expected data=N,fsdp=N,tensor=N (each optional, N >= 1)")
        sizes[name] = int(value)
    return sizes


def mesh_name(sizes: Mapping[str, int]) -> str:
    return " x ".join(f"{k}={v}" for k, v in sizes.items() if v > 1) or "1 device"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def llm_config(config: Any, layers: int | None = None, remat: str | None = None) -> Any:
    """The run's LlamaConfig: a converted backbone's config.json, else the config's own random backbone
    (tests), else Vicuna-7B v1.5's shape; then config.model.llm's overrides, `layers` and `remat`."""
    from empatheia_jax.models.llama import LlamaConfig
    from empatheia_jax.weights.checkpoint_io import read_config

    fields = dict(config.model.llm)
    if config.model.backbone:
        base = read_config(config.model.backbone)[0].to_dict()
    elif "hidden_size" in fields:
        base = {}
        if not fields.get("vocab_size"):
            raise SystemExit("model.llm.vocab_size=0 means len(tokenizer): "
                             "pass --override model.llm.vocab_size=N")
    else:
        base = dict(VICUNA_7B)
    cfg = LlamaConfig.from_dict({**base, **fields})
    if layers is not None:
        cfg = cfg.replace(num_hidden_layers=layers)
    if remat is not None:
        cfg = cfg.replace(remat=remat)
    return cfg


def feature_dims(config: Any, audio_dim: int, video_dim: int) -> dict[str, Any]:
    """The manifest fields the model reads: the shards' when `data.shards` exists, else the given widths."""
    shards = config.data.shards
    if shards and Path(shards, "manifest.json").exists():
        from empatheia_jax.data.shard_format import load_manifest

        return load_manifest(shards)
    return {"features": {"audio_dim": audio_dim, "video_dim": video_dim}}


def empatheia_config(config: Any, llm: Any, manifest: Mapping[str, Any]) -> Any:
    """The EmpatheiaConfig `init.build_model` would build (`model_config_overrides` on this backbone);
    the added-token ids are the defaults, which are what `from_llm` assigns to a vocab_size-long tokenizer."""
    from empatheia_jax.models.empatheia_config import EmpatheiaConfig
    from empatheia_jax.train import init

    return EmpatheiaConfig(llm=llm, **init.model_config_overrides(config, manifest))


# ----------------------------------------------------------------------------------------------------------
# The hand count: every parameter from the architecture, sharded by the rules
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter as the architecture defines it (written out here, not read from the model)."""

    path: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names (sharding.LOGICAL_RULES)
    itemsize: int
    group: str | None  # trainable group (models.trainable); None = the frozen backbone


def _itemsize(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def llama_leaves(llm: Any, lora: Any) -> list[Leaf]:
    """Backbone: embedding, per layer q/k/v/o + SwiGLU + two RMSNorms, final norm, lm_head, the added-token
    rows (`*_extra`, group added_rows) and LoRA A [in, r] / B [r, out] on the targets (always float32:
    `nnx.LoRALinear`'s lora_param_dtype)."""
    p = _itemsize(llm.param_dtype)
    d, f, v, e = llm.hidden_size, llm.intermediate_size, llm.vocab_size, llm.extra_vocab
    q, kv = llm.num_attention_heads * llm.head_dim, llm.num_key_value_heads * llm.head_dim
    proj = {
        "self_attn.q_proj": ((d, q), ("embed", "heads")),
        "self_attn.k_proj": ((d, kv), ("embed", "kv_heads")),
        "self_attn.v_proj": ((d, kv), ("embed", "kv_heads")),
        "self_attn.o_proj": ((q, d), ("heads", "embed")),
        "mlp.gate_proj": ((d, f), ("embed", "mlp")),
        "mlp.up_proj": ((d, f), ("embed", "mlp")),
        "mlp.down_proj": ((f, d), ("mlp", "embed")),
    }
    out = [Leaf("llm.embed_tokens.embedding", (v, d), ("vocab", "embed"), p, None)]
    for i in range(llm.num_hidden_layers):
        pre = f"llm.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out.append(Leaf(f"{pre}.{norm}.scale", (d,), ("norm",), p, None))
        for name, (shape, axes) in proj.items():
            out.append(Leaf(f"{pre}.{name}.kernel", shape, axes, p, None))
            if lora is not None and name.split(".")[1] in lora.targets:
                out.append(Leaf(f"{pre}.{name}.lora.lora_a", (shape[0], lora.rank), (axes[0], "lora_rank"), 4,
                                "lora"))
                out.append(Leaf(f"{pre}.{name}.lora.lora_b", (lora.rank, shape[1]), ("lora_rank", axes[1]), 4,
                                "lora"))
    out.append(Leaf("llm.norm.scale", (d,), ("norm",), p, None))
    if not llm.tie_word_embeddings:
        out.append(Leaf("llm.lm_head.kernel", (d, v), ("embed", "vocab"), p, None))
    if e:
        out.append(Leaf("llm.embed_extra", (e, d), (None, "embed"), p, "added_rows"))
        if not llm.tie_word_embeddings:
            out.append(Leaf("llm.lm_head_extra", (d, e), ("embed", None), p, "added_rows"))
    return out


def _dense(path: str, d_in: int, d_out: int, axes: tuple[str | None, str | None], p: int,
           group: str) -> list[Leaf]:
    """`nnx.Linear` with bias: kernel [in, out] and bias [out] (the bias takes the output axis)."""
    return [Leaf(f"{path}.kernel", (d_in, d_out), axes, p, group),
            Leaf(f"{path}.bias", (d_out,), axes[1:], p, group)]


def vae_leaves(path: str, c: Any, group: str) -> list[Leaf]:
    """One TransformerVAE: queries, FFN(h), encoder stack, mu/logvar heads, FFN(z), decoder stack, out_proj.
    A query layer = 3 LayerNorms (scale + bias), self- and cross-attention (`nnx.MultiHeadAttention`:
    q/k/v kernels [dm, heads, dm/heads] with biases, out kernel [heads, dm/heads, dm] + bias) and an MLP."""
    p = _itemsize(c.param_dtype)
    dm, dh, hd = c.d_model, c.d_hidden, c.d_model // c.num_heads

    def norm(n: str) -> list[Leaf]:
        return [Leaf(f"{n}.scale", (dm,), ("norm",), p, group), Leaf(f"{n}.bias", (dm,), ("norm",), p, group)]

    def ffn(n: str, d_in: int, in_axis: str) -> list[Leaf]:
        return (_dense(f"{n}.fc1", d_in, dh, (in_axis, "mlp"), p, group)
                + _dense(f"{n}.fc2", dh, dm, ("mlp", "embed"), p, group))

    def attention(n: str) -> list[Leaf]:
        out = []
        for proj in ("query", "key", "value"):
            out.append(Leaf(f"{n}.{proj}.kernel", (dm, c.num_heads, hd), ("embed", "heads", "head_dim"), p,
                            group))
            out.append(Leaf(f"{n}.{proj}.bias", (c.num_heads, hd), ("heads", "head_dim"), p, group))
        out.append(Leaf(f"{n}.out.kernel", (c.num_heads, hd, dm), ("heads", "head_dim", "embed"), p, group))
        out.append(Leaf(f"{n}.out.bias", (dm,), ("embed",), p, group))
        return out

    def stack(n: str, layers: int) -> list[Leaf]:
        out = []
        for i in range(layers):
            q = f"{n}.layers.{i}"
            out += norm(f"{q}.self_norm") + attention(f"{q}.self_attn") + norm(f"{q}.cross_norm")
            out += attention(f"{q}.cross_attn") + norm(f"{q}.mlp_norm") + ffn(f"{q}.mlp", dm, "embed")
        return out + norm(f"{n}.memory_norm") + norm(f"{n}.final_norm")

    out = [Leaf(f"{path}.queries", (c.num_queries, dm), ("queries", "embed"), p, group)]
    out += ffn(f"{path}.in_ffn", c.d_in, "embed") + stack(f"{path}.encoder", c.enc_layers)
    out += _dense(f"{path}.mu_head", dm, c.d_latent, ("embed", "features"), p, group)
    out += _dense(f"{path}.logvar_head", dm, c.d_latent, ("embed", "features"), p, group)
    out += ffn(f"{path}.z_ffn", c.d_latent, "features") + stack(f"{path}.decoder", c.dec_layers)
    return out + _dense(f"{path}.out_proj", dm, c.d_out, ("embed", "features"), p, group)


def head_leaves(cfg: Any) -> list[Leaf]:
    """Projections (group proj), the Content Synchronizer (cs) and the Style Disentangler (sd: input
    standardisers, four VAEs, style layers, fusion and the four classifiers)."""
    p = _itemsize(cfg.llm.param_dtype)
    d = cfg.llm.hidden_size
    out: list[Leaf] = []
    if cfg.has_media:
        out += _dense("aud_proj", cfg.audio_dim, d, ("features", "embed"), p, "proj")
        out += _dense("vid_proj", cfg.video_dim, d, ("features", "embed"), p, "proj")
    if cfg.has_cs:
        out += vae_leaves("content_sync.speech", cfg.cs_speech, "cs")
        out += vae_leaves("content_sync.video", cfg.cs_video, "cs")
    if cfg.has_sd:
        for m in ("speech_in", "video_in"):
            out += [Leaf(f"style_dis.{m}.shift", (cfg.n_signal, d), (None, "embed"), p, "sd"),
                    Leaf(f"style_dis.{m}.scale", (d,), ("embed",), p, "sd")]
        blocks = {"speech_emotion": cfg.sd_speech_emotion, "speech_profile": cfg.sd_speech_profile,
                  "video_emotion": cfg.sd_video_emotion, "video_profile": cfg.sd_video_profile}
        for name, c in blocks.items():
            out += vae_leaves(f"style_dis.{name}", c, "sd")
        width = {name: c.num_queries * c.d_out for name, c in blocks.items()}
        ff = ("features", "features")
        for name, (a, b), d_out in (("speech_style", ("speech_emotion", "speech_profile"), cfg.style_dim),
                                    ("video_style", ("video_emotion", "video_profile"), cfg.style_dim),
                                    ("emotion_fuse", ("speech_emotion", "video_emotion"), cfg.fuse_dim),
                                    ("profile_fuse", ("speech_profile", "video_profile"), cfg.fuse_dim)):
            out += _dense(f"style_dis.{name}", width[a] + width[b], d_out, ff, p, "sd")
        for head, n in (("emotion", cfg.num_emotions), ("age", cfg.num_ages), ("gender", cfg.num_genders),
                        ("timbre", cfg.num_timbres)):
            out += _dense(f"style_dis.{head}_head", cfg.fuse_dim, n, ("features", "classes"), p, "sd")
    return out


def param_inventory(cfg: Any) -> list[Leaf]:
    """Every parameter of an Empatheia model with this config."""
    return llama_leaves(cfg.llm, cfg.lora) + head_leaves(cfg)


def shard_divisor(leaf: Leaf, mesh: Mapping[str, int]) -> int:
    """How many pieces the rules cut this parameter into: each dimension is split over the mesh axes its
    logical name maps to (`sharding.LOGICAL_RULES`), unless they do not divide it (then it stays whole, as
    `sharding.state_shardings` does)."""
    from empatheia_jax.sharding import logical_to_spec

    spec = tuple(logical_to_spec(leaf.axes))
    div = 1
    for dim, axis in zip(leaf.shape, spec + (None,) * (len(leaf.shape) - len(spec)), strict=True):
        names = (axis,) if isinstance(axis, str) else tuple(axis or ())
        size = math.prod(mesh[a] for a in names)
        div *= size if dim % size == 0 else 1
    return div


@dataclasses.dataclass(frozen=True)
class HandCount:
    """Bytes from the hand count; `*_per_device` = one device's shards on the given mesh."""

    n_params: int
    n_trainable: int
    params: int
    trainable: int
    optimizer: int
    params_per_device: int
    trainable_per_device: int
    optimizer_per_device: int


def hand_count(cfg: Any, trainable_groups: Iterable[str], mesh: Mapping[str, int]) -> HandCount:
    """Parameter and optimizer-state bytes of the stage, whole and per device.

    Optimizer state = what `init.make_tx` + `stages.make_optimizer` hold: AdamW's mu and nu for every
    trainable leaf (same dtype and sharding as the leaf; frozen leaves have none) plus OPT_SCALAR_BYTES of
    counters on every device.
    """
    groups = set(trainable_groups)
    leaves = param_inventory(cfg)
    train = [leaf for leaf in leaves if leaf.group in groups]

    def total(ls: list[Leaf]) -> int:
        return sum(math.prod(leaf.shape) * leaf.itemsize for leaf in ls)

    def per_device(ls: list[Leaf]) -> int:
        return sum(math.prod(leaf.shape) * leaf.itemsize // shard_divisor(leaf, mesh) for leaf in ls)

    return HandCount(
        n_params=sum(math.prod(leaf.shape) for leaf in leaves),
        n_trainable=sum(math.prod(leaf.shape) for leaf in train),
        params=total(leaves),
        trainable=total(train),
        optimizer=2 * total(train) + OPT_SCALAR_BYTES,
        params_per_device=per_device(leaves),
        trainable_per_device=per_device(train),
        optimizer_per_device=2 * per_device(train) + OPT_SCALAR_BYTES,
    )


# ----------------------------------------------------------------------------------------------------------
# The abstract model and the compiled step
# ----------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def cheap_tracer_errors() -> Iterator[None]:
    """Builds of the abstract Empatheia take ~3 s instead of ~100 s (2 layers; more with depth) inside this.

    flax's `Variable.set_value` probes `getattr(value, "sharding", None)` on every traced write (each rng
    draw, each init). On a tracer that raises an AttributeError whose message JAX builds by walking the
    whole jaxpr traced so far (`_origin_msg`), so the build is quadratic in the model. getattr discards the
    message; an empty one changes nothing else. (`sharding.create_sharded` pays the same cost; the trainer
    traces no construction: `llama.base_shapes_only`.)
    """
    from jax._src.interpreters import partial_eval as pe

    original = pe.DynamicJaxprTracer._origin_msg
    pe.DynamicJaxprTracer._origin_msg = lambda self: ""
    try:
        yield
    finally:
        pe.DynamicJaxprTracer._origin_msg = original


@dataclasses.dataclass
class AbstractRun:
    """The trainer's step arguments as ShapeDtypeStructs carrying their shardings (nothing allocated)."""

    model: Any
    graphs: Any
    params: Any
    frozen: Any
    opt_state: Any


def build_abstract(config: Any, cfg: Any) -> tuple[Any, Any]:
    """(abstract model, abstract optimizer): `Empatheia(cfg)` and `stages.make_optimizer` under eval_shape."""
    from flax import nnx

    from empatheia_jax.models.empatheia import Empatheia
    from empatheia_jax.train import config as config_lib
    from empatheia_jax.train import init, stages

    stage = config_lib.resolve_stage(config)
    tx, _ = init.make_tx(config, config_lib.stage_schedule(config))

    def build():
        model = Empatheia(cfg, rngs=nnx.Rngs(config.seed + 1))
        return model, stages.make_optimizer(model, stage, tx)

    with cheap_tracer_errors():
        return nnx.eval_shape(build)


def place(model: Any, optimizer: Any, stage: Any, mesh: Any) -> AbstractRun:
    """`stages.split_for_step` of the abstract pair, every leaf given the sharding `sharding.shard_model`
    would give it (the optimizer state inherits its parameter's logical axes, as under `jax.set_mesh`)."""
    import jax

    from empatheia_jax import sharding
    from empatheia_jax.train import stages

    graphs, params, frozen, opt_state = stages.split_for_step(model, optimizer, stage)

    def with_shardings(state):
        shardings = sharding.state_shardings(state, mesh)
        return jax.tree.map(lambda s, n: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=n), state, shardings)

    return AbstractRun(model, graphs, with_shardings(params), with_shardings(frozen),
                       with_shardings(opt_state))


def bytes_per_device(tree: Any) -> int:
    """Sum over the leaves of one device's shard: `prod(sharding.shard_shape(shape)) * itemsize`."""
    import jax

    return sum(math.prod(x.sharding.shard_shape(x.shape)) * _nbytes(x.dtype) for x in jax.tree.leaves(tree))


def _nbytes(dtype: Any) -> int:
    """Bytes per element; a typed PRNG key counts its key data (2 x uint32 for threefry)."""
    import jax

    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return jax.random.key_data(jax.random.key(0)).nbytes
    return dtype.itemsize


def abstract_batch(config: Any, stage: Any, cfg: Any, micro: int, seq: int, accum: int | None = None,
                   sharding: Any = None) -> dict[str, Any]:
    """One step's batch `[accum, micro, ...]` (or one micro-batch `[micro, ...]`) as the trainer gets it:
    `batching.batch_spec` of the stage's pipeline, with `sharding` on every array."""
    import jax

    from empatheia_jax.data.batching import batch_spec
    from empatheia_jax.data.pipeline_config import PipelineConfig, pipeline_config_fields

    fields = pipeline_config_fields(cfg, stage, {"max_aud": int(config.data.max_aud),
                                                 "max_vid": int(config.data.max_vid)})
    spec = batch_spec(PipelineConfig(max_len=max(seq, 16), **fields), micro, seq, audio_dim=cfg.audio_dim,
                      video_dim=cfg.video_dim)
    lead = () if accum is None else (accum,)
    return {k: jax.ShapeDtypeStruct(lead + shape, dtype, sharding=sharding)
            for k, (shape, dtype) in spec.items()}


@dataclasses.dataclass
class Compiled:
    """XLA's analyses of one compiled step (per device)."""

    argument: int  # the inputs the program reads (jit prunes unused ones)
    output: int
    alias: int  # outputs written into donated inputs
    temp: int
    flops: float  # the scan body counted once (XLA's cost analysis)
    batch: int  # batch + key, from the abstract shardings
    residuals: int  # saved for the backward of one micro-batch, global bytes (JAX level)
    seconds: float  # lower + compile (+ residual trace)


def compile_step(config: Any, run: AbstractRun, stage: Any, mesh: Any, micro: int, accum: int, seq: int,
                 options: Mapping[str, Any]) -> Compiled:
    """Lowers and compiles `step.jit_step` (the real step) for these abstract arguments and reads XLA's
    memory and cost analyses; the batch is sharded like `pipelines.step_batch` shards it."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from empatheia_jax.train import step as step_lib

    t0 = time.perf_counter()
    step = step_lib.jit_step(stage, step_lib.loss_weights(config), run.params, run.opt_state,
                             compiler_options=options)
    batch = abstract_batch(config, stage, run.model.config, micro, seq, accum,
                           NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp"))))
    key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype,
                               sharding=NamedSharding(mesh, PartitionSpec()))
    with jax.set_mesh(mesh):  # as the trainer calls it: the model's activation constraints apply
        compiled = step.lower(run.graphs, run.params, run.frozen, run.opt_state, batch, key).compile()
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    residuals = residual_bytes(config, run, stage, micro, seq)
    return Compiled(
        argument=int(mem.argument_size_in_bytes),
        output=int(mem.output_size_in_bytes),
        alias=int(mem.alias_size_in_bytes),
        temp=int(mem.temp_size_in_bytes),
        flops=float(cost.get("flops", 0.0)),
        batch=bytes_per_device(batch) + bytes_per_device(key),
        residuals=residuals,
        seconds=time.perf_counter() - t0,
    )


def residual_bytes(config: Any, run: AbstractRun, stage: Any, micro: int, seq: int) -> int:
    """Bytes JAX's autodiff keeps from the forward for the backward of one micro-batch (global, all
    examples): what the remat policy decides, before XLA's layout and scheduling. The gradient is taken
    w.r.t. the trainable params only, as in the step; residuals that are inputs (params, frozen weights, the
    batch) or constants are not counted, they exist anyway. `saved_residuals` differentiates w.r.t. every
    argument, so the frozen weights and the batch pass through `_no_gradient` and its outputs (the inputs
    themselves, which full remat saves at every checkpoint) are recognised by that name and left out."""
    import jax
    from jax._src.ad_checkpoint import saved_residuals  # public jax only prints them

    from empatheia_jax.train import objective
    from empatheia_jax.train import step as step_lib

    loss_fn = objective.make_loss_fn(stage, step_lib.loss_weights(config))
    graphdef = run.graphs.model

    def _no_gradient(tree):
        return jax.lax.stop_gradient(tree)

    def loss(params, frozen, batch, keys):
        frozen, batch = _no_gradient((frozen, batch))
        counts = objective.loss_counts(run.model.config, batch)
        return loss_fn(params, graphdef, frozen, batch, keys, counts=counts)[0]

    batch = abstract_batch(config, stage, run.model.config, micro, seq)
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), micro))
    strip = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)  # noqa: E731
    found = saved_residuals(loss, strip(run.params), strip(run.frozen), batch, keys)
    return sum(math.prod(aval.shape) * _nbytes(aval.dtype) for aval, src in found
               if not src.startswith(("from the argument", "from a constant"))
               and "_no_gradient)" not in src)


# ----------------------------------------------------------------------------------------------------------
# Rows of the plan
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Point:
    """One configuration of the plan."""

    mesh: dict[str, int]
    micro_per_shard: int  # examples per data x fsdp shard in one micro-batch
    seq: int
    remat: str


@dataclasses.dataclass
class Row:
    """One line of the table; bytes are per device."""

    mesh: str
    devices: int
    micro_per_shard: int
    micro: int  # global micro-batch: examples per scan iteration, split over data x fsdp
    grad_accum: int  # micro-batches per optimizer step: batch_size // micro (at least 1)
    seq: int
    remat: str
    layers: int
    compiled_layers: list[int]  # depth(s) compiled; two = temp, residuals and FLOPs extrapolated to `layers`
    params: int  # frozen + trainable parameters, from the sharded abstract state
    opt: int  # optimizer state, idem
    hand_params: int  # the same two from the hand count
    hand_opt: int
    batch: int  # step batch + key
    residuals: int  # JAX-level saved residuals of one micro-batch / (data x fsdp)
    temp: int  # XLA temp_size_in_bytes
    total: int  # params + opt + batch + (output - alias) + temp
    argument: int  # XLA argument_size_in_bytes (<= params + opt + batch: unused inputs are pruned)
    output: int
    alias: int
    donated: int  # trainable params + optimizer state: what alias should be
    flops_xla: float  # per optimizer step, all devices
    flops_trainer: float  # metrics.flops_per_token x tokens
    flops_6n: float
    seconds: float
    fits: dict[str, str] = dataclasses.field(default_factory=dict)


def plan_points(meshes: Sequence[dict[str, int]], micros: Sequence[int], seqs: Sequence[int],
                remats: Sequence[str]) -> list[Point]:
    return [Point(m, b, t, r) for m in meshes for b in micros for t in seqs for r in remats]


def fit(total: int) -> dict[str, str]:
    return {name: "yes" if total <= TIGHT * cap else "tight" if total <= cap else "no"
            for name, cap in DEVICES.items()}


def model_flops(model: Any, n_trainable: int, seq: int, tokens: int) -> tuple[float, float]:
    """(trainer convention, 6N) FLOPs for `tokens` tokens of length-`seq` sequences; N = the backbone's
    parameters without the embedding lookup, `metrics.flops_per_token`'s N."""
    from empatheia_jax.train.metrics import flops_per_token

    llm = model.config.llm
    per_token = flops_per_token(model, seq, n_trainable)
    attention = 12 * llm.num_hidden_layers * seq * llm.num_attention_heads * llm.head_dim
    n = (per_token - 2 * n_trainable - attention) / 4
    return per_token * tokens, 6 * n * tokens


def at_depth(values: Mapping[int, float], depth: int) -> float:
    """The value at `depth`: measured there, or on the line through two measured depths."""
    if depth in values:
        return values[depth]
    if len(values) != 2:
        raise ValueError(f"need depth {depth} itself or two depths to extrapolate from, got {sorted(values)}")
    (d0, v0), (d1, v1) = sorted(values.items())
    return v1 + (v1 - v0) / (d1 - d0) * (depth - d1)


def check_trainer_accepts(config: Any, point: Point, micro: int, accum: int, n_dev: int) -> None:
    """The plan only lists configurations `empatheia train` would run (`config.validate`)."""
    from empatheia_jax.train import config as config_lib

    trial = config.copy_and_resolve_references()
    trial.train.batch_size, trial.train.grad_accum = micro * accum, accum
    trial.mesh.update(point.mesh)
    trial.model.llm.remat = point.remat
    config_lib.validate(trial, device_count=n_dev, process_count=1, check_paths=False)


def measure(config: Any, point: Point, layers: Sequence[int], full_layers: int, manifest: Mapping[str, Any],
            options: Mapping[str, Any]) -> Row:
    """One row: params / opt / batch (abstract, and the hand count) at `full_layers`; temp, residuals and
    FLOPs compiled at `layers` (one depth: as measured; two: on the line through them, at `full_layers`)."""
    import jax

    from empatheia_jax import sharding
    from empatheia_jax.train import config as config_lib

    stage = config_lib.resolve_stage(config)
    n_dev = math.prod(point.mesh.values())
    if jax.device_count() < n_dev:
        raise SystemExit(f"mesh {mesh_name(point.mesh)} needs {n_dev} devices, jax has {jax.device_count()} "
                         "(run as a script: it sets --xla_force_host_platform_device_count)")
    mesh = sharding.make_mesh(**point.mesh, devices=jax.devices()[:n_dev])
    shards = point.mesh["data"] * point.mesh["fsdp"]
    micro = point.micro_per_shard * shards
    accum = max(1, int(config.train.batch_size) // micro)
    check_trainer_accepts(config, point, micro, accum, n_dev)

    def run_at(depth: int) -> AbstractRun:
        cfg = empatheia_config(config, llm_config(config, depth, point.remat), manifest)
        return place(*build_abstract(config, cfg), stage, mesh)

    full = run_at(full_layers)
    compiled = {d: compile_step(config, full if d == full_layers else run_at(d), stage, mesh, micro, accum,
                                point.seq, options) for d in layers}
    params = bytes_per_device(full.params) + bytes_per_device(full.frozen)
    opt = bytes_per_device(full.opt_state)
    hand = hand_count(full.model.config, stage.trainable_groups, point.mesh)
    donated = bytes_per_device(full.params) + opt
    deepest = compiled[max(layers)]
    if full_layers in compiled:
        c = compiled[full_layers]
        argument, output, alias = c.argument, c.output, c.alias
    else:  # the full-depth program: its inputs and donations are known; its metrics do not grow with depth
        argument, alias = params + opt + deepest.batch, donated
        output = donated + deepest.output - deepest.alias
    temp = int(at_depth({d: c.temp for d, c in compiled.items()}, full_layers))
    residuals = int(at_depth({d: c.residuals for d, c in compiled.items()}, full_layers)) // shards
    flops = at_depth({d: c.flops for d, c in compiled.items()}, full_layers)
    f_trainer, f_6n = model_flops(full.model, hand.n_trainable, point.seq, accum * micro * point.seq)
    total = params + opt + deepest.batch + output - alias + temp
    return Row(
        mesh=mesh_name(point.mesh), devices=n_dev, micro_per_shard=point.micro_per_shard, micro=micro,
        grad_accum=accum, seq=point.seq, remat=point.remat, layers=full_layers, compiled_layers=list(layers),
        params=params, opt=opt, hand_params=hand.params_per_device, hand_opt=hand.optimizer_per_device,
        batch=deepest.batch, residuals=residuals, temp=temp, total=total, argument=argument, output=output,
        alias=alias, donated=donated, flops_xla=flops * n_dev * accum, flops_trainer=f_trainer, flops_6n=f_6n,
        seconds=sum(c.seconds for c in compiled.values()), fits=fit(total),
    )


# ----------------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------------


def gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def table(rows: Sequence[Row]) -> str:
    """The Markdown table (GiB per device, TFLOP per optimizer step)."""
    head = ("| mesh | micro/shard x seq (global micro, accum) | remat | layers | params | opt | batch | "
            "resid | temp | total | " + " | ".join(DEVICES) + " | XLA TFLOP | 4N+2Nt+attn | 6N | s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        depth = str(r.layers) if r.compiled_layers == [r.layers] else (
            f"{r.layers} (from {','.join(map(str, r.compiled_layers))})")
        lines.append(
            f"| {r.mesh} | {r.micro_per_shard} x {r.seq} ({r.micro}, {r.grad_accum}) | {r.remat} | {depth} | "
            f"{gib(r.params)} | {gib(r.opt)} | {gib(r.batch)} | {gib(r.residuals)} | {gib(r.temp)} | "
            f"{gib(r.total)} | " + " | ".join(r.fits[k] for k in DEVICES)
            + f" | {r.flops_xla / 1e12:.1f} | {r.flops_trainer / 1e12:.1f} | {r.flops_6n / 1e12:.1f} | "
            f"{r.seconds:.0f} |"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "vicuna7b.py"), help="config file[:arg]")
    parser.add_argument("--stage", default="overall")
    parser.add_argument("--layers", default=None,
                        help="depth to compile: N, or A,B to extrapolate temp/residuals/FLOPs to "
                             "--full-layers")
    parser.add_argument("--full-layers", type=int, default=None, help="full depth (default: the config's)")
    parser.add_argument("--meshes", nargs="+", default=list(DEFAULT_MESHES),
                        help="e.g. fsdp=8 fsdp=4,tensor=2")
    parser.add_argument("--micro", default="1", help="examples per data x fsdp shard per micro-batch (list)")
    parser.add_argument("--seq", default="1024,2048", help="sequence lengths (comma list)")
    parser.add_argument("--remat", default="none,dots,full", help="remat policies (comma list)")
    parser.add_argument("--param-dtype", default=None, help="override model.llm.param_dtype (e.g. bfloat16)")
    parser.add_argument("--audio-dim", type=int, default=AUDIO_DIM, help="without data.shards' manifest")
    parser.add_argument("--video-dim", type=int, default=VIDEO_DIM, help="without data.shards' manifest")
    parser.add_argument("--override", action="append", default=[], help="config KEY=VALUE (repeatable)")
    parser.add_argument("--scheduler", choices=sorted(SCHEDULERS), default="memory", help="XLA:CPU scheduler")
    parser.add_argument("--full-opt", action="store_true",
                        help="full LLVM optimisation (same numbers, slower)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--verbose", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    meshes = [parse_mesh(m) for m in args.meshes]
    need = max(math.prod(m.values()) for m in meshes)
    flags = os.environ.get("XLA_FLAGS", "")
    if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={need}".strip()
    from empatheia_jax import logs

    logs.configure(args.verbose)
    import jax
    from tqdm import tqdm

    overrides = list(args.override)
    if args.param_dtype:
        overrides.append(f"model.llm.param_dtype={args.param_dtype}")
    config = load_config(args.config, args.stage, overrides)
    full = args.full_layers or llm_config(config).num_hidden_layers
    layers = _ints(args.layers) if args.layers else [full]
    if len(layers) > 2 or len(set(layers)) != len(layers):
        raise SystemExit("--layers: one depth, or two different depths to extrapolate from")
    if len(layers) == 1:
        full = layers[0]  # the plan of that depth, nothing extrapolated
    manifest = feature_dims(config, args.audio_dim, args.video_dim)
    remats = [r.strip() for r in args.remat.split(",")]
    points = plan_points(meshes, _ints(args.micro), _ints(args.seq), remats)
    options = compiler_options(args.scheduler, fast=not args.full_opt)
    print(f"memory plan: {args.config} stage={config.stage}, {full} layers (compiled at {layers}), "
          f"{len(points)} configurations, jax {jax.__version__}, {jax.device_count()} fake CPU devices, "
          f"{args.scheduler} scheduler", flush=True)
    rows = []
    t0 = time.perf_counter()
    for point in tqdm(points, desc="compiling", unit="config"):
        rows.append(measure(config, point, layers, full, manifest, options))
        r = rows[-1]
        tqdm.write(f"{r.mesh}, {r.micro_per_shard} x {r.seq}, remat {r.remat}: total {gib(r.total)} "
                   f"GiB/device (temp {gib(r.temp)}), {r.seconds:.0f} s")
    print("\n" + table(rows))
    print(f"\nwall time {time.perf_counter() - t0:.0f} s")
    bad = [r for r in rows if (r.params, r.opt) != (r.hand_params, r.hand_opt)]
    for r in bad:
        print(f"MISMATCH {r.mesh} {r.remat}: abstract params/opt {r.params}/{r.opt} != hand count "
              f"{r.hand_params}/{r.hand_opt}")
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
