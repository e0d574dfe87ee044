"""Decoding mechanics benchmark: ReFusion generate() vs the base model's own generate() on SmolLM2-135M.

    python benchmarks/decode.py [--max_new_tokens 64] [--device cpu] [--dtype float32] [--batch_sizes 1 4 8 16]

The converted model is untrained (its [MASK] embedding is the mean embedding), so drafts are poor and this
measures mechanics, not quality: tokens/s, model forwards, tokens per forward, and the share of wall time spent
inside model forwards versus orchestration (planning, masks, bookkeeping). A second part measures peak memory
with 8 chosen slots per step versus 1, each in a fresh process; a third, throughput at several batch sizes
(left-padded prompts, one batched forward per step) against the base model's generate() at the same sizes.
"""

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from finetune.convert import convert_to_refusion, load_causal_lm
from finetune.smollm2 import SMOLLM2_GGUF, fetch_smollm2

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
BATCH_SETTING = "slot 8, thresholds 0.8/0.3"
SETTINGS = {
    "slot 8, thresholds 0/0 (all parallel)": dict(
        slot_size=8, block_length=64, slot_threshold=0.0, token_threshold=0.0
    ),
    "slot 8, thresholds 0.8/0.3": dict(slot_size=8, block_length=32, slot_threshold=0.8, token_threshold=0.3),
    "slot 4, thresholds 0.8/0.3": dict(slot_size=4, block_length=32, slot_threshold=0.8, token_threshold=0.3),
    "slot 8, thresholds 1/1 (serial)": dict(slot_size=8, block_length=32, slot_threshold=1.0, token_threshold=1.0),
}


class ForwardTimer:
    """Counts model forwards and the wall time spent inside them (forward hooks on the top module)."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.device, self.seconds, self.calls, self._start = device, 0.0, 0, 0.0
        model.register_forward_pre_hook(self._before)
        model.register_forward_hook(self._after)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _before(self, *_) -> None:
        self._synchronize()
        self._start = time.perf_counter()

    def _after(self, *_) -> None:
        self._synchronize()
        self.seconds += time.perf_counter() - self._start
        self.calls += 1


def encode(tokenizer, prompt: str, device) -> torch.Tensor:
    messages = [{"role": "user", "content": prompt}]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return encoded["input_ids"].to(device)


def left_padded_batches(tokenizer, prompts: list[str], device) -> list[dict]:
    """One left-padded batch of chat-formatted prompts."""
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]
    tokenizer.padding_side = "left"
    return [tokenizer(texts, return_tensors="pt", padding=True).to(device)]


def measure(model, timer, inputs, generate_kwargs, eos_token_id) -> dict:
    """Decode every input (a tensor of ids, or a dict with `input_ids` and `attention_mask`) and time it."""
    timer.seconds, timer.calls = 0.0, 0
    tokens, start = 0, time.perf_counter()
    for batch in inputs:
        batch = dict(batch) if not isinstance(batch, torch.Tensor) else {"input_ids": batch}
        output = model.generate(**batch, do_sample=False, eos_token_id=eos_token_id, **generate_kwargs)
        tokens += output[:, batch["input_ids"].shape[1] :].numel()
    wall = time.perf_counter() - start
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "forwards": timer.calls,
        "tokens_per_forward": tokens / timer.calls,
        "forward_share": timer.seconds / wall,
    }


def memory_probe(settings_name: str, max_new_tokens: int) -> None:
    """Run one decoding setting in this (fresh) process and print its peak RSS in MB."""
    model, tokenizer = convert_to_refusion(*load_causal_lm(fetch_smollm2(), gguf_file=SMOLLM2_GGUF))
    # A long prompt (~2000 tokens, ~90 MB of KV cache) so that a per-slot copy of the cache would show.
    context = " ".join(PROMPTS * 14)
    input_ids = encode(tokenizer, f"{context}\n\nAnswer the first question: {PROMPTS[0]}", "cpu")
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark (VmHWM) left by loading
    baseline = memory_kb("VmRSS")
    model.generate(input_ids, max_new_tokens=max_new_tokens, eos_token_id=[], **SETTINGS[settings_name])
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
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--memory_probe", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--skip_memory", action="store_true", help="Skip the peak-memory comparison.")
    parser.add_argument("--batch_sizes", type=int, nargs="*", default=[1, 4, 8, 16])
    parser.add_argument("--batch_new_tokens", type=int, default=32)
    args = parser.parse_args()
    if args.memory_probe:
        return memory_probe(args.memory_probe, args.max_new_tokens)

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    base, tokenizer = load_causal_lm(fetch_smollm2(), gguf_file=SMOLLM2_GGUF)
    base_timer = ForwardTimer(base.to(device, dtype), device)
    prompts = [encode(tokenizer, prompt, device) for prompt in PROMPTS]
    rows = {}
    single_prompts = prompts[:4]
    # No EOS: every method writes exactly max_new_tokens, so throughput compares like with like.
    ar_kwargs = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens)
    measure(base, base_timer, single_prompts[:1], ar_kwargs, tokenizer.eos_token_id)  # warm-up
    rows["base generate() (AR, greedy)"] = measure(base, base_timer, single_prompts, ar_kwargs, tokenizer.eos_token_id)
    batched_rows = {}
    for batch_size in args.batch_sizes:
        batch = left_padded_batches(tokenizer, PROMPTS[:batch_size], device)
        kwargs = dict(max_new_tokens=args.batch_new_tokens, min_new_tokens=args.batch_new_tokens)
        batched_rows[("base generate()", batch_size)] = measure(base, base_timer, batch, kwargs, tokenizer.eos_token_id)

    model, tokenizer = convert_to_refusion(base, tokenizer)
    timer = ForwardTimer(model, device)
    for name, settings in SETTINGS.items():
        kwargs = dict(max_new_tokens=args.max_new_tokens, **settings)
        rows[f"ReFusion {name}"] = measure(model, timer, single_prompts, kwargs, [])
    for batch_size in args.batch_sizes:
        batch = left_padded_batches(tokenizer, PROMPTS[:batch_size], device)
        kwargs = dict(max_new_tokens=args.batch_new_tokens, **SETTINGS[BATCH_SETTING])
        batched_rows[(f"ReFusion {BATCH_SETTING}", batch_size)] = measure(model, timer, batch, kwargs, [])

    setup = f"batch 1, {args.device}, {args.dtype}"
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
    for name, chosen in (("slot 8, thresholds 1/1 (serial)", 1), ("slot 8, thresholds 0/0 (all parallel)", 8)):
        command = [sys.executable, __file__, "--memory_probe", name, "--max_new_tokens", "64"]
        result = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
        print(f"| {name} | {chosen} | {result['peak_mb']:.0f} | {result['decode_growth_mb']:.0f} |")


if __name__ == "__main__":
    main()
