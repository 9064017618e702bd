"""The Empatheia stage-4 ("overall") training step at the LLaMA-2-7B shape: tokens/s, step time, MFU, peak
device memory; beside it the plain LoRA LM step and the HF + PEFT reference at the same shape.

    python bench/train_step.py [--shape 7b|tiny] [--layers N] [--batch B] [--seq T[,T2...]]
        [--remat none|dots|full] [--attention auto|einsum|xla|cudnn] [--backbone-only] [--hf] [--steps 5]
        [--warmup 1] [--peak-tflops 989]
        [--dtype bfloat16] [--param-dtype bfloat16] [--json OUT.jsonl] [--md OUT.md]

What is timed (ours): the trainer's own jitted step, `step.jit_step(stage overall, ...)` over
`stages.split_for_step` of a real `Empatheia` (random weights) built from configs/vicuna7b.py as
bench/memory_plan.py builds it (`load_config`, `llm_config`, `empatheia_config`): media splice of the
`<Aud>`/`<Vid>` placeholders, signal tokens, the Content Synchronizer and Style Disentangler heads and all
their losses, the clipped AdamW update over the stage's groups, the non-finite guard. The batch is a
synthetic one in the input pipeline's layout (`batching.batch_spec`, grad_accum 1): BOS, 4 utterances
of text + `<Aud>` + `<Vid>`, SEP, a reply filling the row, the 2 x n_signal signal tokens, EOS; every row
is exactly T tokens (no padding), with content/style targets and class labels. `loss` in the output is the
first timed call's `metrics["total"]` before any update is applied (tests/test_bench_train_step.py checks
it equals `objective.make_loss_fn` on the same weights and batch: the bench times the real step).

`--backbone-only`: the plain LoRA LM step of the same backbone (bench/backbone.py `lora_lm_step`: mean
next-token CE, AdamW over the LoRA parameters only): what HF + PEFT computes. `--hf`: the reference
(transformers `LlamaForCausalLM` from a config with random weights, PEFT LoRA r16/alpha32 on q/k/v/o, AdamW,
SDPA attention, bf16, gradient checkpointing when --remat is not none) at the same batch/seq, run FIRST in a
separate process (JAX and torch must not share the GPU's allocator; the child sets JAX_PLATFORMS=cpu), then
ours in this process, and the ratio ours/HF of tokens/s. A missing wheel (torch, transformers, peft) is
named, with where to get it (bench/gpu_wheels.sh).

Shapes: `7b` = Vicuna-7B v1.5 (d 4096, MLP 11008, 32 x 128 heads, 32 layers, V 32000), bf16 params and
compute (the LoRA adapters stay float32: `nnx.LoRALinear`'s lora_param_dtype); `--layers N` cuts the depth.
`tiny` = configs/tiny.py's heads on a 2-layer d=64 backbone (V 512, fp32: XLA:CPU bf16 is slow): seconds on
a CPU, to check the script, not a performance figure. Remat default: `full`, the memory plan's choice for
the 7B step (docs/design.md "Memory plan of the 7B step") and configs/vicuna7b.py's.

Figures: step_s = median of --steps timed calls after --warmup calls (the first call compiles:
compile_s); tokens/s = B x T / step_s; MFU = the trainer's convention (`metrics.flops_per_token`: 4N +
2 N_trainable + 12 L T H d_head) and 6N (`memory_plan.model_flops`) x tokens / step_s / peak, peak from
--peak-tflops (default 989: H100/H200 SXM dense bf16). Both count the backbone only: the stage-4 step's
VAE heads are extra work its MFU does not credit. Peak memory: `jax.devices()[0].memory_stats()`'s
peak_bytes_in_use (null on CPU), torch.cuda.max_memory_allocated for HF. One JSON line per row on stdout
(prefixed `RESULT `), then a Markdown table.
"""

from __future__ import annotations

import os
import sys

# memory_plan / backbone default JAX_PLATFORMS to cpu when imported; this bench runs on any device unless
# the caller says otherwise ("" = jax's own choice).
os.environ.setdefault("JAX_PLATFORMS", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
for p in (str(REPO), str(BENCH)):
    if p not in sys.path:
        sys.path.insert(0, p)

import backbone as backbone_bench  # noqa: E402
import memory_plan  # noqa: E402

GiB = 2**30
PEAK_TFLOPS = 989.0  # H100 / H200 SXM dense bf16
LORA_LR = 1e-4
TINY_LLM = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16,
            "max_position_embeddings": 4096, "tie_word_embeddings": False}
