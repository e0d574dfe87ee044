"""Price-aware drafts (`draft_schedule="price"`) against the shipped fixed window: measured here, modelled elsewhere.

    python -m benchmarks.price_schedule [--prompts 16] [--rounds 2] [--max_new_tokens 64] [--eager]

Part 1, measured: each held-out prompt is decoded by the base model's AR (compiled static-cache `generate()`, or
eager with `--eager`) and by ReFusion (shipped setting and adapter, decoding policy's dtype and kernels, compiled
forwards over its static cache unless `--eager`) with the shipped fixed window and with priced drafts, the three back
to back, the first rotating from prompt to prompt (`recipe.decoding.paired_runs`); `--rounds` passes over the prompts.
The speed-ups pool each decoder's runs; the per-prompt ratios' median and quartiles show their spread. The price
table the decoder measured here is printed.

Part 2, modelled: the forward prices of another machine (the AVX2 CPU tables in `PRICE_TABLES`, from
`../shared/notes/performance.md`) are given to the decoder as `forward_prices`; it decodes (eagerly, to record each
forward's width) and the decode is priced forward by forward: modelled seconds are the sum of the table's price of
each forward's width, AR's are one one-query forward per token (prompt forwards left out on both sides; ReFusion's
carries its first plan). This shows
what the schedule chooses where width is dear; it is a model, not a measurement.
"""

import argparse
import copy
import json
import time
from functools import partial

import torch

from benchmarks.settings import generation_config, shipped
from finetune.chat import prompt_token_ids
from prices_refusion import ForwardPrices
from recipe.decoding import (
    compile_mode,
    compile_refusion,
    compiled_ar_settings,
    compiled_refusion,
    decode,
    overall_speed,
    paired_runs,
    paired_speedup,
    warm_up_compiled_ar,
)
from recipe.evaluate import benchmark_prompts
from recipe.model import decoding_dtype, load_base, prepare_for_decoding, with_adapter

# Seconds per forward of SmolLM2-135M over a static cache of 120 tokens, batch 1, by new tokens per row, on the
# 2-core AMD EPYC (AVX2 only) of ../shared/notes/performance.md (fastest of 7-9, quiet machine).
PRICE_TABLES = {
    "AVX2 eager bfloat16": {1: 0.038, 2: 0.056, 4: 0.092, 8: 0.171, 16: 0.271},
    "AVX2 compiled bfloat16": {1: 0.034, 2: 0.042, 4: 0.081, 8: 0.130, 16: 0.298},
    "AVX2 eager float32": {1: 0.058, 2: 0.093, 4: 0.094, 8: 0.103, 16: 0.120},
}


def modelled(model, tokenizer, prompts, max_new_tokens, table: dict, **options) -> dict:
    """Decode eagerly with `options`, recording each forward's width; price the forwards after each prompt's first
    with `table`."""
    widths = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    priced_seconds, tokens, forwards = 0.0, 0, 0
    price = ForwardPrices(table)
    try:
        for prompt in prompts:
            widths.clear()
            run = decode(model, tokenizer, [prompt], max_new_tokens, time_forwards=False, **options)
            priced_seconds += sum(price(width) for width in widths[1:])
            tokens, forwards = tokens + run.tokens, forwards + run.forwards
    finally:
        hook.remove()
    return {"tokens": tokens, "forwards": forwards, "seconds": priced_seconds, "ar_seconds": tokens * price(1)}


