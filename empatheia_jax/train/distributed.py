"""A run on several processes: joining the cluster, and what the processes must agree on at each step.

Every process runs the same trainer on its own slice of the data. `jax.distributed.initialize` must run
before anything else touches a device, so that every later call sees all processes. After that, two things
differ between the processes and must be made one: the token length of a step's batch (each pipeline
buckets its own examples, but a global array has one shape) and the data iterator's state a checkpoint
stores (orbax writes JSON items from process 0 only). Each helper here is a no-op on one process.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections
import numpy as np

from empatheia_jax.data.batching import TOKEN_KEYS
from empatheia_jax.train import config as config_lib


def initialize_distributed(config: ml_collections.ConfigDict) -> None:
    """`jax.distributed.initialize` when `distributed.initialize` (auto-detection, or the explicit values)."""
    d = config.distributed
    if not d.initialize:
        return
    if d.cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", d.cpu_collectives)
    kwargs: dict[str, Any] = {}
    if d.coordinator_address:
        kwargs = {
            "coordinator_address": d.coordinator_address,
            "num_processes": int(d.num_processes),
            "process_id": int(d.process_id),
        }
    try:
        jax.distributed.initialize(**kwargs)
    except ValueError as e:  # no cluster found and no coordinator given: a config for many hosts on one
        raise config_lib.ConfigError(
            f"config.distributed.initialize=True, but jax.distributed.initialize found no cluster to join "
            f"({e}): on one machine pass --config.distributed.initialize=False, else set "
            "distributed.coordinator_address, num_processes and process_id") from e


def agree_on_length(batch: Mapping[str, np.ndarray], pad_id: int) -> Mapping[str, np.ndarray]:
    """Multi-process: pads this process's batch along the token axis to the longest bucket any process
    picked for this step (each pipeline buckets its own examples, but a global array has one shape; as if
    `collate` had chosen that bucket). A collective: every process calls it for every batch. One process:
    the batch itself."""
    if jax.process_count() == 1:
        return batch
    from jax.experimental import multihost_utils

    length = batch["input_ids"].shape[1]
    target = int(np.max(multihost_utils.process_allgather(np.asarray([length], np.int32))))
    if target == length:
        return batch
    out, extra = dict(batch), target - length
    for k in TOKEN_KEYS:
        fill = pad_id if k in ("input_ids", "target_ids") else 0
        out[k] = np.pad(batch[k], ((0, 0), (0, extra)), constant_values=fill)
    out["positions"][:, length:] = batch["positions"][:, -1:] + np.arange(1, extra + 1, dtype=np.int32)
    return out


def gather_data_state(state: dict) -> dict:
    """The iterator state a checkpoint stores. Multi-process: every process's state, in process order
    (`{"processes": [...]}`), since orbax writes JSON items from process 0 only. A collective."""
    if jax.process_count() == 1:
        return state
    from jax.experimental import multihost_utils

    raw = np.frombuffer(json.dumps(state).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([raw.size], np.int32))).reshape(-1)
    buf = np.zeros(int(sizes.max()), np.uint8)
    buf[: raw.size] = raw
    every = np.asarray(multihost_utils.process_allgather(buf))
    return {"processes": [json.loads(every[p, : sizes[p]].tobytes()) for p in range(len(sizes))]}


def own_data_state(state: dict) -> dict:
    """This process's iterator state from a checkpoint's (see `gather_data_state`)."""
    if isinstance(state, dict) and "processes" in state:
        states = state["processes"]
        if len(states) != jax.process_count():
            raise ValueError(
                f"the checkpoint holds the data state of {len(states)} processes, this run has "
                f"{jax.process_count()}: resume with the same process count"
            )
        return states[jax.process_index()]
    return state
