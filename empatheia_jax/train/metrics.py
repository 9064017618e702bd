"""What a run reports: metrics to TensorBoard and `metrics.jsonl`, and its throughput and MFU.

The loop sums a step's metrics into a `Window` and writes their means every `train.log_every` steps. The
throughput sample leaves out the steps that compiled, so tokens/s and MFU measure the steady state. MFU
counts the backbone's FLOPs (`flops_per_token`) against the chip's dense bf16 peak (`peak_flops`; none on
CPU). Only process 0 writes (`MetricsWriter`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from empatheia_jax.models.empatheia import Empatheia

# Dense bf16 peak FLOP/s per chip, for MFU on accelerators (CPU runs report no MFU).
_PEAK_FLOPS = {
    "h100": 989e12,
    "h200": 989e12,
    "a100": 312e12,
    "v4": 275e12,
    "v5e": 197e12,
    "v5 lite": 197e12,
    "v5p": 459e12,
    "v6": 918e12,
}


def flops_per_token(model: Empatheia, seq_len: int, n_trainable: int) -> float:
    """Training FLOPs per token: 4N (forward + input gradients through the frozen backbone: LoRA training
    computes no frozen weight gradients) + 2 N_trainable (weight gradients) + 12 L T H d_head (attention
    scores and mixing, forward and backward; causal masking not discounted). N excludes the embedding."""
    cfg = model.config.llm
    params = nnx.state(model.llm, nnx.Param)
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    n -= (cfg.vocab_size + cfg.extra_vocab) * cfg.hidden_size  # embedding lookup is not a matmul
    if cfg.tie_word_embeddings:
        n += (cfg.vocab_size + cfg.extra_vocab) * cfg.hidden_size  # ... but the tied lm_head is
    attn = 12 * cfg.num_hidden_layers * seq_len * cfg.num_attention_heads * cfg.head_dim
    return 4.0 * n + 2.0 * n_trainable + attn


def peak_flops() -> float | None:
    """The first device's dense bf16 peak FLOP/s, when its kind is known (None on CPU)."""
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return None
    kind = dev.device_kind.lower()
    return next((v for k, v in _PEAK_FLOPS.items() if k in kind), None)


def _summary_writer_class() -> type:
    """tensorboardX's SummaryWriter, imported without importing torch when nothing has yet.

    tensorboardX's writer module imports torch only to accept torch tensors as values (`numpy_compatible`),
    and falls back to numpy when the import fails; we log floats. Importing torch is ~1.9 s of every
    training command (its largest import). A None in sys.modules makes that one `import torch` fail; it is
    removed again at once, so a later import of torch (an encoder, a converter) works as usual.
    """
    if "torch" in sys.modules or "tensorboardX" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class MetricsWriter:
    """TensorBoard + metrics.jsonl on process 0 (other processes write nothing)."""

    def __init__(self, workdir: Path, enabled: bool):
        self.enabled = enabled
        if enabled:
            self.tb = _summary_writer_class()(str(workdir / "tensorboard"))
            self.jsonl = (workdir / "metrics.jsonl").open("a")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        for k, v in metrics.items():
            self.tb.add_scalar(k, v, step)
        self.jsonl.write(json.dumps({"step": step, **{k: float(v) for k, v in metrics.items()}}) + "\n")
        self.jsonl.flush()

    def close(self) -> None:
        if self.enabled:
            self.tb.close()
            self.jsonl.close()


@dataclasses.dataclass
class Window:
    """Metrics summed since the last log line, and the throughput sample (steps, tokens, since when, less
    the seconds of the steps that compiled: `excluded`)."""

    start: float
    sums: dict[str, float] = dataclasses.field(default_factory=dict)
    steps: int = 0
    tokens: int = 0
    excluded: float = 0.0

    def reset(self) -> None:
        self.sums, self.steps, self.tokens, self.start = {}, 0, 0, time.perf_counter()
        self.excluded = 0.0
