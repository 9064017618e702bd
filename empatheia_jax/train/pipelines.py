"""The data a run reads: grain pipelines shaped for its model, packing, and the global arrays of a step.

Each process reads `batch_size / process_count` examples per step from its own pipeline; the arrays it
hands a step are global ones, `[grad_accum, micro_batch, ...]` with the micro-batch axis sharded over the
mesh's `data` and `fsdp` axes, so that one jitted program sees the whole step's batch. The train and eval
pipelines share their keywords (`pipeline_fields`), so their shapes agree with the model's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from empatheia_jax.data.batching import make_global_batch, pack_text_batch
from empatheia_jax.data.input_pipeline import InputPipeline, make_dataset
from empatheia_jax.data.pipeline_config import pipeline_config_fields
from empatheia_jax.data.shard_format import load_manifest, target_source
from empatheia_jax.generators import registry
from empatheia_jax.models.empatheia import Empatheia
from empatheia_jax.train import config as config_lib
from empatheia_jax.train import distributed, stages


def pipeline_fields(
    config: ml_collections.ConfigDict, stage: stages.Stage, model: Empatheia
) -> dict[str, Any]:
    """`make_dataset` keywords shared by the train and eval pipelines (shapes agree with the model); a
    unit-aligned CS gets the content units of the shards' speech generator."""
    source = target_source(load_manifest(config.data.shards), "speech_content")
    units = registry.units_for(model.config.cs_units, source)
    fields = pipeline_config_fields(
        model.config, stage, {"max_aud": int(config.data.max_aud), "max_vid": int(config.data.max_vid)},
        speech_units=units,
    )
    fields.update(
        # the model's dims: the shards' (checked), or its own on text-only shards under a text template
        feature_dims=(model.config.audio_dim, model.config.video_dim),
        max_len=int(config.data.max_len),
        buckets=config_lib.bucket_lengths(config),
        worker_count=int(config.data.worker_count),
        read_threads=int(config.data.read_threads),
    )
    return fields


def make_train_pipeline(
    config: ml_collections.ConfigDict, stage: stages.Stage, model: Empatheia, tokenizer: Any
) -> InputPipeline:
    """This process's train pipeline: its share of `train.batch_size`, shuffled, repeated without end."""
    return make_dataset(
        config.data.shards,
        config.data.train_split,
        stage.template_stage,
        tokenizer,
        batch_size=config.train.batch_size // jax.process_count(),
        seed=config.seed,
        shuffle=True,
        window_batches=int(config.data.window_batches),
        **pipeline_fields(config, stage, model),
    )


def make_eval_pipeline(
    config: ml_collections.ConfigDict,
    stage: stages.Stage,
    model: Empatheia,
    tokenizer: Any,
    split: str | None = None,
) -> InputPipeline:
    micro = config.train.batch_size // config.train.grad_accum
    return make_dataset(
        config.data.shards,
        split or config.data.eval_split,
        stage.template_stage,
        tokenizer,
        batch_size=max(micro // jax.process_count(), 1),
        seed=config.seed,
        shuffle=False,
        num_epochs=1,
        window_batches=1,
        **pipeline_fields(config, stage, model),
    )


def check_packing(config: ml_collections.ConfigDict, stage: stages.Stage) -> None:
    """data.pack_len > 0 packs text rows, whose batches keep only the token keys: a stage whose losses
    read a head (cs, sd: per-example targets and labels) cannot be packed, nor can several processes
    (their row counts would differ)."""
    if not config.data.get("pack_len", 0):
        return
    if stage.heads:
        raise config_lib.ConfigError(
            f"data.pack_len={config.data.pack_len}: stage {stage.name!r} reads per-example targets "
            f"(heads {sorted(stage.heads)}); packing is for the text stages (coe, pipeline)")
    if jax.process_count() > 1:
        raise config_lib.ConfigError(f"data.pack_len={config.data.pack_len}: packing runs on one process")


def pack_for_step(config: ml_collections.ConfigDict, batch: Mapping[str, np.ndarray], pad_id: int,
                  mesh: Mesh) -> Mapping[str, np.ndarray]:
    """The step batch packed into rows of data.pack_len (a multiple of grad_accum x the data-parallel
    devices, so `step_batch` splits it); unchanged when pack_len is 0."""
    if not config.data.get("pack_len", 0):
        return batch
    multiple = int(config.train.grad_accum) * int(mesh.shape["data"] * mesh.shape["fsdp"])
    return pack_text_batch(batch, int(config.data.pack_len), pad_id=pad_id, row_multiple=multiple)


def step_batch(batch: Mapping[str, np.ndarray], mesh: Mesh, grad_accum: int) -> dict[str, jax.Array]:
    """This process's examples -> global arrays `[grad_accum, micro_batch, ...]`, micro-batch axis sharded."""
    local = {k: v.reshape((grad_accum, v.shape[0] // grad_accum) + v.shape[1:]) for k, v in batch.items()}
    return make_global_batch(local, NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp"))), batch_axis=1)


def eval_batches(
    config: ml_collections.ConfigDict,
    stage: stages.Stage,
    model: Empatheia,
    tokenizer: Any,
    mesh: Mesh,
    *,
    split: str | None = None,
    max_batches: int = 0,
) -> Iterator[dict[str, jax.Array]]:
    """One unshuffled pass over a split as global model batches (0 = every batch). Multi-process: a
    collective per batch (`agree_on_length`)."""
    pipe = make_eval_pipeline(config, stage, model, tokenizer, split)
    for i, b in enumerate(pipe):
        if max_batches and i >= max_batches:
            break
        b = distributed.agree_on_length(b, pipe.pad_id)
        yield make_global_batch(b, NamedSharding(mesh, PartitionSpec(("data", "fsdp"))))
