"""The converted-checkpoint folder: what `empatheia_jax.weights.hf_to_flax` writes and `load_model` reads.

```
DIR/config.json   LlamaConfig.to_dict() + "lora" (LoraConfig.to_dict() or null), "source", "format_version"
DIR/params/       orbax StandardCheckpointer tree of nnx.state(model, nnx.Param) (LoRA adapters included)
DIR/tokenizer*    HF tokenizer (save_pretrained; chat template kept), when the source had one
DIR/COMPLETE      written last
```

Why: a folder is written under `DIR.tmp-*` and renamed into place only once complete, so an interrupted
write never looks valid; loading checks shapes against the checkpoint's own metadata before orbax runs, so
a wrong config names the parameter instead of failing deep inside TensorStore.

Two writers make the same folder: `save_checkpoint` (a model in memory) and `save_checkpoint_streaming`
(parameters pulled block by block while they are written, so a converter never holds the model: 7B in
float32 is 27 GB). `load_checkpoint` reads both the same way.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from flax import nnx, traverse_util
from jax.sharding import Mesh, SingleDeviceSharding
from orbax.checkpoint._src.metadata import array_metadata_store
from orbax.checkpoint._src.multihost import multihost
from orbax.checkpoint._src.serialization import jax_array_handlers, ocdbt_utils
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

from empatheia_jax.data.templates import CONVERTED_MARKER, load_tokenizer
from empatheia_jax.models.llama import Llama, LlamaConfig
from empatheia_jax.models.lora import LoraConfig, apply_lora, lora_layers
from empatheia_jax.sharding import state_shardings

FORMAT_VERSION = 1
COMPLETE = CONVERTED_MARKER
_EXTRA_KEYS = ("lora", "source", "format_version")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: a converted folder, a training step (`train.checkpoint`) or an
    export (`serve.load`). One class for all three, so a caller catches one; the message names the folder,
    file, step or key at fault."""


# ----------------------------------------------------------------------------------------------------------
# Building models
# ----------------------------------------------------------------------------------------------------------


def _build(cfg: LlamaConfig, lora: LoraConfig | None) -> Llama:
    model = Llama(cfg, rngs=nnx.Rngs(0))
    if lora is not None:
        apply_lora(model, lora, rngs=nnx.Rngs(1))
    return model


def abstract_model(cfg: LlamaConfig, lora: LoraConfig | None = None) -> Llama:
    """The model with ShapeDtypeStruct leaves: structure and shapes, no memory, no random init."""
    return nnx.eval_shape(lambda: _build(cfg, lora))


def empty_model(cfg: LlamaConfig, lora: LoraConfig | None = None) -> Llama:
    """A concrete model filled with zeros: cheap (no random init of 100M+ values) and ready to be loaded."""
    graphdef, state = nnx.split(abstract_model(cfg, lora))
    state = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), state)
    return nnx.merge(graphdef, state)


# ----------------------------------------------------------------------------------------------------------
# Param trees <-> flat string keys ("layers.3.self_attn.q_proj.kernel"), the names errors use
# ----------------------------------------------------------------------------------------------------------


