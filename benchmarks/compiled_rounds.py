"""ReFusion's compiled forwards against the base model's AR, timed prompt by prompt, back to back (prints a table).

    python -m benchmarks.compiled_rounds [--prompts 16] [--rounds 2] [--max_new_tokens 64] [--mode MODE] [--no_eager]

On a shared machine a busy spell can slow one decoder and not the other when each decodes the whole prompt set in
turn. Here every held-out prompt is decoded one right after the other by ReFusion's compiled forwards over its
static cache (shipped setting and adapter, decoding policy's dtype and kernels) and by three AR decoders of the base
model: transformers' compiled static-cache `generate()` in the policy's dtype, and eager `generate()` in float32 and
in bfloat16 (left out with `--no_eager`). Which goes first rotates from prompt to prompt
(`recipe.decoding.paired_runs`); `--rounds` passes over the prompts. The table gives each pass's tokens/s, then
ReFusion's speed-up over all runs against each AR, the fastest AR named first: the ratio, the median and quartiles
of the per-prompt ratios, ReFusion's tokens per forward, and the speed-up as a share of it (what the speed-up would
be if a ReFusion forward cost what an AR step costs: 1.0). The compiled decoders compile before the first pass
(times printed apart).
"""

import argparse
import copy
import time
from functools import partial

import torch

from finetune.chat import prompt_token_ids
from recipe.decoding import (
    compile_mode,
    compile_refusion,
    compiled_ar_settings,
    compiled_graphs,
    compiled_refusion,
    decode,
    overall_speed,
    paired_runs,
    paired_speedup,
    warm_up_compiled_ar,
)
from recipe.evaluate import benchmark_prompts
from recipe.model import decoding_dtype, load_base, prepare_for_decoding, with_adapter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="passes over the prompts")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mode", default=None, help="torch.compile mode of both (default: by device)")
    parser.add_argument("--no_eager", action="store_true", help="leave out the eager AR decoders")
    args = parser.parse_args()
    dtype, mode = decoding_dtype(None, args.device), args.mode or compile_mode(args.device)

    base, tokenizer = load_base()
    model, refusion_tokenizer = with_adapter(base.eval(), tokenizer)
    ar, model = copy.deepcopy(base).to(args.device, dtype), model.to(args.device, dtype)
    prepare_for_decoding(model)  # the eager forwards (a prompt) use the policy's kernels
    prompts = prompt_token_ids(tokenizer, [prompt.text for prompt in benchmark_prompts(args.prompts)])
    options = dict(compiled_refusion(args.device, mode), time_forwards=False)
    compile_seconds = compile_refusion(model, prompts, args.max_new_tokens, options["compile_config"])
    decode(model, refusion_tokenizer, prompts[:1], 8, **options)
    print(f"ReFusion: every width bucket compiled in {compile_seconds:.1f} s ({mode}, {dtype})", flush=True)
    ar_settings = compiled_ar_settings(ar, prompts, args.max_new_tokens, mode=mode)
    warm_up = warm_up_compiled_ar(ar, tokenizer, prompts[:1], ar_settings)
    print(f"compiled AR: warm-up (compiling) {warm_up.seconds:.1f} s", flush=True)

    decoders = {
        "compiled AR": partial(decode, ar, tokenizer, max_new_tokens=args.max_new_tokens, **ar_settings),
        "ReFusion": partial(decode, model, refusion_tokenizer, max_new_tokens=args.max_new_tokens, **options),
    }
    if not args.no_eager:
        eager = dict(max_new_tokens=args.max_new_tokens, autoregressive=True, time_forwards=False)
        for eager_dtype in (torch.float32, torch.bfloat16):
            eager_ar = copy.deepcopy(base).to(args.device, eager_dtype)
            name = f"eager AR {str(eager_dtype).removeprefix('torch.')}"
            decoders[name] = partial(decode, eager_ar, tokenizer, **eager)
    ars = [name for name in decoders if name != "ReFusion"]
    graphs, passes = compiled_graphs(), []
    for round_index in range(args.rounds):
        runs = paired_runs(decoders, prompts)
        passes.append(runs)
        speeds = ", ".join(f"{name} {overall_speed(runs[name]):.1f}" for name in decoders)
        print(f"[{time.strftime('%H:%M:%S')}] pass {round_index + 1} tokens/s: {speeds}", flush=True)
    graphs = compiled_graphs() - graphs

    every = {name: [run for runs in passes for run in runs[name]] for name in decoders}
    ars.sort(key=lambda name: -overall_speed(every[name]))
    print(f"\n{args.prompts} held-out prompts x {args.rounds} passes, {args.max_new_tokens} new tokens, batch 1, "
          f"ReFusion and compiled AR in {dtype}, {mode}, {torch.get_num_threads()} threads; graphs compiled in the "
          f"passes: {graphs}")  # fmt: skip
    columns = " | ".join(f"{name} tokens/s" for name in ars)
    print(f"| pass | {columns} | ReFusion tokens/s | ReFusion tokens/forward |")
    print("| ---: " * (len(ars) + 3) + "|")
    for index, runs in enumerate(passes, start=1):
        tokens_per_forward = paired_speedup(runs["ReFusion"], runs[ars[0]]).tokens_per_forward
        speeds = " | ".join(f"{overall_speed(runs[name]):.1f}" for name in ars + ["ReFusion"])
        print(f"| {index} | {speeds} | {tokens_per_forward:.2f} |")
    print()
    print("| ReFusion against | speed-up | per prompt median (quartiles) | tokens/forward | share of tokens/forward |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for rank, name in enumerate(ars):
        speedup = paired_speedup(every["ReFusion"], every[name])
        label = f"{name} (the fastest AR)" if rank == 0 else name
        print(f"| {label} | {speedup.ratio:.2f}x | {speedup.median:.2f}x ({speedup.low:.2f}-{speedup.high:.2f}) | "
              f"{speedup.tokens_per_forward:.2f} | {speedup.ratio / speedup.tokens_per_forward:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
