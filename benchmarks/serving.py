"""Serving benchmark: vLLM against transformers and our ReFusion decoder at 1, 8 and 32 concurrent requests.

    python -m benchmarks.serving --output_dir DIR [--prompts 32] [--max_new_tokens 64] [--concurrency 1 8 32]
        [--drafts 4] [--dtype float32] [--skip_vllm] [--refusion_cache dynamic static] [--refusion_schedule fixed price]

One run, the shipped model's native export (`scripts/serve.sh` builds vLLM's environment and the export), the same
held-out chat prompts (never trained on) and greedy decoding everywhere:
- vLLM, autoregressive: the OpenAI server, `concurrency` streamed requests in flight at once;
- vLLM with ReFusion drafts (`--drafts K`, 0 to skip): the same server with the checkpoint as its own parallel
  drafter through the refusion-vllm plugin, with vLLM's speculation counters read back from `/metrics`;
- transformers `generate()`, autoregressive (as loaded, and again with the decoding policy's kernels where it packs
  any, as our decoder has them: a like-for-like AR), and our ReFusion decoder: one process, the prompts in static
  left-padded batches of `concurrency` (a batch is what these decoders serve at once).
Tokens/s count every answer token over the wall time of all prompts. Per request: latency (request to last token),
time to first token and time per output token after the first (vLLM, from the stream; for a static batch every
request of a batch gets its answer at the end, so its latency is the batch's time). Before each concurrency the
transformers-side decoders run one short batch of it, untimed in the tokens/s and reported as "warm-up batch s":
one-off work such as a priced decode measuring its forwards' prices at that batch size. Every decoder runs in `--dtype`
(default: the dtype policy, `recipe.model.decoding_dtype`), our decoder with the policy's kernels
(`recipe.model.prepare_for_decoding`). Writes `serving.json`, `serving.md` and `serving.png`
into `--output_dir`, which has no default: a run elsewhere names its own folder rather than overwriting the
committed results (`benchmarks/results/smollm2-cpu`).
"""

import argparse
import concurrent.futures
import itertools
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from recipe.decoding import decode
from recipe.model import decoding_dtype, prepare_for_decoding
from recipe.prompts import build_prompts, interleave_kinds, split_prompts
from recipe.report import cell, write_results
from serving.client import SHIPPED_NATIVE, Server
from serving.export import load_refusion


def held_out_prompts(count: int) -> list[str]:
    """The first `count` held-out prompts of the recipe, kinds interleaved."""
    return [prompt.text for prompt in interleave_kinds(split_prompts(build_prompts())[1])[:count]]


def streamed_request(server: Server, prompt: str, max_tokens: int) -> dict:
    """One streamed greedy chat completion: its answer tokens and latencies."""
    start = time.perf_counter()
    first, tokens = None, []
    for event in server.chat_stream(prompt, max_tokens):
        for choice in event.get("choices", []):
            if choice.get("token_ids"):
                first = first or time.perf_counter()
                tokens += choice["token_ids"]
    end = time.perf_counter()
    first = first or end
    return {"tokens": len(tokens), "latency": end - start, "ttft": first - start, "answer": tokens,
            "tpot": (end - first) / (len(tokens) - 1) if len(tokens) > 1 else 0.0}  # fmt: skip


def vllm_rows(server: Server, prompts: list[str], max_tokens: int, concurrency: list[int]) -> list[dict]:
    """Tokens/s and per-request latencies at each concurrency (requests in flight at once)."""
    streamed_request(server, prompts[0], 8)  # warm-up
    rows = []
    for workers in concurrency:
        before = speculation(server)
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            results = list(pool.map(lambda prompt: streamed_request(server, prompt, max_tokens), prompts))
        seconds = time.perf_counter() - start
        row = summary(workers, results, seconds)
        after = speculation(server)
        if after["drafts"] > before["drafts"]:
            drafts = after["drafts"] - before["drafts"]
            accepted = after["accepted"] - before["accepted"]
            row["acceptance_rate"] = accepted / (after["draft_tokens"] - before["draft_tokens"])
            row["mean_accepted_length"] = 1 + accepted / drafts  # tokens per target forward, bonus included
        rows.append(row)
    return rows


