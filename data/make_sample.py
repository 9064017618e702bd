"""Build the embedded default's AvaMERG-format sample: real ED dialogues with synthesized media.

Usage: python -m data.make_sample --out DIR --dialogues N --seed S [--ed-csv PATH] [--workers W]

Output (the raw-data contract of docs/design.md):
    DIR/{train,valid,test}.json        lists of AvaMERG dialogue objects
    DIR/media/{utterance_id}.wav       16 kHz mono int16 speech (espeak-ng,
    empatheia_jax/generators/speech_synth.py)
    DIR/media/{utterance_id}.mp4       25 fps 128x128 h264 talking face
    (empatheia_jax/generators/face_render.py)
    DIR/gold_speech/{utterance_id}.wav 24 kHz mono int16 Kokoro-82M speech of the responses of the
                                       --gold-speech splits (default: test), spoken from exactly the
                                       utterance's speech targets (empatheia_jax/generators/kokoro_voices.py)
    DIR/sample_meta.json               seed, N, generator version, splits, per-dialogue flags

Why it looks like this:
- Dialogues are real EmpatheticDialogues conversations (via `data.import_ed`), drawn seeded and
  balanced over the 7 coarse emotions so every class is present even in a small sample.
- Speaker utterances are spoken and acted with the dialogue's 7-class emotion; the listener answers
  with its avatar's response to it (`kokoro_voices.utterance_style`): happy, surprised and sad mirrored,
  the calm, warm "empathetic" style to the others. Speech prosody and facial expression per emotion are
  strong and consistent, so cheap audio/video features recover the emotion.
- A seeded fraction of dialogues (default 30%, stratified by split) is "text_masked": their
  situation text is replaced by one neutral sentence, every sentence containing an emotion word
  (lexicon below) is removed, interjections/emoticons/exclamation marks are neutralised, and an
  utterance left empty becomes a neutral filler. Their media still carry the emotion, so on those
  dialogues the emotion is evident from speech and face, not from words: multimodal input must
  matter. The gold `speaker_emotion` label is kept.
- Two voices per response, on purpose. The media the model hears are espeak-ng (cheap: the 200-dialogue
  sample's 4,100 s of speech take 16 s on 2 cores); Kokoro at a real-time factor of ~0.5 per core would
  need ~17 minutes for all of it, more than `make demo` has. So Kokoro speaks what needs a waveform from
  the generator: the gold speech of the responses whose speech the evaluation compares (`--gold-speech`,
  default the test split; `all` for every split). The speech *targets* of every utterance are real Kokoro
  features regardless (converters/styletts2_targets.py, encoder only).
- Every byte is a function of (corpus, N, seed, generator version): rebuilding gives identical
  files, in parallel or not.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import multiprocessing
import os
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from empatheia_jax import logs
from empatheia_jax.assets import sha256_file
from empatheia_jax.data.raw_layout import media_dir_of, split_json_path
from empatheia_jax.data.schema import (
    EMOTIONS_7,
    Dialogue,
    EmotionMap,
    dialogue_utterances,
    response_utterance_id,
    validate_dialogues,
)

GENERATOR_VERSION = "4"  # 2: Kokoro gold speech of the responses (gold_speech/); 3: the listener
# answers in kokoro_voices.utterance_style (mirrors joy, surprise, sadness) instead of always calm;
# 4: gold speech in voice map version 3 (one additive term per profile factor)
GOLD_SPEECH_DIR = "gold_speech"
SPLITS = ("train", "valid", "test")
DEFAULT_ED_CSV_NAME = "empathetic_dialogues_validation.csv"
MAX_UTTERANCE_WORDS = 60  # longer ED utterances (rare, some are merged raw lines) are not drawn
DEFAULT_MASKED_FRACTION = 0.3
NEUTRAL_SCENARIO = "The speaker tells the listener about something that happened recently."
_SPEAKER_FILLERS = (
    "Let me tell you about something that happened.",
    "So this is what happened the other day.",
    "I wanted to talk to you about it.",
    "That is how it went.",
    "It was about something from last week.",
    "Well, that is the whole story.",
)
_LISTENER_FILLERS = (
    "I see. Tell me more about it.",
    "How did that go for you?",
    "I am listening. What happened next?",
    "Thank you for telling me about it.",
    "What did you do after that?",
    "I understand. Go on.",
)

# ---------------------------------------------------------------------------------------------
# Text masking
# ---------------------------------------------------------------------------------------------

# Words that name or evaluate an emotion: the 32 ED labels, their inflections and common synonyms.
# A sentence containing one is removed from a masked dialogue.
_LEXICON = """
afraid fear fears feared fearful fearfully fearing scare scared scares scary scarier scariest scaring
frighten frightened frightening frightens fright terrified terrifying terrify terrifies terror horrified
horrifying horror horrible horribly panic panicked panicking panicky nervous nervously nervousness nerves
anxious anxiously anxiety worried worry worrying worries worrisome apprehensive apprehension dread dreaded
dreading dreadful uneasy alarmed spooked creepy freaked freaking freak petrified butterflies
angry angrily anger angered mad madder furious furiously fury rage raging enraged livid annoy annoyed
annoying annoys annoyance irritate irritated irritating irritation frustrate frustrated frustrating
frustration pissed irked outrage outraged outrageous upset upsetting hate hated hates hating hatred
resent resented resentful resentment infuriate infuriated infuriating bitter yell yelled yelling scream
screamed screaming shout shouted
happy happier happiest happily happiness unhappy glad gladly joy joyful joyous enjoy enjoyed enjoying
enjoys excite excited excitement exciting thrill thrilled thrilling delight delighted delightful cheerful
cheer cheered ecstatic elated overjoyed pleased proud proudly pride grateful gratitude thankful blessed
content contented confident confidently confidence hopeful hopefully hope hopes hoped hoping love loved
loves loving lovely awesome amazing amazingly wonderful fantastic great greatest excellent terrific
congrats congratulations nice fun funny good better best fortunate fortunately lucky luckily cool sweet
relieved relief relax relaxed relaxing calm satisfied satisfying pumped stoked psyched blast smile
smiled smiling laugh laughed laughing brave courage
sad sadly sadness sadder saddest sorrow grief grieve grieved grieving mourn mourned mourning depress
depressed depressing depression devastate devastated devastating heartbroken heartbreak heartbreaking
miserable misery lonely loneliness alone disappoint disappointed disappointing disappointment
disappoints gutted bummed bummer cry cried crying cries tear tears tearful weep wept sob sobbing hurt
hurts hurtful pain painful sorry unfortunate unfortunately unlucky suck sucks sucked stink stinks
terrible terribly awful awfully bad worse worst poor tough rough pity
nostalgia nostalgic sentimental miss missed misses missing
ashamed shame shameful embarrass embarrassed embarrassing embarrassment humiliate humiliated
humiliating humiliation guilty guilt regret regrets regretted regretful awkward
jealous jealousy envy envious
disgust disgusted disgusting disgusts gross nasty revolting sick sickening repulsed repulsive vile
surprise surprised surprises surprising surprisingly shock shocked shocking stunned amazed astonished
astonishing unexpected unexpectedly impress impressed impressive crazy insane
contempt despise despised scorn disdain caring trusting trust faithful prepared anticipate
anticipated anticipating anticipation stress stressed stressful overwhelmed overwhelming tense
emotional touched touching heartwarming mood
"""
_EMOTION_WORDS = frozenset(_LEXICON.split())
_EMOTION_RE = re.compile(r"\b(?:" + "|".join(sorted(_EMOTION_WORDS, key=len, reverse=True)) + r")\b",
                         re.IGNORECASE)
_EMOTION_PHRASE_RE = re.compile(
    r"\b(?:can'?t wait|looking forward|look forward|oh no|thank god|cloud (?:9|nine)|fed up)\b", re.IGNORECASE
)
_INTERJECTION_RE = re.compile(
    r"\b(?:wow+|whoa+|yay+|ugh+|omg|lol|lmao|(?:ha){2,}h?|(?:he){2,}|yikes|ew+|yuck|damn|dang|aww*|hooray|"
    r"phew|geez|jeez|gosh|ouch|yeah+|yes+|oh+|ah+|hmm+)\b[,.!]*\s*",
    re.IGNORECASE,
)
_EMOTICON_RE = re.compile(r"(?:[:;=]-?[()DPp/\\|]+|<3|\^_?\^)")
_SENTENCE_RE = re.compile(r"[^.!?]+[.!?]*")


def has_emotion_word(text: str) -> bool:
    """True if `text` names or evaluates an emotion (the masking lexicon); used by tests and checks."""
    return bool(_EMOTION_RE.search(text) or _EMOTION_PHRASE_RE.search(text))


def neutralize_text(text: str) -> tuple[str, int]:
    """(text without emotion-revealing sentences/interjections, number of sentences removed)."""
    text = _EMOTICON_RE.sub(" ", text)
    kept, removed = [], 0
    for m in _SENTENCE_RE.finditer(text):
        sent = _INTERJECTION_RE.sub("", m.group(0)).strip(" ,;-")
        if not sent.strip(" .!?"):
            continue
        if has_emotion_word(sent):
            removed += 1
            continue
        sent = re.sub(r"[!?]*!+[!?]*", ".", sent)
        kept.append(sent[0].upper() + sent[1:])
    out = " ".join(" ".join(kept).split())
    if out and out[-1] not in ".?":
        out += "."
    return out, removed


def _filler(role: str, key: str) -> str:
    pool = _SPEAKER_FILLERS if role == "speaker" else _LISTENER_FILLERS
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big")
    return pool[h % len(pool)]


def mask_dialogue(obj: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """A text-masked copy of an AvaMERG dialogue and the number of sentences removed.

    Situation text (turn `context`, CoE `event_scenario`/`emotion_cause`) becomes NEUTRAL_SCENARIO;
    each utterance (same text wherever it recurs across turns) is neutralised, and replaced by a
    neutral filler if nothing is left. `speaker_emotion` (the gold label) is untouched.
    """
    out = copy.deepcopy(obj)
    cid = str(out.get("conversation_id"))
    cache: dict[int, str] = {}
    removed = 0

    def masked(k: int, role: str, text: str) -> str:
        nonlocal removed
        if k not in cache:
            new, n = neutralize_text(text)
            removed += n
            cache[k] = new or _filler(role, f"{cid}/{k}")
        return cache[k]

    for t in out["turns"]:
        t["context"] = NEUTRAL_SCENARIO
        coe = t.setdefault("chain_of_empathy", {})
        coe["event_scenario"] = NEUTRAL_SCENARIO
        if coe.get("emotion_cause"):
            coe["emotion_cause"] = ""
        for u in t["dialogue_history"]:
            u["utterance"] = masked(u["index"], u["role"], u["utterance"])
        t["response"] = masked(len(t["dialogue_history"]), "listener", t["response"])
    return out, removed


# ---------------------------------------------------------------------------------------------
# Selection and splits
# ---------------------------------------------------------------------------------------------


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def shipped_ed_csv() -> Path:
    """The ED validation csv shipped in `data/ed/` (data card and sha256 beside it)."""
    return repo_root() / "data" / "ed" / DEFAULT_ED_CSV_NAME


def check_shipped_ed_csv(path: Path) -> None:
    """A truncated or re-encoded copy (a CRLF->LF checkout, say) would silently change the sample's
    dialogues, so the shipped copy must hash to the sum recorded beside it."""
    sums = path.with_name("SHA256SUMS")
    lines = [line.split(maxsplit=1) for line in sums.read_text().splitlines() if line.strip()]
    expected = {name: digest for digest, name in lines}
    got = hashlib.sha256(path.read_bytes()).hexdigest()
    if expected.get(path.name) != got:
        raise ValueError(
            f"{path}: sha256 {got} does not match {sums} ({expected.get(path.name)}); restore the file "
            "with `git checkout -- data/ed` (it must keep its CRLF line endings)"
        )


def resolve_ed_csv(path: str | os.PathLike | None = None) -> Path:
    """The ED csv to draw from: `path`, else $EMPATHEIA_ED_CSV, else the copy shipped in data/ed/."""
    tried = []
    candidates = [("--ed-csv", path)] if path else []
    if not path:
        candidates.append(("EMPATHEIA_ED_CSV", os.environ.get("EMPATHEIA_ED_CSV")))
        candidates.append(("default", shipped_ed_csv()))
    for how, p in candidates:
        if not p:
            continue
        p = Path(p).expanduser()
        if p.is_file():
            if how == "default":
                check_shipped_ed_csv(p)
            return p.resolve()
        tried.append(f"{how}: {p}")
    raise FileNotFoundError(
        "EmpatheticDialogues csv not found (tried " + "; ".join(tried or ["nothing"]) + "). "
        "Pass --ed-csv PATH or set EMPATHEIA_ED_CSV to an ED-format csv such as " + DEFAULT_ED_CSV_NAME
    )


def _words(obj: dict[str, Any]) -> int:
    d = Dialogue.from_json(obj)
    return max(len(text.split()) for _, _, text in dialogue_utterances(d))


def select_dialogues(dialogues: list[dict[str, Any]], n: int, seed: int,
                     emotion_map: EmotionMap) -> list[dict[str, Any]]:
    """n dialogues, seeded, interleaved over the 7 classes in EMOTIONS_7 order (balanced while each
    class lasts). Dialogues with an utterance over MAX_UTTERANCE_WORDS words are not drawn."""
    rng = random.Random(f"select/{seed}")
    by_class: dict[str, list[dict[str, Any]]] = {c: [] for c in EMOTIONS_7}
    for obj in dialogues:
        emo = emotion_map.class_name(obj["turns"][0]["chain_of_empathy"]["speaker_emotion"])
        if emo in by_class and _words(obj) <= MAX_UTTERANCE_WORDS:
            by_class[emo].append(obj)
    for pool in by_class.values():
        rng.shuffle(pool)
    total = sum(len(p) for p in by_class.values())
    if n > total:
        raise ValueError(f"asked for {n} dialogues but the corpus has only {total} eligible ones")
    out: list[dict[str, Any]] = []
    depth = 0
    while len(out) < n:
        for c in EMOTIONS_7:
            if depth < len(by_class[c]) and len(out) < n:
                out.append(by_class[c][depth])
        depth += 1
    return out


def assign_splits(n: int) -> list[str]:
    """Split of each position of the interleaved selection: ~80/10/10, evenly spread (so the classes
    cycle through valid/test too); valid and test get >= 1 dialogue whenever n >= 3."""
    split = ["train"] * n
    k = max(1, round(0.1 * n)) if n >= 3 else 0
    if k:
        step = n / k
        for j in range(k):
            split[int(j * step + 0.25 * step)] = "valid"
            split[int(j * step + 0.75 * step)] = "test"
    return split


def choose_masked(splits: list[str], fraction: float, seed: int) -> list[bool]:
    """floor(fraction * size + 0.5) masked dialogues inside each split, seeded."""
    rng = random.Random(f"mask/{seed}")
    masked = [False] * len(splits)
    for s in SPLITS:
        idx = [i for i, x in enumerate(splits) if x == s]
        for i in rng.sample(idx, math.floor(fraction * len(idx) + 0.5)):
            masked[i] = True
    return masked


# ---------------------------------------------------------------------------------------------
# Media
# ---------------------------------------------------------------------------------------------


def render_utterance(job: tuple[str, str, dict, str, str, int]) -> tuple[str, int, int]:
    """Worker: write `{uid}.wav` and `{uid}.mp4`; returns (uid, audio samples, video frames)."""
    from empatheia_jax.generators.face_render import render_face_video
    from empatheia_jax.generators.speech_synth import (
        SAMPLE_RATE,
        speech_envelope,
        synthesize_speech,
        write_wav,
    )

    uid, text, profile, style, media_dir, size = job
    wav = synthesize_speech(text, profile, style, SAMPLE_RATE)
    write_wav(os.path.join(media_dir, uid + ".wav"), wav, SAMPLE_RATE)
    env = speech_envelope(wav, SAMPLE_RATE)
    frames = render_face_video(env, profile, style, os.path.join(media_dir, uid + ".mp4"), size=size)
    return uid, len(wav), frames


def speak_gold(job: tuple[str, str, dict, str | None, str]) -> tuple[str, dict]:
    """Worker: write `{uid}.wav` of the gold speech of a listener's reply (Kokoro, 24 kHz) to the dialogue's
    emotion; returns (uid, voice recipe)."""
    from empatheia_jax.generators.kokoro import SAMPLE_RATE
    from empatheia_jax.generators.kokoro_voices import gold_speech, utterance_delivery
    from empatheia_jax.generators.speech_synth import write_wav

    uid, text, profile, emotion, gold_dir = job
    style, speed = utterance_delivery("listener", emotion)
    wav, v = gold_speech(text, profile, style, speed)
    write_wav(os.path.join(gold_dir, uid + ".wav"), wav, SAMPLE_RATE)
    return uid, {"style": style, **v.recipe, "samples": len(wav)}


def _run_jobs(jobs: list, workers: int, progress: bool, fn=render_utterance, desc: str = "media") -> list:
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(jobs), desc=desc, unit=" utt", mininterval=0.5)
    results = []
    try:
        if workers <= 1:
            for job in jobs:
                results.append(fn(job))
                if bar:
                    bar.update()
        else:
            # spawn, not fork: the caller may have imported jax (threads), which fork can deadlock.
            ctx = multiprocessing.get_context("spawn")
            with ctx.Pool(workers) as pool:
                for r in pool.imap(fn, jobs, chunksize=4):
                    results.append(r)
                    if bar:
                        bar.update()
    finally:
        if bar:
            bar.close()
    return results


# ---------------------------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------------------------


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, indent=1) + "\n"


def _prepare_out(out: Path) -> Path:
    """A fresh temp folder next to `out`; refuses to replace a non-empty folder that is not a sample."""
    if out.exists() and any(out.iterdir()) and not (out / "sample_meta.json").exists():
        raise FileExistsError(f"{out} exists, is not empty and holds no sample_meta.json; not overwriting it")
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))


def build_sample(out: str | os.PathLike, n: int, seed: int, *, ed_csv: str | os.PathLike | None = None,
                 corpus: list[dict[str, Any]] | None = None, masked_fraction: float = DEFAULT_MASKED_FRACTION,
                 workers: int | None = None, size: int = 128, progress: bool = False,
                 gold_speech: tuple[str, ...] | list[str] = ("test",)) -> dict[str, Any]:
    """Build the sample into `out` (replacing an earlier sample there) and return its meta dict.

    `corpus` (AvaMERG dialogues) skips reading the csv; otherwise `ed_csv` is resolved with
    `resolve_ed_csv` and converted by `data.import_ed.convert_ed_csv`. `gold_speech`: the splits whose
    responses get Kokoro gold speech in `gold_speech/`.
    """
    from empatheia_jax.generators.kokoro_voices import utterance_style
    from empatheia_jax.generators.speech_synth import EMOTION_PROSODY, FRAME_RATE, SAMPLE_RATE

    if n < 1:
        raise ValueError("--dialogues must be >= 1")
    if not 0.0 <= masked_fraction <= 1.0:
        raise ValueError("masked_fraction must be in [0, 1]")
    bad = sorted(set(gold_speech) - set(SPLITS))
    if bad:
        raise ValueError(f"--gold-speech: unknown split(s) {bad}; expected a subset of {SPLITS}")
    emap = EmotionMap.load("avamerg7")
    source: dict[str, Any] = {"kind": "corpus"}
    if corpus is None:
        from empatheia_jax.data.ed import convert_ed_csv

        csv_path = resolve_ed_csv(ed_csv)
        corpus = convert_ed_csv(str(csv_path)).dialogues
        source = {"kind": "ed-csv", "file": csv_path.name, "sha256": sha256_file(csv_path)}
    chosen = select_dialogues(corpus, n, seed, emap)
    splits = assign_splits(n)
    masked = choose_masked(splits, masked_fraction, seed)

    out = Path(out)
    tmp = _prepare_out(out)
    try:
        media = Path(media_dir_of(tmp))
        media.mkdir()
        per_split: dict[str, list[dict[str, Any]]] = {s: [] for s in SPLITS}
        info: dict[str, dict[str, Any]] = {}
        jobs, gold_jobs = [], {}
        gold_dir = tmp / GOLD_SPEECH_DIR
        for obj, split, is_masked in zip(chosen, splits, masked, strict=True):
            removed = 0
            if is_masked:
                obj, removed = mask_dialogue(obj)
            else:
                obj = copy.deepcopy(obj)
            per_split[split].append(obj)
            d = Dialogue.from_json(obj)
            word = d.turns[0].chain_of_empathy.speaker_emotion
            emotion = emap.class_name(word)
            uids = []
            for uid, role, text in dialogue_utterances(d):
                style = utterance_style(role, emotion)
                profile = d.profile_of(role).to_json()
                jobs.append((uid, text, profile, style, str(media), size))
                uids.append(uid)
            if split in gold_speech:
                listener = d.profile_of("listener").to_json()
                for j, turn in enumerate(d.turns):
                    uid = response_utterance_id(d, j)
                    gold_jobs.setdefault(uid, (uid, turn.response, listener, emotion, str(gold_dir)))
            info[d.conversation_id] = {"split": split, "emotion": emotion, "speaker_emotion": word,
                                       "text_masked": is_masked, "sentences_removed": removed,
                                       "utterances": uids}
        workers = min(2, os.cpu_count() or 1) if workers is None else workers
        results = _run_jobs(jobs, workers, progress)
        for uid, samples, frames in results:
            if samples * FRAME_RATE != frames * SAMPLE_RATE:
                raise RuntimeError(f"{uid}: audio ({samples} samples) and video ({frames} frames) disagree")
        gold_info: dict[str, Any] = {"splits": [s for s in SPLITS if s in gold_speech], "utterances": {}}
        if gold_jobs:
            from empatheia_jax.generators import kokoro, kokoro_voices

            gold_dir.mkdir()
            for cut in ("encoder", "synthesizer"):  # built once here, not raced by the workers
                kokoro.cut_model(cut)
            recipes = _run_jobs(list(gold_jobs.values()), workers, progress, speak_gold,
                                "gold speech (Kokoro)")
            gold_info.update(generator="Kokoro-82M int8 ONNX", model_sha256=kokoro.MODEL_SHA256,
                             voice_map_version=kokoro_voices.MAP_VERSION, sample_rate=kokoro.SAMPLE_RATE,
                             audio="wav mono int16", utterances=dict(sorted(recipes)))
        problems = []
        for s in SPLITS:
            problems += validate_dialogues(per_split[s], source=f"{s}.json", media_dir=str(media),
                                           emotion_map=emap, check_media_readable=False)
            Path(split_json_path(tmp, s)).write_text(_dumps(per_split[s]), encoding="utf-8")
        if problems:
            raise RuntimeError("generated sample fails validation:\n" + "\n".join(map(str, problems[:20])))
        meta = {
            "generator": "data.make_sample",
            "generator_version": GENERATOR_VERSION,
            "seed": seed,
            "num_dialogues": n,
            "masked_fraction": masked_fraction,
            "source": source,
            "media": {"sample_rate": SAMPLE_RATE, "audio": "wav mono int16", "fps": FRAME_RATE,
                      "video": f"mp4 h264 yuv420p {size}x{size}", "listener_style": "utterance_style",
                      "prosody": {k: vars(v) for k, v in EMOTION_PROSODY.items()}},
            "gold_speech": gold_info,
            "targets": {"speech": "real: Kokoro-82M features of every utterance "
                                  "(python -m converters.styletts2_targets --backend kokoro)",
                        "video": "real for the embedded face generator: the controls each video was drawn "
                                 "with (python -m converters.face_targets); a procedural stand-in for "
                                 "DreamTalk"},
            "splits": {s: [o["conversation_id"] for o in per_split[s]] for s in SPLITS},
            "num_utterances": len(jobs),
            "media_seconds": round(sum(r[1] for r in results) / SAMPLE_RATE, 2),
            "dialogues": info,
        }
        (tmp / "sample_meta.json").write_text(_dumps(meta), encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return meta


def _gold_splits(arg: str) -> tuple[str, ...]:
    arg = arg.strip().lower()
    if arg == "all":
        return SPLITS
    if arg in ("", "none"):
        return ()
    return tuple(s.strip() for s in arg.split(",") if s.strip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data.make_sample", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output folder (an earlier sample there is replaced)")
    ap.add_argument("--dialogues", type=int, default=200, help="number of dialogues N (default 200)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ed-csv", default=None,
                    help=f"ED csv (default: $EMPATHEIA_ED_CSV, else data/ed/{DEFAULT_ED_CSV_NAME})")
    ap.add_argument("--masked-fraction", type=float, default=DEFAULT_MASKED_FRACTION,
                    help="fraction of dialogues whose text is emotion-masked (default 0.3)")
    ap.add_argument("--workers", type=int, default=None, help="render processes (default min(2, cpus))")
    ap.add_argument("--gold-speech", default="test",
                    help="comma-separated splits whose responses get Kokoro gold speech ('all', 'none'; "
                         "default test: what `empatheia eval` compares generated speech with)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--verbose", action="store_true",
                    help="library logging (absl, jax, transformers, ...) at INFO instead of WARNING")
    args = ap.parse_args(argv)
    logs.configure(args.verbose)
    start = time.perf_counter()
    try:
        meta = build_sample(args.out, args.dialogues, args.seed, ed_csv=args.ed_csv,
                            masked_fraction=args.masked_fraction, workers=args.workers,
                            progress=not args.quiet, gold_speech=_gold_splits(args.gold_speech))
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sizes = {s: len(v) for s, v in meta["splits"].items()}
    n_masked = sum(d["text_masked"] for d in meta["dialogues"].values())
    print(f"{meta['num_dialogues']} dialogues {sizes}, {n_masked} text-masked, "
          f"{meta['num_utterances']} utterances ({meta['media_seconds']:.0f} s of media) -> {args.out} "
          f"in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
