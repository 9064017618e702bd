"""Speech generator targets (speech_content, speech_style) for every utterance of an AvaMERG folder.

Why this exporter exists: the Content Synchronizer and the Style Disentangler are trained to regress the
generator's own intermediate features, so that at inference their outputs can be handed to the generator's
decoder as if its encoders had produced them (DESIGN §2). The targets therefore have to come from the very
generator that will speak, computed exactly the way that generator computes them at inference:

- ``kokoro`` (default, embedded): Kokoro-82M (empatheia_jax/generators/kokoro.py) is what ships inside our
wheels, so it
  is what the offline system speaks with. Its graph has no style encoder, so the style target is the voice
  the utterance is *spoken with* (empatheia_jax/generators/kokoro_voices.py: profile + emotion -> ref_s), not
  a measurement.
  Content rows are Kokoro's t_en ++ d_en for ``[0, *ids, 0]``, the two boundary pads included, because
  the synthesizer only reproduces the full model when it gets all of them.
- ``styletts2``: a user's checkout of yl4579/StyleTTS2 and a trained checkpoint. Here both targets are
  measured: content from the text (``text_encoder`` and PL-BERT + ``bert_encoder`` on the tokens
  ``[0, *TextCleaner(phonemes)]``: one leading pad, no trailing one, as StyleTTS2's inference does), style
  from the utterance's gold speech (``ref_s = style_encoder(mel) ++ predictor_encoder(mel)`` on the
  trimmed 24 kHz wav, as StyleTTS2's ``compute_style`` does).

Why the mel is computed here and not with torchaudio: StyleTTS2 builds it with
``torchaudio.transforms.MelSpectrogram(n_mels=80, n_fft=2048, win_length=1200, hop_length=300)`` and no
``sample_rate``, so torchaudio's default of 16 kHz shapes the filterbank (f_max 8 kHz, bins spaced as if
the 24 kHz audio were 16 kHz audio). The encoders were trained on exactly that, so we reproduce it with
librosa (htk mel scale, no norm, periodic Hann, centred reflect-padded STFT, power 2), which avoids a
torchaudio dependency tied to the torch version; ``MEL`` records every setting.

Why the StyleTTS2 model is loaded the way it is: the published checkpoints hold pickled Python objects,
and our rule is ``torch.load(weights_only=True)`` only; a checkpoint that needs more is refused with a
one-line conversion to ``.safetensors`` the user can run where they trust the file. The checkout's own
``load_plbert`` / ASR / JDC loaders unpickle their files without that guard, so they are not called:
PL-BERT is built from the checkout's ``Utils/PLBERT/config.yml`` and filled from the checkpoint's ``bert``
weights, and ``build_model`` gets no text aligner or pitch extractor (it only stores them; the five
modules used here never touch them). ``utils.py`` is not imported either (it needs ``monotonic_align``).

StyleTTS2 phonemes: espeak-ng en-us through phonemizer-fork with StyleTTS2's settings
(``preserve_punctuation=True, with_stress=True``, no stripping of language flags, unlike Kokoro's
``remove-flags``), then ``nltk.word_tokenize`` joined by spaces, exactly like StyleTTS2's ``inference``;
espeak-ng comes from the ``espeakng-loader`` wheel (`empatheia_jax.generators.kokoro.espeak_backend`, the one
library
set-up), so its version can differ from a system espeak-ng the checkpoint was trained with.

CLI::

    python -m converters.styletts2_targets --raw RAW --out TARGETS [--splits a,b]
        [--backend kokoro|styletts2] [--repo CHECKOUT --ckpt FILE [--config YML] [--device D]]
        [--workers N] [--shard-size N] [--quiet]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import io
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from converters.target_export import TargetExportError, UsageError, raw_dialogues, safe_torch_load

BACKENDS = ("kokoro", "styletts2")
KINDS = ("speech_content", "speech_style")

# StyleTTS2's reference mel (meldataset.py / the inference notebooks' `preprocess`), see the module docstring.
MEL: dict[str, Any] = {
    "sample_rate": 24000,  # audio is loaded (librosa) at this rate
    "filterbank_sample_rate": 16000,  # torchaudio.transforms.MelSpectrogram's default, which StyleTTS2 keeps
    "n_mels": 80,
    "n_fft": 2048,
    "win_length": 1200,
    "hop_length": 300,
    "f_min": 0.0,
    "f_max": 8000.0,  # filterbank_sample_rate / 2
    "window": "hann (periodic)",
    "center": True,
    "pad_mode": "reflect",
    "power": 2.0,
    "mel_scale": "htk",
    "norm": None,
    "log_offset": 1e-5,
    "mean": -4.0,
    "std": 4.0,  # normalised = (log(1e-5 + mel) - mean) / std
    "trim_top_db": 30,  # librosa.effects.trim before the mel, as StyleTTS2's compute_style does
}
STYLETTS2_MODULES = ("text_encoder", "bert", "bert_encoder", "style_encoder", "predictor_encoder")
SAFETENSORS_HINT = (
    "convert it once, where you trust the file, with: python -c \"import sys, torch; "
    "from safetensors.torch import save_file; n = torch.load(sys.argv[1], map_location='cpu', "
    "weights_only=False)['net']; save_file({m + '.' + k: v.clone().contiguous() for m in "
    f"{STYLETTS2_MODULES!r} for k, v in n[m].items()}}, sys.argv[2])\" CKPT CKPT.safetensors, "
    "then pass --ckpt CKPT.safetensors"
)
KOKORO_LAYOUT = "t_en ++ d_en per token incl. the two boundary pad rows ([0, *ids, 0])"
STYLETTS2_LAYOUT = "t_en ++ d_en per token incl. the leading pad token 0 ([0, *TextCleaner(phonemes)])"
KOKORO_PHONEMIZER = ("espeak-ng en-us via phonemizer-fork (espeakng-loader), preserve_punctuation, "
                     "with_stress, language_switch=remove-flags; symbols outside Kokoro's vocabulary dropped")
STYLETTS2_PHONEMIZER = ("espeak-ng en-us via phonemizer-fork (espeakng-loader), preserve_punctuation, "
                        "with_stress; then nltk.word_tokenize joined by spaces")


class SpeechJob(NamedTuple):
    uid: str
    role: str
    text: str
    profile: dict[str, Any]
    emotion: str | None  # the dialogue's avamerg7 class, None when the word does not resolve
    wav: str


def speech_jobs(
    raw: str | os.PathLike,
    splits: list[str] | None = None,
    dialogues: Iterable[Any] | None = None,
    responses_only: bool = False,
) -> list[SpeechJob]:
    """One job per distinct utterance (histories and responses) of `dialogues`, else of RAW's splits.

    `responses_only` keeps the turns' responses: a record's targets are its response's
    (data.prepare joins them by response id), so a text corpus such as imported EmpatheticDialogues
    needs no more, and half the work is saved.
    """
    from empatheia_jax.data import raw_layout, schema

    dialogues = raw_dialogues(raw, splits, dialogues)
    emap = schema.EmotionMap.load("avamerg7")
    media = Path(raw_layout.media_dir_of(raw))
    jobs, seen = [], set()
    for d in dialogues:
        emotion = emap.class_name(d.turns[0].chain_of_empathy.speaker_emotion) if d.turns else None
        keep = ({schema.response_utterance_id(d, j) for j in range(len(d.turns))} if responses_only
                else None)
        for uid, role, text in schema.dialogue_utterances(d):
            if uid not in seen and (keep is None or uid in keep):
                seen.add(uid)
                jobs.append(SpeechJob(uid, role, text, d.profile_of(role).to_json(), emotion,
                                      str(media / f"{uid}.wav")))
    return jobs


Result = tuple[str, dict[str, np.ndarray] | None, str | None]


# ---------------------------------------------------------------------------------------------------------
# Kokoro


def _kokoro_init() -> None:
    from empatheia_jax.generators import kokoro

    kokoro.shared(1)


def _kokoro_one(job: SpeechJob) -> Result:
    from empatheia_jax.generators import kokoro, kokoro_voices

    try:
        content = kokoro.shared(1).content_features(kokoro.phonemize(job.text))
        style = kokoro_voices.voice(job.profile, kokoro_voices.utterance_style(job.role, job.emotion)).style
        return job.uid, {"speech_content": content, "speech_style": style}, None
    except Exception as e:  # noqa: BLE001 - collected and reported with the utterance id
        return job.uid, None, f"{job.uid}: {type(e).__name__}: {e}"


def _kokoro_meta() -> dict[str, dict[str, Any]]:
    from empatheia_jax.generators import kokoro, kokoro_voices

    common = {"generator": "Kokoro-82M", "model": kokoro.MODEL_NAME, "model_sha256": kokoro.MODEL_SHA256,
              "cut_version": kokoro.CUT_VERSION, "voice_map_version": kokoro_voices.MAP_VERSION}
    return {
        "speech_content": {**common, "layout": KOKORO_LAYOUT, "phonemizer": KOKORO_PHONEMIZER},
        "speech_style": {**common, "method": "empatheia_jax.generators.kokoro_voices.voice(profile, "
                                            "utterance_style(role, "
                         "emotion)).style: the ref_s the utterance is spoken with (first 128 acoustic, "
                         "last 128 prosodic)"},
    }


def _kokoro_results(jobs: list[SpeechJob], workers: int, stack: contextlib.ExitStack) -> Iterator[Result]:
    from empatheia_jax.generators import kokoro

    kokoro.cut_model("encoder")  # built once here, not raced by the workers
    if workers > 1:
        import multiprocessing as mp

        pool = stack.enter_context(mp.get_context("spawn").Pool(workers, _kokoro_init))
        return pool.imap(_kokoro_one, jobs, chunksize=8)
    _kokoro_init()
    return map(_kokoro_one, jobs)


# ---------------------------------------------------------------------------------------------------------
# StyleTTS2: phonemes and mel


_ESPEAK = None
_ESPEAK_LOCK = threading.Lock()


def _styletts2_espeak():
    global _ESPEAK
    if _ESPEAK is None:
        from empatheia_jax.generators.kokoro import espeak_backend

        _ESPEAK = espeak_backend(preserve_punctuation=True, with_stress=True)
    return _ESPEAK


def styletts2_phonemes(text: str, word_tokenize: Callable[[str], list[str]]) -> str:
    """The phoneme string StyleTTS2's inference feeds its TextCleaner for `text`."""
    with _ESPEAK_LOCK:
        ps = _styletts2_espeak().phonemize([text.strip()])[0]
    return " ".join(word_tokenize(ps))


