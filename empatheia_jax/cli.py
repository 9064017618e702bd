"""`empatheia train | eval | chat | serve | export`: the one console entry point.

    empatheia train --config configs/smollm2_demo.py --config.stage=coe --workdir work/run/coe
    empatheia train --config configs/smollm2_demo.py --config.stage=ccl --config.init_from=work/run/coe ...
    empatheia eval  --ckpt work/run/overall --split test [--untrained] [--json metrics.json]
    empatheia eval  --ckpt work/run/coe --data data/ed/empathetic_dialogues_validation.csv [--template coe]
                    # an ED-format csv: imported, prepared text-only (cached), evaluated
    empatheia eval  --ckpt work/run/overall --asr  # history texts = Whisper's transcripts of the speech
    empatheia chat  --ckpt work/run/overall --text "..." [--audio a.wav] [--video v.mp4] [--history h.json]
                    [--out reply]      # writes reply.npz (features, emotion, profile) and reply.json
                    # without --text, the utterance is Whisper tiny.en's transcript of --audio
    empatheia serve --ckpt work/run/overall [--host 127.0.0.1] [--port 7860]
                    # the web page and POST /api/turn on one loaded model (docs/design.md "Serving")
    empatheia export --ckpt work/run/overall --out work/export [--merged] [--dtype bfloat16] [--max_len N]
                     [--overwrite]
                    # PEFT adapter (default) or merged HF, + heads.safetensors; load_trained(DIR) reads it

Flags are absl flags; `--config` is an ml-collections config file (`path.py[:arg]`) whose every field can be
overridden (`--config.optim.lr=1e-4`; unknown fields are refused). Library logging (absl, orbax, jax, grain,
transformers) stays at WARNING unless `--verbose` (`empatheia_jax.logs.configure`); progress bars and results
always show.

Exit status: 0 done (also after a preemption checkpoint); 1 a failed run (non-finite loss under the stop
policy); 2 bad usage or input: an unknown flag or bad flag value, a bad config, a missing or incomplete
checkpoint, a missing or corrupt shards folder, a media or history file that cannot be read, a prompt too
long. Those print ONE line `error: ...` naming the flag, key or file, and no traceback; anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from absl import app, flags
from ml_collections import config_flags

from empatheia_jax import compile_cache, host_memory
from empatheia_jax.eval import run as eval_run
from empatheia_jax.serve.decoding import Decoding, ReplySampling

FLAGS = flags.FLAGS

# ----------------------------------------------------------------------------------------------------------
# Flags, one function per concern; each help starts with the commands that read the flag
# ----------------------------------------------------------------------------------------------------------


def _define_train_flags() -> Any:
    """train's --config (returned: its holder reads the loaded config) and --workdir."""
    config = config_flags.DEFINE_config_file("config", None, "train: ml-collections config file",
                                             lock_config=True)
    flags.DEFINE_string("workdir", None, "train: run folder (checkpoints, TensorBoard, metrics.jsonl)")
    return config


def _define_checkpoint_flags() -> None:
    """Which trained model eval/chat/serve/export read."""
    flags.DEFINE_string("ckpt", None, "eval/chat/serve/export: a training workdir, its checkpoints folder, "
                        "one step folder or an export folder")
    flags.DEFINE_string("backbone", None, "eval/chat/serve: the converted backbone folder, when the one the "
                        "run or export recorded has moved (e.g. the packaged reference model on another "
                        "machine)")
    flags.DEFINE_integer("step", None, "eval/chat/serve/export: checkpoint step (default: the latest)")


