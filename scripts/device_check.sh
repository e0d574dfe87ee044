#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one run of about 10 minutes: install this package, run the CUDA tests (cached
# == recomputed, batched == alone, bfloat16 decoding, the static cache under CUDA graphs, a bitsandbytes QLoRA step),
# then price a forward of the shipped model by width and dtype and run its quality-speed benchmark in bfloat16 (eager
# and compiled AR, eager ReFusion and ReFusion compiled with CUDA graphs over its static cache). Everything
# lands in one folder: $OUT when set (the device tool's), else device-results/.
#
#   bash scripts/device_check.sh                 # a GPU machine with PyPI: keeps the machine's CUDA torch
#   WHEELS=.whl ARCHITECTURE=.standin bash scripts/device_check.sh
#
# The second form is for a machine that reaches no package index: WHEELS is a folder of wheels of the packages its
# Python lacks (installed with --no-deps into a folder put on PYTHONPATH; this package runs from the checkout), and
# ARCHITECTURE a folder written by `recipe.model.save_architecture` (the shipped model's config and tokenizer, a few
# MB) when the shipped model's 98 MB GGUF cannot be fetched there: the speed check then times a model of that
# architecture with random weights (`benchmarks.compiled_rounds --random_base`), whose forwards cost what the shipped
# model's cost but whose drafts are not the shipped model's.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-device-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python="${PYTHON:-python3}"

nvidia-smi > "$out/nvidia-smi.txt"
if [ -n "${WHEELS:-}" ]; then
    site="$(mktemp -d)"
    "$python" -m pip install --quiet --no-index --no-deps --no-compile --target "$site" "$WHEELS"/*.whl
    export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    # transformers (5.25) fetches kernels from the Hub in from_pretrained on CUDA unless told not to
    export USE_HUB_KERNELS=0 HF_HUB_OFFLINE=1
else
    "$python" -m pip install --quiet -e ".[test]"
fi
"$python" - <<'PY' | tee "$out/machine.txt"
import torch
assert torch.cuda.is_available(), "no CUDA device: this script checks the GPU path"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}, "
      f"bf16 {torch.cuda.is_bf16_supported()}")
PY

status=0
timeout 150 "$python" -m pytest -q -rs tests/test_cuda.py tests/test_dtype_policy.py tests/test_host_reads.py 2>&1 | tee "$out/cuda_tests.txt" \
    || status=1
if [ -n "${ARCHITECTURE:-}" ]; then
    # compiling ReFusion's seven width buckets took 217 s cold on an H200 (transformers' AR 34 s, the static AR 42 s)
    REFUSION_PRICE_CACHE="$out/prices.json" timeout 400 "$python" -m benchmarks.compiled_rounds --device cuda \
        --random_base "$ARCHITECTURE" --prompts 8 --rounds 1 --no_eager --refusion compiled \
        --draft_schedules fixed price --lookup_drafts 4 --token_thresholds 0.5 2>&1 | tee "$out/compiled_rounds.log" \
        || status=1
    exit "$status"
fi
timeout 120 "$python" -m benchmarks.forward_cost --device cuda --dtypes bfloat16 float32 \
    --widths 1 2 4 8 16 32 64 128 --output_dir "$out" 2>&1 | tee "$out/forward_cost.log" || status=1
timeout 300 "$python" -m benchmarks.quality_speed --device cuda --dtype bfloat16 --prompts 16 \
    --settings "shipped default" "fused redraft" --ar_compiled bfloat16 --refusion_compiled --output_dir "$out" 2>&1 | tee "$out/quality_speed.log" || status=1
timeout 300 "$python" -m benchmarks.price_schedule --device cuda --prompts 16 --rounds 2 --skip_modelled 2>&1 \
    | tee "$out/price_schedule.log" || status=1
exit "$status"
