"""The encoder interface and the name table: `Encoder`, `register_encoder`, `get_encoder` (``A+V`` names),
and a manifest entry's config turned back into constructor arguments.

Why one module: a name means nothing without the interface it names, and building ``A+V`` (a
`CombinedEncoder` of two registered parts, keyword arguments routed to whichever part accepts them) is
the registry's job. The built-in encoders register themselves with `@register_encoder` in their own
modules (`lite`, `whisper`, `facemesh`, `hubert_clip`); the package's `__init__` imports every one of
them, and Python runs it before any module of the package, this one included, so every name is
registered before `get_encoder` or `available_encoders` can be called. This module imports none of them:
they import it.
"""

from __future__ import annotations

import inspect
from abc import ABC
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from empatheia_jax.data.encoders.media import AudioInput, VideoInput

_REGISTRY: dict[str, type[Encoder]] = {}


def register_encoder(name: str) -> Callable[[type[Encoder]], type[Encoder]]:
    """Class decorator: make an encoder available to `get_encoder(name)` (and to data/prepare.py)."""

    if not name or "+" in name:
        raise ValueError(f"encoder name {name!r} must be non-empty and contain no '+'")

    def deco(cls: type[Encoder]) -> type[Encoder]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"encoder {name!r} is already registered by {_REGISTRY[name].__qualname__}")
        cls.registered_name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def available_encoders() -> list[str]:
    """Registered names, each followed by the modalities it provides, e.g. ``['clip (video)', ...]``."""
    return [f"{n} ({'+'.join(_REGISTRY[n].modalities)})" for n in sorted(_REGISTRY)]


def get_encoder(name: str, **kwargs: Any) -> Encoder:
    """Build an encoder by name; ``"A+V"`` takes audio from A and video from V.

    Keyword arguments go to the part(s) whose constructor accepts them; an argument no part accepts is
    an error (a typo in a weights path should not be silently ignored).
    """
    parts = name.split("+")
    for p in parts:
        if p not in _REGISTRY:
            known = ", ".join(sorted(_REGISTRY))
            raise KeyError(f"unknown encoder {p!r} in {name!r}; registered encoders: {known}")
    if len(parts) == 1:
        cls = _REGISTRY[name]
        if set(cls.modalities) != {"audio", "video"}:
            other = "clip" if "audio" in cls.modalities else "hubert"
            example = f"{name}+{other}" if "audio" in cls.modalities else f"{other}+{name}"
            raise ValueError(
                f"encoder {name!r} only encodes {cls.modalities[0]}; name both parts, e.g. {example!r} "
                f"or with 'lite' for the other modality"
            )
        return cls(**_route_kwargs(name, [cls], kwargs)[0])
    if len(parts) != 2:
        raise ValueError(f"encoder name {name!r}: use 'NAME' or 'AUDIO+VIDEO'")
    a_cls, v_cls = _REGISTRY[parts[0]], _REGISTRY[parts[1]]
    if "audio" not in a_cls.modalities:
        raise ValueError(f"{name!r}: {parts[0]!r} has no audio encoder (it provides {a_cls.modalities})")
    if "video" not in v_cls.modalities:
        raise ValueError(f"{name!r}: {parts[1]!r} has no video encoder (it provides {v_cls.modalities})")
    if a_cls is v_cls:
        return a_cls(**_route_kwargs(name, [a_cls], kwargs)[0])
    a_kw, v_kw = _route_kwargs(name, [a_cls, v_cls], kwargs)
    return CombinedEncoder(name, a_cls(**a_kw), v_cls(**v_kw))


# Config keys stored under another name than the constructor argument they come from.
_CONFIG_RENAMES = {"hubert": {"path": "hubert_path", "layer": "hubert_layer"},
                   "clip": {"path": "clip_path", "frames": "clip_frames"}}


def _part_kwargs(part: Mapping[str, Any]) -> dict[str, Any]:
    cls = _REGISTRY.get(part.get("name"))
    if cls is None:
        return {}
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self"}
    renames = _CONFIG_RENAMES.get(part["name"], {})
    return {renames.get(k, k): v for k, v in part.items() if renames.get(k, k) in accepted}


def kwargs_from_config(entry: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(name, constructor keyword arguments) of the encoder a manifest's ``{"name", "config"}`` entry
    describes, so `get_encoder(name, **kwargs)` builds it again.

    Why here: chat rebuilds the training encoder to read new media, and a re-preparation of the same data
    (`data.asr_shards`) must encode exactly as the first one did; both read the same stored config.
    """
    name, stored = entry["name"], dict(entry.get("config") or {})
    parts = [stored[k] for k in ("audio", "video") if isinstance(stored.get(k), Mapping)] or [stored]
    kwargs: dict[str, Any] = {}
    for part in parts:
        kwargs.update(_part_kwargs({"name": part.get("name", name), **part}))
    return name, kwargs


def config_diff(a: Any, b: Any, where: str = "") -> list[str]:
    """The dotted keys where two encoder configs differ, `path` entries excepted (weights may move)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        out = []
        for k in sorted(set(a) | set(b)):
            if k == "path":
                continue
            out += config_diff(a.get(k), b.get(k), f"{where}.{k}" if where else str(k))
        return out
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return [] if list(a) == list(b) else [where]
    return [] if a == b else [where]


def _route_kwargs(name: str, classes: list[type], kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    accepted = [set(inspect.signature(c.__init__).parameters) - {"self"} for c in classes]
    unused = [k for k in kwargs if not any(k in acc for acc in accepted)]
    if unused:
        allowed = sorted(set().union(*accepted))
        raise TypeError(f"encoder {name!r} got unknown argument(s) {unused}; accepted: {allowed}")
    return [{k: v for k, v in kwargs.items() if k in acc} for acc in accepted]


class Encoder(ABC):  # noqa: B024 - subclasses implement one or both encode methods
    """Base class. Subclasses set `modalities` and the matching `*_dim`, and implement the encode methods."""

    registered_name: str = ""
    modalities: tuple[str, ...] = ()
    audio_dim: int | None = None
    video_dim: int | None = None
    k: int = 1

    @property
    def name(self) -> str:
        return self.registered_name

    def encode_audio(self, audio: AudioInput) -> np.ndarray:
        raise NotImplementedError(f"encoder {self.name!r} does not encode audio")

    def encode_video(self, video: VideoInput) -> np.ndarray:
        raise NotImplementedError(f"encoder {self.name!r} does not encode video")

    def config(self) -> dict[str, Any]:
        """Everything that determines the features; stored in the shard manifest."""
        return {"name": self.name, "k": self.k}


class CombinedEncoder(Encoder):
    """Audio from one registered encoder, video from another (``hubert+clip``)."""

    modalities = ("audio", "video")

    def __init__(self, name: str, audio: Encoder, video: Encoder):
        if audio.k != video.k:
            raise ValueError(f"{name!r}: audio k={audio.k} != video k={video.k}")
        self._name, self.audio, self.video = name, audio, video
        self.k = audio.k
        self.audio_dim, self.video_dim = audio.audio_dim, video.video_dim

    @property
    def name(self) -> str:
        return self._name

    def encode_audio(self, audio: AudioInput) -> np.ndarray:
        return self.audio.encode_audio(audio)

    def encode_video(self, video: VideoInput) -> np.ndarray:
        return self.video.encode_video(video)

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "k": self.k, "audio": self.audio.config(), "video": self.video.config()}