def _key(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def _flat_params(state: nnx.State) -> dict[tuple, Any]:
    return traverse_util.flatten_dict(nnx.to_pure_dict(state))


def _nested_str(flat: dict[tuple, Any]) -> dict:
    # Orbax stores dict keys as strings anyway; saying so up front keeps save and restore trees identical.
    return traverse_util.unflatten_dict({tuple(str(p) for p in k): v for k, v in flat.items()})


# ----------------------------------------------------------------------------------------------------------
# Save
# ----------------------------------------------------------------------------------------------------------


def _check_lora(model: Llama, lora: LoraConfig | None) -> None:
    layers = lora_layers(model)
    if lora is None and layers:
        raise ValueError("the model has LoRA layers: pass lora=LoraConfig(...) so loading rebuilds them")
    if lora is not None:
        if not layers:
            raise ValueError("lora= was given but the model has no LoRA layers (apply_lora first)")
        expected = model.config.num_hidden_layers * len(lora.targets)
        if len(layers) != expected:
            raise ValueError(f"model has {len(layers)} LoRA layers, lora config implies {expected}")
        for m in layers:
            if m.merged:
                raise ValueError("a LoRA layer is merged into its kernel; unmerge_lora(model) before saving")
            if m.lora.lora_a.shape[1] != lora.rank or abs(m.lora_scale - lora.scale) > 1e-9:
                raise ValueError(f"model LoRA rank/scale ({m.lora.lora_a.shape[1]}, {m.lora_scale}) differ "
                                 f"from lora config ({lora.rank}, {lora.scale})")


def _out_path(dir: str | os.PathLike, overwrite: bool) -> Path:
    out = Path(dir).absolute()
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists (pass overwrite=True to replace it)")
    return out


def _config_json(cfg: LlamaConfig, lora: LoraConfig | None, source: str) -> dict:
    config = cfg.to_dict()
    config.update(lora=lora.to_dict() if lora else None, source=str(source))
    config["format_version"] = FORMAT_VERSION
    return config


def _write_folder(out: Path, config: dict, write_params: Callable[[Path], None], tokenizer: Any) -> Path:
    """The folder around the parameters: config.json, params/ (by `write_params`), tokenizer, COMPLETE, all
    in `out.tmp-*`, renamed onto `out` last (an existing `out` is moved aside first and deleted after)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_params(tmp / "params")
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        (tmp / COMPLETE).write_text("ok\n")
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=out.name + ".old-", dir=out.parent))
            os.rename(out, old / "x")
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def save_checkpoint(
    dir: str | os.PathLike,
    model: Llama,
    tokenizer: Any = None,
    *,
    lora: LoraConfig | None = None,
    source: str = "",
    overwrite: bool = False,
) -> Path:
    """Writes the converted-checkpoint folder atomically; returns its path.

    An existing folder is replaced only with overwrite=True (and only once the new one is complete).
    """
    out = _out_path(dir, overwrite)
    _check_lora(model, lora)

    def write_params(path: Path) -> None:
        params = _nested_str(_flat_params(nnx.state(model, nnx.Param)))
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(path, params)
            ckptr.wait_until_finished()

    return _write_folder(out, _config_json(model.config, lora, source), write_params, tokenizer)


# ----------------------------------------------------------------------------------------------------------
# Streaming save: the same params/ tree, written one block at a time
# ----------------------------------------------------------------------------------------------------------

Block = tuple[tuple[slice, ...], np.ndarray]


@dataclasses.dataclass(frozen=True)
class StreamedArray:
    """A parameter that `save_checkpoint_streaming` pulls while it writes, so no more than a block of it is
    ever in memory.

    `blocks()` yields (index, values) pairs, values in `dtype`, that cover the array exactly once, each a
    union of whole chunks (a partial chunk would be written, read back and rewritten by TensorStore).
    `chunks` is the on-disk chunk shape; None keeps orbax's choice (the whole array up to 2 GiB, as
    `save_checkpoint` writes it). Nothing is read before the writer asks for the first block.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    blocks: Callable[[], Iterable[Block]]
    chunks: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:  # orbax's logging sums it
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def _write_spec(value: StreamedArray, info: Any) -> tuple[dict, Any]:
    """(TensorStore spec, orbax ArrayMetadata) that ArrayHandler would use for this array, with the chunk
    grid set to `value.chunks`: orbax's `chunk_byte_size` splits the largest dimensions first, which for a
    transposed kernel cuts across the rows a converter reads, so a band of rows would span many chunks."""
    spec = ts_utils.build_array_write_spec(
        info, ocp.SaveArgs(), global_shape=value.shape, local_shape=value.shape,
        dtype=np.dtype(value.dtype), use_ocdbt=info.is_ocdbt_checkpoint,
        process_index=ocdbt_utils.get_process_index_for_subdir(info.is_ocdbt_checkpoint),
    )
    json_spec, metadata = spec.json, spec.metadata
    if value.chunks is not None and tuple(value.chunks) != tuple(metadata.chunk_shape):
        if json_spec.get("driver") != "zarr":  # zarr2, as StandardCheckpointHandler (use_zarr3=False) writes
            raise ValueError(f"{info.name}: cannot set chunks on a {json_spec.get('driver')!r} array spec")
        json_spec["metadata"]["chunks"] = list(value.chunks)
        metadata = dataclasses.replace(metadata, chunk_shape=tuple(value.chunks))
    return json_spec, metadata


