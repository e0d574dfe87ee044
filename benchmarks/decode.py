"""Decoding mechanics benchmark: ReFusion generate() vs the base model's own generate() on SmolLM2-135M.

    python -m benchmarks.decode [--max_new_tokens 64] [--device cpu] [--dtype float32] [--batch_sizes 1 4 8 16]

The converted model is untrained (its [MASK] embedding is the mean embedding), so drafts are poor and this
measures mechanics, not quality: tokens/s, model forwards, tokens per forward, and the share of wall time spent
inside model forwards versus orchestration (planning, masks, bookkeeping). A second part measures peak memory
with 8 chosen slots per step versus 1, each in a fresh process; a third, throughput at several batch sizes
(left-padded prompts, one batched forward per step) against the base model's generate() at the same sizes.
Every setting is whole (`SETTINGS`); both models decode in `--dtype` (default: the dtype policy,
`recipe.model.decoding_dtype`). Prints its tables; it writes no file.
"""

import argparse
import gc
import json
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.settings import WHOLE_SLOTS, generation_config, setting, shipped
from finetune.chat import prompt_token_ids
from finetune.convert import convert_to_refusion
from recipe.decoding import DecodeRun, decode
from recipe.model import decoding_dtype, load_base

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
    "List three primary colours.",
    "Explain in one sentence why the sky is blue.",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 11?",
    "Name a famous painting by Leonardo da Vinci.",
    "Why do we have seasons?",
    "Write a haiku about the sea.",
    "What does a thermometer measure?",
    "Suggest a name for a pet goldfish.",
    "What is the boiling point of water in Celsius?",
    "Describe a cat in three words.",
    "What is the largest planet in our solar system?",
]
SETTINGS = {  # name -> a whole decoding setting: the whole-slot fast rule changed as the name says, and what ships
    "shipped default": shipped(),  # the recipe config's `decoding` section (recipe/smollm2.yaml), as it is now
    "whole slots": WHOLE_SLOTS,
    "thresholds 0/0 (all parallel)": setting(WHOLE_SLOTS, slot_threshold=0.0, token_threshold=0.0, block_length=64),
    "slot 8": setting(WHOLE_SLOTS, slot_size=8),
    "slot 4": setting(WHOLE_SLOTS, slot_size=4),
    "thresholds 1/1 (serial)": setting(WHOLE_SLOTS, slot_threshold=1.0, token_threshold=1.0),
}
BATCH_SETTING = "shipped default"


def figures(run: DecodeRun) -> dict:
    return {
        "tokens_per_s": run.tokens_per_second,
        "forwards": run.forwards,
        "tokens_per_forward": run.tokens_per_forward,
        "forward_share": 1.0 - run.orchestration,
    }


def memory_probe(settings_name: str, max_new_tokens: int, dtype: torch.dtype) -> None:
    """Run one decoding setting in this (fresh) process and print its peak RSS in MB."""
    model, tokenizer = convert_to_refusion(*load_base())
    model = model.to(dtype)
    # A long prompt (~2000 tokens, ~90 MB of KV cache) so that a per-slot copy of the cache would show.
    context = " ".join(PROMPTS * 14)
    prompt = f"{context}\n\nAnswer the first question: {PROMPTS[0]}"
    input_ids = torch.tensor(prompt_token_ids(tokenizer, [prompt]))
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark (VmHWM) left by loading
    baseline = memory_kb("VmRSS")
    config = generation_config(model, SETTINGS[settings_name])
    model.generate(input_ids, generation_config=config, max_new_tokens=max_new_tokens, eos_token_id=[])
    peak = memory_kb("VmHWM")
    print(json.dumps({"peak_mb": peak / 1024, "decode_growth_mb": (peak - baseline) / 1024}))


