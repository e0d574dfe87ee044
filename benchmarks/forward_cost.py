"""What one model forward of the shipped model costs on this machine, by number of queries and dtype.

    python -m benchmarks.forward_cost --output_dir DIR [--cache 120] [--widths 1 2 4 8 16 32 64]
        [--dtypes float32 bfloat16] [--dtype float32] [--repeats 10] [--prompts 8] [--device cpu]

ReFusion beats autoregressive decoding when tokens per forward exceed the price of a ReFusion forward relative to
an AR one. This measures that price. For each dtype and number of new tokens (queries) after a cache of `--cache`
tokens, the median time of:

- the decoder's call: the 4-D storage-order mask built by `decisions_refusion.attention_mask` (its cost
  included, as the decoder pays it), position ids, the cache, `logits_to_keep` (ReFusion's forward);
- the plain causal call of autoregressive decoding: the base model with a 2-D mask and the cache.

Beside them: for each dtype `kernels_refusion` packs on this CPU (`packing_plan()`), both calls again with the
linear layers through oneDNN with prepacked weights as `kernels_refusion.prepack_linears` runs them by default (the
"prepacked" rows: from the plan's fewest rows on; narrower forwards stay `F.linear`); the memory-bound floor (weight
bytes / measured read bandwidth: no forward can be faster); and the decode mix of the shipped default (how many
forwards of each width one answer spends, from hooks on the model while it answers held-out prompts, decoding in
`--dtype`, by default the dtype policy's, `recipe.model.decoding_dtype`), which turns the curve into the average
price of a ReFusion forward and the tokens per forward ReFusion needs to tie with AR. Writes `forward_cost.json`,
`.md` and `.png` into `--output_dir`, which has no default: a run elsewhere names its own folder rather than
overwriting the committed results.
"""

import argparse
import bisect
import copy
import json
import platform
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
from transformers import CompileConfig, DynamicCache, PreTrainedModel, StaticCache

from compiling_refusion import compiled_backbone
from decisions_refusion import NO_GROUP, attention_mask
from executor_refusion import WIDTH_BUCKETS, SlotCache, StaticLayout, pad_width, run_model, width_buckets
from finetune.chat import prompt_token_ids
from kernels_refusion import packing_plan, prepack_linears
from recipe.decoding import compile_mode, compiled_graphs, decode, synchronize
from recipe.evaluate import benchmark_prompts
from recipe.model import decoding_dtype, load_base, with_adapter
from recipe.report import write_results

DEFAULT_WIDTHS = (1, 2, 4, 8, 16, 32, 64)
CALLS = (
    "decoder",
    "causal",
    "decoder, prepacked",
    "causal, prepacked",
    "decoder, compiled",
    "causal, compiled",
    "decoder, static compiled",
    "decoder, draft adapter",
    "decoder, draft adapter, static compiled",
)


def read_bandwidth(device: torch.device, megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second `device` reads from its memory: the best of `repeats` full reads of a large tensor."""
    data = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    data.sum()
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        data.sum()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def weight_bytes(model: PreTrainedModel) -> int:
    """Bytes of the model's distinct parameters (a tied lm_head counted once: it is read once per forward)."""
    return sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())


def decoder_forward(model: PreTrainedModel, cache: DynamicCache, ids: torch.Tensor) -> None:
    """One forward as the decoder makes it: a causal run of `ids` after the cache, through the 4-D storage-order
    mask (built here, as the decoder builds it per forward), explicit position ids and `logits_to_keep`."""
    past, width = cache.get_seq_length(), ids.shape[1]
    ranks = torch.arange(past + width, device=ids.device)[None]
    groups = torch.zeros_like(ranks)
    new, new_groups = ranks[:, past:], groups[:, past:]
    mask = attention_mask(ranks, groups, new, new, new_groups, new_groups - 1, past, model.dtype)
    model(input_ids=ids, position_ids=new, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=width)


def causal_forward(model: PreTrainedModel, cache: DynamicCache, ids: torch.Tensor) -> None:
    """One forward as autoregressive decoding makes it: a 2-D padding mask, positions implied by the cache."""
    past, width = cache.get_seq_length(), ids.shape[1]
    mask = torch.ones(1, past + width, dtype=torch.long, device=ids.device)
    model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=width)