@functools.cache
def _mel_filterbank() -> np.ndarray:
    import librosa

    return librosa.filters.mel(sr=MEL["filterbank_sample_rate"], n_fft=MEL["n_fft"], n_mels=MEL["n_mels"],
                               fmin=MEL["f_min"], fmax=MEL["f_max"], htk=True, norm=None).astype(np.float32)


def load_reference_audio(path: str | os.PathLike) -> np.ndarray:
    """Mono float32 audio at 24 kHz with leading/trailing silence trimmed (StyleTTS2's compute_style)."""
    import librosa

    y, _ = librosa.load(str(path), sr=MEL["sample_rate"], mono=True)
    y, _ = librosa.effects.trim(y, top_db=MEL["trim_top_db"])
    return np.asarray(y, np.float32)


def styletts2_mel(audio: np.ndarray) -> np.ndarray:
    """The normalised log-mel [80, frames] StyleTTS2's style encoders read, of 24 kHz `audio` (see MEL)."""
    import librosa

    y = np.asarray(audio, np.float32).reshape(-1)
    if len(y) <= MEL["n_fft"] // 2:
        raise ValueError(f"{len(y)} samples after trimming; the mel needs more than {MEL['n_fft'] // 2}")
    spec = librosa.stft(y, n_fft=MEL["n_fft"], hop_length=MEL["hop_length"], win_length=MEL["win_length"],
                        window="hann", center=True, pad_mode="reflect")
    mel = _mel_filterbank() @ (np.abs(spec) ** 2)
    return ((np.log(MEL["log_offset"] + mel) - MEL["mean"]) / MEL["std"]).astype(np.float32)