def memory_kb(field: str) -> int:
    """A field of /proc/self/status in kB (VmRSS: resident now, VmHWM: peak since the last reset)."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 where native, else float32")
    parser.add_argument("--memory_probe", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--skip_memory", action="store_true", help="Skip the peak-memory comparison.")
    parser.add_argument("--batch_sizes", type=int, nargs="*", default=[1, 4, 8, 16])
    parser.add_argument("--batch_new_tokens", type=int, default=32)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), decoding_dtype(args.dtype, args.device)
    if args.memory_probe:
        return memory_probe(args.memory_probe, args.max_new_tokens, dtype)

    base, tokenizer = load_base()
    base = base.to(device, dtype)
    prompts = prompt_token_ids(tokenizer, PROMPTS)
    single_prompts = prompts[:4]
    # No EOS: every method writes exactly max_new_tokens, so throughput compares like with like.
    fixed = dict(eos_token_id=[], min_new_tokens=args.max_new_tokens)
    decode(base, tokenizer, single_prompts[:1], 4)  # warm-up
    ar = decode(base, tokenizer, single_prompts, args.max_new_tokens, **fixed)
    rows = {"base generate() (AR, greedy)": figures(ar)}
    batched_rows = {}
    batch_fixed = dict(eos_token_id=[], min_new_tokens=args.batch_new_tokens)
    for batch_size in args.batch_sizes:
        run = decode(base, tokenizer, prompts[:batch_size], args.batch_new_tokens, batch_size, **batch_fixed)
        batched_rows[("base generate()", batch_size)] = figures(run)

    model, tokenizer = convert_to_refusion(base, tokenizer)
    configs = {name: generation_config(model, decoding) for name, decoding in SETTINGS.items()}
    for name, config in configs.items():
        run = decode(model, tokenizer, single_prompts, args.max_new_tokens, eos_token_id=[], generation_config=config)
        rows[f"ReFusion {name}"] = figures(run)
    batch_setting = dict(eos_token_id=[], generation_config=configs[BATCH_SETTING])
    for batch_size in args.batch_sizes:
        run = decode(model, tokenizer, prompts[:batch_size], args.batch_new_tokens, batch_size, **batch_setting)
        batched_rows[(f"ReFusion {BATCH_SETTING}", batch_size)] = figures(run)

    setup = f"batch 1, {args.device}, {str(dtype).removeprefix('torch.')}"
    print(f"\nDecoding {len(single_prompts)} prompts x {args.max_new_tokens} new tokens, {setup}\n")
    print("| method | tokens/s | forwards | tokens/forward | in forwards | orchestration |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, row in rows.items():
        print(
            f"| {name} | {row['tokens_per_s']:.1f} | {row['forwards']} | {row['tokens_per_forward']:.2f} | "
            f"{100 * row['forward_share']:.1f}% | {100 * (1 - row['forward_share']):.1f}% |"
        )

    print(f"\nBatched decoding: {args.batch_new_tokens} new tokens per prompt, left-padded, {args.device}\n")
    print("| method | batch | tokens/s | forwards | tokens/s vs batch 1 |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for (name, batch_size), row in batched_rows.items():
        speedup = row["tokens_per_s"] / batched_rows[(name, args.batch_sizes[0])]["tokens_per_s"]
        print(f"| {name} | {batch_size} | {row['tokens_per_s']:.1f} | {row['forwards']} | {speedup:.2f}x |")

    if args.skip_memory or args.device != "cpu":
        return
    print("\nPeak RSS while decoding a ~2000-token prompt (fresh process each)\n")
    print("| setting | chosen slots per step | peak RSS during decode MB | growth over the loaded model MB |")
    print("| --- | ---: | ---: | ---: |")
    for name in ("thresholds 1/1 (serial)", "thresholds 0/0 (all parallel)"):
        chosen = 1 if name.endswith("(serial)") else SETTINGS[name]["block_length"] // SETTINGS[name]["slot_size"]
        command = [sys.executable, "-m", "benchmarks.decode", "--memory_probe", name, "--max_new_tokens", "64"]
        command += ["--dtype", str(dtype).removeprefix("torch.")]
        result = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
        print(f"| {name} | {chosen} | {result['peak_mb']:.0f} | {result['decode_growth_mb']:.0f} |")


if __name__ == "__main__":
    main()
