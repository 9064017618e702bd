"""Which generator reads which target source: one line per generator, looked up by name.

Adding a generator is one new module with a `SpeechGenerator`/`VideoGenerator` subclass and one
`register` line here (or, for a bridge that lives outside the library, a `register` call in its own
module). Synthesis (`serve.avatar`), speech evaluation and chat look generators up here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from empatheia_jax.data.targets import STAND_IN, standin_units
from empatheia_jax.generators.base import Generator, GeneratorError
from empatheia_jax.generators.face_render import FaceRenderer
from empatheia_jax.generators.kokoro_speech import KokoroSpeech

_GENERATORS: dict[str, type[Generator]] = {}


def register(cls: type[Generator]) -> type[Generator]:
    """Makes `cls` the generator of target source `cls.name` (usable as a class decorator)."""
    _GENERATORS[cls.name] = cls
    return cls


register(KokoroSpeech)
register(FaceRenderer)


def names(modality: str | None = None) -> list[str]:
    return sorted(n for n, c in _GENERATORS.items() if modality in (None, c.modality))


def generator_class(name: str) -> type[Generator]:
    if name not in _GENERATORS:
        raise GeneratorError(f"no generator reads {name!r} targets; registered: {names()}")
    return _GENERATORS[name]


def get(name: str, **options: Any) -> Generator:
    """An instance of the generator of target source `name`, built with `options`."""
    return generator_class(name)(**options)


def check_trained_on(name: str, trained_on: str | None, where: str = "features") -> None:
    """Refuses features of another target source than generator `name` reads, before anything runs."""
    cls = generator_class(name)
    if trained_on == name:
        return
    if trained_on == STAND_IN:
        why = (f"stand-in {cls.modality} targets (deterministic functions of the sample's media, not "
               "generator features)")
    elif trained_on in _GENERATORS:
        other = _GENERATORS[trained_on]
        why = f"{trained_on} features, which {other.description} reads ({other.how})"
    else:
        why = f"{cls.modality} targets of source {trained_on!r}"
    raise GeneratorError(f"{where}: the model was trained on {why}; {cls.description} reads {name} features "
                         f"({cls.how})")


def content_rows(text: str, source: str) -> int | None:
    """How many speech_content rows are read for `text` under targets of `source` (T_ph): a registered
    generator counts its own; stand-in targets have one row per `standin_units` character."""
    if source == STAND_IN:
        return len(standin_units(text))
    if source in _GENERATORS:
        return _GENERATORS[source].content_rows(text)
    return None


def units_for(cs_units: int, source: str | None) -> Callable[[str], np.ndarray] | None:
    """The unit function (`Generator.content_units`) a unit-aligned CS with a `cs_units`-sized table reads
    for speech targets of `source`; None when the CS is not unit-aligned or the data has no speech targets
    of a generator with units (a text-only stage runs no CS). A table smaller than the generator's unit
    vocabulary is refused: its ids would clip onto each other."""
    if not cs_units or source not in _GENERATORS:
        return None
    cls = _GENERATORS[source]
    if not cls.num_units:
        raise GeneratorError(f"the Content Synchronizer is unit-aligned (cs_units={cs_units}) but "
                             f"{cls.description} ({source} targets) has no content units")
    if cs_units < cls.num_units:
        raise GeneratorError(f"cs_units={cs_units} is smaller than {cls.description}'s {cls.num_units} "
                             "content units; set model.empatheia.cs_units >= it")
    return cls.content_units
