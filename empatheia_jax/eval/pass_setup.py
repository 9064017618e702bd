"""What both evaluation passes do before and around their batches: refuse data the model cannot read, and
show a progress bar.

The teacher-forced pass (`eval/teacher_forced.py`) and the generation pass (`eval/generation_pass.py`)
read the same split under the same template, so they refuse the same data with the same message, before
any batch is compiled or run; one function here says what is refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from empatheia_jax.data import shard_format
from empatheia_jax.data import templates as tpl
from empatheia_jax.data.splits import ShardsError
from empatheia_jax.models.empatheia import Empatheia
from empatheia_jax.train import stages


def check_model_and_data(
    model: Empatheia, tokenizer: Any, manifest: Mapping[str, Any], shards_dir, split: str, stage: stages.Stage
) -> None:
    """Refuses data the stage's template cannot read, before any batch: text-only records under a template
    with <Aud>/<Vid> (`shard_format.MissingMediaError`), features of another encoder than the model's. A
    template without media reads no feature, so then neither matters (text-only shards evaluate)."""
    cfg = model.config
    feats = manifest.get("features") or {}
    needs_media = stage.template_spec(cfg.n_signal).has_media
    shard_format.check_media_for_template(manifest, shards_dir, split, stage=stage.name,
                                          needs_media=needs_media,
                                          hint="the coe template (empatheia eval --template coe)")
    if needs_media:
        for key in ("audio_dim", "video_dim"):
            if feats.get(key) is not None and int(feats[key]) != getattr(cfg, key):
                raise ShardsError(f"{shards_dir}: features {key}={feats[key]} but the model was built for "
                                 f"{getattr(cfg, key)} (shards from another encoder?)")
    ids = tpl.extend_tokenizer(tokenizer, cfg.n_signal)
    if ids != cfg.token_ids:
        raise ValueError(f"the tokenizer's added-token ids {ids} differ from the model's {cfg.token_ids}")


def progress_bar(iterable: Iterable | None, *, total: int | None, desc: str, enabled: bool) -> Any:
    """A tqdm bar over `iterable` (None: updated by hand) of `total` batches, silent unless `enabled`."""
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit="batch", disable=not enabled, leave=False)


__all__ = ["check_model_and_data", "progress_bar"]
