"""Shards of one split whose history texts are Whisper's transcripts of their speech (`empatheia eval --asr`).

Why: a deployed Empatheia hears the speaker; it is not handed a transcript. Evaluating on the typed texts
measures a model given perfect words. `cached_asr_shards` prepares the split again as if the words were known
only from the speech: every history utterance that has a .wav gets Whisper tiny.en's transcript (`asr`,
the recogniser chat uses for audio-only turns) as its text, and the rest of the record (media features,
labels, CoE, the gold reply, generator targets) is what the original shards hold. Shards store features,
not audio, so the transcription starts from the raw AvaMERG folder the manifest records (`raw`), and the
re-preparation runs `prepare.prepare` with the manifest's encoder (its stored config), emotion map, media
mode and targets folder, on that split only.

Decisions (docs/design.md "eval --asr"):

- Only history utterances are transcribed: they are what the model hears. Responses are the gold replies
  the model is scored against; they keep their text (the same utterance, heard again as history in a later
  turn, does get its transcript there).
- An empty transcript (Whisper heard no word) becomes `INAUDIBLE` ("..."): the schema refuses empty text,
  and an ellipsis gives the model an utterance with no words, which is what the speech gave the recogniser,
  without inventing any. The WER counts it as every reference word deleted; the summary counts such
  utterances (`asr_empty`).
- Under `media: optional`, a dialogue with none of its media files was prepared text-only and has no speech:
  its texts stay typed (counted as `asr_typed`). Under `media: required` a history utterance without its
  .wav is an error naming the file. Shards prepared text-only (`media: none`) have no speech: an error.
- The dialogues the original preparation skipped (`--skip-invalid`, listed in the manifest) are left out,
  and the ASR split must hold as many records as the original one: a raw folder that changed since is an
  error, not a silently different test set.
- A recorded targets folder that no longer exists is an error naming it: without the targets the
  evaluation's feature and speech/video rows would silently change, so the two evaluations would not be
  comparable.
- Cache: ``CACHE/asr-{split}-{key}/`` holds ``raw/{split}.json`` (the ASR copy, with ``raw/media`` a symlink
  to the original media folder), ``transcripts.jsonl`` (utt_id, conversation_id, text, transcript,
  confidence, written), ``summary.json`` and ``shards/``. The key is the sha256 of everything the
  transcripts and the preparation are functions of: the split file's bytes, every history utterance's
  media bytes, the recogniser (model.bin's pinned sha256, beam, language), the encoder entry, emotion map,
  media mode, targets entry, skipped dialogues and the schema/manifest/this module's versions. Keying on the
  inputs of the transcripts rather than on the transcripts themselves lets a second run reuse the folder
  without transcribing again (decoding is deterministic on one machine, `asr`); hashing the media
  costs a read of each file, far less than a transcription. The shards are written under a temporary name
  and renamed, like `prepare.cached_text_only_shards`; a folder failing `verify_shards` is rebuilt.
- `input_wer`: corpus WER of the transcripts against the typed texts (`asr.word_error_rate`: the same
  normalisation as the intelligibility rows, jiwer underneath), over the transcribed utterances whose
  typed text has a word.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from empatheia_jax.assets import atomic_write, sha256_file
from empatheia_jax.data import encoders as enc_lib
from empatheia_jax.data import raw_layout, schema
from empatheia_jax.data.encoders import asr
from empatheia_jax.data.encoders.media import load_audio
from empatheia_jax.data.prepare import prepare
from empatheia_jax.data.raw_splits import InvalidInputError
from empatheia_jax.data.shard_format import MANIFEST, MANIFEST_FORMAT, load_manifest, verify_shards

INAUDIBLE = "..."  # the text of an utterance in which Whisper heard no word
VERSION = "asr-shards/1"  # bump when what this module writes changes: old cache folders are not reused
TRANSCRIPTS = "transcripts.jsonl"
SUMMARY = "summary.json"


class AsrShardsError(ValueError):
    """Shards that cannot be prepared again from their speech: text-only shards, a raw folder, split file,
    speech file or targets folder that is missing or changed. The message names the file or folder."""


def _default_log(message: str) -> None:
    print(f"[asr] {message}", file=sys.stderr)


def _write_atomic(path: Path, text: str) -> None:
    # the same key holds the same content: concurrent writers agree
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


class _Plan:
    """What one split needs: the raw split objects (skipped dialogues removed), the history utterances to
    transcribe (utt_id -> (conversation id, typed text, wav)) and the count of those left typed."""

    def __init__(self, manifest: dict[str, Any], shards: Path, split: str, raw: Path | None = None):
        self.media_mode = manifest.get("media", "required")
        if self.media_mode == "none":
            raise AsrShardsError(f"{shards} was prepared text-only (manifest media: none): it has no speech "
                                 "to transcribe; --asr needs shards prepared from AvaMERG media")
        if manifest.get("encoder") is None:
            raise AsrShardsError(f"{shards / MANIFEST} names no encoder; cannot prepare its media again")
        if raw is not None:  # the shards moved to another machine, or the raw folder did
            if not Path(raw).is_dir():
                raise AsrShardsError(f"--raw {raw} is not a folder (the AvaMERG folder {shards} was prepared "
                                     "from)")
            raw = Path(raw)
        else:
            raw = Path(str(manifest.get("raw")))
            if not raw.is_dir():
                raise AsrShardsError(f"{shards / MANIFEST} records the raw folder {raw}, which does not "
                                     "exist (moved or deleted?): --asr transcribes the speech files there; "
                                     "give its new place with --raw")
        self.raw, self.split = raw, split
        self.split_json = Path(raw_layout.split_json_path(raw, split))
        if not self.split_json.is_file():
            raise AsrShardsError(f"{self.split_json} does not exist (the split file the shards of split "
                                 f"{split!r} were prepared from)")
        self.media_dir = Path(raw_layout.media_dir_of(raw))
        self.skipped = sorted(str(s.get("conversation_id")) for s in (manifest.get("skipped") or {}).get(
            "dialogues", []) if s.get("split") == split)
        self.raw_bytes = self.split_json.read_bytes()
        try:
            objs = json.loads(self.raw_bytes.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise AsrShardsError(f"{self.split_json}: not a JSON file ({e})") from e
        if not isinstance(objs, list):
            raise AsrShardsError(f"{self.split_json}: expected a list of dialogues")
        skip = set(self.skipped)
        self.objs = [o for o in objs if not (isinstance(o, dict) and o.get("conversation_id") in skip)]
        self.utts: dict[str, tuple[str, str, Path]] = {}
        self.typed = 0
        for i, obj in enumerate(self.objs):
            try:
                d = schema.Dialogue.from_json(obj, source=str(self.split_json))
            except (schema.SchemaError, ValueError, TypeError, KeyError) as e:
                raise AsrShardsError(f"{self.split_json}: dialogue #{i} no longer parses (the raw folder "
                                     f"changed since the shards were prepared?): {e}") from e
            self._add(d)

    def _add(self, d: schema.Dialogue) -> None:
        hist: dict[str, str] = {}  # utt_id -> typed text; the first occurrence wins, as in preparation
        for t in d.turns:
            for uid, _, text in schema.turn_utterances(d, t):
                hist.setdefault(uid, text)
        if self.media_mode == "optional" and not any(
                (self.media_dir / f"{uid}{ext}").is_file()
                for uid, _, _ in schema.dialogue_utterances(d) for ext in raw_layout.MEDIA_EXTENSIONS):
            self.typed += len(hist)  # prepared text-only: no speech
            return
        for uid, text in hist.items():
            if uid in self.utts:
                continue
            wav = self.media_dir / f"{uid}.wav"
            if not wav.is_file():
                raise AsrShardsError(f"{self.split_json}: conversation {d.conversation_id}: utterance {uid} "
                                     f"has no speech file {wav} (--asr transcribes every history utterance)")
            self.utts[uid] = (d.conversation_id, text, wav)


def _key(plan: _Plan, manifest: dict[str, Any]) -> str:
    """16 hex digits of the sha256 of everything the transcripts and the preparation depend on (module
    docstring)."""
    h = hashlib.sha256()

    def part(x: Any) -> None:
        h.update((x if isinstance(x, bytes) else json.dumps(x, sort_keys=True).encode("utf-8")) + b"\0")

    for x in (VERSION, plan.split, plan.raw_bytes, plan.skipped, asr.MODEL_FILES["model.bin"][1],
              asr.BEAM_SIZE, asr.LANGUAGE, manifest.get("encoder"), manifest.get("emotion_map"),
              plan.media_mode, manifest.get("targets"), schema.SCHEMA_VERSION, MANIFEST_FORMAT):
        part(x)
    for uid, (_, _, wav) in plan.utts.items():  # the media the preparation reads
        part(uid)
        for path in (wav, wav.with_suffix(".mp4")):
            part(sha256_file(path) if path.is_file() else "absent")
    return h.hexdigest()[:16]


def _sound(root: Path) -> dict[str, Any] | None:
    """The summary of a finished cache folder, None when it is missing or unsound."""
    shards = root / "shards"
    if not (shards / MANIFEST).is_file() or verify_shards(shards):
        return None
    try:
        summary = json.loads((root / SUMMARY).read_text())
    except (OSError, ValueError):
        return None
    # the paths where the folder is now (a cache may be moved as a whole)
    return {**summary, "transcripts": str(root / TRANSCRIPTS), "shards": str(shards)}


def _transcribe(plan: _Plan, threads: int, progress: bool) -> list[dict[str, Any]]:
    """One record per history utterance with speech, in the split file's order."""
    from tqdm import tqdm

    recognizer = asr.shared(threads)
    rows = []
    for uid, (cid, text, wav) in tqdm(plan.utts.items(), total=len(plan.utts), unit="utt",
                                      desc=f"{plan.split}: ASR (Whisper tiny.en)", disable=not progress):
        try:
            heard = recognizer.transcribe(load_audio(wav, asr.SAMPLE_RATE), asr.SAMPLE_RATE)
        except ValueError as e:  # unreadable or empty audio
            raise AsrShardsError(f"utterance {uid}: cannot transcribe {wav}: {e}") from e
        written = heard.text if heard.text.strip() else INAUDIBLE
        rows.append({"utt_id": uid, "conversation_id": cid, "text": text, "transcript": heard.text,
                     "confidence": heard.confidence, "written": written})
    return rows