class _StreamedArrayHandler(ocp.type_handlers.ArrayHandler):
    """Writes a StreamedArray as ArrayHandler writes a jax.Array on one device: the same TensorStore spec
    (chunk grid aside), typestr ("jax.Array"), sharding file and array metadata, so `load_checkpoint`
    restores it unchanged.

    Only the data path differs. ArrayHandler hands TensorStore the whole array in one write, and OCDBT
    keeps every encoded chunk in memory until that write commits: a second copy of the tensor on top of
    the first (measured +0.7-0.9x of a 500 MB array, whatever the chunk size). Here each block is written
    and committed before the next one is produced. Single-process only (a converter is).
    """

    def __init__(self, store: array_metadata_store.Store) -> None:
        super().__init__(array_metadata_store=store)

    async def serialize(
        self,
        values: Sequence[StreamedArray],
        infos: Sequence[ocp.type_handlers.ParamInfo],
        args: Sequence[ocp.SaveArgs] | None = None,
    ) -> list:
        if jax.process_count() > 1:
            raise ValueError("streamed parameters are written by a single process")
        written = []
        for value, info in zip(values, infos, strict=True):
            await info.await_path_creation()
            json_spec, metadata = _write_spec(value, info)
            store = await ts.open(ts.Spec(json_spec), create=True, open=True, context=info.ts_context)
            count = 0
            for index, block in value.blocks():
                target = store[index]
                if tuple(block.shape) != tuple(target.shape) or block.dtype != np.dtype(value.dtype):
                    raise ValueError(f"{info.name}: block {index} is {block.dtype}{list(block.shape)}, "
                                     f"expected {np.dtype(value.dtype)}{list(target.shape)}")
                # Resolves once committed: one block in flight. The block is never modified, so TensorStore
                # may encode it in place instead of copying it first (as orbax's own writes do).
                await target.write(block, can_reference_source_data_indefinitely=True)
                count += block.size
            if count != math.prod(value.shape):
                raise ValueError(f"{info.name}: blocks hold {count} values, the array has {value.shape}")
            written.append(metadata)
        sharding = SingleDeviceSharding(jax.local_devices()[0])  # where save_checkpoint's arrays live
        await jax_array_handlers._async_serialize_shardings(
            [sharding] * len(values), infos, primary_host=self._primary_host
        )
        await self._array_metadata_store.write(
            checkpoint_dir=infos[0].parent_dir, array_metadatas=written,
            process_index=multihost.process_index(),
        )
        return []


