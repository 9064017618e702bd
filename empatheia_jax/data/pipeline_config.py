"""`PipelineConfig`: what an example and a batch look like, and the fields that must agree with the model.

One small module below the three that read it: example building (`examples`), batching (`batching`) and
the grain pipeline (`input_pipeline`) all take the same frozen config, so shapes derived from it are static
per bucket and the config can be part of a pipeline's fingerprint. `pipeline_config_fields` sits here too:
the trainer, evaluation and chat derive the model-bound fields through it, so no caller restates them.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from empatheia_jax.data import templates as tpl


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """What an example and a batch look like. Shapes derived from it are static per bucket.

    max_aud/max_vid: feature rows per example (= placeholders; k per utterance, see docs/design.md);
    histories with more are cut oldest-first. max_speech_len/max_video_len: rows of the content targets.
    buckets: sequence lengths a batch is padded to (default: 128, 256, 512, ... below max_len, and
    max_len). window_batches: batches per length-sorting window (1 keeps record order inside a batch).
    include_target: False builds prompts only (generation); loss masks are then all zero.
    speech_units: the speech generator's content units of a reply text, one id per content row
    (`generators.registry.content_units_fn`), for a unit-aligned Content Synchronizer: examples then carry
    `speech_units` [max_speech_len]. A function, not a name, because the generators sit above this layer.
    video_units: examples carry `video_units` [max_video_len], the record's stored per-frame unit ids
    (targets kind `video_units`, written with a phoneme mouth), for a unit-aligned video block
    (`EmpatheiaConfig.cv_units`); a record without them, or with a count other than its video_content
    rows, is refused by name. Stored, not computed from the text as speech units are: a frame's unit
    depends on the durations the gold clip was timed with.
    """

    stage: str = "overall"
    max_len: int = 1024
    n_signal: int = 16
    use_coe: bool = True
    media_input: bool = True
    pipeline_baseline: bool = False
    chat_format: str = "auto"
    max_aud: int = 32
    max_vid: int = 32
    max_speech_len: int = 256
    max_video_len: int = 256
    speech_content_dim: int = 1024
    video_content_dim: int = 256
    style_dim: int = 256
    buckets: tuple[int, ...] | None = None
    window_batches: int = 8
    include_target: bool = True
    speech_units: Callable[[str], np.ndarray] | None = None
    video_units: bool = False

    def __post_init__(self) -> None:
        self.template_spec()  # validates stage and flags
        if self.max_len < 16:
            raise ValueError(f"max_len must be >= 16, got {self.max_len}")
        if self.window_batches < 1:
            raise ValueError(f"window_batches must be >= 1, got {self.window_batches}")
        if self.buckets is not None:
            b = tuple(int(x) for x in self.buckets)
            if not b or list(b) != sorted(set(b)) or b[-1] != self.max_len or b[0] < 1:
                raise ValueError(f"buckets must be increasing and end at max_len={self.max_len}, got {b}")
            object.__setattr__(self, "buckets", b)

    def template_spec(self) -> tpl.TemplateSpec:
        return tpl.TemplateSpec(
            stage=self.stage,
            use_coe=self.use_coe,
            media_input=self.media_input,
            pipeline_baseline=self.pipeline_baseline,
            n_signal=self.n_signal,
        )

    def bucket_lengths(self) -> tuple[int, ...]:
        """Sequence lengths batches are padded to, ascending, the last one `max_len`."""
        if self.buckets is not None:
            return self.buckets
        out, b = [], 128
        while b < self.max_len:
            out.append(b)
            b *= 2
        return (*out, self.max_len)

    def bucket_for(self, length: int) -> int:
        buckets = self.bucket_lengths()
        i = bisect.bisect_left(buckets, length)
        if i == len(buckets):
            raise ValueError(f"length {length} exceeds max_len {self.max_len}")
        return buckets[i]


_MODEL_FIELDS = ("n_signal", "max_speech_len", "max_video_len", "speech_content_dim", "video_content_dim",
                 "style_dim")


def pipeline_config_fields(
    cfg: Any, stage: Any, overrides: Mapping[str, Any] | None = None,
    speech_units: Callable[[str], np.ndarray] | None = None,
) -> dict[str, Any]:
    """`PipelineConfig` fields (without stage/max_len) that agree with the model; `overrides` may set the
    others (max_aud, max_vid, buckets, chat_format) but not contradict the model. `speech_units`: the
    speech generator's unit function for a unit-aligned CS (`generators.registry.units_for`);
    `video_units` follows the model (`cv_units` > 0: the batch carries the stored frame units).

    `cfg` is an `EmpatheiaConfig` and `stage` a `stages.Stage`, typed Any: the data layer sits below both."""
    fields = {k: v for k, v in stage.pipeline_fields().items() if k != "stage"}
    fields.update({k: getattr(cfg, k) for k in _MODEL_FIELDS})
    if speech_units is not None:
        fields["speech_units"] = speech_units
    if getattr(cfg, "cv_units", 0):
        fields["video_units"] = True
    for k, v in (overrides or {}).items():
        if k in ("stage", "max_len", "include_target", "window_batches"):
            raise ValueError(f"pipeline_overrides may not set {k!r} (evaluate sets it)")
        if k in fields and fields[k] != v:
            raise ValueError(f"pipeline_overrides[{k!r}]={v!r} contradicts the model ({fields[k]!r})")
        fields[k] = v
    return fields


__all__ = ["PipelineConfig", "pipeline_config_fields"]