def _asr_json(plan: _Plan, written: dict[str, str]) -> str:
    """The split file with each transcribed history utterance's text replaced (responses untouched)."""
    objs = json.loads(json.dumps(plan.objs))  # a deep copy
    for obj in objs:
        d = schema.Dialogue.from_json(obj)
        for t_obj, t in zip(obj["turns"], d.turns, strict=True):
            ids = [uid for uid, _, _ in schema.turn_utterances(d, t)]
            for u_obj, uid in zip(t_obj["dialogue_history"], ids, strict=True):
                if uid in written:
                    u_obj["utterance"] = written[uid]
    return json.dumps(objs, ensure_ascii=False, indent=1)


def _summary(plan: _Plan, rows: list[dict[str, Any]]) -> dict[str, Any]:
    pairs = [(r["text"], r["transcript"]) for r in rows if asr.normalize(r["text"])]
    refs, hyps = [p[0] for p in pairs], [p[1] for p in pairs]
    return {
        "split": plan.split,
        "recogniser": asr.MODEL_NAME,
        "asr_utterances": len(rows),
        "asr_empty": sum(1 for r in rows if not r["transcript"].strip()),
        "asr_typed": plan.typed,
        "asr_scored": len(pairs),
        "input_wer": asr.word_error_rate(refs, hyps) if pairs else None,
        "input_cer": asr.char_error_rate(refs, hyps) if pairs else None,
        "raw": str(plan.raw),
    }


