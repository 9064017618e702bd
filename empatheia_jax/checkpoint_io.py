"""The converted-checkpoint folder: what `converters.hf_to_flax` writes and `load_model` reads.

```
DIR/config.json   LlamaConfig.to_dict() + "lora" (LoraConfig.to_dict() or null), "source", "format_version"
DIR/params/       orbax StandardCheckpointer tree of nnx.state(model, nnx.Param) (LoRA adapters included)
DIR/tokenizer*    HF tokenizer (save_pretrained; chat template kept), when the source had one
DIR/COMPLETE      written last
```

Why: a folder is written under `DIR.tmp-*` and renamed into place only once complete, so an interrupted
write never looks valid; loading checks shapes against the checkpoint's own metadata before orbax runs, so
a wrong config names the parameter instead of failing deep inside TensorStore.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx, traverse_util
from jax.sharding import Mesh, SingleDeviceSharding

from empatheia_jax.models.llama import Llama, LlamaConfig
from empatheia_jax.models.lora import LoraConfig, apply_lora, lora_layers
from empatheia_jax.sharding import state_shardings

FORMAT_VERSION = 1
COMPLETE = "COMPLETE"
_EXTRA_KEYS = ("lora", "source", "format_version")


class CheckpointError(ValueError):
    """A converted-checkpoint folder that cannot be loaded; the message names the file/key at fault."""


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
    out = Path(dir).absolute()
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists (pass overwrite=True to replace it)")
    _check_lora(model, lora)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        config = model.config.to_dict()
        config.update(lora=lora.to_dict() if lora else None, source=str(source))
        config["format_version"] = FORMAT_VERSION
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        params = _nested_str(_flat_params(nnx.state(model, nnx.Param)))
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(tmp / "params", params)
            ckptr.wait_until_finished()
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


def load_tokenizer(path: str | os.PathLike) -> Any:
    """The HF tokenizer saved in a folder: a converted checkpoint, an export or an HF model folder.

    A converted checkpoint's config.json is ours, not an HF config: AutoTokenizer would parse it as one
    (and warn about its `rope_scaling` key on every load), so it is given an empty config instead.
    """
    from transformers import AutoTokenizer, PretrainedConfig

    kw = {"config": PretrainedConfig()} if is_complete(path) else {}
    return AutoTokenizer.from_pretrained(os.fspath(path), **kw)


def _load_tokenizer(path: Path) -> Any:
    if not (path / "tokenizer_config.json").is_file() and not (path / "tokenizer.json").is_file():
        return None
    return load_tokenizer(path)
