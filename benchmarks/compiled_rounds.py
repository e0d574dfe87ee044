"""Compiled AR against compiled ReFusion, timed in interleaved rounds (prints a table).

    python -m benchmarks.compiled_rounds [--prompts 16] [--rounds 3] [--max_new_tokens 64] [--mode MODE]

On a shared machine a busy spell can slow one decoder and not the other when they run one after the other. Here each
round decodes the same held-out prompts with the base model's compiled static-cache `generate()` and with ReFusion's
compiled forwards over its static cache (shipped setting and adapter, decoding policy's dtype), one after the other;
the table gives each decoder's tokens/s per round and the ratio within each round, whose median is the speed-up.
Both compile before the first round (times printed apart).
"""

import argparse
import copy
import statistics
import time

import torch

from finetune.chat import prompt_token_ids
from recipe.decoding import (
    compile_mode,
    compile_refusion,
    compiled_graphs,
    compiled_refusion,
    decode,
    decode_compiled_ar,
)
from recipe.evaluate import benchmark_prompts
from recipe.model import decoding_dtype, load_base, prepare_for_decoding, with_adapter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
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

    graphs, rows = compiled_graphs(), []
    for round_index in range(args.rounds):
        ar_run = decode_compiled_ar(ar, tokenizer, prompts, args.max_new_tokens, mode=mode)
        refusion_run = decode(model, refusion_tokenizer, prompts, args.max_new_tokens, **options)
        rows.append((ar_run, refusion_run))
        print(
            f"[{time.strftime('%H:%M:%S')}] round {round_index + 1}: AR {ar_run.tokens_per_second:.1f} tokens/s "
            f"(warm-up {ar_run.compile_seconds:.1f} s), ReFusion {refusion_run.tokens_per_second:.1f} tokens/s at "
            f"{refusion_run.tokens_per_forward:.2f} tokens/forward",
            flush=True,
        )
    ratios = [refusion.tokens_per_second / ar.tokens_per_second for ar, refusion in rows]
    graphs = compiled_graphs() - graphs  # the AR's own graph, compiled in its first warm-up, is one
    print(f"\n{args.prompts} held-out prompts, {args.max_new_tokens} new tokens, batch 1, {dtype}, {mode}, "
          f"{torch.get_num_threads()} threads; graphs compiled during the rounds: {graphs}")  # fmt: skip
    print("| round | compiled AR tokens/s | compiled ReFusion tokens/s | ReFusion tokens/forward | ratio |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for index, ((ar, refusion), ratio) in enumerate(zip(rows, ratios), start=1):
        print(f"| {index} | {ar.tokens_per_second:.1f} | {refusion.tokens_per_second:.1f} | "
              f"{refusion.tokens_per_forward:.2f} | {ratio:.2f}x |")  # fmt: skip
    print(f"median ratio: {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
