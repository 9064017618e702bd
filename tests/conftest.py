"""Test-wide environment: offline, CPU, 8 fake devices for the sharding tests, XLA's CPU codegen unoptimised.

These must be set before jax is imported anywhere, hence at conftest import time.
"""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite's programs are tiny models compiled once or twice each: LLVM's optimisation costs more than it
# saves (test_sd_warmup: 203 s -> 126 s), and the CLI subprocesses (`cli_env`) already run this way.
# Tests that re-measure a stored figure run their own process without these flags (test_reference_model).
_FLAGS = {
    "xla_force_host_platform_device_count": "8",
    "xla_backend_optimization_level": "0",
    "xla_llvm_disable_expensive_passes": "true",
}
for _flag, _value in _FLAGS.items():
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{_flag}={_value}".strip()


@pytest.fixture
def exact_matmuls():
    """fp32 matmuls at full precision, for tests comparing two computations of the same values."""
    import jax

    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="session")
def cli_env(tmp_path_factory):
    """Environment for `python -m empatheia_jax.cli` subprocesses: one CPU device, XLA optimisation off, and
    one persistent compilation cache for the session, so only the first CLI run pays for compiling."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        "--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0 "
        "--xla_llvm_disable_expensive_passes=true"
    )
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("jax_cache"))
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["PYTHONPATH"] = os.pathsep.join([str(repo), env.get("PYTHONPATH", "")])
    return env