def save_checkpoint_streaming(
    dir: str | os.PathLike,
    cfg: LlamaConfig,
    params: Mapping[str, StreamedArray],
    tokenizer: Any = None,
    *,
    lora: LoraConfig | None = None,
    source: str = "",
    overwrite: bool = False,
) -> Path:
    """`save_checkpoint` for a model that is never built: `params` maps every flat parameter name
    ("layers.3.mlp.up_proj.kernel", LoRA adapters included when `lora` is given) to a StreamedArray of
    the shape and dtype `abstract_model(cfg, lora)` has. Parameters are written one after another.
    """
    out = _out_path(dir, overwrite)
    flat = _flat_params(nnx.state(abstract_model(cfg, lora), nnx.Param))
    wanted = {_key(k): v for k, v in flat.items()}
    problems = [f"missing {sorted(set(wanted) - set(params))[:5]}"] if set(wanted) - set(params) else []
    if set(params) - set(wanted):
        problems.append(f"not in the model {sorted(set(params) - set(wanted))[:5]}")
    for k in sorted(set(params) & set(wanted)):
        got, want = params[k], wanted[k]
        if tuple(got.shape) != tuple(want.shape) or np.dtype(got.dtype) != np.dtype(want.dtype):
            problems.append(f"{k}: {np.dtype(got.dtype)}{list(got.shape)}, the model has "
                            f"{np.dtype(want.dtype)}{list(want.shape)}")
    if problems:
        raise ValueError("streamed parameters do not match the config: " + "; ".join(problems))
    tree = _nested_str({k: params[_key(k)] for k in flat})

    def write_params(path: Path) -> None:
        # StandardCheckpointHandler is this PyTreeCheckpointHandler (with its save_concurrent_gb) plus a
        # leaf-type check that StreamedArray would fail; the registry adds the streaming leaf type. The
        # pytree handler takes the array-metadata store (which puts write_shape into _METADATA) from the
        # jax.Array handler: both share one.
        store = array_metadata_store.Store()
        registry = ocp.type_handlers.create_type_handler_registry(
            (jax.Array, ocp.type_handlers.ArrayHandler(array_metadata_store=store)),
            (StreamedArray, _StreamedArrayHandler(store)),
        )
        handler = ocp.PyTreeCheckpointHandler(save_concurrent_gb=96, type_handler_registry=registry)
        # _CHECKPOINT_METADATA names the handler that restores the item: the tree is the one
        # StandardCheckpointHandler writes and load_checkpoint restores with, so record that one, as
        # save_checkpoint's folder does.
        handler.typestr = ocp.StandardCheckpointHandler.typestr
        with ocp.Checkpointer(handler) as ckptr:
            ckptr.save(path, args=ocp.args.PyTreeSave(item=tree))

    return _write_folder(out, _config_json(cfg, lora, source), write_params, tokenizer)


# ----------------------------------------------------------------------------------------------------------
# Load
# ----------------------------------------------------------------------------------------------------------


def is_complete(dir: str | os.PathLike) -> bool:
    """True when `dir` is a finished converted checkpoint (its COMPLETE marker exists)."""
    return (Path(dir) / COMPLETE).is_file()