def _define_eval_data_flags() -> None:
    """What eval scores the model on: shards, a csv, the ASR shards, the template, how many records."""
    flags.DEFINE_string("split", "test", "eval: the split of the run's shards to evaluate")
    flags.DEFINE_string("shards", None, "eval: shards folder (default: the run's data.shards)")
    flags.DEFINE_string("data", None, "eval: what to evaluate on: a shards folder (as --shards) or an "
                        "EmpatheticDialogues-format csv, imported and prepared text-only (cached in "
                        "--data_cache); a csv's split is named from its file (validation -> valid) or "
                        "--split")
    flags.DEFINE_string("data_cache", None, "eval: folder for the shards prepared from a --data csv or for "
                        "--asr, reused by a later run on the same input (default: $XDG_CACHE_HOME or "
                        "~/.cache, then empatheia_jax/eval_data)")
    flags.DEFINE_bool("asr", False, "eval: evaluate as if the speaker's words were known only from their "
                      "speech: the split is prepared again (cached in --data_cache) with every history "
                      "utterance's text replaced by Whisper tiny.en's transcript of its .wav (rows "
                      "input_wer, asr_utterances); needs shards prepared from AvaMERG media, not a csv")
    flags.DEFINE_string("raw", None, "eval --asr: the AvaMERG folder the shards were prepared from, when it "
                        "is no longer where their manifest says (default: the manifest's `raw`)")
    flags.DEFINE_enum("template", None, list(eval_run.TEMPLATE_NAMES), "eval: the stage whose prompt and "
                      "loss formula score the model (default: the stage the checkpoint was trained for; "
                      "overall for older checkpoints)")
    flags.DEFINE_integer("max_examples", 0, "eval: score the first N records of the split only (0 = all; a "
                         "quick look at a large file before the whole run)", lower_bound=0)


def _define_eval_scoring_flags() -> None:
    """What eval computes: the columns, batch sizes, extra emotion rows, the speech and video rows."""
    flags.DEFINE_bool("untrained", False, "eval: also evaluate the untrained model (same config, fresh "
                      "heads)")
    flags.DEFINE_bool("generate", True, "eval: generate the CoE text (emotion accuracy from text, Dist-n)")
    flags.DEFINE_integer("batch_size", 8, "eval: batch size", lower_bound=1)
    flags.DEFINE_integer("generate_batch_size", 0, "eval: batch size of the generation (0 = --batch_size)",
                         lower_bound=0)
    flags.DEFINE_bool("score_emotions", False, "eval: also choose CoE step 2 among the 32 ED labels by "
                      "likelihood after the model's own step 1 (rows emotion*_acc_scored; CoE templates)")
    flags.DEFINE_string("emotion_head", None, "eval: an emotion head file (python -m "
                        "empatheia_jax.eval.fit_emotion_head): rows emotion*_acc_head, and with "
                        "--score_emotions emotion*_acc_combined (default: the --ckpt folder's "
                        "emotion_head.safetensors when it has one)")
    flags.DEFINE_list("vote_templates", [], "eval: emotion voting (E3RG): these templates also predict each "
                      "record's emotion with the same model; the majority decides (rows emotion*_acc_vote)")
    flags.DEFINE_multi_string("vote_ckpt", [], "eval: emotion voting: these checkpoints also predict each "
                              "record's emotion, each on the template of the stage it was trained for")
    flags.DEFINE_integer("speech_examples", 16, "eval: test replies spoken by Kokoro for the speech rows "
                         "(MCD, speaker similarity, F0, duration); 0 = no speech rows", lower_bound=0)
    flags.DEFINE_integer("video_examples", 6, "eval: test replies drawn by the face generator for the video "
                         "rows (SSIM, PSNR, CPBD, landmark distances, lip sync); 0 = no video rows",
                         lower_bound=0)
    flags.DEFINE_string("gold_speech", None, "eval: folder of gold speech wavs (default: RAW/gold_speech of "
                        "the shards' manifest)")


def _define_eval_output_flags() -> None:
    """Where eval writes its table, report and generation journal."""
    flags.DEFINE_string("json", None, "eval: also write the metrics table as JSON here")
    flags.DEFINE_string("report", None, "eval: a report folder: report.md (table, per-class tables and "
                        "plots), metrics.json, per_class.json, per_class_*.png, predictions_*.jsonl")
    flags.DEFINE_string("journal", None, "eval: keep each finished generation batch in this file, so a "
                        "killed eval, run again with the same model, data and flags, generates only the "
                        "batches it lacks (default with --report: REPORT/generation.journal.jsonl); removed "
                        "once the eval is written")