def speculation(server: Server) -> dict[str, float]:
    """vLLM's speculative-decoding counters (zero without speculation)."""
    metrics = server.metrics()

    def total(name: str) -> float:
        return sum(value for key, value in metrics.items() if key.split("{")[0] == f"vllm:{name}")

    return {
        "drafts": total("spec_decode_num_drafts_total"),
        "draft_tokens": total("spec_decode_num_draft_tokens_total"),
        "accepted": total("spec_decode_num_accepted_tokens_total"),
    }


def summary(concurrency: int, results: list[dict], seconds: float) -> dict:
    tokens = sum(result["tokens"] for result in results)
    return {
        "concurrency": concurrency,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "latency_s": statistics.mean(result["latency"] for result in results),
        "ttft_s": statistics.mean(result["ttft"] for result in results),
        "tpot_ms": 1000 * statistics.mean(result["tpot"] for result in results),
        "answers": [result["answer"] for result in results],
    }


def static_batch_rows(model, tokenizer, prompts: list[str], max_tokens: int, concurrency: list[int], **kwargs):
    """transformers-side decoding in static batches of each concurrency; a request waits for its whole batch."""
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]
    prompt_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    rows = []
    for batch_size in concurrency:
        # A short warm-up batch of this size, outside the timing: one-off work (a priced decode measures what its
        # forwards cost at each batch size, once, then keeps the table) is reported apart.
        warm_up = time.perf_counter()
        decode(model, tokenizer, prompt_ids[:batch_size], 4, batch_size, **kwargs)
        warm_up = time.perf_counter() - warm_up
        results = []
        for start in range(0, len(prompt_ids), batch_size):
            run = decode(model, tokenizer, prompt_ids[start : start + batch_size], max_tokens, batch_size, **kwargs)
            for answer in run.answers:
                results.append({"tokens": len(answer), "latency": run.seconds, "ttft": run.seconds, "tpot": 0.0,
                                "answer": answer})  # fmt: skip
        seconds = sum(result["latency"] for result in results[::batch_size])
        row = summary(batch_size, results, seconds)
        row["ttft_s"], row["tpot_ms"] = None, None  # not streamed: the whole batch's answers come at once
        row["warm_up_s"] = warm_up
        rows.append(row)
    return rows


