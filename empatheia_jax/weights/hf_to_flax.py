"""HF LLaMA checkpoint (safetensors folder or GGUF file) -> converted-checkpoint folder.

    python -m converters.hf_to_flax --src SRC --out DIR [--dtype float32|bfloat16] [--extra-vocab N]

SRC is an HF folder (config.json + model.safetensors, or shards + model.safetensors.index.json) or a
`.gguf` file. `convert` never builds the model: each parameter is read, converted and written in bands of
whole on-disk chunks while `checkpoint_io.save_checkpoint_streaming` writes it, so peak memory is a band
or two plus fixed costs, not the model (measured in bench/convert_memory.py). Safetensors are read with
plain positioned reads, not through safetensors' memory map, whose touched pages stay resident until the
file is closed (the whole model by the end). GGUF goes through transformers (needs `gguf` +
`accelerate`), which dequantizes it to a float32 torch model held in memory; its state dict is then
written the same way. The tensor name table is `empatheia_jax.weights.hf_names` (shared with the exporter);
the
folder format is `empatheia_jax.weights.checkpoint_io`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from empatheia_jax.models.llama import Llama, LlamaConfig, init_added_rows
from empatheia_jax.weights.checkpoint_io import (
    Block,
    StreamedArray,
    abstract_model,
    empty_model,
    read_json,
    save_checkpoint_streaming,
)
from empatheia_jax.weights.hf_names import (
    ConversionError,
    ParamName,
    check_hf_tensors,
    load_hf_tensors,
    variable,
)

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
# Sources of the in-memory route (`load_hf_model_into_flax`): get_tensor(name) -> float32 array, and names
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
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    check_gguf_special_tokens(path, tokenizer)  # before the slow part
    hf_model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return hf_model, tokenizer


_GGUF_SPECIAL_IDS = {"bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
                     "unk": "tokenizer.ggml.unknown_token_id", "pad": "tokenizer.ggml.padding_token_id"}


def check_gguf_special_tokens(path: Path, tokenizer: Any) -> None:
    """The tokenizer transformers builds from a GGUF must have the special tokens the GGUF's metadata names.

    Why: transformers 5.17 reads SmolLM2's GGUF with eos_token <|im_start|> (the GGUF says <|im_end|>) and
    no pad token. Every training target ends in the eos token, so a model trained on that conversion learns
    another end token, and its checkpoint scores worse under a correct conversion (docs/design.md
    "The GGUF tokenizer check"). A special token the GGUF does not name is not checked.
    """
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    wrong = []
    for name, key in _GGUF_SPECIAL_IDS.items():
        field = fields.get(key)
        if field is None:
            continue
        want, got = int(field.parts[field.data[0]][0]), getattr(tokenizer, f"{name}_token_id", None)
        if got != want:
            wrong.append(f"{name}_token {getattr(tokenizer, f'{name}_token', None)!r} (id {got}), the GGUF "
                         f"says id {want} ({tokenizer.convert_ids_to_tokens(want)!r})")
    if wrong:
        import transformers

        raise ConversionError(f"{path}: transformers {transformers.__version__} reads this GGUF's tokenizer "
                              f"wrongly: {'; '.join(wrong)}. setup.py's pinned transformers reads it right.")


def _state_dict_source(hf_model) -> tuple[Callable[[str], np.ndarray], set[str]]:
    sd = hf_model.state_dict()
    return (lambda name: sd[name].detach().float().cpu().numpy()), set(sd)


# ----------------------------------------------------------------------------------------------------------
# Row readers for the streaming conversion: a band of leading-axis rows at a time, in the stored dtype
# ----------------------------------------------------------------------------------------------------------


class _RowReader(Protocol):
    """Tensor shapes as stored, and rows [start, stop) of the leading axis in the stored dtype."""

    shapes: dict[str, tuple[int, ...]]

    def rows(self, name: str, start: int, stop: int) -> np.ndarray: ...


# safetensors dtype names -> numpy (the format is little-endian); bfloat16 is ml_dtypes' (jax's own)
_ST_DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
              "BF16": np.dtype(ml_dtypes.bfloat16)}


def _safetensors_header(fd: int) -> tuple[int, dict]:
    """(offset of the data, {name: (dtype or None, shape, begin, end)}): the format is an 8-byte
    little-endian header length, a JSON header (name -> dtype, shape, data_offsets), then the data.
    Offsets are checked against the file size here, so a truncated file fails before anything is written."""
    size = os.fstat(fd).st_size
    (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if 8 + n > size:
        raise ValueError(f"a header of {n} bytes in a file of {size}")
    entries = {}
    for name, meta in json.loads(os.pread(fd, n, 8)).items():
        if name == "__metadata__":
            continue
        dtype, shape = _ST_DTYPES.get(meta["dtype"]), tuple(int(d) for d in meta["shape"])
        begin, end = (int(x) for x in meta["data_offsets"])
        if 8 + n + end > size:
            raise ValueError(f"tensor {name!r} ends at byte {8 + n + end} of a file of {size}")
        if dtype is not None and end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"tensor {name!r} has {end - begin} bytes for {meta['dtype']} {shape}")
        entries[name] = (dtype, shape, begin, end)
    return 8 + n, entries


class _SafetensorsRows:
    """Rows of the tensors of safetensors files, read with os.preadv at the offsets of their headers.

    Why not `safe_open`: it memory-maps the file, and every page a read touches stays in the process's
    resident set until the file is closed (measured: a tensor read through it stays resident), so a
    conversion would end with the whole checkpoint resident. Plain reads go through the page cache, which
    the kernel reclaims freely and which is not this process's memory.
    """

    def __init__(self, files: list[Path]):
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._where: dict[str, tuple[int, Path, np.dtype | None, int]] = {}  # fd, file, dtype, offset
        self._fds: list[int] = []
        for f in files:
            self._fds.append(fd := os.open(f, os.O_RDONLY))
            try:
                data, entries = _safetensors_header(fd)
            except (ValueError, KeyError, TypeError, struct.error) as e:
                self.close()
                raise ConversionError(f"cannot read safetensors file {f} (truncated or corrupt?): {e}") from e
            for name, (dtype, shape, begin, _) in entries.items():
                self.shapes[name] = shape
                self._where[name] = (fd, f, dtype, data + begin)

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        fd, f, dtype, offset = self._where[name]
        shape = self.shapes[name]
        if dtype is None:
            raise ConversionError(f"tensor {name!r} in {f} is not a F32, F16, BF16 or F64 tensor")
        out = np.empty((stop - start, *shape[1:]), dtype)
        raw, done = memoryview(out.reshape(-1).view(np.uint8)), 0
        offset += start * math.prod(shape[1:]) * dtype.itemsize
        while done < raw.nbytes:  # a read may return less than asked
            got = os.preadv(fd, [raw[done:]], offset + done)
            if got <= 0:
                raise ConversionError(f"cannot read tensor {name!r} from {f} (truncated or corrupt?)")
            done += got
        return out

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


class _StateDictRows:
    """Rows of an in-memory torch state dict (the dequantized GGUF)."""

    def __init__(self, hf_model):
        self._sd = hf_model.state_dict()
        self.shapes = {k: tuple(v.shape) for k, v in self._sd.items()}

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        return self._sd[name][start:stop].detach().cpu().float().numpy()


# ----------------------------------------------------------------------------------------------------------
# Streamed parameters: what `save_checkpoint_streaming` pulls
# ----------------------------------------------------------------------------------------------------------

# A streamed parameter is written in chunks of about this size, each a band of the checkpoint's rows, read,
# converted and committed before the next: what one tensor costs in flight (several times this: the rows
# as stored, the converted chunk, TensorStore's compressed copy).
_CHUNK_BYTES = 8 * 2**20
# Rows go through float32 this many values at a time, so no float32 copy of a whole band is made.
_PIECE_VALUES = 2**18


def _pretrained(reader: _RowReader, name: ParamName, shape: tuple[int, ...], dtype: np.dtype
                ) -> StreamedArray:
    """One HF tensor in bands of the checkpoint's rows (contiguous on disk): our rows for an untransposed
    tensor, our columns for a transposed Linear kernel ([out, in] -> [in, out]). Each band is one on-disk
    chunk. Values go stored dtype -> float32 -> `dtype` as `load_hf_tensors` converts them (exact, or
    round to nearest even), so both paths write the same bits."""
    axis = 1 if name.transpose else 0
    line = math.prod(shape) // shape[axis]  # values in one checkpoint row
    step = max(1, min(shape[axis], _CHUNK_BYTES // (line * dtype.itemsize)))
    piece = max(1, _PIECE_VALUES // line)
    chunks = tuple(step if a == axis else d for a, d in enumerate(shape))

    def blocks() -> Iterator[Block]:
        for start in range(0, shape[axis], step):
            stop = min(start + step, shape[axis])
            stored = reader.rows(name.hf, start, stop)
            index = tuple(slice(start, stop) if a == axis else slice(None) for a in range(len(shape)))
            block = np.empty(tuple(stop - start if a == axis else d for a, d in enumerate(shape)), dtype)
            for p in range(0, stop - start, piece):
                rows = stored[p:p + piece].astype(np.float32)  # what `t.float()` gives load_hf_tensors
                if name.transpose:
                    block[:, p:p + piece] = rows.T  # the cast to `dtype` happens in the assignment
                else:
                    block[p:p + piece] = rows
            del stored
            yield index, block

    return StreamedArray(shape, dtype, blocks, chunks)


@functools.partial(jax.jit, donate_argnums=0)
def _put(buffer: jax.Array, block: np.ndarray, starts: tuple[int, ...]) -> jax.Array:
    return jax.lax.dynamic_update_slice(buffer, block, starts)


def _materialise(table: StreamedArray) -> jax.Array:
    """The whole table as one jax array, filled block by block in place (donated buffer): 1x its size."""
    buffer = jnp.zeros(table.shape, table.dtype)
    for index, block in table.blocks():
        buffer = _put(buffer, block, tuple(s.start or 0 for s in index))
    return buffer


def _added_rows(table: StreamedArray, axis: int, shape: Sequence[int]) -> StreamedArray:
    """`extra_vocab` rows (axis 0) or columns (axis 1) at the mean of the table's, exactly as
    `init_added_rows` computes them (same jax expression on the same values: the same bits).

    The one place a whole tensor is resident: the mean needs the table whole (XLA's reduction order is what
    fixes the bits). It is computed now, before the writer starts, so the table shares memory with nothing
    but the fixed overhead (read again later, when the table itself is written, in bands as usual); the
    rows are a few KB.
    """
    full = _materialise(table)
    rows = np.asarray(jnp.broadcast_to(full.mean(axis, keepdims=True), tuple(shape)).astype(full.dtype))
    full.delete()  # now, not whenever the last reference goes
    return StreamedArray(rows.shape, rows.dtype, lambda: [((slice(None),) * rows.ndim, rows)])


def _counted(param: StreamedArray, bar: Any) -> StreamedArray:
    def blocks() -> Iterator[Block]:
        yield from param.blocks()
        bar.update(1)

    return dataclasses.replace(param, blocks=blocks)


def _streamed_params(cfg: LlamaConfig, reader: _RowReader, bar: Any) -> dict[str, StreamedArray]:
    """Flat parameter name -> StreamedArray for every parameter of `Llama(cfg)`. Raises ConversionError
    (missing, unexpected or mis-shaped tensors) from the names and shapes alone, before any value is read.
    Only added-vocab rows are computed here; the rest is read when the writer pulls it. `bar` (tqdm) counts
    the tensors as the writer pulls them."""
    model = abstract_model(cfg)
    params = {}
    for name in check_hf_tensors(model, reader.shapes):
        var = variable(model, name.path)
        key = ".".join(map(str, name.path))
        params[key] = _pretrained(reader, name, tuple(var.shape), np.dtype(var.dtype))
    if cfg.extra_vocab:  # rows at the mean of their table's, as init_added_rows (computed here, see there)
        params["embed_extra"] = _added_rows(params["embed_tokens.embedding"], 0, model.embed_extra.shape)
        if not cfg.tie_word_embeddings:
            params["lm_head_extra"] = _added_rows(params["lm_head.kernel"], 1, model.lm_head_extra.shape)
    bar.reset(total=len(params))
    return {k: _counted(v, bar) for k, v in params.items()}


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
    """Converts an HF folder or .gguf file into a converted-checkpoint folder at `out`; returns `out`.

    Streams: the model is never built (see the module docstring); the folder is the one `save_checkpoint`
    writes from a model, and `load_model` reads it the same way.
    """
    src = _existing(Path(src))
    if src.is_file() and src.suffix == ".gguf":
        hf_model, tokenizer = _load_gguf(src)
        cfg = _with_overrides(_config_from_hf(hf_model.config.to_dict(), str(src)), dtype, extra_vocab)
        reader = contextlib.nullcontext(_StateDictRows(hf_model))
    elif src.is_dir():
        cfg = _with_overrides(_read_hf_config(src), dtype, extra_vocab)
        tokenizer = _load_tokenizer(src) if _has_tokenizer(src) else None
        reader = contextlib.closing(_SafetensorsRows(_safetensors_files(src)))
    else:
        raise ConversionError(f"{src} is neither an HF model folder nor a .gguf file")
    from tqdm import tqdm

    # disable=None: a bar on a terminal, silence in logs and tests.
    with reader as rows, tqdm(desc=f"converting {src.name}", unit="tensor", disable=None) as bar:
        params = _streamed_params(cfg, rows, bar)
        return save_checkpoint_streaming(out, cfg, params, tokenizer, source=str(src.absolute()),
                                         overwrite=overwrite)