def _define_generation_flags() -> None:
    """How eval/chat/serve decode: the budget, HF's repetition controls, the drawn replies."""
    flags.DEFINE_integer("max_new_tokens", 160, "eval/chat/serve: generation budget", lower_bound=1)
    flags.DEFINE_float("repetition_penalty", 1.0, "eval/chat/serve: HF's repetition penalty (1.0 = off)",
                       lower_bound=1e-6)
    flags.DEFINE_integer("no_repeat_ngram_size", 0, "eval/chat/serve: HF's no_repeat_ngram_size (0 = off)",
                         lower_bound=0)
    flags.DEFINE_float("reply_temperature", 0.0, "eval/chat/serve: draw each reply with this temperature "
                       "after the greedy Chain of Empathy (its steps and the emotion rows stay greedy; 0 = "
                       "greedy replies)", lower_bound=0.0)
    flags.DEFINE_float("reply_top_p", 0.95, "eval/chat/serve: the nucleus of the drawn replies "
                       "(--reply_temperature)", lower_bound=1e-6, upper_bound=1.0)
    flags.DEFINE_integer("reply_candidates", 1, "eval/chat/serve: draw this many replies per turn and keep "
                         "their consensus (the one that agrees most with the others: ROUGE-L and BLEU-2; "
                         "--reply_temperature)", lower_bound=1)
    flags.DEFINE_integer("seed", 0, "eval/chat/serve: the seed of the drawn replies (--reply_temperature)")


def _define_chat_flags() -> None:
    """chat's inputs, what it renders and where it writes (--out is also export's folder)."""
    flags.DEFINE_string("text", None, "chat: the speaker's latest utterance (without it, the transcript of "
                        "--audio by Whisper tiny.en)")
    flags.DEFINE_string("audio", None, "chat: its speech (.wav)")
    flags.DEFINE_string("video", None, "chat: its talking-face video (.mp4)")
    flags.DEFINE_string("history", None, "chat: earlier utterances, a JSON list of {role, utterance, audio?, "
                        "video?}")
    flags.DEFINE_bool("speak", False, "chat: also speak the reply with Kokoro-82M from the predicted C^s/S^s "
                      "(OUT.wav; the checkpoint must be trained on Kokoro speech targets)")
    flags.DEFINE_bool("avatar", False, "chat: also render the talking avatar from the predicted C^v/S^v with "
                      "the spoken reply (OUT.mp4; implies --speak; needs face_render video targets)")
    flags.DEFINE_string("listener", None, "chat: pin the listener avatar, age,gender,timbre (e.g. "
                        "young,female,mid): the voice and face are that avatar's, the predicted emotion sets "
                        "expression and prosody (default: the SD's predicted style); with --speak / --avatar")
    flags.DEFINE_string("out", None, "chat: output path stem (default: ./chat_reply); export: the folder")


def _define_export_flags() -> None:
    """export's format and prompt budget."""
    flags.DEFINE_bool("merged", False, "export: LoRA merged into a full HF checkpoint (default: a PEFT "
                      "adapter)")
    flags.DEFINE_bool("peft", False, "export: a PEFT adapter on the converted backbone (the default)")
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "export: the stored dtype of "
                      "the weights (bfloat16 halves the files; loading casts back to the model's dtype)")
    flags.DEFINE_bool("overwrite", False, "export: replace an existing --out folder")
    flags.DEFINE_integer("max_len", None, "export: the prompt budget in tokens the export serves at (its "
                         "config.data.max_len; default the run's)", lower_bound=16)