def markdown(results: dict) -> str:
    lines = [
        f"{results['setup']}",
        "",
        "| decoder | concurrent requests | tokens/s | vs fastest AR | mean latency s | time to first token s "
        "| ms per output token | acceptance rate | mean accepted length | warm-up batch s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, rows in results["decoders"].items():
        for row in rows:
            fastest = max(
                other["tokens_per_s"]
                for decoder, others in results["decoders"].items()
                if decoder in results["autoregressive"]
                for other in others
                if other["concurrency"] == row["concurrency"]
            )
            lines.append(
                f"| {name} | {row['concurrency']} | {row['tokens_per_s']:.1f} | {row['tokens_per_s'] / fastest:.2f}x "
                f"| {row['latency_s']:.2f} | {cell(row.get('ttft_s'))} | {cell(row.get('tpot_ms'), '.1f')} "
                f"| {cell(row.get('acceptance_rate'))} | {cell(row.get('mean_accepted_length'))} "
                f"| {cell(row.get('warm_up_s'), '.1f')} |"
            )
    for name, equal in results["answers_equal_to_vllm_ar"].items():
        lines.append(f"\n{name}: answers equal to vLLM AR's at concurrency 1: {equal}.")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.5, 4))
    for name, rows in results["decoders"].items():
        axis.plot([r["concurrency"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", label=name)
    axis.set_xscale("log", base=2)
    axis.set_xticks(results["concurrency"], [str(c) for c in results["concurrency"]])
    axis.set_xlabel("concurrent requests")
    axis.set_ylabel("tokens/s (all requests)")
    axis.set_title("ReFusion SmolLM2-135M served, greedy, 2 CPU cores")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--drafts", type=int, default=4, help="ReFusion drafts per vLLM step (0: skip that row).")
    parser.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16"], help="default: bfloat16 where native, else float32"
    )
    parser.add_argument("--output_dir", required=True, help="where serving.json, .md and .png go (overwritten)")
    parser.add_argument("--skip_vllm", action="store_true", help="the transformers-side rows only (no vLLM server)")
    parser.add_argument(
        "--refusion_cache", nargs="+", default=["dynamic"], choices=["dynamic", "static"],
        help="the KV cache of the ReFusion rows: a row for each (a static cache keeps each request's tokens together)",
    )
    parser.add_argument(
        "--refusion_schedule", nargs="+", default=["fixed"], choices=["fixed", "price"],
        help="the draft schedule of the ReFusion rows: a row for each (price: drafts per forward chosen by what a "
        "forward of each width costs at the batch size)",
    )  # fmt: skip
    args = parser.parse_args()
    dtype = decoding_dtype(args.dtype)  # vLLM on the CPU, as the transformers-side decoders here
    in_dtype = str(dtype).removeprefix("torch.")
    prompts = held_out_prompts(args.prompts)
    logs = Path(tempfile.mkdtemp(prefix="serving-benchmark-"))  # the servers' logs, named if one fails

    decoders = {}
    vllm_args = ["--dtype", in_dtype, "--max-model-len", "2048"]
    if not args.skip_vllm:
        with Server(vllm_args=vllm_args, log_path=logs / "vllm-ar.log") as server:
            decoders[f"vLLM AR ({in_dtype})"] = vllm_rows(server, prompts, args.max_new_tokens, args.concurrency)
    if args.drafts and not args.skip_vllm:
        name = f"vLLM + ReFusion drafts, K={args.drafts} ({in_dtype})"
        try:
            with Server(drafts=args.drafts, vllm_args=vllm_args, log_path=logs / "vllm-drafts.log") as server:
                decoders[name] = vllm_rows(server, prompts, args.max_new_tokens, args.concurrency)
        except (RuntimeError, TimeoutError) as error:  # reported, not hidden: the other rows still count
            print(f"{name}: the server did not start: {error}")

    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_NATIVE)
    native = AutoModelForCausalLM.from_pretrained(SHIPPED_NATIVE, dtype=dtype).eval()
    decoders[f"transformers generate() AR ({in_dtype})"] = static_batch_rows(
        native, tokenizer, prompts, args.max_new_tokens, args.concurrency, autoregressive=True
    )
    if prepare_for_decoding(native):  # the same kernels as our decoder's, where the policy packs any: a fair AR
        decoders[f"transformers generate() AR ({in_dtype}, the policy's kernels)"] = static_batch_rows(
            native, tokenizer, prompts, args.max_new_tokens, args.concurrency, autoregressive=True
        )
    del native
    refusion, _ = load_refusion()  # the same weights in our class: this package's decoder as it is now
    prepare_for_decoding(refusion.to(dtype))  # the decoding policy's kernels
    for cache, schedule in itertools.product(args.refusion_cache, args.refusion_schedule):
        name = f"ReFusion decoder, shipped default ({in_dtype})" + (", static cache" if cache == "static" else "")
        name += ", priced drafts" if schedule == "price" else ""
        decoders[name] = static_batch_rows(refusion, tokenizer, prompts, args.max_new_tokens, args.concurrency,
                                           cache_implementation=cache, draft_schedule=schedule)  # fmt: skip

    lossless = {  # speculative decoding must not change a greedy answer
        name: sum(a == b for a, b in zip(rows[0]["answers"], decoders[f"vLLM AR ({in_dtype})"][0]["answers"]))
        for name, rows in decoders.items()
        if name.startswith("vLLM +")
    }
    results = {
        "answers_equal_to_vllm_ar": {name: f"{equal}/{len(prompts)}" for name, equal in lossless.items()},
        "setup": (
            f"{len(prompts)} held-out prompts x up to {args.max_new_tokens} new tokens, greedy, "
            f"{platform.machine()} CPU, {os.cpu_count()} cores; every decoder in {in_dtype}."
        ),
        "concurrency": args.concurrency,
        "autoregressive": [name for name in decoders if "ReFusion" not in name],
        "decoders": decoders,
    }
    table = markdown(results)
    print(table)
    write_results(args.output_dir, "serving", table, results, lambda path: plot(results, path))


if __name__ == "__main__":
    main()
