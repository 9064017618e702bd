"""empatheia_jax: JAX/Flax training and serving for Empatheia (multimodal empathetic dialogue)."""

from setuptools import find_packages, setup

CORE = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax>=0.2.8",
    "orbax-checkpoint==0.12.8",
    "chex>=0.1.92",
    "ml-collections>=1.1.0",
    "grain==0.2.18",
    "array-record>=0.8.6",
    "safetensors>=0.8.0",
    "tokenizers>=0.23",
    "transformers==5.23.0",
    "msgpack>=1.0",
    "numpy>=2.0",
    "tqdm>=4.66",
    "tensorboardX>=2.6",
    "absl-py>=2.0",
]
# torch is pinned so that it is resolved (to the CPU wheel) before peft can pull a CUDA build.
CONVERT = ["torch==2.13.0", "peft==0.21.2", "gguf>=0.19.0", "accelerate>=1.15.0"]
DATA = ["librosa>=0.11", "av>=18.0", "espeakng-loader>=0.2.4", "tensorflow-datasets>=4.9.10"]
# pytest-xdist runs the suite on both cores of the CI box (docs/design.md "Tests and CI"); filelock guards
# the session cache those workers share.
TEST = ["pytest>=9.0", "pytest-xdist>=3.6", "filelock>=3.12", "ruff>=0.17"]

setup(
    name="empatheia_jax",
    version="0.1.0",
    description="Empatheia multimodal empathetic LLM in JAX/Flax",
    python_requires=">=3.11",
    packages=find_packages(include=["empatheia_jax*", "converters*", "data*", "configs*"]),
    package_data={"empatheia_jax": ["resources/*.json"]},
    install_requires=CORE,
    extras_require={
        "convert": CONVERT,
        "data": DATA,
        "test": CONVERT + DATA + TEST,
    },
    entry_points={"console_scripts": ["empatheia=empatheia_jax.cli:main"]},
)
