"""How long a fresh process takes to the first answer token of compiled ReFusion (prints a table).

    python -m benchmarks.warm_start --compile_cache_dir DIR [--paths eager compiled saved saved] [--dtype bfloat16]
        [--draft_schedule price] [--token_threshold 0.5] [--lookup_drafts 4] [--max_new_tokens 64] [--no_freeze]
        [--output_dir DIR]

Each run is a new Python process (`--child`), as a restarted server or script is: it imports, loads the shipped
model (`recipe.model.load_base` + `with_adapter`, the decoding policy's kernels), then decodes one held-out prompt
with `generate()` and a streamer, and reports the seconds from the `generate()` call to the first answer token and
to the last, the load time apart, and its peak resident memory (VmHWM: the whole process, loading and compiling
included; inductor's compiler subprocesses are not counted). `--paths`, in order (repeat one to see a later process):
- `eager`: no compiling (the floor);
- `compiled`: `torch.compile` over ReFusion's static cache with frozen weights (`--no_freeze`: unfrozen), compiled
  as the decode first needs each width (inductor's own disk cache, warm or cold as this machine has it);
- `saved`: the same forwards compiled ahead of time and kept in `--compile_cache_dir` (AOTInductor packages,
  `generate(compile_cache_dir=...)`): the first such run compiles and keeps them (cold), later runs load them (warm).
Priced drafts (`--draft_schedule price`, the default) price their widths (`prices_refusion.PRICE_WIDTHS`) before
the first forward, so the first token waits for those widths' forwards to compile or load, unless this forward path's
price table is already kept (`~/.cache/refusion/forward_prices.json`; `REFUSION_PRICE_CACHE`). The table ends with
the saved packages on disk: how many, and their size. Writes `warm_start.md` and `.json` into `--output_dir` when
given.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

STARTED = time.perf_counter()


def child(args: argparse.Namespace) -> dict:
    """One fresh process's run of `args.child` (a path): load, then decode one prompt; times in seconds."""
    import torch

    from benchmarks.decode import memory_kb
    from finetune.chat import prompt_token_ids
    from recipe.decoding import compile_mode, compiled_refusion
    from recipe.evaluate import benchmark_prompts
    from recipe.model import decoding_dtype, load_base, prepare_for_decoding, with_adapter

    imported = time.perf_counter()
    base, tokenizer = load_base()
    model, tokenizer = with_adapter(base.eval(), tokenizer)
    model = model.to(decoding_dtype(args.dtype))
    prepare_for_decoding(model)
    loaded, loaded_kb = time.perf_counter(), memory_kb("VmRSS")
    settings = dict(max_new_tokens=args.max_new_tokens, draft_schedule=args.draft_schedule, do_sample=False,
                    token_threshold=args.token_threshold)  # fmt: skip
    if args.lookup_drafts is not None:
        settings["lookup_drafts"] = args.lookup_drafts
    if args.child != "eager":
        saved = args.compile_cache_dir if args.child == "saved" else None
        settings.update(compiled_refusion("cpu", compile_mode("cpu"), not args.no_freeze, saved))
    prompt = torch.tensor([prompt_token_ids(tokenizer, [benchmark_prompts(1)[0].text])[0]])
    times = []

    class Clock:  # a streamer that notes when each piece of the answer arrives (the prompt comes first)
        def put(self, value):
            times.append(time.perf_counter())

        def end(self):
            pass

    begin = time.perf_counter()
    output = model.generate(prompt, streamer=Clock(), **settings)
    end = time.perf_counter()
    return {
        "path": args.child,
        "import_s": imported - STARTED,
        "load_s": loaded - imported,
        "first_token_s": (times[1] if len(times) > 1 else end) - begin,
        "answer_s": end - begin,
        "tokens": output.shape[1] - prompt.shape[1],
        "loaded_rss_gb": loaded_kb / 2**20,
        "peak_rss_gb": memory_kb("VmHWM") / 2**20,
        "dtype": str(model.dtype).removeprefix("torch."),
        "torch": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile_cache_dir", required=True, help="where the saved forwards are kept")
    parser.add_argument("--paths", nargs="+", default=["eager", "compiled", "saved", "saved"],
                        choices=["eager", "compiled", "saved"])  # fmt: skip
    parser.add_argument("--dtype", default=None, help="ReFusion's dtype (default: the decoding policy's)")
    parser.add_argument("--draft_schedule", default="price", choices=["fixed", "price"])
    parser.add_argument("--token_threshold", type=float, default=0.5,
                        help="0.5 or more: a measured price table changes the speed, never the answer (below it "
                        "generate() takes priced drafts only from a table passed in)")  # fmt: skip
    parser.add_argument("--lookup_drafts", type=int, default=None)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--no_freeze", action="store_true", help="compile without inductor's weight freezing")
    parser.add_argument("--output_dir", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return

    rows = []
    for path in args.paths:
        command = [sys.executable, "-m", "benchmarks.warm_start", "--child", path, *sys.argv[1:]]
        started = time.perf_counter()
        run = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
        if run.returncode or not lines:
            raise RuntimeError(f"The {path} run failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
        row = json.loads(lines[-1].removeprefix("RESULT "))
        row["process_s"] = time.perf_counter() - started
        rows.append(row)
        print(f"{path}: first token {row['first_token_s']:.1f} s after generate(), answer {row['answer_s']:.1f} s, "
              f"model load {row['load_s']:.1f} s, process {row['process_s']:.1f} s", flush=True)  # fmt: skip
    folder = Path(args.compile_cache_dir)
    packages = sorted(folder.glob("*.pt2")) if folder.is_dir() else []
    kept, steps = sum(file.stat().st_size for file in packages), sum(file.name.startswith("step-") for file in packages)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())  # fmt: skip
    lines = [
        f"One held-out prompt, {args.max_new_tokens} new tokens, batch 1, {rows[0]['dtype']}, draft schedule "
        f"{args.draft_schedule}, token threshold {args.token_threshold}, lookup_drafts "
        f"{args.lookup_drafts if args.lookup_drafts is not None else 'shipped'}, "
        f"{'unfrozen' if args.no_freeze else 'frozen'} weights; {cpu}, {os.cpu_count()} cores, torch "
        f"{rows[0]['torch']}; each row a new process, in this order. Kept in the folder: "
        f"{len(packages) - steps} forward and {steps} step packages, {kept / 1e9:.2f} GB.",
        "",
        "| run | path | to the first answer token, s | to the whole answer, s | answer tokens | model load, s "
        "| resident after load, GB | peak resident, GB |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for number, row in enumerate(rows, 1):
        lines.append(f"| {number} | {row['path']} | {row['first_token_s']:.1f} | {row['answer_s']:.1f} "
                     f"| {row['tokens']} | {row['load_s']:.1f} | {row['loaded_rss_gb']:.2f} "
                     f"| {row['peak_rss_gb']:.2f} |")  # fmt: skip
    table = "\n".join(lines) + "\n"
    print(table)
    if args.output_dir:
        output = Path(args.output_dir)
        output.mkdir(parents=True, exist_ok=True)
        (output / "warm_start.md").write_text(table)
        (output / "warm_start.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
