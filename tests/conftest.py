"""Test-wide environment: offline, CPU, 8 fake devices for the sharding tests.

These must be set before jax is imported anywhere, hence at conftest import time.
"""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()


@pytest.fixture
def exact_matmuls():
    """fp32 matmuls at full precision, for tests comparing two computations of the same values."""
    import jax

    with jax.default_matmul_precision("highest"):
        yield
