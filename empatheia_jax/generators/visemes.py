"""A mouth track from a reply's phonemes and Kokoro's durations, with no waveform and no rendering.

Why: a text-only dialogue reply has no video, yet the face generator's video content (dim 0 = mouth
opening per 25-fps frame, `face_render.CONTENT_MOUTH`) should still say something true about it. Kokoro
already knows when each phoneme is spoken: its prosody predictor gives every content row a duration
(`Kokoro.durations`, ~30 ms on a CPU) and the synthesizer spends exactly `kokoro.frames_of(durations)`
frames of 600 samples on each row. Laying the rows' phonemes on that time axis and giving each phoneme
class a mouth opening yields the per-frame mouth of the audio Kokoro would speak, without decoding it.

Rows are Kokoro's content rows, `[pad, *symbols, pad]` (`kokoro.token_ids`, `content_length`). Openings
(`OPENINGS`, 0 = lips together, 1 = the widest speaking mouth) follow jaw height and lip rounding:
open vowels ~0.9-1.0, mid vowels ~0.5-0.7, close vowels ~0.3-0.35, bilabial closures p b m 0.0 (the
lips seal), labiodentals ~0.15, rounded w ~0.2, sibilants and affricates ~0.2 (teeth nearly together),
other consonants ~0.25-0.45. Rows without articulation of their own take it from their neighbours:
stress marks ˈ ˌ the next row's (espeak writes them before the stressed vowel, and Kokoro gives them
~3 frames of that vowel's onset), length ː and the other modifiers the previous row's, spaces, quotes
and brackets the mean of both sides (a word boundary inside a phrase is a transition, not a pause);
pause punctuation and the pads rest (0.0).

The frame rule (`mouth_track`): video frame k covers [k, k+1) / fps seconds of the audio; its opening
is the time-weighted mean of the rows over that window, except that a frame whose window is covered for
at least `CLOSURE_SHARE` (0.3) by bilabial closures is shut (0.0). Kokoro's shortest row is one frame
of 25 ms, so the 40-ms video frame holding a bilabial's centre always sees >= 12.5 ms (0.31) of it:
every p, b, m closes the mouth at least once, which a plain mean would blur away. Light coarticulation
smoothing (each open frame takes `coarticulation` of each neighbour) follows; shut frames stay shut.

Loudness (`mouth_track(energy=)`): a jaw opens further the louder a sound is spoken, and a phoneme's
opening alone tracks the speech only so far (r = 0.62 against the spoken reply's RMS envelope, 40 ED dev
replies; docs/benchmarks.md "The mouth follows the loudness"). Kokoro's prosody predictor says how loud it
will speak every 12.5 ms (`Kokoro.energy`, its N curve). Given it, each open frame becomes
(1 - `LOUDNESS_WEIGHT`) x its phoneme opening + `LOUDNESS_WEIGHT` x its loudness (the frame's mean N, scaled
to [0, 1] between the reply's 5th and 95th percentiles); shut and resting frames stay 0, so every p, b, m
still closes the lips. On the same replies: r = 0.73.

Frame units (`frame_units`): the same frames, each labelled with the Kokoro unit id (the id space of
`KokoroSpeech.content_units`, `[0, *token_ids(phonemes), 0]`) of the content row covering the frame's
centre. A unit-aligned video block (`EmpatheiaConfig.cv_units`) is told these ids the way the speech block
is told the rows' ids: the mouth opening is a function of the phoneme at the frame, and a frame's phoneme
is known once the durations are. A frame the track shuts for a bilabial carries that bilabial's id, the
others the id of the row at their centre. Pads stay 0 (silence, the pad id) and pause punctuation keeps
its own id (its rows are silent too, but a learnt table row per mark costs nothing and keeps the layout
the speech block's). Both functions lay the frames on the rows with one piece of code (`_frame_layout`).
"""

from __future__ import annotations

import numpy as np

from empatheia_jax.generators import kokoro
from empatheia_jax.generators.face_render import frame_count
from empatheia_jax.generators.speech_synth import FRAME_RATE

