"""The shard records of one dialogue: its history utterances' encoder features, computed in this process
or in a spawn pool of workers, and one record per turn with the generator targets joined by response id.

Features are computed once per utterance (turns are growing prefixes, so later turns reuse them). Shared
by `prepare` and the TFDS builder, so both write the same records.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from empatheia_jax.data import schema
from empatheia_jax.data.encoders import Encoder, get_encoder
from empatheia_jax.data.shard_format import make_shard_record
from empatheia_jax.data.targets import TargetReader


def history_utterances(dialogue: schema.Dialogue) -> list[str]:
    """Distinct utterance ids that occur in some turn's history (the ones that need features)."""
    seen: dict[str, None] = {}
    for t in dialogue.turns:
        for uid, _, _ in schema.turn_utterances(dialogue, t):
            seen.setdefault(uid, None)
    return list(seen)


def extract_features(
    encoder: Encoder, utt_ids: list[str], media_dir: str | os.PathLike
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """utt_id -> (audio [k,d_a], video [k,d_v]); errors name the utterance and the file."""
    media_dir = Path(media_dir)
    feats = {}
    for uid in utt_ids:
        wav, mp4 = media_dir / f"{uid}.wav", media_dir / f"{uid}.mp4"
        try:
            a = encoder.encode_audio(wav)
        except Exception as e:
            raise RuntimeError(f"utterance {uid}: audio features of {wav} failed: {e}") from e
        try:
            v = encoder.encode_video(mp4)
        except Exception as e:
            raise RuntimeError(f"utterance {uid}: video features of {mp4} failed: {e}") from e
        feats[uid] = (a, v)
    return feats


def dialogue_records(
    dialogue: schema.Dialogue,
    *,
    split: str,
    feats: dict[str, tuple[np.ndarray, np.ndarray]],
    emotion_map: schema.EmotionMap,
    targets: TargetReader | None,
    audio_dim: int,
    video_dim: int,
    k: int,
    text_only: bool = False,
) -> list[dict[str, Any]]:
    """One shard record per turn of `dialogue`; features looked up in `feats`, targets by response id.

    `text_only`: no features at all, i.e. zero vectors per utterance (`[n_hist, 0, dim]`), so a record
    never pretends to hold media it was prepared without."""
    recs = []
    for j, t in enumerate(dialogue.turns):
        uids = [u for u, _, _ in schema.turn_utterances(dialogue, t)]
        if text_only:
            audio = np.zeros((len(uids), 0, audio_dim), np.float32)
            video = np.zeros((len(uids), 0, video_dim), np.float32)
        elif uids:
            audio = np.stack([feats[u][0] for u in uids])
            video = np.stack([feats[u][1] for u in uids])
        else:
            audio = np.zeros((0, k, audio_dim), np.float32)
            video = np.zeros((0, k, video_dim), np.float32)
        tg = {}
        if targets is not None:
            resp = schema.response_utterance_id(dialogue, j)
            for kind in targets.kinds:
                a = targets.get(kind, resp)
                if a is not None:
                    tg[kind] = a
        recs.append(
            make_shard_record(
                dialogue,
                j,
                split=split,
                emotion_map=emotion_map,
                audio_feats=audio,
                video_feats=video,
                targets=tg,
            )
        )
    return recs


# ----------------------------------------------------------------------------------------------
# feature workers

_ENC: Encoder | None = None


def _worker_init(name: str, kwargs: dict[str, Any]) -> None:
    global _ENC
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _ENC = get_encoder(name, **kwargs)


def _worker_features(job: tuple[int, list[str], str]) -> tuple[int, dict[str, Any] | None, str | None]:
    i, uids, media = job
    assert _ENC is not None
    try:
        return i, extract_features(_ENC, uids, media), None
    except Exception as e:  # noqa: BLE001 - returned to the parent, which decides (skip or fail)
        return i, None, str(e)


class FeaturePool:
    """Features per dialogue job, in job order: in-process, or one spawn pool (no forked JAX state) kept for
    all splits, since starting workers that load a transformers encoder costs seconds each."""

    def __init__(self, encoder: Encoder, name: str, kwargs: dict[str, Any], workers: int):
        self.encoder, self.pool = encoder, None
        if workers > 1:
            import multiprocessing as mp

            self.pool = mp.get_context("spawn").Pool(workers, _worker_init, (name, kwargs))

    def __enter__(self) -> FeaturePool:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.pool is not None:
            if exc_type is None:
                self.pool.close()
            else:
                self.pool.terminate()
            self.pool.join()

    def stream(
        self, jobs: list[tuple[int, list[str], str]]
    ) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
        if self.pool is not None:
            yield from self.pool.imap(_worker_features, jobs, chunksize=4)
            return
        for i, uids, media in jobs:
            try:
                yield i, extract_features(self.encoder, uids, media), None
            except Exception as e:  # noqa: BLE001 - the caller skips or fails, naming the dialogue
                yield i, None, str(e)


__all__ = ["FeaturePool", "dialogue_records", "extract_features", "history_utterances"]