def measured(args, ar, model, tokenizer, refusion_tokenizer, prompts, dtype, mode) -> None:
    """Part 1: AR, the fixed window and priced drafts, prompt by prompt (prints its table)."""
    options = dict(time_forwards=False)
    if not args.eager:
        options.update(compiled_refusion(args.device, mode))
        seconds = compile_refusion(model, prompts, args.max_new_tokens, options["compile_config"],
                                   draft_schedule="price")  # its buckets serve the fixed window too  # fmt: skip
        print(f"ReFusion: every width bucket compiled in {seconds:.1f} s ({mode}, {dtype})", flush=True)
    plain = decode(model, refusion_tokenizer, prompts[:1], 8, **options).seconds
    first = decode(model, refusion_tokenizer, prompts[:1], 8, draft_schedule="price", **options).seconds
    print(f"the first priced decode (8 tokens) took {first:.1f} s, measuring the price table; unpriced {plain:.1f} s")
    for key, table in getattr(model, "_refusion_prices", {}).items():
        print(f"measured prices ({key}):\n  " + json.dumps({width: round(price * 1000, 1) for width, price in
                                                        table.items()}) + " ms")  # fmt: skip

    if args.eager:
        ar_options = dict(autoregressive=True, time_forwards=False)
    else:
        ar_options = compiled_ar_settings(ar, prompts, args.max_new_tokens, mode=mode)
        warm_up_compiled_ar(ar, tokenizer, prompts[:1], ar_options)
    decoders = {
        "AR": partial(decode, ar, tokenizer, max_new_tokens=args.max_new_tokens, **ar_options),
        "fixed": partial(decode, model, refusion_tokenizer, max_new_tokens=args.max_new_tokens, **options),
        "priced": partial(decode, model, refusion_tokenizer, max_new_tokens=args.max_new_tokens,
                          draft_schedule="price", **options),
    }  # fmt: skip
    passes = []
    for round_index in range(args.rounds):
        passes.append(paired_runs(decoders, prompts))
        speeds = ", ".join(f"{name} {overall_speed(runs):.1f}" for name, runs in passes[-1].items())
        print(f"[{time.strftime('%H:%M:%S')}] pass {round_index + 1}: {speeds} tokens/s", flush=True)

    path = "eager" if args.eager else f"compiled ({mode})"
    print(f"\nPart 1, measured: {args.prompts} held-out prompts x {args.rounds} passes, {args.max_new_tokens} new "
          f"tokens, batch 1, {dtype}, {path}, {torch.get_num_threads()} threads; AR {path}")  # fmt: skip
    every = {name: [run for runs in passes for run in runs[name]] for name in decoders}
    print(f"AR: {overall_speed(every['AR']):.1f} tokens/s")
    print("| schedule | tokens/s | tokens/forward | vs AR | per prompt: median (quartiles) | vs AR / tokens/forward |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name in ("fixed", "priced"):
        speedup = paired_speedup(every[name], every["AR"])
        print(f"| {name} | {overall_speed(every[name]):.1f} | {speedup.tokens_per_forward:.2f} | "
              f"{speedup.ratio:.2f}x | {speedup.median:.2f}x ({speedup.low:.2f}-{speedup.high:.2f}) | "
              f"{speedup.ratio / speedup.tokens_per_forward:.2f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="passes over the prompts in part 1 (0: part 2 only)")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--eager", action="store_true", help="eager forwards and eager AR (default: compiled)")
    parser.add_argument("--skip_modelled", action="store_true", help="part 1 only")
    args = parser.parse_args()
    dtype, mode = decoding_dtype(None, args.device), compile_mode(args.device)

    base, tokenizer = load_base()
    model, refusion_tokenizer = with_adapter(base.eval(), tokenizer)
    ar, model = copy.deepcopy(base).to(args.device, dtype), model.to(args.device, dtype)
    prepare_for_decoding(model)
    model.generation_config = generation_config(model, shipped())
    prompts = prompt_token_ids(tokenizer, [prompt.text for prompt in benchmark_prompts(args.prompts)])
    if args.rounds:
        measured(args, ar, model, tokenizer, refusion_tokenizer, prompts, dtype, mode)
    if args.skip_modelled:
        return

    print("\nPart 2, modelled: the same prompts decoded with another machine's prices (eager forwards here, each "
          "forward priced by its width)")  # fmt: skip
    print("| price table | schedule | tokens/forward | modelled tokens/s | modelled AR tokens/s | vs AR |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, table in PRICE_TABLES.items():
        for schedule in ("fixed", "price"):
            result = modelled(model, refusion_tokenizer, prompts, args.max_new_tokens, table,
                              draft_schedule=schedule, forward_prices=table)  # fmt: skip
            speed, ar_speed = result["tokens"] / result["seconds"], result["tokens"] / result["ar_seconds"]
            print(f"| {name} | {schedule} | {result['tokens'] / result['forwards']:.2f} | {speed:.1f} | "
                  f"{ar_speed:.1f} | {speed / ar_speed:.2f}x |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