def _define_serve_flags() -> None:
    """serve's address and its limits on uploads, queueing and start-up compiles."""
    flags.DEFINE_string("host", "127.0.0.1", "serve: the address to listen on (the default answers this "
                        "machine only; 0.0.0.0 exposes the model, unauthenticated, to the network)")
    flags.DEFINE_integer("port", 7860, "serve: the TCP port", lower_bound=0, upper_bound=65535)
    flags.DEFINE_float("max_upload_mb", 20.0, "serve: the largest audio or video upload, MB",
                       lower_bound=0.01)
    flags.DEFINE_float("max_media_seconds", 30.0, "serve: the longest audio or video upload, seconds",
                       lower_bound=0.1)
    flags.DEFINE_bool("warmup", True, "serve: compile the programs of every prompt length before serving, so "
                      "no turn waits for a compile (start-up takes longer; --nowarmup skips it)")
    flags.DEFINE_integer("queue", 4, "serve: turns that may wait behind the running one (more get HTTP 503)",
                         lower_bound=0)


def _define_logging_flags() -> None:
    """How much the library logs."""
    flags.DEFINE_bool("verbose", False, "library logging (absl, orbax, jax, grain, transformers) at INFO")


_CONFIG = _define_train_flags()
_define_checkpoint_flags()
_define_eval_data_flags()
_define_eval_scoring_flags()
_define_eval_output_flags()
_define_generation_flags()
_define_chat_flags()
_define_export_flags()
_define_serve_flags()
_define_logging_flags()

# ----------------------------------------------------------------------------------------------------------
# Commands
# ----------------------------------------------------------------------------------------------------------


def _load_trained() -> tuple[Any, Any, Any, dict[str, Any]]:
    """--ckpt (--step, --backbone) loaded, its checkpoint errors naming --ckpt (`eval.run.load_ckpt`)."""
    return eval_run.load_ckpt(FLAGS.ckpt, step=FLAGS.step, backbone=FLAGS.backbone)


def _train() -> int:
    from empatheia_jax.train import trainer

    if _CONFIG.value is None or not FLAGS.workdir:
        raise app.UsageError("train needs --config and --workdir")
    result = trainer.train(_CONFIG.value, FLAGS.workdir)
    print(
        f"{result.status}: step {result.step} in {result.workdir}"
        + (f" ({result.nonfinite_skipped} non-finite steps skipped)" if result.nonfinite_skipped else "")
    )
    for k, v in sorted(result.eval_metrics.items()):
        print(f"  {k} = {v:.4f}")
    return 0


def _eval() -> int:
    if not FLAGS.ckpt:
        raise app.UsageError("eval needs --ckpt")
    eval_run.run_eval(_eval_options())
    return 0


def _eval_options() -> eval_run.EvalOptions:
    """The eval flags as `eval.run.EvalOptions`, whose fields are named as the flags (every field: the
    flags hold the defaults), the decoding flags as one `Decoding`."""
    names = [f.name for f in dataclasses.fields(eval_run.EvalOptions) if f.name in FLAGS]
    return eval_run.EvalOptions(**{name: FLAGS[name].value for name in names},
                                split_given=FLAGS["split"].present, decoding=_decoding_from_flags())


def _decoding_from_flags() -> Decoding:
    """The decoding flags (`_define_generation_flags`) as the `Decoding` eval, chat and serve run: greedy,
    the budget and HF's repetition controls; --reply_temperature > 0 draws the reply again
    (`ReplySampling` of --reply_temperature, --reply_top_p, --seed, --reply_candidates)."""
    sampling = None
    if FLAGS.reply_temperature != 0:
        sampling = ReplySampling(temperature=FLAGS.reply_temperature, top_p=FLAGS.reply_top_p,
                                 seed=FLAGS.seed, candidates=FLAGS.reply_candidates)
    return Decoding(max_new_tokens=FLAGS.max_new_tokens, repetition_penalty=FLAGS.repetition_penalty,
                    no_repeat_ngram_size=FLAGS.no_repeat_ngram_size, reply_sampling=sampling)