# ---------------------------------------------------------------------------------------------------------
# StyleTTS2: the model


@dataclass
class StyleTTS2Parts:
    """What the targets need from a StyleTTS2 model: its five modules (torch, eval mode), the checkout's
    TextCleaner, the word tokenizer applied to espeak's output, the device, and provenance for meta.json.
    Tests pass stand-ins with the same interfaces."""

    text_encoder: Any  # (tokens [B,T], lengths [B], mask [B,T] True at padding) -> [B, 512, T]
    bert: Any  # (tokens [B,T], attention_mask=[B,T] int) -> [B, T, 768]
    bert_encoder: Any  # [B, T, 768] -> [B, T, 512]
    style_encoder: Any  # mel [B, 1, 80, frames] -> [B, 128] acoustic style
    predictor_encoder: Any  # mel [B, 1, 80, frames] -> [B, 128] prosodic style
    text_cleaner: Callable[[str], list[int]]
    word_tokenize: Callable[[str], list[str]]
    device: str = "cpu"
    meta: dict[str, Any] | None = None


def length_to_mask(lengths: Any) -> Any:
    """[B, max(lengths)] bool, True at the padding positions (StyleTTS2's mask convention)."""
    import torch

    positions = torch.arange(int(lengths.max()), device=lengths.device)
    return positions.unsqueeze(0) >= lengths.unsqueeze(1)