TINY_FEATURES = 16  # audio / video feature width of the tiny shape
UTTERANCES = 4  # history utterances of the synthetic batch, each with k <Aud> and k <Vid>
MISSING_HINT = ("pre-download them with bench/gpu_wheels.sh into bench/wheels/ and install with "
                "`pip install --no-index --find-links bench/wheels ...` (bench/gpu.sh does)")


# ----------------------------------------------------------------------------------------------------------
# The run's config and model
# ----------------------------------------------------------------------------------------------------------


def defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fills the shape-dependent defaults (batch, seq, dtypes, layers)."""
    tiny = args.shape == "tiny"
    args.batch = args.batch or (2 if tiny else 1)
    args.seq = args.seq or ("64" if tiny else "2048")
    args.dtype = args.dtype or ("float32" if tiny else "bfloat16")
    args.param_dtype = args.param_dtype or ("float32" if tiny else "bfloat16")
    args.layers = args.layers or (TINY_LLM["num_hidden_layers"] if tiny else 32)
    args.remat = args.remat or "full"
    return args


def seqs(args: argparse.Namespace) -> list[int]:
    return [int(x) for x in str(args.seq).split(",") if x.strip()]


def run_config(args: argparse.Namespace) -> Any:
    """configs/vicuna7b.py (or configs/tiny.py's heads on TINY_LLM) at stage overall, as the trainer reads it,
    with the bench's dtypes, remat and depth."""
    over = [f"model.llm.dtype={args.dtype}", f"model.llm.param_dtype={args.param_dtype}",
            f"model.llm.remat={args.remat}", f"model.llm.attention={args.attention}", "train.grad_accum=1",
            f"train.batch_size={args.batch}"]
    if args.shape == "tiny":
        config = memory_plan.load_config(str(REPO / "configs" / "tiny.py"), "overall", over)
        config.model.llm.update({**TINY_LLM, "num_hidden_layers": args.layers})
    else:
        config = memory_plan.load_config(str(REPO / "configs" / "vicuna7b.py"), "overall", over)
    return config


def empatheia_cfg(args: argparse.Namespace, config: Any) -> Any:
    dim = TINY_FEATURES if args.shape == "tiny" else memory_plan.AUDIO_DIM
    manifest = memory_plan.feature_dims(config, dim, dim)
    llm = memory_plan.llm_config(config, args.layers, args.remat)
    return memory_plan.empatheia_config(config, llm, manifest)


def synthetic_batch(config: Any, stage: Any, cfg: Any, batch: int, seq: int, seed: int = 0) -> dict:
    """One micro-batch [B, ...] in the pipeline's layout (`memory_plan.abstract_batch` = `batch_spec`), every
    row exactly `seq` tokens: BOS, UTTERANCES x (text, k <Aud>, k <Vid>), SEP, reply, signal tokens, EOS."""
    spec = memory_plan.abstract_batch(config, stage, cfg, batch, seq)
    if cfg.cs_units:
        raise SystemExit("the bench's batch has no speech_units: needs model.empatheia.cs_units=0")
    rng = np.random.default_rng(seed)
    out = {k: np.zeros(s.shape, s.dtype) for k, s in spec.items()}
    max_aud, max_vid = out["aud_mask"].shape[1], out["vid_mask"].shape[1]
    k = cfg.k
    n_utt = min(UTTERANCES, max_aud // k, max_vid // k)
    signals = list(cfg.aud_signal_ids) + list(cfg.vid_signal_ids)
    bos, sep, eos, first_word = 1, 2, 2, 3
    words = max(1, seq // 4 // max(n_utt, 1) - 2 * k)
    for b in range(batch):
        row = [bos]
        for _ in range(n_utt):
            row += rng.integers(first_word, cfg.llm.vocab_size, words).tolist()
            row += [cfg.aud_token_id] * k + [cfg.vid_token_id] * k
        row.append(sep)
        start = len(row)
        n_reply = seq - start - len(signals) - 1
        if n_reply < 1:
            raise SystemExit(f"--seq {seq} is too short for the synthetic stage-4 batch (needs > "
                             f"{start + len(signals) + 1} tokens)")
        row += rng.integers(first_word, cfg.llm.vocab_size, n_reply).tolist() + signals + [eos]
        assert len(row) == seq, (len(row), seq)
        out["input_ids"][b] = row
        out["target_ids"][b, :-1] = row[1:]
        out["loss_mask"][b, start - 1:seq - 1] = 1
        out["response_mask"][b, start:start + n_reply] = 1
        out["attention_mask"][b] = 1
        out["positions"][b] = np.arange(seq)
        for key, width in (("speech_content", out["speech_content"].shape[1]),
                           ("video_content", out["video_content"].shape[1])):
            out[f"{key}_mask"][b, :min(n_reply, width)] = 1
    for feat in ("aud", "vid"):
        out[f"{feat}_feats"][...] = rng.normal(size=out[f"{feat}_feats"].shape)
        out[f"{feat}_mask"][:, :n_utt * k] = 1
    for key in ("speech_content", "video_content", "speech_style", "video_style"):
        out[key][...] = rng.normal(size=out[key].shape)
    out["style_mask"][...] = 1
    for key, n in (("emotion", cfg.num_emotions), ("age", cfg.num_ages), ("gender", cfg.num_genders),
                   ("timbre", cfg.num_timbres)):
        out[key][...] = rng.integers(0, n, batch)
    out["record_index"][...] = np.arange(batch)
    return out


class StageRun:
    """The trainer's step arguments for stage overall: (graphs, params, frozen, opt_state), the step function
    (`step.jit_step`), the model, the stage and the loss weights."""

    def __init__(self, args: argparse.Namespace, seed: int = 0):
        import jax
        from flax import nnx

        from empatheia_jax.models.empatheia import Empatheia
        from empatheia_jax.train import config as config_lib
        from empatheia_jax.train import init, stages
        from empatheia_jax.train import step as step_lib

        self.config = run_config(args)
        self.stage = config_lib.resolve_stage(self.config)
        cfg = empatheia_cfg(args, self.config)
        self.model = Empatheia(cfg, rngs=nnx.Rngs(seed + 1))
        tx, _ = init.make_tx(self.config, config_lib.stage_schedule(self.config),
                             stages.trainable_state(self.model, self.stage))
        optimizer = stages.make_optimizer(self.model, self.stage, tx)
        graphs, params, frozen, opt_state = stages.split_for_step(self.model, optimizer, self.stage)
        # Committed to their device, as the trainer's sharded state is: the step's outputs are (it pins
        # out_shardings), and uncommitted first inputs would make the second call compile again.
        commit = lambda tree: jax.tree.map(lambda x: jax.device_put(x, x.sharding), tree)  # noqa: E731
        self.graphs, self.params, self.frozen, self.opt_state = graphs, *commit((params, frozen, opt_state))
        self.weights = step_lib.loss_weights(self.config)
        self.step = step_lib.jit_step(self.stage, self.weights, self.params, self.opt_state,
                                      compiler_options=cpu_compiler_options())
        self.n_trainable = sum(math.prod(x.shape) for x in _leaves(self.params))

    def batch(self, batch: int, seq: int, seed: int = 0) -> dict:
        return synthetic_batch(self.config, self.stage, self.model.config, batch, seq, seed)

    def runner(self, batch: int, seq: int):
        """A call running one step on the synthetic [1, B, T] batch, updating the state; returns the loss."""
        import jax
        import jax.numpy as jnp

        data = {k: jnp.asarray(v)[None] for k, v in self.batch(batch, seq).items()}
        key = jax.random.key(0)

        def call() -> float:
            self.params, self.opt_state, metrics = self.step(self.graphs, self.params, self.frozen,
                                                             self.opt_state, data, key)
            jax.block_until_ready(self.params)
            return float(metrics["total"])

        return call


class LoraLMRun:
    """The plain LoRA LM step on the same backbone (bench/backbone.py's `lora_lm_step`)."""

    def __init__(self, args: argparse.Namespace, seed: int = 0):
        from flax import nnx

        from empatheia_jax.models.llama import Llama
        from empatheia_jax.models.lora import LoraConfig, apply_lora

        config = run_config(args)
        llm = memory_plan.llm_config(config, args.layers, args.remat)
        self.model = Llama(llm, rngs=nnx.Rngs(seed))
        lora = config.model.lora
        apply_lora(self.model, LoraConfig(rank=int(lora.rank), alpha=float(lora.alpha),
                                          targets=tuple(lora.targets)), rngs=nnx.Rngs(seed + 1))
        self.step, self.params, self.opt_state, self.rest = backbone_bench.lora_lm_step(self.model, LORA_LR)
        self.n_trainable = sum(math.prod(x.shape) for x in _leaves(self.params))

    def runner(self, batch: int, seq: int):
        import jax
        import jax.numpy as jnp

        # seq + 1 tokens: the model sees exactly `seq` positions (HF's shifted labels over `seq` do too).
        x = jnp.asarray(np.random.default_rng(0).integers(0, self.model.config.vocab_size, (batch, seq + 1)),
                        jnp.int32)

        def call() -> float:
            self.params, self.opt_state, loss = self.step(self.params, self.opt_state, self.rest, x)
            jax.block_until_ready(self.params)
            return float(loss)

        return call


def cpu_compiler_options() -> dict | None:
    """On CPU, the memory plan's fast codegen (minutes less compile for the overall step; CPU figures are
    smoke checks, not performance claims); nothing elsewhere."""
    import jax

    return dict(memory_plan.FAST_CODEGEN) if jax.default_backend() == "cpu" else None


def _leaves(tree: Any) -> list:
    import jax

    return jax.tree.leaves(tree)


def flops(model: Any, n_trainable: int, seq: int, tokens: int) -> tuple[float, float]:
    """(trainer convention, 6N) FLOPs of `tokens` tokens (`memory_plan.model_flops`); a bare Llama is seen
    through the `.config.llm` / `.llm` attributes `metrics.flops_per_token` reads."""
    if not hasattr(model, "llm"):
        model = types.SimpleNamespace(config=types.SimpleNamespace(llm=model.config), llm=model)
    return memory_plan.model_flops(model, n_trainable, seq, tokens)


# ----------------------------------------------------------------------------------------------------------
# Timing and rows
# ----------------------------------------------------------------------------------------------------------


def time_calls(call, steps: int, warmup: int) -> dict:
    """compile_s (first call), then `warmup - 1` more untimed calls, then `steps` timed ones."""
    t0 = time.perf_counter()
    loss = call()
    compile_s = time.perf_counter() - t0
    times = backbone_bench.wall_times(call, steps, warmup=max(warmup - 1, 0))
    return {"loss": loss, "compile_s": compile_s, "step_s_all": times}


def make_row(args: argparse.Namespace, side: str, what: str, seq: int, timing: dict, flops_pair: tuple,
             peak_bytes: int | None, device: str, versions: dict) -> dict:
    step_s = statistics.median(timing["step_s_all"])
    tokens = args.batch * seq
    peak = args.peak_tflops * 1e12
    return {
        "bench": "train_step", "side": side, "what": what, "shape": args.shape, "layers": args.layers,
        "batch": args.batch, "seq": seq, "remat": args.remat, "dtype": args.dtype,
        "attention": attention_kernel(args) if side == "ours" else "sdpa",
        "param_dtype": args.param_dtype, "tokens_per_s": tokens / step_s, "step_s": step_s,
        "step_s_all": timing["step_s_all"], "compile_s": timing["compile_s"],
        "mfu_4n": flops_pair[0] / step_s / peak, "mfu_6n": flops_pair[1] / step_s / peak,
        "flops_4n": flops_pair[0], "flops_6n": flops_pair[1], "peak_tflops": args.peak_tflops,
        "peak_mem_gib": None if peak_bytes is None else peak_bytes / GiB, "loss": timing["loss"],
        "device": device, "versions": versions,
    }


def attention_kernel(args: argparse.Namespace) -> str:
    """The kernel our step's attention ran: the forced one, or what "auto" decided while tracing it (every
    call of one bench process has the same shape, so one kernel; a mix would be listed)."""
    if args.attention != "auto":
        return args.attention
    from empatheia_jax.models import attention_choice

    kernels = sorted({choice.kernel for choice in attention_choice.decisions().values()})
    return "auto: " + ("/".join(kernels) or "not traced")


def jax_versions() -> tuple[str, dict]:
    import flax
    import jax
    import jaxlib

    dev = jax.devices()[0]
    return (f"{dev.platform}: {dev.device_kind}",
            {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__})


def jax_peak_bytes() -> int | None:
    import jax

    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001  (not every backend implements it)
        stats = None
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def run_ours(args: argparse.Namespace, run: StageRun | LoraLMRun | None = None) -> list[dict]:
    """Rows of our step (stage overall, or --backbone-only) for each --seq, in this process (on `run` when
    given: a test reads its initial state first)."""
    device, versions = jax_versions()
    t0 = time.perf_counter()
    if run is None:
        run = LoraLMRun(args) if args.backbone_only else StageRun(args)
    build_s = time.perf_counter() - t0
    what = "LoRA LM step" if args.backbone_only else "Empatheia stage-4 (overall) step"
    rows = []
    for seq in seqs(args):
        timing = time_calls(run.runner(args.batch, seq), args.steps, args.warmup)
        f = flops(run.model, run.n_trainable, seq, args.batch * seq)
        rows.append(make_row(args, "ours", what, seq, timing, f, jax_peak_bytes(), device, versions))
        rows[-1].update(build_s=build_s, compiler_options=cpu_compiler_options())
    return rows


# ----------------------------------------------------------------------------------------------------------
# The HF + PEFT reference (a separate process)
# ----------------------------------------------------------------------------------------------------------


def hf_side(args: argparse.Namespace) -> int:
    """The child process: prints one `HF ` JSON line per --seq with the timing, or names missing wheels."""
    missing = []
    for name in ("torch", "transformers", "peft"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        print(f"HF_MISSING {json.dumps(missing)}", flush=True)
        print(f"error: the HF reference needs the wheel(s) {', '.join(missing)}, not installed in "
              f"{sys.executable}; {MISSING_HINT}", file=sys.stderr)
        return 3
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    config = run_config(args)
    llm = memory_plan.llm_config(config, args.layers, args.remat)
    hf_cfg = transformers.LlamaConfig(**llm.to_hf())
    hf_cfg._attn_implementation = "sdpa"
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.param_dtype]
    with torch.device(dev):
        torch.set_default_dtype(dtype)
        model = transformers.LlamaForCausalLM(hf_cfg)
        torch.set_default_dtype(torch.float32)
    lora = config.model.lora
    pm = peft.get_peft_model(model, peft.LoraConfig(r=int(lora.rank), lora_alpha=float(lora.alpha),
                                                    target_modules=list(lora.targets), lora_dropout=0.0,
                                                    bias="none", task_type="CAUSAL_LM"))
    pm.train()
    if args.remat != "none":
        pm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        pm.enable_input_require_grads()
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=LORA_LR, weight_decay=0.0,
                            fused=dev == "cuda")
    device = f"{dev}: {torch.cuda.get_device_name(0) if dev == 'cuda' else 'cpu'}"
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "peft": peft.__version__}
    for seq in seqs(args):
        ids = torch.randint(0, llm.vocab_size, (args.batch, seq), device=dev)

        def call(ids=ids) -> float:
            opt.zero_grad(set_to_none=True)
            loss = pm(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            sync()
            return float(loss.item())

        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        timing = time_calls(call, args.steps, args.warmup)
        peak = torch.cuda.max_memory_allocated() if dev == "cuda" else None
        print("HF " + json.dumps({"seq": seq, "timing": timing, "peak_bytes": peak, "device": device,
                                  "versions": versions}), flush=True)
    return 0


class MissingWheels(RuntimeError):
    """The HF side cannot run here: torch, transformers or peft is not installed (named in the message)."""


def run_hf(args: argparse.Namespace, argv: list[str]) -> list[dict]:
    """Runs `hf_side` in a child process (JAX_PLATFORMS=cpu there) and turns its lines into rows."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    cmd = [sys.executable, __file__, "--side", "hf", *[a for a in argv if a != "--hf"]]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = proc.stdout.splitlines()
    missing = [json.loads(x[len("HF_MISSING "):]) for x in lines if x.startswith("HF_MISSING ")]
    if missing:
        raise MissingWheels(f"the HF reference needs the wheel(s) {', '.join(missing[0])}; {MISSING_HINT}")
    if proc.returncode:
        raise SystemExit(f"error: the HF reference failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    rows = []
    model = _abstract_llama(args)
    for line in (x for x in lines if x.startswith("HF ")):
        r = json.loads(line[3:])
        f = flops(model, _lora_count(model), r["seq"], args.batch * r["seq"])
        rows.append(make_row(args, "hf", "HF + PEFT LoRA LM step", r["seq"], r["timing"], f, r["peak_bytes"],
                             r["device"], r["versions"]))
    return rows


def _abstract_llama(args: argparse.Namespace) -> Any:
    """The LoRA'd backbone as shapes only (for the FLOP count of the HF rows: nothing allocated)."""
    from flax import nnx

    from empatheia_jax.models.llama import Llama
    from empatheia_jax.models.lora import LoraConfig, apply_lora

    config = run_config(args)
    llm = memory_plan.llm_config(config, args.layers, args.remat)
    lora = config.model.lora

    def build():
        m = Llama(llm, rngs=nnx.Rngs(0))
        return apply_lora(m, LoraConfig(rank=int(lora.rank), alpha=float(lora.alpha),
                                        targets=tuple(lora.targets)), rngs=nnx.Rngs(1))

    with memory_plan.cheap_tracer_errors():
        return nnx.eval_shape(build)


def _lora_count(model: Any) -> int:
    from flax import nnx

    return sum(math.prod(x.shape) for x in _leaves(nnx.state(model, nnx.LoRAParam)))


# ----------------------------------------------------------------------------------------------------------


def markdown(rows: list[dict]) -> str:
    head = ("| side | step | shape (layers) | B x T | remat | attention | tokens/s | step s (median) | "
            "compile s | MFU 4N+attn | MFU 6N | peak mem GiB | loss | ours/HF | device |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        mem = "null" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.2f}"
        ratio = f"{r['ratio_ours_hf']:.2f}x" if r.get("ratio_ours_hf") else "-"
        lines.append(f"| {r['side']} | {r['what']} | {r['shape']} ({r['layers']}) | "
                     f"{r['batch']} x {r['seq']} | {r['remat']} | {r['attention']} | "
                     f"{r['tokens_per_s']:.1f} | "
                     f"{r['step_s']:.4f} | {r['compile_s']:.1f} | "
                     f"{100 * r['mfu_4n']:.2f} % | {100 * r['mfu_6n']:.2f} % | {mem} | {r['loss']:.4f} | "
                     f"{ratio} | {r['device']} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    from empatheia_jax.models.llama import ATTENTION_IMPLEMENTATIONS

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=("7b", "tiny"), default="7b")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    p.add_argument("--batch", type=int, default=None, help="examples per step (7b: 1, tiny: 2)")
    p.add_argument("--seq", default=None, help="sequence length(s), comma list (7b: 2048, tiny: 64)")
    p.add_argument("--remat", choices=("none", "dots", "full"), default=None, help="default: full")
    p.add_argument("--attention", choices=ATTENTION_IMPLEMENTATIONS, default="auto",
                   help="our attention kernel (model.llm.attention; auto: cuDNN flash where it compiles)")
    p.add_argument("--dtype", default=None, help="compute dtype (7b: bfloat16, tiny: float32)")
    p.add_argument("--param-dtype", default=None, help="parameter dtype (7b: bfloat16, tiny: float32)")
    p.add_argument("--backbone-only", action="store_true", help="time the plain LoRA LM step instead")
    p.add_argument("--hf", action="store_true",
                   help="also the HF + PEFT reference (separate process) + ratio")
    p.add_argument("--side", choices=("ours", "hf"), default="ours", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first (the first one compiles)")
    p.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS,
                   help="device peak for MFU (default 989: H100/H200 dense bf16)")
    p.add_argument("--json", default=None, help="append the rows (JSON lines) to this file")
    p.add_argument("--md", default=None, help="append the Markdown rows to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = defaults(parser().parse_args(argv))
    if args.side == "hf":
        return hf_side(args)
    hf_rows, hf_error = [], None
    if args.hf:  # first: the GPU is still free of JAX
        try:
            hf_rows = run_hf(args, argv)
        except MissingWheels as e:  # our rows are still measured; the error is said and recorded
            hf_error = str(e)
            print(f"error: {hf_error}", file=sys.stderr, flush=True)
    rows = run_ours(args)
    for r in rows:
        if hf_error:
            r["hf_error"] = hf_error
    for h in hf_rows:
        ours = next((r for r in rows if r["seq"] == h["seq"]), None)
        if ours:
            ours["ratio_ours_hf"] = ours["tokens_per_s"] / h["tokens_per_s"]
            ours["hf_tokens_per_s"] = h["tokens_per_s"]
    rows = hf_rows + rows
    for r in rows:
        print("RESULT " + json.dumps(r), flush=True)
    table = markdown(rows)
    print("\n" + table)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    if args.md:
        with open(args.md, "a") as f:
            f.write("\n".join(table.splitlines()[2:]) + "\n")
    return 3 if hf_error else 0


if __name__ == "__main__":
    sys.exit(main())
