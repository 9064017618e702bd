"""Test-wide environment: offline, CPU, 8 fake devices for the sharding tests, XLA's CPU codegen unoptimised.

These must be set before jax is imported anywhere, hence at conftest import time.
"""

import os

import pytest
from helpers import FAST_COMPILE, run_temp_root, xla_flags

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite's programs are tiny models compiled once or twice each: LLVM's optimisation costs more than it
# saves (test_sd_warmup: 203 s -> 126 s), and the CLI subprocesses (`cli_env`) already run this way.
# Tests that re-measure a stored figure run their own process without these flags (test_reference_model).
# (helpers.FAST_COMPILE has the flags and why.)
_FLAGS = {"xla_force_host_platform_device_count": "8", **FAST_COMPILE}
for _flag, _value in _FLAGS.items():
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{_flag}={_value}".strip()


@pytest.fixture
def exact_matmuls():
    """fp32 matmuls at full precision, for tests comparing two computations of the same values."""
    import jax

    with jax.default_matmul_precision("highest"):
        yield


# jax locks its persistent cache's files (a FileLock per read and write) only when a maximum size is set; two
# xdist workers writing and reading one folder need it. Any size above what a run writes (~2 GB) will do.
_CACHE_MAX_BYTES = str(16 * 2**30)


def run_compilation_cache(tmp_path_factory) -> str:
    """One persistent compilation cache for the whole pytest run, shared by both xdist workers: a program
    the other worker compiled (a CLI run's step, a module fixture's) is read, not compiled again (a stage
    overall step costs ~70 s of compile at optimisation level 0)."""
    cache = run_temp_root(tmp_path_factory) / "jax_cache"
    cache.mkdir(exist_ok=True)
    return str(cache)


@pytest.fixture(scope="session", autouse=True)
def compilation_cache_in_process(tmp_path_factory):
    """The pytest processes read and write the same cache: a program a test compiles again in a new jit
    (every `trainer.train`, `jit_step` or warm-up call traces a fresh closure) is read, not compiled.
    Measured side by side, twice: test_sd_warmup 79-83 s -> 62-70 s (its second warm-up); test_ema, the
    accumulation and 8-device tests unchanged (their programs differ, or reading costs what compiling
    did). Only programs of a second or more are kept: the eager ops' hundreds of small compiles are
    cheaper done again than written."""
    import jax

    jax.config.update("jax_compilation_cache_dir", run_compilation_cache(tmp_path_factory))
    jax.config.update("jax_compilation_cache_max_size", int(_CACHE_MAX_BYTES))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


@pytest.fixture(scope="session")
def cli_env(tmp_path_factory):
    """Environment for `python -m empatheia_jax.cli` subprocesses: one CPU device, XLA optimisation off, and
    the run's persistent compilation cache, so only the first CLI run of a program pays for compiling."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags(devices=1)
    env["JAX_COMPILATION_CACHE_DIR"] = run_compilation_cache(tmp_path_factory)
    env["JAX_COMPILATION_CACHE_MAX_SIZE"] = _CACHE_MAX_BYTES
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["PYTHONPATH"] = os.pathsep.join([str(repo), env.get("PYTHONPATH", "")])
    return env
