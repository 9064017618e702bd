"""The paper's setting (Table 9/10): Vicuna-7B backbone, LoRA r16/alpha32 on q/k/v/o, bf16, lr 5e-5,
weight decay 0.001, global batch 32 = micro-batch 4 x 8 accumulation, 16 signal tokens, 4-layer CS/SD.

Set `--config.model.backbone` to a converted Vicuna-7B folder (`python -m converters.hf_to_flax --src
lmsys/vicuna-7b-v1.5-checkout --out DIR --dtype bfloat16`) and `--config.data.shards` to prepared AvaMERG
shards. The mesh is fsdp x tensor=2 (8 GPUs: 4 x 2); scale `mesh.tensor` / `train.grad_accum` with the
device count.
"""

from __future__ import annotations

from configs import base


def get_config(arg: str | None = None):
    c = base.get_config()
    c.model.llm.dtype = "bfloat16"
    c.model.llm.param_dtype = "float32"
    c.model.llm.remat = "full"
    c.data.max_len = 2048
    c.train.batch_size = 32
    c.train.grad_accum = 8
    c.train.eval_every = 500
    c.schedule.coe.steps = 3000
    c.schedule.ccl.steps = 2000
    c.schedule.sac.steps = 2000
    c.schedule.overall.steps = 3000
    c.schedule.pipeline.steps = 3000
    c.checkpoint.every = 500
    c.checkpoint.keep = 3
    c.checkpoint.keep_best = True
    # Micro-batches of 4 split over data x fsdp, so that product must divide 4: FSDP over the rest of the
    # devices needs tensor parallelism for the remainder (8 GPUs: fsdp 4 x tensor 2).
    c.mesh.tensor = 2
    c.distributed.initialize = True
    return base.apply_arg(c, arg)