@torch.no_grad()
def forward_times(
    model: PreTrainedModel, cache_length: int, widths, repeats: int, call
) -> tuple[dict[int, float], int]:
    """Median milliseconds of `call` (`decoder_forward` or `causal_forward`) at each width after a cache of
    `cache_length` random tokens; the cache is cropped back after every call, so each one sees the same past. Also
    the graphs a compiled forward built during the timed calls (after each width's warm-up call): its
    recompilations in steady state."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    cache = DynamicCache()
    prompt = torch.randint(0, vocab, (1, cache_length), generator=generator).to(model.device)
    model(input_ids=prompt, cache=cache, use_cache=True)
    times, recompiled = {}, 0
    for width in widths:
        ids = torch.randint(0, vocab, (1, width), generator=generator).to(model.device)
        call(model, cache, ids)  # warm-up: first-call allocations (and compilation)
        cache.crop(-width)
        graphs = compiled_graphs()
        samples = []
        for _ in range(repeats):
            synchronize(model.device)
            start = time.perf_counter()
            call(model, cache, ids)
            synchronize(model.device)
            samples.append(time.perf_counter() - start)
            cache.crop(-width)
        times[width] = 1000 * statistics.median(samples)
        recompiled += compiled_graphs() - graphs
    return times, recompiled


def prepacked_times(
    refusion: PreTrainedModel, ar: PreTrainedModel, cache_length: int, widths, repeats: int
) -> tuple[dict[int, float], dict[int, float]] | None:
    """`forward_times` of the decoder's and the causal call on copies of `refusion` and `ar` whose linear layers
    compute through oneDNN with prepacked weights as `prepack_linears` runs them by default; None where those kernels
    do not apply (no oneDNN, not a CPU, a dtype `kernels_refusion` does not pack here). The models themselves are not
    changed."""
    plan = packing_plan()
    if refusion.device.type != "cpu" or refusion.dtype not in plan:
        return None
    refusion, ar = copy.deepcopy(refusion), copy.deepcopy(ar)
    prepack_linears(refusion, dtypes={refusion.dtype: plan[refusion.dtype]})
    prepack_linears(ar, dtypes={ar.dtype: plan[ar.dtype]})
    decoder, _ = forward_times(refusion, cache_length, widths, repeats, decoder_forward)
    causal, _ = forward_times(ar, cache_length, widths, repeats, causal_forward)
    return decoder, causal


@torch.no_grad()
def static_compiled_times(
    refusion: PreTrainedModel, ar: PreTrainedModel, cache_length: int, widths, repeats: int, mode: str
) -> tuple[dict[int, float], float]:
    """Median milliseconds of the forwards `generate(cache_implementation="static", compile_config=...)` runs:
    ReFusion's compiled backbone over its static cache at each width (padded to its bucket as the decoder pads it
    with priced drafts, whose buckets include the narrow ones; a width past the widest bucket runs eagerly) plus the
    output layer for the `width` queries, and transformers' compiled one-query AR step over its `StaticCache` (the
    compiled AR `generate()`'s step). Both after a cache of `cache_length` random tokens, which every call sees
    again (the write pointers move back after each)."""
    config = CompileConfig(fullgraph=True, dynamic=False, mode=mode)
    generator = torch.Generator().manual_seed(0)
    vocab, device = refusion.config.get_text_config(decoder=True).vocab_size, refusion.device
    cache = SlotCache(refusion, 1, cache_length + max(max(widths), WIDTH_BUCKETS[-1]))
    layout, compiled = StaticLayout(cache, 1, device), compiled_backbone(refusion, config)

    def causal_run(start: int, width: int) -> dict:
        ranks = torch.arange(start, start + width, device=device)[None]
        ids = torch.randint(0, vocab, (1, width), generator=generator).to(device)
        return dict(ids=ids, positions=ranks, ranks=ranks, prefixes=ranks, groups=torch.zeros_like(ranks),
                    parents=torch.full_like(ranks, NO_GROUP))  # fmt: skip

    def refusion_call(width: int, run_with=compiled) -> None:
        batch = causal_run(layout.pointers[0], pad_width(width, None if run_with is None else width_buckets("price")))
        mask = layout.mask(batch, [batch["ids"].shape[1]], refusion.dtype)
        run_model(refusion, run_with, batch, mask, cache, width)

    refusion_call(cache_length, run_with=None)  # the cached past, computed eagerly
    layout.keep(None, None, [cache_length])
    times = {width: timed(lambda width=width: refusion_call(width), repeats, device) for width in widths}

    ar_cache = StaticCache(config=ar.config, max_cache_len=cache_length + 1)
    prompt = torch.randint(0, vocab, (1, cache_length), generator=generator).to(device)
    ar(input_ids=prompt, cache=ar_cache, use_cache=True)
    ar_step = torch.compile(ar.__call__, **config.to_dict())
    token, position = prompt[:, -1:], torch.tensor([[cache_length]], device=device)

    def ar_call() -> None:
        ar_step(input_ids=token, position_ids=position, cache=ar_cache, use_cache=True, logits_to_keep=1)
        ar_cache.crop(-1)

    return times, timed(ar_call, repeats, device)


def timed(call, repeats: int, device: torch.device) -> float:
    """Median milliseconds of `repeats` calls of `call`, after one untimed call (first-call costs, compilation)."""
    call()
    samples = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        call()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return 1000 * statistics.median(samples)


def mean_price(curve: dict[int, float], mix: Counter) -> float:
    """Mean milliseconds of a forward of the decode `mix` priced on `curve`."""
    return sum(count * price_at(curve, width) for width, count in mix.items()) / sum(mix.values())


@torch.no_grad()
def decode_mix(model: PreTrainedModel, tokenizer, prompt_ids, max_new_tokens: int) -> Counter:
    """Forwards of each width (new tokens per row) while `model` answers `prompt_ids` one by one with its own
    decoding defaults. The first forward of each answer carries the prompt (the prefill, which AR decoding pays
    too) and is left out."""
    widths = Counter()
    seen: list[int] = []
    hook = model.register_forward_pre_hook(lambda _m, _a, kwargs: seen.append(kwargs["input_ids"].shape[1]),
                                           with_kwargs=True)  # fmt: skip
    try:
        for prompt in prompt_ids:
            seen.clear()
            decode(model, tokenizer, [prompt], max_new_tokens)
            widths.update(seen[1:])
    finally:
        hook.remove()
    return widths


def price_at(curve: dict[int, float], width: int) -> float:
    """Milliseconds of a forward of `width` queries, linear between measured widths (flat past the ends)."""
    measured = sorted(curve)
    if width <= measured[0] or width >= measured[-1]:
        return curve[measured[0] if width <= measured[0] else measured[-1]]
    right = bisect.bisect_left(measured, width)
    low, high = measured[right - 1], measured[right]
    share = (width - low) / (high - low)
    return curve[low] + share * (curve[high] - curve[low])


def markdown(results: dict) -> str:
    widths = results["widths"]
    lines = [
        f"{results['machine']}, {results['threads']} threads, torch {results['torch']}; cache of "
        f"{results['cache']} tokens, median of {results['repeats']} forwards. Read bandwidth "
        f"{results['bandwidth_gb_s']:.1f} GB/s."
        + (
            f" The draft adapter's rows: rank {results['draft_adapter']} on every projection."
            if results.get("draft_adapter")
            else ""
        ),
        "",
        "| dtype | call | " + " | ".join(f"{w} q" for w in widths) + " | memory floor |",
        "| --- | --- | " + " | ".join("---:" for _ in widths) + " | ---: |",
    ]
    for dtype, entry in results["dtypes"].items():
        for call in CALLS:
            if call not in entry:
                continue
            cells = " | ".join(f"{entry[call][str(w)]:.0f}" for w in widths)
            lines.append(f"| {dtype} | {call} | {cells} | {entry['floor_ms']:.0f} |")
    mix = results["mix"]
    counts = ", ".join(f"{w}: {n}" for w, n in sorted(mix.items(), key=lambda item: int(item[0])))
    lines += [
        "",
        f"Decode mix of the shipped default ({results['mix_prompts']} held-out prompts, {results['max_new_tokens']} "
        f"new tokens, {results.get('mix_dtype', 'float32')}, prefill left out): {sum(mix.values())} forwards; "
        f"width: count {counts}.",
        "",
        "| dtype | AR forward (1 query) ms | mean ReFusion forward ms | price ratio (= tokens/forward to tie) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for dtype, entry in results["dtypes"].items():
        lines.append(
            f"| {dtype} | {entry['ar_ms']:.0f} | {entry['refusion_mean_ms']:.0f} | {entry['price_ratio']:.2f} |"
        )
        if "prepacked" in entry:
            packed = entry["prepacked"]
            lines.append(
                f"| {dtype}, prepacked (AR: the faster 1-query causal call) | {packed['ar_ms']:.0f} | "
                f"{packed['refusion_mean_ms']:.0f} | {packed['price_ratio']:.2f} |"
            )
        if "static compiled" in entry:
            static = entry["static compiled"]
            lines.append(
                f"| {dtype}, static compiled (AR: transformers' compiled static-cache step) | {static['ar_ms']:.0f} | "
                f"{static['refusion_mean_ms']:.0f} | {static['price_ratio']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (curves, mix) = plt.subplots(1, 2, figsize=(12, 4.5))
    widths = results["widths"]
    for index, (dtype, entry) in enumerate(results["dtypes"].items()):
        colour = f"C{index}"
        curves.plot(widths, [entry["decoder"][str(w)] for w in widths], "o-", color=colour, label=f"{dtype}, decoder")
        curves.plot(widths, [entry["causal"][str(w)] for w in widths], "s--", color=colour, label=f"{dtype}, causal")
        if "decoder, prepacked" in entry:
            prepacked = [entry["decoder, prepacked"][str(w)] for w in widths]
            curves.plot(widths, prepacked, "^-.", color=colour, label=f"{dtype}, decoder, prepacked")
        curves.axhline(entry["floor_ms"], color=colour, linestyle=":", label=f"{dtype}, memory floor")
    curves.set_xscale("log", base=2)
    curves.set_xlabel("queries per forward")
    curves.set_ylabel("ms per forward")
    curves.set_ylim(bottom=0)
    curves.set_title(f"one forward after {results['cache']} cached tokens")
    curves.legend(fontsize=8)
    counts = sorted((int(w), n) for w, n in results["mix"].items())
    mix.bar([str(w) for w, _ in counts], [n for _, n in counts], color="C2")
    mix.set_xlabel("queries per forward")
    mix.set_ylabel("forwards")
    mix.set_title("decode mix of the shipped default")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=int, default=120, help="tokens already in the cache")
    parser.add_argument("--widths", type=int, nargs="+", default=list(DEFAULT_WIDTHS))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts for the decode mix")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile'd forwards (dynamic shapes)")
    parser.add_argument(
        "--static_compiled",
        action="store_true",
        help="also time the compiled forwards of generate(cache_implementation='static'): ReFusion's over its static "
        "cache at its width buckets, and transformers' compiled one-query AR step (compiles a few graphs)",
    )
    parser.add_argument("--dtype", default=None, help="of the decode mix; default: bfloat16 where native, else float32")
    parser.add_argument(
        "--draft_adapter",
        type=int,
        default=None,
        metavar="RANK",
        help="also time the decoder's calls (eager, and static compiled with --static_compiled) on a copy with a "
        "draft-only adapter of this rank on every projection (adapter_refusion): what the adapter costs a forward",
    )
    parser.add_argument("--output_dir", required=True, help="where forward_cost.json, .md and .png go (overwritten)")
    args = parser.parse_args()
    device, mix_dtype = torch.device(args.device), decoding_dtype(args.dtype, args.device)

    base, tokenizer = load_base()
    model, refusion_tokenizer = with_adapter(base.eval(), tokenizer)
    model, base = model.to(device), base.to(device)
    prompt_ids = prompt_token_ids(tokenizer, [prompt.text for prompt in benchmark_prompts(args.prompts)])
    mix = decode_mix(copy.deepcopy(model).to(mix_dtype), refusion_tokenizer, prompt_ids, args.max_new_tokens)
    bandwidth = read_bandwidth(device)
    results = {
        "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.machine()} CPU",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cache": args.cache,
        "repeats": args.repeats,
        "widths": args.widths,
        "bandwidth_gb_s": bandwidth / 1e9,
        "mix_prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "mix_dtype": str(mix_dtype).removeprefix("torch."),
        "mix": {str(width): count for width, count in sorted(mix.items())},
        "compile": args.compile,
        "draft_adapter": args.draft_adapter,
        "dtypes": {},
    }
    for name in args.dtypes:
        dtype = getattr(torch, name)
        torch._dynamo.reset()  # the last dtype's graphs would count against this one's recompile limit
        refusion, ar = copy.deepcopy(model).to(dtype), copy.deepcopy(base).to(dtype)
        decoder, _ = forward_times(refusion, args.cache, args.widths, args.repeats, decoder_forward)
        causal, _ = forward_times(ar, args.cache, args.widths, args.repeats, causal_forward)
        refusion_mean = mean_price(decoder, mix)
        entry = {
            "decoder": {str(w): t for w, t in decoder.items()},
            "causal": {str(w): t for w, t in causal.items()},
            "floor_ms": 1000 * weight_bytes(refusion) / bandwidth,
            "ar_ms": causal[min(causal)],
            "refusion_mean_ms": refusion_mean,
            "price_ratio": refusion_mean / causal[min(causal)],
        }
        prepacked = prepacked_times(refusion, ar, args.cache, args.widths, args.repeats)
        if prepacked is not None:
            decoder, causal = prepacked
            entry["decoder, prepacked"] = {str(w): t for w, t in decoder.items()}
            entry["causal, prepacked"] = {str(w): t for w, t in causal.items()}
            ar_ms, refusion_mean = min(entry["ar_ms"], causal[min(causal)]), mean_price(decoder, mix)
            entry["prepacked"] = dict(ar_ms=ar_ms, refusion_mean_ms=refusion_mean, price_ratio=refusion_mean / ar_ms)
        if args.compile:
            refusion.forward = torch.compile(refusion.forward, dynamic=True)
            ar.forward = torch.compile(ar.forward, dynamic=True)
            decoder, decoder_recompiled = forward_times(
                refusion, args.cache, args.widths, args.repeats, decoder_forward
            )
            causal, causal_recompiled = forward_times(ar, args.cache, args.widths, args.repeats, causal_forward)
            entry["decoder, compiled"] = {str(w): t for w, t in decoder.items()}
            entry["causal, compiled"] = {str(w): t for w, t in causal.items()}
            entry["recompilations"] = decoder_recompiled + causal_recompiled
        if args.static_compiled:
            decoder, ar_ms = static_compiled_times(refusion, ar, args.cache, args.widths, args.repeats,
                                                   compile_mode(device))  # fmt: skip
            entry["decoder, static compiled"] = {str(w): t for w, t in decoder.items()}
            refusion_mean = mean_price(decoder, mix)
            entry["static compiled"] = dict(
                ar_ms=ar_ms, refusion_mean_ms=refusion_mean, price_ratio=refusion_mean / ar_ms
            )
        if args.draft_adapter:
            adapted = copy.deepcopy(refusion)
            adapted.add_draft_adapter(rank=args.draft_adapter)
            decoder, _ = forward_times(adapted, args.cache, args.widths, args.repeats, decoder_forward)
            entry["decoder, draft adapter"] = {str(w): t for w, t in decoder.items()}
            if args.static_compiled:
                decoder, _ = static_compiled_times(adapted, ar, args.cache, args.widths, args.repeats,
                                                   compile_mode(device))  # fmt: skip
                entry["decoder, draft adapter, static compiled"] = {str(w): t for w, t in decoder.items()}
            del adapted
        results["dtypes"][name] = entry
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {json.dumps(entry)}", flush=True)
        del refusion, ar

    table = markdown(results)
    print(table)
    write_results(args.output_dir, "forward_cost", table, results, lambda path: plot(results, path))


if __name__ == "__main__":
    main()