def cached_asr_shards(
    shards_dir: str | os.PathLike,
    split: str,
    cache: str | os.PathLike,
    *,
    threads: int = asr.DEFAULT_THREADS,
    progress: bool = True,
    command: str | None = None,
    log: Callable[[str], None] | None = None,
    raw: str | os.PathLike | None = None,
) -> tuple[Path, bool, dict[str, Any]]:
    """(shards folder, reused, summary) of split `split` of `shards_dir` prepared again with every history
    utterance's text replaced by Whisper tiny.en's transcript of its .wav; see the module docstring.

    The summary holds `input_wer` / `input_cer` (transcripts vs typed texts), `asr_utterances` (transcribed),
    `asr_empty` (heard no word: written as `INAUDIBLE`), `asr_typed` (left typed: text-only dialogues),
    `asr_scored` (in the WER), `recogniser`, `raw`, and `transcripts` / `shards` (paths).
    `raw` replaces the raw folder the manifest records (shards moved to another machine): the split file
    there must still be the one the shards were prepared from (the record count is checked).
    Errors that name a file or folder are `AsrShardsError`.
    """
    log = log or _default_log
    shards = Path(shards_dir)
    manifest = _manifest_with(shards, split)
    plan = _Plan(manifest, shards, split, None if raw is None else Path(raw))
    targets_dir = _targets_dir(manifest, shards)
    encoder = _encoder_of(manifest, shards)
    root = Path(cache) / f"asr-{split}-{_key(plan, manifest)}"
    out = root / "shards"
    summary = _sound(root)
    if summary is not None:
        log(f"reusing ASR shards {out} (prepared earlier from the same speech and settings)")
        return out, True, summary
    asr_raw, summary = _write_asr_raw(plan, root, threads, progress)
    reused = _prepare_asr(asr_raw, root, plan, manifest, shards, encoder, targets_dir, progress=progress,
                          log=log, command=command or f"cached_asr_shards({str(shards)!r}, {split!r})")
    if not reused:
        log(f"ASR shards ready in {out}")
    return out, reused, summary


