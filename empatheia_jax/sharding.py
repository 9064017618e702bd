"""Mesh construction and the logical-axis rules table (the MaxText pattern).

Parameters carry logical axis names (`vocab`, `embed`, `heads`, `kv_heads`, `mlp`, ...). `LOGICAL_RULES`
maps each name to mesh axes of the (`data`, `fsdp`, `tensor`) mesh; changing the parallelism layout is a
change to this table, never to the model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# logical name -> mesh axis (or axes, or None = replicated). First match wins.
LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    ("lora_rank", None),
    ("queries", None),
    ("conv", None),
    ("features", None),
    ("classes", None),
)

M = TypeVar("M", bound=nnx.Module)


def make_mesh(
    data: int = 1, fsdp: int = -1, tensor: int = 1, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A (data, fsdp, tensor) mesh; one size may be -1 to take the remaining devices.

    Axes are Auto (GSPMD propagation), not Explicit — `jax.make_mesh`'s default would make every
    un-annotated op an error.
    """
    devices = list(devices if devices is not None else jax.devices())
    sizes = [data, fsdp, tensor]
    if sum(s == -1 for s in sizes) > 1:
        raise ValueError(f"mesh sizes {dict(zip(MESH_AXES, sizes, strict=True))}: at most one may be -1")
    if any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh sizes {dict(zip(MESH_AXES, sizes, strict=True))} must be positive or -1")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"mesh sizes {sizes} do not divide the {len(devices)} devices")
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, sizes, strict=True))} needs {int(np.prod(sizes))} devices, "
            f"have {len(devices)}"
        )
    grid = np.asarray(devices).reshape(sizes)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(axes: Sequence[str | None], rules=LOGICAL_RULES) -> PartitionSpec:
    """Maps logical names to a PartitionSpec, never using a mesh axis twice in one spec."""
    table = dict(rules)
    used: set[str] = set()
    out = []
    for name in axes:
        target = table.get(name) if name is not None else None
        if name is not None and name not in table:
            raise KeyError(f"logical axis {name!r} has no rule in the sharding table")
        targets = (target,) if isinstance(target, str) else tuple(target or ())
        targets = tuple(t for t in targets if t not in used)
        used.update(targets)
        out.append(targets[0] if len(targets) == 1 else (targets or None))
    return PartitionSpec(*out)


def state_shardings(state: Any, mesh: Mesh, rules=LOGICAL_RULES) -> Any:
    """NamedShardings for an nnx State (or abstract state) from its variables' logical axes."""

    def one(var):
        if not isinstance(var, nnx.Variable):
            return NamedSharding(mesh, PartitionSpec())
        names = var.get_metadata().get("out_sharding")
        spec = logical_to_spec(names, rules) if names else PartitionSpec()
        return var.replace(NamedSharding(mesh, _fit(spec, var.shape, mesh)))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _fit(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """Drops a mesh axis from a dimension it does not divide (e.g. 3 KV heads on tensor=2)."""
    out = []
    for dim, axis in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)), strict=False):
        axes = (axis,) if isinstance(axis, str) else tuple(axis or ())
        size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        out.append(axis if dim % size == 0 else None)
    return PartitionSpec(*out)


def shard_model(model: M, mesh: Mesh, rules=LOGICAL_RULES) -> M:
    """Places an existing model's state onto the mesh according to the rules (returns the same model).

    Multi-process: `jax.device_put` of a committed one-device array onto a mesh spanning processes takes
    jax's cross-host transfer path, whose arrays have no usable `addressable_shards` (orbax cannot save
    them). Every process holds the same host model (same seed or backbone files), so each cuts its own
    shards from its copy instead; arrays already spread over the processes are resharded by a jitted
    identity.
    """
    state = nnx.state(model)
    shardings = state_shardings(state, mesh, rules)
    if jax.process_count() == 1:
        nnx.update(model, jax.device_put(state, shardings))
        return model

    def place(x, s):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            # Already there (the usual case after `create_sharded` / `load_checkpoint(mesh=)`): one jitted
            # identity per leaf cost ~20 s of compiles per process for the tiny test model.
            if x.sharding.is_equivalent_to(s, x.ndim):
                return x
            return jax.jit(lambda a: a, out_shardings=s)(x)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # nnx RNG streams: place the raw key data
            return jax.random.wrap_key_data(place(jax.random.key_data(x), s), impl=jax.random.key_impl(x))
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, s, lambda index: host[index])

    nnx.update(model, jax.tree.map(place, state, shardings))
    return model


def create_sharded(factory: Callable[[], M], mesh: Mesh, rules=LOGICAL_RULES) -> M:
    """Builds a model directly sharded: parameters are created on their devices, never gathered on one."""
    abstract = nnx.eval_shape(factory)
    graphdef, abstract_state = nnx.split(abstract)
    shardings = state_shardings(abstract_state, mesh, rules)

    def init():
        return nnx.state(factory())

    with jax.set_mesh(mesh):
        state = jax.jit(init, out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def constrain(x: jax.Array, axes: Sequence[str | None], rules=LOGICAL_RULES) -> jax.Array:
    """Pins an activation to its logical layout under the mesh being traced for (`jax.set_mesh`).

    Why: parameters carry shardings, activations do not, and GSPMD then propagates the FSDP weights' layout
    into the hidden states: the compiled 7B step all-gathered the batch and held every example's
    activations on every device (bench/memory_plan.py, docs/design.md "Memory plan"). A no-op outside a
    mesh of more than one device (single-device runs, generation), and an axis a dimension does not divide
    is dropped (`_fit`), so the constraint never changes what runs on one device.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, _fit(logical_to_spec(axes, rules), x.shape, mesh))


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Inputs are split over (data, fsdp) on the leading batch dimension and replicated otherwise."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1)))
