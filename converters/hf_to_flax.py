"""HF LLaMA checkpoint (safetensors folder or GGUF file) -> converted-checkpoint folder.

    python -m converters.hf_to_flax --src SRC --out DIR [--dtype float32|bfloat16] [--extra-vocab N]

SRC is an HF folder (config.json + model.safetensors, or shards + model.safetensors.index.json) or a
`.gguf` file. Safetensors are streamed one tensor at a time (`safe_open`), so converting never holds two
copies of the model. GGUF goes through transformers (needs `gguf` + `accelerate`), which dequantizes it to
a float32 torch model; its state dict is then streamed the same way. The tensor name table is
`converters.hf_names` (shared with the exporter); the folder format is `empatheia_jax.checkpoint_io`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from converters.hf_names import ConversionError, load_hf_tensors
from empatheia_jax import logs
from empatheia_jax.checkpoint_io import empty_model, read_json, save_checkpoint
from empatheia_jax.models.llama import Llama, LlamaConfig, init_added_rows

DTYPES = ("float32", "bfloat16")


def _progress(desc: str) -> Callable[[Iterator], Iterator]:
    from tqdm import tqdm

    # disable=None: a bar on a terminal, silence in logs and tests.
    return lambda names: iter(tqdm(list(names), desc=desc, unit="tensor", disable=None))


def _config_from_hf(hf: dict, where: str, **overrides) -> LlamaConfig:
    try:
        return LlamaConfig.from_hf(hf, **overrides)
    except ValueError as e:
        raise ConversionError(f"{where}: {e}") from e


# ----------------------------------------------------------------------------------------------------------
# Sources: each yields (config, get_tensor, available names, tokenizer or None)
# ----------------------------------------------------------------------------------------------------------


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ConversionError(f"{index} is not a valid safetensors index: {e}") from e
        files = sorted({folder / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ConversionError(f"{index} lists shard(s) that do not exist: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConversionError(f"{folder} holds no *.safetensors files (and no model.safetensors.index.json)")
    return files


@contextlib.contextmanager
def _open_safetensors(folder: Path):
    """Opens every shard lazily; yields (get_tensor, available names). Errors name the file."""
    from safetensors import safe_open

    files = _safetensors_files(folder)
    with contextlib.ExitStack() as stack:
        where: dict[str, tuple[Path, Any]] = {}
        for f in files:
            try:
                # "pt": numpy cannot represent bfloat16 checkpoints; torch is a converter dependency anyway.
                handle = stack.enter_context(safe_open(str(f), framework="pt"))
                keys = list(handle.keys())
            except Exception as e:
                raise ConversionError(f"cannot read safetensors file {f} (truncated or corrupt?): {e}") from e
            for k in keys:
                where[k] = (f, handle)

        def get_tensor(name: str) -> np.ndarray:
            f, handle = where[name]
            try:
                t = handle.get_tensor(name)
            except Exception as e:
                raise ConversionError(
                    f"cannot read tensor {name!r} from {f} (truncated or corrupt?): {e}"
                ) from e
            return t.float().numpy()

        yield get_tensor, set(where)


def _load_tokenizer(folder: Path, **kw) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), **kw)
    except (OSError, ValueError, TypeError):
        return None  # a bare weights folder (e.g. a test model) has no tokenizer; that is allowed


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def _load_gguf(path: Path):
    """Dequantizes a GGUF through transformers; returns (torch model, tokenizer)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:  # pragma: no cover - environment problem
        raise ConversionError(f"GGUF conversion needs torch+transformers+gguf+accelerate: {e}") from e
    try:
        from transformers import AutoConfig

        hf_cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise ConversionError(f"cannot read the GGUF header of {path}: {e}") from e
    if getattr(hf_cfg, "model_type", None) not in ("llama", "mistral"):
        raise ConversionError(f"{path}: model_type={hf_cfg.model_type!r} is not a LLaMA-family decoder")
    hf_model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return hf_model, tokenizer


