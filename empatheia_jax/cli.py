"""`empatheia train | eval | chat`: the one console entry point.

    empatheia train --config configs/smollm2_demo.py --config.stage=coe --workdir work/run/coe
    empatheia train --config configs/smollm2_demo.py --config.stage=ccl --config.init_from=work/run/coe ...
    empatheia eval  --ckpt work/run/overall --split test [--untrained] [--json metrics.json]
    empatheia chat  --ckpt work/run/overall --text "..." [--audio a.wav] [--video v.mp4] [--history h.json]
                    [--out reply]      # writes reply.npz (features, emotion, profile) and reply.json

Flags are absl flags; `--config` is an ml-collections config file (`path.py[:arg]`) whose every field can be
overridden (`--config.optim.lr=1e-4`; unknown fields are refused). Exit status: 0 done (also after a
preemption checkpoint), 1 a failed run (non-finite loss under the stop policy), 2 bad usage or config.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

COMMANDS = ("train", "eval", "chat")
FLAGS = flags.FLAGS

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "train: ml-collections config file", lock_config=True
)
flags.DEFINE_string("workdir", None, "train: run folder (checkpoints, TensorBoard, metrics.jsonl)")
flags.DEFINE_string("ckpt", None, "eval/chat: a training workdir, its checkpoints folder or one step folder")
flags.DEFINE_integer("step", None, "eval/chat: checkpoint step (default: the latest)")
flags.DEFINE_string("split", "test", "eval: the split of the run's shards to evaluate")
flags.DEFINE_string("shards", None, "eval: shards folder (default: the run's data.shards)")
flags.DEFINE_bool("untrained", False, "eval: also evaluate the untrained model (same config, fresh heads)")
flags.DEFINE_bool("generate", True, "eval: generate the CoE text (emotion accuracy from text, Dist-n)")
flags.DEFINE_integer("batch_size", 8, "eval: batch size")
flags.DEFINE_integer("generate_batch_size", 0, "eval: batch size of the generation (0 = --batch_size)",
                     lower_bound=0)
flags.DEFINE_integer("max_new_tokens", 160, "eval/chat: generation budget")
flags.DEFINE_string("json", None, "eval: also write the metrics table as JSON here")
flags.DEFINE_string("text", None, "chat: the speaker's latest utterance")
flags.DEFINE_string("audio", None, "chat: its speech (.wav)")
flags.DEFINE_string("video", None, "chat: its talking-face video (.mp4)")
flags.DEFINE_string(
    "history", None, "chat: earlier utterances, a JSON list of {role, utterance, audio?, video?}"
)
flags.DEFINE_string("out", None, "chat: output path stem (default: ./chat_reply)")


def _train() -> int:
    from empatheia_jax import trainer

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
    from empatheia_jax import evaluate, trainer

    if not FLAGS.ckpt:
        raise app.UsageError("eval needs --ckpt")
    model, tokenizer, config, _ = trainer.load_trained(FLAGS.ckpt, step=FLAGS.step)
    shards = FLAGS.shards or config.data.shards
    kwargs = dict(
        batch_size=FLAGS.batch_size,
        max_len=int(config.data.max_len),
        max_new_tokens=FLAGS.max_new_tokens,
        generate_text=FLAGS.generate,
        generate_batch_size=FLAGS.generate_batch_size or None,
        pipeline_overrides={"max_aud": int(config.data.max_aud), "max_vid": int(config.data.max_vid)},
    )
    columns = {"trained": evaluate.evaluate(model, tokenizer, shards, FLAGS.split, **kwargs)}
    if FLAGS.untrained:
        fresh, tok, _, _ = trainer.load_trained(FLAGS.ckpt, step=FLAGS.step, restore=False)
        columns["untrained"] = evaluate.evaluate(fresh, tok, shards, FLAGS.split, **kwargs)
    columns["baseline"] = evaluate.baselines(
        shards,
        FLAGS.split,
        train_split=config.data.train_split,
        max_speech_len=model.config.max_speech_len,
        max_video_len=model.config.max_video_len,
    )
    columns["chance"] = evaluate.chance_levels(model.config)
    print(evaluate.format_table(columns))
    if FLAGS.json:
        Path(FLAGS.json).write_text(json.dumps(columns, indent=1))
    return 0


def _chat() -> int:
    from empatheia_jax import chat, trainer

    if not FLAGS.ckpt or FLAGS.text is None:
        raise app.UsageError("chat needs --ckpt and --text")
    model, tokenizer, config, meta = trainer.load_trained(FLAGS.ckpt, step=FLAGS.step)
    history = chat.load_history(FLAGS.history) if FLAGS.history else None
    result = chat.respond(
        model,
        tokenizer,
        text=FLAGS.text,
        audio=FLAGS.audio,
        video=FLAGS.video,
        history=history,
        encoder=chat.encoder_from_manifest(meta.get("encoder") or {"name": "lite", "config": {}}),
        max_new_tokens=FLAGS.max_new_tokens,
        # The prompt gets the training budget; the reply (and its signal tokens) come on top of it.
        max_len=int(config.data.max_len) + FLAGS.max_new_tokens + 2 * model.config.n_signal + 2,
    )
    print(chat.format_result(result))
    npz, js = chat.write_outputs(result, FLAGS.out or "chat_reply")
    print(f"features -> {npz}\ntext -> {js}")
    return 0


def _run(command: str, argv: list[str]) -> None:
    from empatheia_jax.checkpoint import CheckpointError
    from empatheia_jax.checkpoint_io import CheckpointError as ConvertedCheckpointError
    from empatheia_jax.config import ConfigError
    from empatheia_jax.trainer import NonFiniteLossError

    del argv
    logging.getLogger("empatheia_jax").setLevel(logging.INFO)
    try:
        code = {"train": _train, "eval": _eval, "chat": _chat}[command]()
    except (ConfigError, CheckpointError, ConvertedCheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except NonFiniteLossError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 1
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] not in COMMANDS:
        print(
            f"usage: empatheia {{{','.join(COMMANDS)}}} [flags]   (empatheia COMMAND --helpfull for flags)",
            file=sys.stderr,
        )
        sys.exit(2)
    command = argv.pop(1)
    app.run(lambda a: _run(command, a), argv=argv)


if __name__ == "__main__":
    main()