REST = 0.0
CLOSURE_SHARE = 0.3
COARTICULATION = 0.2
LOUDNESS_WEIGHT = 0.5
MOUTH_VERSION = "2"  # bump when the track's rule changes: face targets record it (converters.face_targets)
BILABIALS = frozenset("pbm")
NEXT = frozenset("ˈˌ")  # stress marks: the opening of the row after
PREVIOUS = frozenset("ːʰʲ\u0303↓→↗↘")  # length, aspiration, palatalised, nasal, tones: the row before
BETWEEN = frozenset(" \"()“”")  # the mean of both sides
PAUSES = frozenset(";:,.!?—…")  # rest

_GROUPS: tuple[tuple[float, str], ...] = (
    (1.0, "ɑ"), (0.95, "aɒ"), (0.9, "æʌ"), (0.75, "ɐ"),  # open (a: the onset of aɪ, aʊ)
    (0.7, "ɔ"), (0.65, "ɛœ"), (0.6, "ɜo"), (0.55, "eøɤ"), (0.5, "əɚ"), (0.4, "ᵊ"),  # mid
    (0.35, "ɪʊᵻ"), (0.3, "iuyɨɯ"),  # close
    (0.0, "pbm"), (0.1, "βɸᵝ"), (0.15, "fvʋ"), (0.2, "wɥ"),  # lips: sealed, narrowed, on the teeth, rounded
    (0.2, "szʃʒʂɕçʝʤʧʦʣʥʨꭧ"),  # sibilants and affricates
    (0.25, "tdnʈɖɳɲʔ"), (0.3, "θðɹɾɽɻrjkɡŋcɟqxχɣɴʁʎɰ"), (0.35, "l"), (0.45, "h"),  # the other consonants
    # misaki's one-letter diphthongs (Kokoro's vocabulary, never in espeak output): by their first element
    (0.55, "A"), (0.95, "IW"), (0.7, "Y"), (0.6, "O"), (0.5, "Q"),
)
OPENINGS: dict[str, float] = {c: v for v, cs in _GROUPS for c in cs}
"""Mouth opening per articulated symbol. Every symbol English espeak writes is here or in a rule set above
(tests/test_visemes.py); of Kokoro's 114 only `S` and `T` (misaki symbols outside English) are in none
and take `DEFAULT_OPENING`, a consonant's."""
DEFAULT_OPENING = 0.3


def row_openings(phonemes: str) -> tuple[np.ndarray, np.ndarray]:
    """(opening [T], bilabial closure [T] bool) per Kokoro content row of `phonemes`, T =
    `kokoro.content_length(phonemes)`: the pads and pause punctuation rest, stress marks take the next
    row's opening, modifiers the previous row's, spaces/quotes/brackets the mean of both sides."""
    table = kokoro.vocab()
    symbols = ["", *(c for c in phonemes if c in table), ""]  # "" = the boundary pads
    n = len(symbols)
    value: list[float | None] = [None] * n
    closed = np.zeros(n, bool)
    for i, c in enumerate(symbols):
        if c == "" or c in PAUSES:
            value[i] = REST
        elif c not in NEXT and c not in PREVIOUS and c not in BETWEEN:
            value[i] = OPENINGS.get(c, DEFAULT_OPENING)
            closed[i] = c in BILABIALS
    for i in range(1, n):  # modifiers: the row before (already resolved, left to right)
        if symbols[i] in PREVIOUS:
            value[i], closed[i] = value[i - 1], closed[i - 1]
    for i in range(n - 2, 0, -1):  # stress: the row after (right to left)
        if symbols[i] in NEXT:
            value[i], closed[i] = value[i + 1], closed[i + 1]
    known = [i for i in range(n) if value[i] is not None]
    for i in range(n):
        if value[i] is None:  # between: the nearest resolved rows on both sides (a pad at the latest)
            left = max(j for j in known if j < i)
            right = min(j for j in known if j > i)
            value[i] = 0.5 * (value[left] + value[right])
    return np.array(value, np.float64), closed


