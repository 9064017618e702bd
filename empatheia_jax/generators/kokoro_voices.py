"""Which Kokoro voice speaks an utterance: a fixed map from (age, gender, timbre) and emotion to a style.

The gold speech_style target of an utterance IS this vector (Kokoro's graph has no style encoder, so a style
target cannot be measured from audio; it is chosen, and the gold speech is synthesized with it). The map
works on labels only, so it applies to any AvaMERG-format data, not just the sample.

How the vector is built (docs/design.md "Speech out"; measured in tests/test_kokoro.py): each shipped voice
pack ([510, 256], one row per input length) is reduced to its mean row, and a voice is a SUM of one term per
factor, each along its own direction, so that a linear probe reads age, gender and timbre back from any
voice whatever its emotion (version 2 blended different voices per female age and moved male ages along the
timbre direction: a timbre was not linearly separable from an age, and the pinned avatar was read right 0.55
of the time, docs/benchmarks.md):
- gender: the base voice, the mean of jf_alpha and jf_nezumi (female, F0 ~270 Hz on an English sentence) or
  jm_kumo (male, 94 Hz), the wheel's only male voice;
- PITCH = (tebukuro - kumo) on the last 128 dims (the prosodic style the F0 predictor reads): +0.3 of it lifts
  kumo's F0 from 94 to ~146 Hz with the timbre kept. Age, timbre and emotion all move the pitch along it;
- AGE = (tebukuro - gongitsune), the wheel's youngest- and oldest-sounding voices, less its components along
  PITCH and TIMBRE: what makes a voice sound young or old besides its pitch. Ages sit at -1/-1/3/+1/3/+1
  (elderly ... child) times `AGE_STEP` along it, plus a per-gender pitch step (`AGE_PITCH`);
- TIMBRE = (tebukuro - kumo) on the first 128 dims (the decoder's acoustic style): low/mid/high at -/0/+
  with a small pitch step, and nothing else moves along it;
- emotion: a PITCH offset and the speaking rate (`speed`): happy/surprised/fear high and fast, sad low and
  slow, and so on (`EMOTION_VOICE`). The listener's "empathetic" style is calm: slightly low, speed 1.

The speed is not part of the 256-d target: the bridge synthesizes Empatheia's reply (the listener) at the
listener's speed, 1.0.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from empatheia_jax.generators.speech_synth import LISTENER_STYLE, STYLES, check_profile, listener_style

MAP_VERSION = "3"  # bump when any table or rule below changes: targets and gold speech record it
# 2: the listener answers in `listener_style(emotion)` (mirrors joy, surprise, sadness), not always calm
# 3: one additive term per factor (gender base + age + timbre + emotion), each on its own direction


@dataclass(frozen=True)
class EmotionVoice:
    pitch: float  # offset along PITCH
    speed: float


EMOTION_VOICE: dict[str, EmotionVoice] = {
    "happy": EmotionVoice(pitch=0.12, speed=1.12),
    "surprised": EmotionVoice(pitch=0.22, speed=1.05),
    "angry": EmotionVoice(pitch=0.06, speed=1.2),
    "fear": EmotionVoice(pitch=0.16, speed=1.25),
    "sad": EmotionVoice(pitch=-0.16, speed=0.8),
    "disgusted": EmotionVoice(pitch=-0.08, speed=0.9),
    "contempt": EmotionVoice(pitch=-0.1, speed=0.95),
    "neutral": EmotionVoice(pitch=0.0, speed=1.0),
    LISTENER_STYLE: EmotionVoice(pitch=-0.04, speed=1.0),
}

FEMALE_BASE = {"jf_alpha": 0.5, "jf_nezumi": 0.5}  # voice-pack weights of the female base voice
MALE_BASE = {"jm_kumo": 1.0}
AGE_STEP = 0.3  # along AGE, per unit of AGE_LEVEL
AGE_LEVEL = {"child": 1.0, "young": 1 / 3, "middle-aged": -1 / 3, "elderly": -1.0}
AGE_PITCH = {  # PITCH offset of each age, per gender: a boy's voice is lifted further from kumo than a girl's
    "female": {"child": 0.25, "young": 0.08, "middle-aged": -0.08, "elderly": -0.25},
    "male": {"child": 0.55, "young": 0.1, "middle-aged": 0.0, "elderly": -0.1},
}
TIMBRE = {"low": (-0.06, -0.3), "mid": (0.0, 0.0), "high": (0.06, 0.3)}  # (PITCH, TIMBRE) offsets


@dataclass(frozen=True)
class Voice:
    """A voice to synthesize with: the style vector (the speech_style target), the speed, how it was made."""

    style: np.ndarray
    speed: float
    recipe: dict[str, Any] = field(default_factory=dict)


@functools.cache
def _bases() -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    """(mean row of each voice pack, PITCH, TIMBRE, AGE): the directions of the module docstring."""
    from empatheia_jax.generators.kokoro import voice_packs

    means = {name: pack.mean(axis=0).astype(np.float64) for name, pack in voice_packs().items()}
    d = means["jf_tebukuro"] - means["jm_kumo"]
    pitch = np.concatenate([np.zeros(128), d[128:]])
    timbre = np.concatenate([d[:128], np.zeros(128)])
    age = means["jf_tebukuro"] - means["jf_gongitsune"]
    for other in (pitch, timbre):  # orthogonal to both: pitch and timbre are moved by their own terms
        age = age - (age @ other) / (other @ other) * other
    return means, pitch, timbre, age


def voice(profile: dict[str, Any], style: str) -> Voice:
    """The voice of a speaker with this profile ({age, gender, timbre}) speaking in `style` (an emotion of
    EMOTIONS_7, "neutral" or the listener's "empathetic"); ValueError names a bad field."""
    age, gender, timbre = check_profile(profile)
    if style not in EMOTION_VOICE:
        raise ValueError(f"style {style!r} is not one of {STYLES}")
    means, pitch_dir, timbre_dir, age_dir = _bases()
    blend = FEMALE_BASE if gender == "female" else MALE_BASE
    tp, tt = TIMBRE[timbre]
    emo = EMOTION_VOICE[style]
    p, a = AGE_PITCH[gender][age] + tp + emo.pitch, AGE_STEP * AGE_LEVEL[age]
    vec = sum(w * means[name] for name, w in blend.items()) + p * pitch_dir + tt * timbre_dir + a * age_dir
    recipe = {"blend": blend, "pitch": round(p, 6), "timbre": tt, "age": round(a, 6), "speed": emo.speed,
              "map_version": MAP_VERSION}
    return Voice(style=vec.astype(np.float32), speed=emo.speed, recipe=recipe)


def utterance_style(role: str, emotion: str | None) -> str:
    """The style an utterance is spoken and drawn in: the dialogue's emotion class for the speaker; for the
    listener, the avatar's answer to it (`speech_synth.listener_style`: joy, surprise and sadness mirrored,
    the calm empathetic style otherwise), the same rule chat's pinned avatar follows, so the SD's style
    targets carry the expression a reply should show. data/make_sample.py renders media with it."""
    if role == "listener":
        return listener_style(emotion)
    return emotion or "neutral"


def to_pcm16(audio: np.ndarray) -> np.ndarray:
    """Float audio in [-1, 1] -> int16, the way every gold/generated wav is stored."""
    return np.round(np.clip(np.asarray(audio, np.float64), -1.0, 32767 / 32768) * 32768).astype(np.int16)


LISTENER_SPEED = 1.0
"""The rate a listener utterance is spoken at in gold speech and in the phoneme mouth track, whatever its
style: the rate the bridge speaks the model's reply at (`serve.avatar`), since the style the SD predicts
(S^s) carries no rate. Only the pinned avatar (`chat --listener`) speaks at its style's rate."""


def utterance_delivery(role: str, emotion: str | None) -> tuple[str, float | None]:
    """(style, speed) an utterance's gold speech and mouth track are made with: `utterance_style`, and
    `LISTENER_SPEED` for the listener (None: the speaker speaks at the style's own rate). The one owner of
    the rule, for data/make_sample.py, converters/face_targets.py and the tests' gold speech."""
    return utterance_style(role, emotion), (LISTENER_SPEED if role == "listener" else None)


def gold_speech(text: str, profile: dict[str, Any], style: str, speed: float | None = None
                ) -> tuple[np.ndarray, Voice]:
    """The gold speech of an utterance (int16, 24 kHz) and the voice it was spoken with.

    Kokoro speaks the utterance's own content features (`content_features(phonemize(text))`, the
    speech_content target) in `voice(profile, style)` (the speech_style target), so the targets are exactly
    what the audio was made from; at `speed` when given (a listener's reply: LISTENER_SPEED), else the
    style's.
    """
    from empatheia_jax.generators import kokoro

    v = voice(profile, style)
    if speed is not None:
        v = Voice(style=v.style, speed=float(speed), recipe={**v.recipe, "speed": float(speed)})
    engine = kokoro.shared(1)
    audio = engine.synthesize(engine.content_features(kokoro.phonemize(text)), v.style, v.speed)
    return to_pcm16(audio), v