def _chat() -> int:
    from empatheia_jax.serve import outputs, turn
    from empatheia_jax.serve.history import load_history

    if not FLAGS.ckpt or (FLAGS.text is None and not FLAGS.audio):
        raise app.UsageError("chat needs --ckpt and --text (or --audio alone: Whisper transcribes it)")
    # The inputs first: a wrong path fails in a second, not after the model is loaded.
    for flag in ("audio", "video"):
        path = FLAGS[flag].value
        if path and not Path(path).is_file():
            raise FileNotFoundError(f"--{flag} {path}: no such file")
    history = load_history(FLAGS.history) if FLAGS.history else None
    listener = _listener_flag()
    decoding = _decoding_from_flags()
    replier = _load_replier()
    render = "avatar" if FLAGS.avatar else "speech" if FLAGS.speak else "text"
    replier.check_can_render(render)  # before generating: a checkpoint that cannot speak fails now
    done = turn.run_turn(replier, text=FLAGS.text or "", audio=FLAGS.audio, video=FLAGS.video,
                         history=history, out=FLAGS.out or "chat_reply", render=render, listener=listener,
                         hear=render != "text", decoding=decoding)
    result = done.result
    print(outputs.format_result(result))
    print(f"features -> {done.npz}\ntext -> {done.json}")
    if done.wav is not None:
        for n in done.speech_notes:
            print(f"note: {n}")
        print(f"speech ({done.speech_seconds:.2f} s, Kokoro-82M, {result.speech_content_units} phoneme rows) "
              f"-> {done.wav}")
        heard = done.heard or {}
        wer = "no word to score" if heard.get("speech_wer") is None else f"WER {heard['speech_wer']:.2f}"
        print(f"heard by Whisper tiny.en: {heard.get('speech_transcript')!r} ({wer}) -> {done.json}")
    if done.mp4 is not None:
        for n in done.video_notes:
            print(f"note: {n}")
        print(f"avatar ({done.frames} frames at 25 fps with the speech, procedural face generator) "
              f"-> {done.mp4}")
    return 0


def _load_replier() -> Any:
    """The --ckpt model as a `turn.Replier` (its training shards' encoder, target sources, prompt budget)."""
    from empatheia_jax.serve import turn

    model, tokenizer, config, meta = _load_trained()
    where = f"--ckpt {FLAGS.ckpt} (step {meta.get('step', '?')})"
    return turn.replier_from_loaded(model, tokenizer, config, meta, where)


def _serve() -> int:
    import time

    import uvicorn

    from empatheia_jax.serve import web

    if not FLAGS.ckpt:
        raise app.UsageError("serve needs --ckpt")
    decoding = _decoding_from_flags()
    t0 = time.perf_counter()
    replier = _load_replier()
    load_seconds = time.perf_counter() - t0
    if FLAGS.warmup:
        t0 = time.perf_counter()
        warmed = replier.warm_up(decoding, progress=lambda b: print(
            f"warm-up: compiled the programs of {b}-token prompts", flush=True))
        print(f"warm-up: {len(warmed)} prompt lengths in {time.perf_counter() - t0:.1f} s", flush=True)
    limits = web.Limits(max_upload_bytes=int(FLAGS.max_upload_mb * 2**20),
                        max_media_seconds=FLAGS.max_media_seconds, queue=FLAGS.queue)
    server = web.Server(web.replier_turn(replier, decoding),
                        limits, info={"ckpt": str(FLAGS.ckpt), "load_seconds": load_seconds,
                                      "speech_targets": replier.speech_targets,
                                      "video_targets": replier.video_targets})
    if FLAGS.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: --host {FLAGS.host} exposes the model to the network, without authentication",
              file=sys.stderr)
    print(f"model loaded in {load_seconds:.1f} s; serving on http://{FLAGS.host}:{FLAGS.port}/ "
          "(Ctrl-C stops)", flush=True)
    try:
        uvicorn.run(server.app(), host=FLAGS.host, port=FLAGS.port, log_level="warning")
    finally:
        server.shutdown()
    return 0


def _listener_flag() -> dict[str, str] | None:
    """The --listener profile, checked before the model loads (a user error in a second, not a minute)."""
    if FLAGS.listener is None:
        return None
    from empatheia_jax.serve.avatar import parse_listener
    from empatheia_jax.serve.history import ChatInputError

    if not (FLAGS.speak or FLAGS.avatar):
        raise app.UsageError("--listener sets the voice and the face: add --speak or --avatar")
    try:
        return parse_listener(FLAGS.listener)
    except ValueError as e:
        raise ChatInputError(str(e)) from e