def styletts2_content(parts: Any, phonemes: str) -> np.ndarray:
    """speech_content [1 + len(tokens), 2 * hidden] = t_en ++ d_en of ``[0, *text_cleaner(phonemes)]``."""
    import torch

    with contextlib.redirect_stdout(io.StringIO()):  # TextCleaner prints texts with unknown symbols
        ids = [int(i) for i in parts.text_cleaner(phonemes)]
    if not ids:
        raise ValueError(f"no StyleTTS2 tokens in phonemes {phonemes!r}")
    device = getattr(parts, "device", "cpu")
    tokens = torch.tensor([[0, *ids]], dtype=torch.long, device=device)
    n = tokens.shape[1]
    limit = getattr(getattr(parts.bert, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and n > limit:
        raise ValueError(f"{n} tokens; PL-BERT takes at most {limit} (phonemes start {phonemes[:40]!r})")
    lengths = torch.tensor([n], dtype=torch.long, device=device)
    mask = length_to_mask(lengths)
    with torch.inference_mode():
        t_en = parts.text_encoder(tokens, lengths, mask)
        bert_dur = parts.bert(tokens, attention_mask=(~mask).int())
        d_en = parts.bert_encoder(bert_dur).transpose(-1, -2)
    if t_en.ndim != 3 or d_en.ndim != 3 or t_en.shape[0] != 1 or t_en.shape[2] != n or d_en.shape[2] != n:
        raise ValueError(f"t_en {list(t_en.shape)} / d_en {list(d_en.shape)} do not have {n} positions")
    return torch.cat([t_en[0], d_en[0]], dim=0).transpose(0, 1).float().cpu().numpy()


def styletts2_style(parts: Any, mel: np.ndarray) -> np.ndarray:
    """speech_style = ref_s = style_encoder(mel) ++ predictor_encoder(mel) of a normalised mel [80, F]."""
    import torch

    x = torch.from_numpy(np.ascontiguousarray(mel, np.float32))[None, None]
    x = x.to(getattr(parts, "device", "cpu"))
    with torch.inference_mode():
        acoustic = parts.style_encoder(x)
        prosodic = parts.predictor_encoder(x)
    if acoustic.ndim != 2 or prosodic.ndim != 2 or acoustic.shape[0] != 1 or prosodic.shape[0] != 1:
        raise ValueError(f"style encoders gave {list(acoustic.shape)} and {list(prosodic.shape)}, "
                         "expected [1, style_dim] each")
    return torch.cat([acoustic, prosodic], dim=1)[0].float().cpu().numpy()


def _nltk_word_tokenize() -> Callable[[str], list[str]]:
    try:
        import nltk
    except ImportError as e:
        raise UsageError("the styletts2 backend splits espeak's phonemes with nltk.word_tokenize, as "
                         "StyleTTS2's inference does: pip install nltk (StyleTTS2's requirements.txt has it)"
                         ) from e
    try:
        nltk.word_tokenize("a b.")
    except LookupError as e:
        raise UsageError("nltk.word_tokenize needs nltk's punkt data: python -m nltk.downloader punkt_tab "
                         "punkt") from e
    return nltk.word_tokenize


def read_styletts2_checkpoint(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """{module: state_dict} of a StyleTTS2 checkpoint: a torch file whose ``net`` loads with
    ``weights_only=True``, or a ``.safetensors`` file keyed ``{module}.{parameter}``."""


    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            flat = load_file(str(path))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise UsageError(f"{path}: not a readable safetensors file ({e})") from e
        net: dict[str, dict[str, Any]] = {}
        for key, value in flat.items():
            module, _, name = key.removeprefix("net.").partition(".")
            if not name:
                raise UsageError(f"{path}: key {key!r} is not '{{module}}.{{parameter}}'")
            net.setdefault(module, {})[name] = value
        return net
    obj = safe_torch_load(path, SAFETENSORS_HINT)
    net = obj.get("net", obj) if isinstance(obj, dict) else None
    if not isinstance(net, dict):
        raise UsageError(f"{path}: expected a dict with a 'net' entry of per-module state dicts")
    return {k: dict(v) for k, v in net.items() if isinstance(v, dict)}


class _Params(dict):
    """A dict whose keys read as attributes, like the munch objects ``build_model`` is written against."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _munchify(x: Any) -> Any:
    if isinstance(x, dict):
        return _Params((k, _munchify(v)) for k, v in x.items())
    if isinstance(x, list):
        return [_munchify(v) for v in x]
    return x


def _import_checkout(repo: Path) -> tuple[Any, Any]:
    import importlib

    for name in ("models", "text_utils"):
        mod = sys.modules.get(name)
        where = getattr(mod, "__file__", None) or ""
        if mod is not None and Path(where).resolve().parent != repo:
            raise UsageError(f"a module named {name!r} is already imported from {where or mod!r}; "
                             "load the StyleTTS2 checkout in a fresh process")
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    try:
        return importlib.import_module("models"), importlib.import_module("text_utils")
    except ImportError as e:
        raise UsageError(f"importing StyleTTS2's code from {repo} failed ({e}); install its requirements: "
                         f"pip install -r {repo / 'requirements.txt'}") from e


def _build_plbert(repo: Path, cfg: dict[str, Any]) -> Any:
    import yaml
    from transformers import AlbertConfig, AlbertModel

    plbert_dir = Path(str(cfg.get("PLBERT_dir") or "Utils/PLBERT/"))
    path = (plbert_dir if plbert_dir.is_absolute() else repo / plbert_dir) / "config.yml"
    if not path.is_file():
        raise UsageError(f"PL-BERT config {path} does not exist (config key PLBERT_dir)")
    params = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("model_params")
    if not isinstance(params, dict):
        raise UsageError(f"{path}: no model_params")

    class PLBert(AlbertModel):  # PL-BERT's interface: the last hidden state only
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return super().forward(*args, **kwargs).last_hidden_state

    return PLBert(AlbertConfig(**params))


def _load_state(name: str, module: Any, state: dict[str, Any]) -> None:
    if state and all(k.startswith("module.") for k in state):  # saved from a DataParallel wrapper
        state = {k[len("module."):]: v for k, v in state.items()}
    try:
        result = module.load_state_dict(state, strict=False)
    except RuntimeError as e:
        why = " ".join(line.strip() for line in str(e).strip().splitlines()[:3])
        raise UsageError(f"checkpoint module {name!r} does not fit the model built from the config ({why}); "
                         "does --config match --ckpt?") from e
    benign = ("position_ids",)  # a buffer some transformers versions save and others do not
    missing = [k for k in result.missing_keys if not k.endswith(benign)]
    unexpected = [k for k in result.unexpected_keys if not k.endswith(benign)]
    if missing or unexpected:
        raise UsageError(f"checkpoint module {name!r}: {len(missing)} missing {missing[:4]}, "
                         f"{len(unexpected)} unexpected {unexpected[:4]}; does --config match --ckpt?")


def _git_commit(repo: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def load_styletts2(
    repo: str | os.PathLike,
    ckpt: str | os.PathLike,
    config: str | os.PathLike | None = None,
    *,
    device: str | None = None,
    word_tokenize: Callable[[str], list[str]] | None = None,
) -> StyleTTS2Parts:
    """The five StyleTTS2 modules of `ckpt`, built by the checkout's ``models.build_model``.

    `config` defaults to ``config.yml`` beside the checkpoint (the layout of the published models); its
    ``model_params`` build the model and ``PLBERT_dir`` (relative to the checkout) names PL-BERT's config.
    `word_tokenize` defaults to ``nltk.word_tokenize``. Every problem is a one-line `UsageError`.
    """
    import torch
    import yaml

    from empatheia_jax.assets import sha256_file

    repo = Path(repo).expanduser().resolve()
    if not (repo / "models.py").is_file() or not (repo / "text_utils.py").is_file():
        raise UsageError(f"--repo {repo} is not a StyleTTS2 checkout (it needs models.py and text_utils.py)")
    ckpt = Path(ckpt).expanduser().resolve()
    if not ckpt.is_file():
        raise UsageError(f"--ckpt {ckpt} does not exist")
    cfg_path = Path(config).expanduser().resolve() if config else ckpt.parent / "config.yml"
    if not cfg_path.is_file():
        raise UsageError(f"--config {cfg_path} does not exist" if config else
                         f"no --config given and no config.yml beside the checkpoint ({cfg_path})")
    try:
        cfg = yaml.safe_load(cfg_path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise UsageError(f"{cfg_path}: not valid YAML ({str(e).splitlines()[0]})") from e
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model_params"), dict):
        raise UsageError(f"{cfg_path}: no model_params (is it a StyleTTS2 config?)")
    word_tokenize = word_tokenize or _nltk_word_tokenize()
    net = read_styletts2_checkpoint(ckpt)
    absent = [m for m in STYLETTS2_MODULES if m not in net]
    if absent:
        raise UsageError(f"{ckpt}: no weights for {absent} (it has {sorted(net)})")
    models, text_utils = _import_checkout(repo)
    bert = _build_plbert(repo, cfg)
    try:
        model = models.build_model(_munchify(cfg["model_params"]), None, None, bert)
    except (AttributeError, KeyError, TypeError, AssertionError) as e:
        raise UsageError(f"StyleTTS2's build_model rejected {cfg_path} ({type(e).__name__}: {e})") from e
    for name in STYLETTS2_MODULES:
        _load_state(name, model[name], net[name])
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    modules = {name: model[name].to(device).eval() for name in STYLETTS2_MODULES}
    with contextlib.redirect_stdout(io.StringIO()):  # TextCleaner prints its table size
        cleaner = text_utils.TextCleaner()
    meta = {"generator": "StyleTTS2", "checkpoint": str(ckpt), "checkpoint_sha256": sha256_file(ckpt),
            "config": str(cfg_path), "repo": str(repo), "repo_commit": _git_commit(repo), "device": device}
    return StyleTTS2Parts(**modules, text_cleaner=cleaner, word_tokenize=word_tokenize, device=device,
                          meta=meta)


def _styletts2_meta(parts: Any) -> dict[str, dict[str, Any]]:
    common = {"generator": "StyleTTS2", **(getattr(parts, "meta", None) or {})}
    return {
        "speech_content": {**common, "layout": STYLETTS2_LAYOUT, "phonemizer": STYLETTS2_PHONEMIZER},
        "speech_style": {**common, "mel": MEL,
                         "method": "ref_s = style_encoder(mel) ++ predictor_encoder(mel) of the utterance's "
                         "gold speech RAW/media/{uid}.wav (trimmed, 24 kHz)"},
    }


def _prefetch(ex: ThreadPoolExecutor, fn: Callable[[Any], Any], items: Iterable[Any],
              depth: int) -> Iterator[Any]:
    """``map(fn, items)`` in order, at most `depth` items ahead on the executor's threads."""
    pending: collections.deque[Future] = collections.deque()
    for item in items:
        pending.append(ex.submit(fn, item))
        if len(pending) >= depth:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _styletts2_results(parts: Any, jobs: list[SpeechJob], workers: int,
                       stack: contextlib.ExitStack) -> Iterator[Result]:
    def prepare(job: SpeechJob) -> tuple[SpeechJob, str | None, np.ndarray | None, str | None]:
        try:
            phonemes = styletts2_phonemes(job.text, parts.word_tokenize)
            return job, phonemes, styletts2_mel(load_reference_audio(job.wav)), None
        except Exception as e:  # noqa: BLE001 - collected and reported with the utterance id
            return job, None, None, f"{job.uid}: {type(e).__name__}: {e}"

    ex = stack.enter_context(ThreadPoolExecutor(max(1, workers)))
    for job, phonemes, mel, err in _prefetch(ex, prepare, jobs, 4 * max(1, workers)):
        if err is None:
            try:
                arrays = {"speech_content": styletts2_content(parts, phonemes),
                          "speech_style": styletts2_style(parts, mel)}
            except Exception as e:  # noqa: BLE001 - collected and reported with the utterance id
                frames = mel.shape[-1] if mel is not None else "?"
                err = f"{job.uid}: {type(e).__name__}: {e} (mel of {frames} frames)"
        yield (job.uid, None, err) if err else (job.uid, arrays, None)


# ---------------------------------------------------------------------------------------------------------
# Export


def export_speech_targets(
    raw: str | os.PathLike,
    out: str | os.PathLike,
    *,
    backend: str = "kokoro",
    splits: list[str] | None = None,
    dialogues: Iterable[Any] | None = None,
    repo: str | os.PathLike | None = None,
    ckpt: str | os.PathLike | None = None,
    config: str | os.PathLike | None = None,
    workers: int = 1,
    shard_size: int = 512,
    progress: bool = True,
    device: str | None = None,
    styletts2_parts: Any = None,
    responses_only: bool = False,
) -> dict[str, int]:
    """Write speech_content and speech_style for every distinct utterance of RAW into `out`.

    `dialogues` (schema.Dialogue objects) replaces reading RAW's split files; media still come from RAW.
    `responses_only`: only the turns' responses (`speech_jobs`); kokoro reads no media, so a text corpus
    without any (imported ED) gets its reply targets.
    kokoro: `workers` > 1 runs a spawn pool, one single-threaded Kokoro per process. styletts2: the model
    runs in this process (on `device`, default cuda when there is one), `workers` threads read audio and
    phonemize ahead of it; `styletts2_parts` (a `StyleTTS2Parts`-like object) replaces loading `repo`/`ckpt`.
    Utterance failures are collected and raised together as `TargetExportError`, nothing committed; bad
    arguments or files raise `UsageError`. Returns {kind: count}.
    """
    from tqdm import tqdm

    from empatheia_jax.data.targets import TargetWriter

    if backend not in BACKENDS:
        raise UsageError(f"unknown --backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if workers < 1 or shard_size < 1:
        raise UsageError(f"--workers and --shard-size must be >= 1, got {workers} and {shard_size}")
    if backend == "styletts2" and styletts2_parts is None:
        if not repo:
            raise UsageError("--backend styletts2 needs --repo CHECKOUT (a clone of yl4579/StyleTTS2)")
        if not ckpt:
            raise UsageError("--backend styletts2 needs --ckpt FILE (a StyleTTS2 checkpoint)")
    jobs = speech_jobs(raw, splits, dialogues, responses_only)
    if not jobs:
        raise UsageError(f"{raw}: no utterances to export")
    if backend == "styletts2":
        parts = styletts2_parts or load_styletts2(repo, ckpt, config, device=device)
        meta, source = _styletts2_meta(parts), "styletts2"
    else:
        meta, source = _kokoro_meta(), "kokoro"
    if progress:
        print(f"[speech targets] {backend}: {', '.join(KINDS)} for {len(jobs)} utterances of {raw} -> {out}",
              file=sys.stderr)
    extra = {"raw": str(Path(raw).resolve())}
    errors: list[str] = []
    with contextlib.ExitStack() as stack:
        writers: dict[str, TargetWriter] = {}
        if backend == "styletts2":
            results = _styletts2_results(parts, jobs, workers, stack)
        else:
            results = _kokoro_results(jobs, workers, stack)
        for uid, arrays, err in tqdm(results, total=len(jobs), desc=f"speech targets ({backend})",
                                     disable=not progress):
            if err:
                errors.append(err)
                continue
            for kind in KINDS:
                a = arrays[kind]
                if kind not in writers:  # dims come from the model (e.g. a StyleTTS2 with another hidden_dim)
                    writers[kind] = stack.enter_context(
                        TargetWriter(out, kind, source, a.shape[-1], shard_size, {**extra, **meta[kind]}))
                writers[kind].add(uid, a)
        if errors:
            raise TargetExportError(f"{len(errors)} of {len(jobs)} utterance(s) failed; no targets written:\n"
                                    + "\n".join(errors))
    return {k: len(w) for k, w in writers.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m converters.styletts2_targets",
                                 description="Write the speech_content and speech_style targets of RAW.")
    ap.add_argument("--raw", required=True, help="RAW folder with {split}.json and media/")
    ap.add_argument("--out", required=True, help="TARGETS folder to write (other kinds there are kept)")
    ap.add_argument("--splits", default=None, help="comma-separated splits (default: every RAW split)")
    ap.add_argument("--backend", default="kokoro", help="kokoro (embedded, default) or styletts2")
    ap.add_argument("--repo", default=None, help="styletts2: a checkout of yl4579/StyleTTS2")
    ap.add_argument("--ckpt", default=None,
                    help="styletts2: checkpoint (.pth that loads weights-only, or .safetensors)")
    ap.add_argument("--config", default=None,
                    help="styletts2: config yml (default: config.yml beside --ckpt)")
    ap.add_argument("--device", default=None, help="styletts2: torch device (default: cuda if available)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--shard-size", type=int, default=512)
    ap.add_argument("--quiet", action="store_true", help="no progress output")
    ap.add_argument("--responses-only", action="store_true",
                    help="only the turns' responses (what records read); kokoro needs no media then")
    args = ap.parse_args(argv)
    from empatheia_jax.data.schema import SchemaError
    from empatheia_jax.generators.kokoro import KokoroAssetError

    t0 = time.perf_counter()
    try:
        counts = export_speech_targets(
            args.raw, args.out, backend=args.backend,
            splits=[s for s in args.splits.split(",") if s] if args.splits else None,
            repo=args.repo, ckpt=args.ckpt, config=args.config, device=args.device, workers=args.workers,
            shard_size=args.shard_size, progress=not args.quiet, responses_only=args.responses_only,
        )
    except (UsageError, KokoroAssetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SchemaError as e:
        print(f"error: {args.raw} does not follow the AvaMERG schema: {e}", file=sys.stderr)
        return 2
    except TargetExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not args.quiet:
        dt = time.perf_counter() - t0
        print(f"[speech targets] wrote {counts} ({args.backend}) in {dt:.1f}s to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
