"""Compiled AR against compiled ReFusion, timed prompt by prompt, back to back (prints a table).

    python -m benchmarks.compiled_rounds [--prompts 16] [--rounds 2] [--max_new_tokens 64] [--mode MODE]

On a shared machine a busy spell can slow one decoder and not the other when each decodes the whole prompt set in
turn. Here every held-out prompt is decoded by the base model's compiled static-cache `generate()` and by ReFusion's
compiled forwards over its static cache (shipped setting and adapter, decoding policy's dtype and kernels) one right
after the other, the first of the two alternating from prompt to prompt (`recipe.decoding.paired_runs`); `--rounds`
passes over the prompts. The table gives each pass's tokens/s, then the speed-up over all runs, the median and
quartiles of the per-prompt ratios, ReFusion's tokens per forward, and the speed-up as a share of it (what the
speed-up would be if a ReFusion forward cost what an AR step costs: 1.0). Both compile before the first pass (times
printed apart).
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
        "AR": partial(decode, ar, tokenizer, max_new_tokens=args.max_new_tokens, **ar_settings),
        "ReFusion": partial(decode, model, refusion_tokenizer, max_new_tokens=args.max_new_tokens, **options),
    }
    graphs, passes = compiled_graphs(), []
    for round_index in range(args.rounds):
        runs = paired_runs(decoders, prompts)
        passes.append(runs)
        ratio = paired_speedup(runs["ReFusion"], runs["AR"]).ratio
        print(f"[{time.strftime('%H:%M:%S')}] pass {round_index + 1}: AR {overall_speed(runs['AR']):.1f} tokens/s, "
              f"ReFusion {overall_speed(runs['ReFusion']):.1f} tokens/s ({ratio:.2f}x)", flush=True)  # fmt: skip
    graphs = compiled_graphs() - graphs

    print(f"\n{args.prompts} held-out prompts x {args.rounds} passes, {args.max_new_tokens} new tokens, batch 1, "
          f"{dtype}, {mode}, {torch.get_num_threads()} threads; graphs compiled in the passes: {graphs}")  # fmt: skip
    print("| pass | compiled AR tokens/s | compiled ReFusion tokens/s | ReFusion tokens/forward | speed-up |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for index, runs in enumerate(passes, start=1):
        speedup = paired_speedup(runs["ReFusion"], runs["AR"])
        ar_speed = overall_speed(runs["AR"])
        print(f"| {index} | {ar_speed:.1f} | {ar_speed * speedup.ratio:.1f} | {speedup.tokens_per_forward:.2f} | "
              f"{speedup.ratio:.2f}x |")  # fmt: skip
    every = {name: [run for runs in passes for run in runs[name]] for name in decoders}
    speedup = paired_speedup(every["ReFusion"], every["AR"])
    print(f"all passes: {speedup.ratio:.2f}x; per prompt median {speedup.median:.2f}x (quartiles {speedup.low:.2f}"
          f"-{speedup.high:.2f}); {speedup.tokens_per_forward:.2f} tokens/forward; speed-up / tokens per forward "
          f"{speedup.ratio / speedup.tokens_per_forward:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