def _export() -> int:
    from empatheia_jax.serve.load import export_trained

    if not FLAGS.ckpt or not FLAGS.out:
        raise app.UsageError("export needs --ckpt and --out")
    if FLAGS.peft and FLAGS.merged:
        raise app.UsageError("export takes --peft or --merged, not both")
    out = export_trained(FLAGS.ckpt, FLAGS.out, step=FLAGS.step, mode="merged" if FLAGS.merged else "peft",
                         overwrite=FLAGS.overwrite, dtype=FLAGS.dtype, max_len=FLAGS.max_len)
    print(f"exported ({'merged HF' if FLAGS.merged else 'PEFT adapter'} + heads, {FLAGS.dtype}) -> {out}")
    return 0


# The sub-commands: name -> function returning the exit status. A new one adds its function here (its flags
# are defined above, in a `_define_*_flags` function, with the command name at the start of their help).
COMMANDS: dict[str, Callable[[], int]] = {"train": _train, "eval": _eval, "chat": _chat, "serve": _serve,
                                          "export": _export}


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input, not a bug: one `error:` line and exit 2. Imported only when an
    exception is being matched (the modules import jax)."""
    from empatheia_jax.data.asr_shards import AsrShardsError
    from empatheia_jax.data.encoders.asr import AsrAssetError
    from empatheia_jax.data.shard_format import ShardRecordError
    from empatheia_jax.data.splits import ShardsError
    from empatheia_jax.eval.emotion_head import EmotionHeadError
    from empatheia_jax.eval.speech import SpeechEvalUnavailable
    from empatheia_jax.generators.base import GeneratorError
    from empatheia_jax.generators.kokoro import KokoroAssetError
    from empatheia_jax.serve.history import ChatInputError
    from empatheia_jax.serve.prompt import EncoderManifestError
    from empatheia_jax.train.checkpoint import CheckpointError
    from empatheia_jax.train.config import ConfigError
    from empatheia_jax.train.stages import TemplateError
    from empatheia_jax.weights.export_hf import ExportError

    return (
        ConfigError, CheckpointError, ShardsError, ShardRecordError, ChatInputError,
        EncoderManifestError, ExportError, GeneratorError, KokoroAssetError, SpeechEvalUnavailable,
        eval_run.DataError, TemplateError, AsrAssetError, AsrShardsError, EmotionHeadError,
        FileNotFoundError, NotADirectoryError, IsADirectoryError,
        PermissionError,
    )


def _failed_run_errors() -> tuple[type[BaseException], ...]:
    """A run that started and failed (not a bug, not bad input): one `error:` line and exit 1."""
    from empatheia_jax.train.trainer import NonFiniteLossError

    return (NonFiniteLossError,)


def one_line(message: str) -> str:
    """A possibly multi-line message (a ConfigError lists one problem per line) as one line."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()] or ["(no message)"]
    head, rest = lines[0], lines[1:]
    if not rest:
        return head
    return head + (" " if head.endswith(":") else "; ") + "; ".join(rest)


def fail(message: str, code: int = 2) -> int:
    """Prints `error: MESSAGE` on one stderr line and returns `code` (the exit status to use)."""
    print(f"error: {one_line(message)}", file=sys.stderr)
    return code


def _run(command: str, argv: list[str]) -> None:
    from empatheia_jax import logs

    logs.configure(verbose=FLAGS.verbose)
    try:
        if len(argv) > 1:
            raise app.UsageError(f"unexpected argument(s) {argv[1:]} (flags are --name=value)")
        code = COMMANDS[command]()
    except (app.UsageError, eval_run.EvalUsageError) as e:
        code = fail(f"{e} (empatheia {command} --helpfull lists the flags)")
    except _user_errors() as e:
        code = fail(str(e))
    except _failed_run_errors() as e:
        code = fail(str(e), code=1)
    sys.exit(code)