def _frame_layout(frames_per_row: np.ndarray, fps: int, sample_rate: int, frame_samples: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(row ends [T + 1], frame edges [n_frames + 1]), int64 on an exact time axis in units of
    1 / (sample_rate * fps) s: row i spans ends[i]..ends[i + 1] (cumsum(frames) x frame_samples x fps),
    video frame k spans edges[k]..edges[k + 1] (k x sample_rate, the last clipped to the audio's end);
    n_frames = `face_render.frame_count` of the audio, as many frames as `FaceRenderer.render` draws."""
    frames = np.asarray(frames_per_row)
    whole = np.issubdtype(frames.dtype, np.number) and np.all(frames == np.round(frames))
    if not (frames.ndim == 1 and whole and np.all(frames >= 1)):
        raise ValueError("frames_per_row must be whole frames >= 1: pass kokoro.frames_of(durations)")
    n_samples = int(frames.sum()) * frame_samples
    n_frames = frame_count(n_samples, sample_rate, fps)
    ends = np.concatenate([[0], np.cumsum(frames.astype(np.int64)) * frame_samples * fps])
    edges = np.minimum(np.arange(n_frames + 1, dtype=np.int64) * sample_rate, ends[-1])
    return ends, edges


def row_frame_units(row_units: np.ndarray, frames_per_row: np.ndarray, closed: np.ndarray | None = None,
                    fps: int = FRAME_RATE, sample_rate: int = kokoro.SAMPLE_RATE,
                    frame_samples: int = kokoro.FRAME_SAMPLES) -> np.ndarray:
    """int32 [n_frames]: `row_units[i]` of the content row whose span holds video frame k's centre
    ((k + 0.5) / fps s; the last frame, which may outlast the audio, takes its clipped window's centre),
    except that a frame `mouth_track` shuts (bilabial rows cover >= `CLOSURE_SHARE` of it) carries the
    bilabial row covering most of it: a 25-ms p between two vowels may hold no frame centre, yet the track
    shuts a frame for it, and the frame's unit must say why. n_frames is `mouth_track`'s.

    `row_units` [T]: the rows' unit ids (`KokoroSpeech.content_units`, or a model's own units of its reply
    at inference); `frames_per_row` [T]: `kokoro.frames_of(durations)`; `closed` [T] bool: the bilabial
    rows (`row_openings`' second result), by default the rows whose id is p, b or m."""
    units = np.asarray(row_units).reshape(-1)
    frames = np.asarray(frames_per_row)
    if frames.shape != units.shape:
        raise ValueError(f"frames_per_row has shape {list(frames.shape)} for {len(units)} row units")
    if closed is None:
        table = kokoro.vocab()
        closed = np.isin(units, [table[c] for c in BILABIALS if c in table])
    ends, edges = _frame_layout(frames, fps, sample_rate, frame_samples)
    centres = edges[:-1] + edges[1:]  # twice the centre: stays integer
    row = np.minimum(np.searchsorted(2 * ends[1:], centres, side="right"), len(units) - 1)
    # overlap [n_frames, T] of each frame with each bilabial row, on the same exact time axis
    overlap = (np.minimum(edges[1:, None], ends[None, 1:]) - np.maximum(edges[:-1, None], ends[None, :-1]))
    overlap = np.where(np.asarray(closed, bool)[None, :], np.maximum(overlap, 0), 0)
    shut = overlap.sum(1) >= CLOSURE_SHARE * np.diff(edges)
    row = np.where(shut, overlap.argmax(1), row)
    return units[row].astype(np.int32)


def frame_units(phonemes: str, frames_per_row: np.ndarray, fps: int = FRAME_RATE,
                sample_rate: int = kokoro.SAMPLE_RATE, frame_samples: int = kokoro.FRAME_SAMPLES
                ) -> np.ndarray:
    """int32 [n_frames]: the Kokoro unit id per video frame of `phonemes` spoken with `frames_per_row`
    (the module docstring's "Frame units"); frame for frame the frames of `mouth_track`."""
    units = np.concatenate([[0], kokoro.token_ids(phonemes), [0]])
    return row_frame_units(units, frames_per_row, row_openings(phonemes)[1], fps, sample_rate, frame_samples)


def mouth_track(phonemes: str, frames_per_row: np.ndarray, fps: int = FRAME_RATE,
                sample_rate: int = kokoro.SAMPLE_RATE, frame_samples: int = kokoro.FRAME_SAMPLES,
                coarticulation: float = COARTICULATION, energy: np.ndarray | None = None) -> np.ndarray:
    """float32 [n_frames]: the mouth opening in [0, 1] per video frame of the audio Kokoro speaks for
    `phonemes` with `frames_per_row` (integer frames per content row: `kokoro.frames_of(durations)`).

    n_frames = `face_render.frame_count(frames_per_row.sum() * frame_samples, sample_rate, fps)`: as many
    frames as `FaceRenderer.render` draws for that audio. Frame k's window [k, k+1) / fps s is clipped to
    the audio; its value is the time-weighted mean of the rows' openings over the window, or 0.0 when
    bilabial closures cover at least `CLOSURE_SHARE` of it; then each open frame becomes (1 - 2c) x itself
    + c x each neighbour (c = `coarticulation`; edges repeat), shut frames staying 0. With `energy`
    (`Kokoro.energy` on the same durations: two values per duration frame) every frame still open follows
    the loudness too (the module docstring's "Loudness").
    """
    frames = np.asarray(frames_per_row)
    openings, closed = row_openings(phonemes)
    if frames.shape != openings.shape:
        raise ValueError(f"frames_per_row has shape {list(frames.shape)}; {phonemes[:40]!r} has "
                         f"{len(openings)} content rows (kokoro.content_length)")
    if not 0 <= coarticulation <= 0.5:
        raise ValueError(f"coarticulation must be in [0, 0.5], got {coarticulation}")
    ends, edges = _frame_layout(frames, fps, sample_rate, frame_samples)
    n_frames = len(edges) - 1
    # integrals of the opening and of the closure indicator, piecewise linear in time: exact at the edges
    area = np.concatenate([[0.0], np.cumsum(openings * np.diff(ends))])
    shut = np.concatenate([[0.0], np.cumsum(closed * np.diff(ends))])
    width = np.diff(edges).astype(np.float64)
    mean = np.diff(np.interp(edges, ends, area)) / width
    is_shut = np.diff(np.interp(edges, ends, shut)) / width >= CLOSURE_SHARE
    mean[is_shut] = 0.0
    if coarticulation and n_frames > 1:
        padded = np.concatenate([mean[:1], mean, mean[-1:]])
        mean = (1 - 2 * coarticulation) * mean + coarticulation * (padded[:-2] + padded[2:])
        mean[is_shut] = 0.0
    if energy is not None:
        loud = _frame_loudness(energy, frames, edges, fps, frame_samples)
        mean = np.where(mean > 0, (1 - LOUDNESS_WEIGHT) * mean + LOUDNESS_WEIGHT * loud, 0.0)
    return np.clip(mean, 0.0, 1.0).astype(np.float32)


def _frame_loudness(energy: np.ndarray, frames: np.ndarray, edges: np.ndarray, fps: int, frame_samples: int
                    ) -> np.ndarray:
    """[n_frames] in [0, 1]: each video frame's mean energy over its window (exact, on `_frame_layout`'s time
    axis), scaled between the reply's 5th and 95th percentiles; a flat curve says nothing (0.5 everywhere)."""
    e = np.asarray(energy, np.float64).reshape(-1)
    if e.size != 2 * int(frames.sum()) or not np.isfinite(e).all():
        raise ValueError(f"energy must hold 2 finite values per duration frame ({2 * int(frames.sum())}), "
                         f"got {e.size}: pass Kokoro.energy on the same durations")
    step = frame_samples // 2 * fps  # one energy value's span on the time axis
    area = np.concatenate([[0.0], np.cumsum(e * step)])
    mean = np.diff(np.interp(edges, np.arange(e.size + 1) * step, area)) / np.diff(edges)
    lo, hi = np.percentile(e, [5, 95])
    if hi - lo <= 1e-6 * max(1.0, abs(hi)):
        return np.full(len(mean), 0.5)
    return np.clip((mean - lo) / (hi - lo), 0.0, 1.0)