def _manifest_with(shards: Path, split: str) -> dict[str, Any]:
    """The manifest of `shards`, which must list `split`."""
    try:
        manifest = load_manifest(shards)
    except ValueError as e:
        raise AsrShardsError(str(e)) from e
    if split not in (manifest.get("splits") or {}):
        known = sorted(manifest.get("splits") or {})
        raise AsrShardsError(f"{shards} has no split {split!r}; its manifest lists {known}")
    return manifest


def _targets_dir(manifest: dict[str, Any], shards: Path) -> Path | None:
    """The targets folder the shards were prepared with (None: none), which must still exist."""
    targets = manifest.get("targets")
    targets_dir = Path(targets["dir"]) if isinstance(targets, dict) and targets.get("dir") else None
    if targets_dir is not None and not targets_dir.is_dir():
        raise AsrShardsError(f"{shards / MANIFEST} records the targets folder {targets_dir}, which does not "
                             "exist (moved or deleted?): the ASR shards would lack the targets the original "
                             "ones carry")
    return targets_dir


def _write_asr_raw(plan: _Plan, root: Path, threads: int, progress: bool) -> tuple[Path, dict[str, Any]]:
    """(ROOT/raw, summary): the split transcribed into a raw folder of its own (the split file with the
    transcripts, the media linked), plus ROOT's transcripts and summary files."""
    rows = _transcribe(plan, threads, progress)
    raw = root / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    _write_atomic(Path(raw_layout.split_json_path(raw, plan.split)),
                  _asr_json(plan, {r["utt_id"]: r["written"] for r in rows}))
    _link_media(raw, plan.media_dir)
    _write_atomic(root / TRANSCRIPTS, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    summary = {**_summary(plan, rows), "transcripts": str(root / TRANSCRIPTS), "shards": str(root / "shards")}
    _write_atomic(root / SUMMARY, json.dumps(summary, indent=1) + "\n")
    return raw, summary


def _prepare_asr(
    raw: Path,
    root: Path,
    plan: _Plan,
    manifest: dict[str, Any],
    shards: Path,
    encoder: tuple[str, dict[str, Any]],
    targets_dir: Path | None,
    *,
    progress: bool,
    log: Callable[[str], None],
    command: str,
) -> bool:
    """Prepares the ASR raw folder as the original shards were into ROOT/shards, under a temporary name
    renamed when complete; True when another run finished first and its sound folder is used instead."""
    split, out = plan.split, root / "shards"
    name, kwargs = encoder
    em = (manifest.get("emotion_map") or {}).get("name") or "avamerg7"
    tmp = root / f".shards.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        try:
            got = prepare(raw, tmp, encoder=name, encoder_kwargs=kwargs, targets=targets_dir, splits=[split],
                          emotion_map=em, media=plan.media_mode, progress=progress, log=log, command=command)
        except InvalidInputError as e:
            raise AsrShardsError(f"the ASR copy {raw} of {plan.split_json} does not prepare: {e}") from e
        n_new, n_old = got["splits"][split]["records"], manifest["splits"][split]["records"]
        if n_new != n_old:
            raise AsrShardsError(f"{plan.split_json} gives {n_new} records of split {split!r}, the shards "
                                 f"{shards} hold {n_old}: the raw folder changed since they were prepared")
        if out.exists():
            shutil.rmtree(out)  # an unsound folder of an earlier run (a sound one was returned above)
        try:
            os.rename(tmp, out)
        except OSError:  # another run finished first: use its folder if it is sound
            if _sound(root) is None:
                raise
            return True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return False


def _encoder_of(manifest: dict[str, Any], shards: Path) -> tuple[str, dict[str, Any]]:
    """(name, kwargs) of the encoder that prepared the shards, checked by building it: its config must equal
    the stored one (paths excepted), or the ASR shards' features would differ from the original ones."""
    entry = manifest["encoder"]
    name, kwargs = enc_lib.kwargs_from_config(entry)
    try:
        config = enc_lib.get_encoder(name, **kwargs).config()
    except (KeyError, ValueError) as e:
        raise AsrShardsError(f"{shards / MANIFEST}: cannot rebuild encoder {name!r}: {e}") from e
    diff = enc_lib.config_diff(entry.get("config") or {}, config)
    if diff:
        raise AsrShardsError(f"encoder {name!r} rebuilt from {shards / MANIFEST} differs from the one that "
                             f"prepared the shards in {diff}; features would not match")
    return name, kwargs


def _link_media(raw: Path, media: Path) -> None:
    """RAW/media of the ASR copy: a symlink to the original media folder (nothing copied)."""
    link = Path(raw_layout.media_dir_of(raw))
    if link.is_symlink() and Path(os.readlink(link)) == media.resolve():
        return
    tmp = link.with_name(f".media.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(media.resolve(), target_is_directory=True)
    os.replace(tmp, link)


__all__ = ["INAUDIBLE", "AsrShardsError", "cached_asr_shards"]
