"""empatheia_jax: train, evaluate and serve Empatheia (multimodal empathetic dialogue) in JAX/Flax.

Public API (names are a contract):

    model, tokenizer = empatheia_jax.load_model("work/smollm2")      # a converted checkpoint folder
    logits = model(input_ids)                                         # float32 [B, T, V]
    model, tokenizer, config, meta = empatheia_jax.load_trained("work/run")  # a trained Empatheia:
        # a training workdir, its checkpoints folder, one step folder, or an export folder
        # (`empatheia_jax.serve.load.export_trained`); step=N picks a step
    replies = empatheia_jax.generate(model, tokenizer, prompts, max_new_tokens=64)
    ids = empatheia_jax.generate_ids(model, tokenizer, prompts, max_new_tokens=64)

The heavy modules (jax, orbax, transformers) are imported on first use, so `import empatheia_jax.data.schema`
in a data-preparation process stays cheap.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from empatheia_jax.models.llama import Llama
    from empatheia_jax.serve.generation import generate, generate_ids, generate_tokens
    from empatheia_jax.serve.load import load_trained

__all__ = ["load_model", "load_trained", "generate", "generate_ids", "generate_tokens"]


def load_model(path: str | os.PathLike, *, mesh: Mesh | None = None) -> tuple[Llama, Any]:
    """(model, tokenizer) from a converted checkpoint folder (see `empatheia_jax.weights.hf_to_flax`)."""
    from empatheia_jax.weights.checkpoint_io import load_checkpoint

    return load_checkpoint(path, mesh=mesh)


def __getattr__(name: str):
    if name in ("generate", "generate_ids", "generate_tokens"):
        from empatheia_jax.serve import generation

        return getattr(generation, name)
    if name == "load_trained":
        from empatheia_jax.serve.load import load_trained

        return load_trained
    raise AttributeError(f"module 'empatheia_jax' has no attribute {name!r}")