def read_json(path: Path, error: type[Exception], missing: str) -> Any:
    """A folder's JSON file (config.json, an export's config): a missing or malformed file raises the
    caller's `error` naming the file; `missing` says what its absence means."""
    if not path.is_file():
        raise error(f"{path} is missing: {missing}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise error(f"{path} is not valid JSON: {e}") from e


def read_config(dir: str | os.PathLike) -> tuple[LlamaConfig, LoraConfig | None, dict]:
    """Parses DIR/config.json into (LlamaConfig, LoraConfig | None, the raw dict); errors name the file."""
    path = Path(dir) / "config.json"
    raw = read_json(path, CheckpointError, "not a converted checkpoint folder")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    version = raw.get("format_version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version={version!r}, this code reads {FORMAT_VERSION}")
    fields = {k: v for k, v in raw.items() if k not in _EXTRA_KEYS}
    try:
        cfg = LlamaConfig.from_dict(fields)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from e
    try:
        lora = LoraConfig.from_dict(raw["lora"]) if raw.get("lora") else None
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: invalid 'lora' entry {raw.get('lora')!r}: {e}") from e
    return cfg, lora, raw


def _check_against_metadata(params_dir: Path, expected: dict[tuple, Any]) -> None:
    """Compares the checkpoint's stored keys/shapes with what config.json implies; names every problem."""
    try:
        with ocp.StandardCheckpointer() as ckptr:
            meta = ckptr.metadata(params_dir).item_metadata.tree
    except Exception as e:  # unreadable _METADATA / manifest
        raise CheckpointError(f"cannot read the parameter metadata in {params_dir}: {e}") from e
    stored = {_key(k): v for k, v in traverse_util.flatten_dict(dict(meta)).items()}
    wanted = {_key(k): v for k, v in expected.items()}
    problems = []
    missing = sorted(set(wanted) - set(stored))
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        problems.append(f"missing parameters {missing[:5]}{more}")
    unexpected = sorted(set(stored) - set(wanted))
    if unexpected:
        problems.append(f"parameters config.json does not describe {unexpected[:5]}")
    for k in sorted(set(stored) & set(wanted)):
        if tuple(stored[k].shape) != tuple(wanted[k].shape):
            problems.append(f"parameter {k!r} has shape {tuple(stored[k].shape)} in the checkpoint but "
                            f"config.json implies {tuple(wanted[k].shape)}")
    if problems:
        raise CheckpointError(f"{params_dir} does not match {params_dir.parent / 'config.json'}: "
                              + "; ".join(problems))


def _unreadable_keys(params_dir: Path, target: dict[tuple, Any]) -> list[str]:
    """Restores each parameter alone to find the ones whose files are damaged (only on the error path)."""
    bad = []
    with ocp.PyTreeCheckpointer() as ckptr:
        for k, v in target.items():
            sub = _nested_str({k: v})
            try:
                restore_args = ocp.checkpoint_utils.construct_restore_args(sub)
                ckptr.restore(
                    params_dir,
                    args=ocp.args.PyTreeRestore(item=sub, restore_args=restore_args, partial_restore=True),
                )
            except Exception:
                bad.append(_key(k))
    return bad


def load_checkpoint(dir: str | os.PathLike, *, mesh: Mesh | None = None) -> tuple[Llama, Any]:
    """Loads (model, tokenizer) from a converted-checkpoint folder; tokenizer is None if none was saved.

    With a mesh, parameters are restored directly into their shards (logical-axis rules of sharding.py);
    no host ever holds the whole model.
    """
    path = Path(dir)
    if not path.is_dir():
        raise CheckpointError(f"no converted checkpoint at {path} (folder does not exist); "
                              "create it with `python -m converters.hf_to_flax --src ... --out DIR`")
    if not is_complete(path):
        raise CheckpointError(f"{path} has no {COMPLETE} marker: the conversion that wrote it was "
                              "interrupted or is still running; convert again")
    cfg, lora, _ = read_config(path)
    params_dir = (path / "params").absolute()
    if not params_dir.is_dir():
        raise CheckpointError(f"{params_dir} is missing")

    graphdef, params_abstract, rest = nnx.split(abstract_model(cfg, lora), nnx.Param, ...)
    if jax.tree.leaves(rest):  # the backbone keeps no non-parameter state; a converted folder stores none
        raise CheckpointError(f"model has non-parameter state {list(_flat_params(rest))[:3]}")
    if mesh is not None:
        shardings = state_shardings(params_abstract, mesh)
        flat_shardings = _flat_params(shardings)
    flat = _flat_params(params_abstract)
    default = SingleDeviceSharding(jax.local_devices()[0])
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=flat_shardings[k] if mesh is not None else default)
        for k, v in flat.items()
    }
    _check_against_metadata(params_dir, target)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            restored = ckptr.restore(params_dir, _nested_str(target))
    except Exception as e:
        bad = _unreadable_keys(params_dir, target)
        cause = str(e.__cause__ or e).splitlines()[0][:300]
        where = f"parameters {bad}" if bad else "parameters"
        raise CheckpointError(
            f"cannot read {where} from {params_dir} (corrupt or truncated file?): {cause}"
        ) from e
    flat_restored = traverse_util.flatten_dict(restored)
    values = traverse_util.unflatten_dict({k: flat_restored[tuple(str(p) for p in k)] for k in flat})
    nnx.replace_by_pure_dict(params_abstract, values)
    model = nnx.merge(graphdef, params_abstract, rest)
    return model, _load_tokenizer(path)


def _load_tokenizer(path: Path) -> Any:
    if not (path / "tokenizer_config.json").is_file() and not (path / "tokenizer.json").is_file():
        return None
    return load_tokenizer(path)