def _flag_error(e: Exception, args: list[str]) -> str:
    """One line naming the flag for an error raised while parsing `args`.

    absl's errors name the flag but may embed a traceback (an exception inside the config file's
    get_config); ml-collections reports an unknown `--config.a.b` override as a bare AttributeError("'b'"),
    so the override is found again here, with close matches."""
    if isinstance(e, flags.Error):
        lines = str(e).splitlines()
        if len(lines) > 1 and "Traceback (most recent call last)" in str(e):
            head = lines[0].replace("Traceback (most recent call last):", "").rstrip(": ")
            return f"{head}: {lines[-1].strip()}"
        return str(e)
    spec = next((a.split("=", 1)[1] for a in args if a.startswith("--config=")), None)
    if spec is None and "--config" in args[:-1]:
        spec = args[args.index("--config") + 1]
    try:  # the failure came before the flag stored its value: load the file again to walk its fields
        config = FLAGS["config"].parser.parse(spec) if spec else None
    except Exception:  # noqa: BLE001 - the config does not load either: no override can be checked
        config = None
    for arg in args:
        if config is None or not arg.startswith("--config."):
            continue
        path = arg[len("--config."):].split("=", 1)[0]
        node, seen = config, "config"
        for key in path.split("."):
            keys = list(node.keys()) if hasattr(node, "keys") else []
            if key not in keys:
                close = difflib.get_close_matches(key, [str(k) for k in keys], n=3)
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                return f"{arg}: {seen} has no field {key!r}{hint}"
            node, seen = node[key], f"{seen}.{key}"
    raise e


def _config_package_importable(argv: list[str]) -> None:
    """Config files import their siblings as a package (`from configs import base`), and `configs/` is not
    installed with the library (docs/design.md "Packaging"): put the folder holding a config file's package
    on sys.path, as running from the repository root does."""
    for i, arg in enumerate(argv):
        path = arg.split("=", 1)[1] if arg.startswith("--config=") else (
            argv[i + 1] if arg == "--config" and i + 1 < len(argv) else None)
        if path:
            folder = Path(path.split(":", 1)[0]).resolve().parent
            if (folder / "__init__.py").is_file() and str(folder.parent) not in sys.path:
                sys.path.insert(0, str(folder.parent))


def main(argv: list[str] | None = None) -> None:
    if argv is None:  # the process is the command's own (not a caller's, e.g. a notebook's or a test's)
        # before jax's backend starts its threads: XLA:CPU's per-step buffers reused, not faulted in again
        host_memory.keep_freed_memory()
        compile_cache.use_persistent_cache()  # a caller's process keeps its own jax configuration
    argv = list(sys.argv if argv is None else argv)
    usage = (f"usage: empatheia {{{','.join(COMMANDS)}}} [flags]   "
             "(empatheia COMMAND --helpfull lists the flags)")
    if len(argv) >= 2 and argv[1] in ("-h", "--help", "help"):
        print(usage)
        sys.exit(0)
    if len(argv) < 2 or argv[1] not in COMMANDS:
        got = f"unknown command {argv[1]!r}; " if len(argv) >= 2 and not argv[1].startswith("-") else ""
        print(f"error: {got}{usage}", file=sys.stderr)
        sys.exit(2)
    command = argv.pop(1)
    helpfull = f"(empatheia {command} --helpfull lists the flags)"
    _config_package_importable(argv)

    def parse_flags(args: list[str]) -> list[str]:
        # absl's own parser prints two lines and exits 1; a bad flag is bad usage: one line, exit 2.
        try:
            rest = FLAGS(args)
        except (flags.Error, AttributeError, KeyError) as e:
            sys.exit(fail(f"{_flag_error(e, args)} {helpfull}"))
        if FLAGS["config"].present:
            try:
                _CONFIG.value.keys()  # a config file that failed to load raises only when a field is read
            except OSError as e:
                name = FLAGS["config"].config_filename.split(":", 1)[0]
                why = "no such file" if not Path(name).is_file() else one_line(str(e))
                sys.exit(fail(f"--config {name}: {why}"))
        return rest

    app.run(lambda a: _run(command, a), argv=argv, flags_parser=parse_flags)


if __name__ == "__main__":
    main()