def _state_dict_source(hf_model) -> tuple[Callable[[str], np.ndarray], set[str]]:
    sd = hf_model.state_dict()
    return (lambda name: sd[name].detach().float().cpu().numpy()), set(sd)


# ----------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------


def _with_overrides(cfg: LlamaConfig, dtype: str, extra_vocab: int) -> LlamaConfig:
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} not in {DTYPES}")
    return cfg.replace(dtype=dtype, param_dtype=dtype, extra_vocab=extra_vocab)


def _fill(cfg: LlamaConfig, get_tensor, available: set[str], desc: str) -> Llama:
    model = empty_model(cfg)
    load_hf_tensors(model, get_tensor, available, progress=_progress(desc))
    init_added_rows(model)
    return model


def load_hf_model_into_flax(
    hf_model_or_dir: Any, *, dtype: str = "float32", extra_vocab: int = 0
) -> Llama:
    """A `Llama` holding the weights of a transformers model object, an HF folder or a .gguf file.

    For tests and notebooks: no folder is written.
    """
    if isinstance(hf_model_or_dir, str | os.PathLike):
        src = Path(hf_model_or_dir)
        if src.suffix == ".gguf":
            hf_model_or_dir, _ = _load_gguf(_existing(src))
        else:
            cfg = _with_overrides(_read_hf_config(_existing(src)), dtype, extra_vocab)
            with _open_safetensors(src) as (get_tensor, available):
                return _fill(cfg, get_tensor, available, f"loading {src.name}")
    hf_cfg = hf_model_or_dir.config.to_dict()
    cfg = _with_overrides(_config_from_hf(hf_cfg, type(hf_model_or_dir).__name__), dtype, extra_vocab)
    get_tensor, available = _state_dict_source(hf_model_or_dir)
    return _fill(cfg, get_tensor, available, "loading state dict")


def _existing(src: Path) -> Path:
    if not src.exists():
        raise FileNotFoundError(f"conversion source {src} does not exist")
    return src


def _read_hf_config(folder: Path) -> LlamaConfig:
    path = folder / "config.json"
    hf = read_json(path, ConversionError, "an HF model folder needs config.json")
    return _config_from_hf(hf, str(path))


def convert(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: str = "float32",
    extra_vocab: int = 0,
    overwrite: bool = False,
) -> Path:
    """Converts an HF folder or .gguf file into a converted-checkpoint folder at `out`; returns `out`."""
    src = _existing(Path(src))
    if src.is_file() and src.suffix == ".gguf":
        hf_model, tokenizer = _load_gguf(src)
        cfg = _with_overrides(_config_from_hf(hf_model.config.to_dict(), str(src)), dtype, extra_vocab)
        get_tensor, available = _state_dict_source(hf_model)
        model = _fill(cfg, get_tensor, available, f"converting {src.name}")
        del hf_model
    elif src.is_dir():
        cfg = _with_overrides(_read_hf_config(src), dtype, extra_vocab)
        with _open_safetensors(src) as (get_tensor, available):
            model = _fill(cfg, get_tensor, available, f"converting {src.name}")
        tokenizer = _load_tokenizer(src) if _has_tokenizer(src) else None
    else:
        raise ConversionError(f"{src} is neither an HF model folder nor a .gguf file")
    return save_checkpoint(out, model, tokenizer, source=str(src.absolute()), overwrite=overwrite)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m converters.hf_to_flax", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--src", required=True, help="HF folder (config.json + safetensors) or a .gguf file")
    parser.add_argument("--out", required=True, help="output folder (converted checkpoint)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="parameter and compute dtype")
    parser.add_argument("--extra-vocab", type=int, default=0,
                        help="rows appended for added tokens, initialised at the mean of the existing rows")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    parser.add_argument("--verbose", action="store_true",
                        help="library logging (absl, jax, transformers, ...) at INFO instead of WARNING")
    args = parser.parse_args(argv)
    logs.configure(args.verbose)
    try:
        out = convert(args.src, args.out, dtype=args.dtype, extra_vocab=args.extra_vocab,
                      overwrite=args.overwrite)
    except (ConversionError, FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
