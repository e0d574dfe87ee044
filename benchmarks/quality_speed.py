"""Quality against speed: the recipe's ReFusion SmolLM2 vs the base model's autoregressive generate(), side by side.

    python benchmarks/quality_speed.py [--prompts 32] [--max_new_tokens 64] [--adapter recipe/artifacts/smollm2/adapter]
        [--checkpoints outputs/recipe-smollm2/refusion/checkpoint-62 ...] [--device cpu] [--dtype float32]
        [--output_dir benchmarks/results/smollm2-cpu]

Same held-out prompts (never trained on), same weights, one run. Decoders: the base model's greedy generate()
(the AR teacher), the converted model decoded token by token with transformers' generate() (what the adapter costs,
apart from the decoding order), ReFusion over a grid around a centre setting (infill mode fast / reference / fast
with the fused MDM redraft; slot sizes 4-32; block lengths 16-64; slot thresholds 0.3-0.9; token thresholds
0.1-0.9), and the token-level ablation (slot size 1). Per decoder: tokens/s and speed-up over AR at batch 1 (and at
batch 8 for AR and the chosen setting), forwards, tokens per forward by our definition (committed / forwards) and
by the authors' (mean per-step ratio), the share of time outside model forwards, generative perplexity under the
base model, agreement with the teacher's answer (exact match, word F1), and accuracy on the verifiable prompts the
teacher answers correctly. The chosen setting is the fastest one within 5% of AR on word F1 (against the converted
model's own AR decoding) and generative perplexity, else the best word F1 at >= 1 token per forward. With
`--checkpoints`, the chosen setting is also measured after each saved fraction of the training. Writes
`results.json`, `results.md` and `quality_vs_speed.png` into `--output_dir`.
"""

import argparse
import json
import platform
import re
import time
from pathlib import Path

import torch

from recipe.decoding import DecodeRun, chat_prompt_ids, decode
from recipe.metrics import answer_nll, contains_reference, exact_match, perplexity, token_f1
from recipe.model import SHIPPED_ADAPTER, load_base, with_adapter
from recipe.prompts import Prompt, build_prompts, interleave_kinds, split_prompts

CENTRE = dict(slot_size=8, block_length=32, slot_threshold=0.8, token_threshold=0.3, infill_mode="fast")
VARIATIONS = {  # name -> changes from CENTRE; one knob at a time, plus the authors' own default
    "fast": {},
    "reference": dict(infill_mode="reference"),
    "fast + fused redraft": dict(fused_redraft=True),
    "slot 4": dict(slot_size=4),
    "slot 16": dict(slot_size=16),
    "slot 32": dict(slot_size=32),
    "block 16": dict(block_length=16),
    "block 64": dict(block_length=64),
    "slot thr 0.5": dict(slot_threshold=0.5),
    "slot thr 0.3": dict(slot_threshold=0.3),
    "token thr 0.1": dict(token_threshold=0.1),
    "token thr 0.9": dict(token_threshold=0.9),
    "slot 16 + fused redraft": dict(slot_size=16, fused_redraft=True),
    "slot 16, 0.5/0.1": dict(slot_size=16, slot_threshold=0.5, token_threshold=0.1),
    "slot 32, 0.5/0.1": dict(slot_size=32, slot_threshold=0.5, token_threshold=0.1),
    "reference, slot 4, block 16, 0.6/0.3 (authors')": dict(
        infill_mode="reference", slot_size=4, block_length=16, slot_threshold=0.6
    ),
    "slot 1 (tokens), 0.5": dict(slot_size=1, slot_threshold=0.5, block_length=32),
}
GRID = {name: {**CENTRE, **change} for name, change in VARIATIONS.items()}
AR = "AR: base generate()"
CONVERTED_AR = "AR: converted model, token by token"


def choose_setting(rows: list[dict], reference: dict) -> tuple[str, str]:
    """The fastest ReFusion row within 5% of `reference` (the converted model's AR row) on word F1 and generative
    perplexity, else the best word F1 at >= 1 token per forward, else the best word F1; and the reason."""
    candidates = [row for row in rows if row["kind"] in ("slots", "tokens") and row["batch_size"] == 1]
    close = [
        row
        for row in candidates
        if row["token_f1"] >= 0.95 * reference["token_f1"]
        and row["generative_perplexity"] <= 1.05 * reference["generative_perplexity"]
    ]
    if close:
        return max(close, key=lambda row: row["speedup"])["name"], "fastest within 5% of AR quality"
    parallel = [row for row in candidates if row["tokens_per_forward"] >= 1.0]
    if parallel:
        return max(parallel, key=lambda row: row["token_f1"])["name"], "best word F1 at >= 1 token per forward"
    return max(candidates, key=lambda row: row["token_f1"])["name"], "best word F1 (none reaches 1 token/forward)"


def benchmark_prompts(count: int) -> list[Prompt]:
    """`count` held-out prompts: half verifiable (factual, arithmetic), half open-ended, kinds interleaved."""
    _, held_out = split_prompts(build_prompts())
    verifiable = interleave_kinds([p for p in held_out if p.reference is not None])
    open_ended = interleave_kinds([p for p in held_out if p.reference is None])
    return verifiable[: count // 2] + open_ended[: count - count // 2]


def quality(run: DecodeRun, teacher: DecodeRun, prompts: list[Prompt], tokenizer, scores, correct: list[int]) -> dict:
    """The quality metrics of `run` against the AR `teacher` (`scores`: the base model's NLL of each answer)."""
    texts = [tokenizer.decode(answer, skip_special_tokens=True) for answer in run.answers]
    references = [tokenizer.decode(answer, skip_special_tokens=True) for answer in teacher.answers]
    verifiable = [i for i, p in enumerate(prompts) if p.reference is not None]
    return {
        "generative_perplexity": perplexity(scores),
        "exact_match": sum(exact_match(t, r) for t, r in zip(texts, references)) / len(texts),
        "token_f1": sum(token_f1(t, r) for t, r in zip(texts, references)) / len(texts),
        "accuracy_where_ar_correct": (
            sum(contains_reference(texts[i], prompts[i].reference) for i in correct) / len(correct) if correct else None
        ),
        "accuracy_verifiable": sum(contains_reference(texts[i], prompts[i].reference) for i in verifiable)
        / max(len(verifiable), 1),
    }


def fastest(runs: list[DecodeRun]) -> DecodeRun:
    """The quickest of repeated runs: greedy decoding gives the same answers every time, a busy machine only adds
    time."""
    if any(run.answers != runs[0].answers for run in runs):
        raise RuntimeError("Repeated greedy runs gave different answers.")
    return min(runs, key=lambda run: run.seconds)


def speed(run: DecodeRun, ar_tokens_per_second: float) -> dict:
    steps = run.step_tokens_per_forward
    return {
        "tokens": run.tokens,
        "seconds": run.seconds,
        "tokens_per_second": run.tokens_per_second,
        "speedup": run.tokens_per_second / ar_tokens_per_second,
        "forwards": run.forwards,
        "tokens_per_forward": run.tokens_per_forward,
        "step_tokens_per_forward": sum(steps) / len(steps) if steps else None,
        "orchestration": run.orchestration,
    }


def markdown(results: dict) -> str:
    """The results as Markdown tables."""
    ar = results["rows"][0]
    lines = [
        f"Held-out prompts: {results['prompts']}, max_new_tokens {results['max_new_tokens']}, "
        f"{results['machine']}, {results['dtype']}. AR generative perplexity {ar['generative_perplexity']:.2f}; "
        f"AR accuracy on the verifiable prompts {ar['accuracy_verifiable']:.2f} ({results['ar_correct']} correct). "
        f"Times: the fastest of {results.get('repeats', 1)} run(s) of each decoder.",
        "",
        f"Centre setting: {CENTRE}; each ReFusion row changes what its name says. Chosen: **{results['chosen']}** "
        f"({results['chosen_reason']}).",
        "",
        "| decoder | batch | tokens/s | speed-up vs AR (same batch) | forwards | tokens/forward | authors' TPF "
        "| outside forwards | gen. PPL (AR-scored) | exact match vs AR | word F1 vs AR | acc. where AR correct |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in results["rows"]:
        accuracy = row["accuracy_where_ar_correct"]
        per_forward = f"{row['tokens_per_forward']:.2f}" if row["batch_size"] == 1 else "-"  # batch: rows differ
        steps = row.get("step_tokens_per_forward")
        lines.append(
            f"| {row['name']} | {row['batch_size']} | {row['tokens_per_second']:.1f} | {row['speedup']:.2f}x "
            f"| {row['forwards']} | {per_forward} | {'-' if steps is None else f'{steps:.2f}'} "
            f"| {row['orchestration']:.0%} | {row['generative_perplexity']:.2f} "
            f"| {row['exact_match']:.2f} | {row['token_f1']:.2f} | {'-' if accuracy is None else f'{accuracy:.2f}'} |"
        )
    if results["progress"]:
        lines += [
            "",
            f"Training progress ({results['chosen']}, batch 1):",
            "",
            "| checkpoint | step | tokens/forward | speed-up vs AR | gen. PPL | word F1 vs AR "
            "| acc. where AR correct |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for row in results["progress"]:
            accuracy = row["accuracy_where_ar_correct"]
            lines.append(
                f"| {row['name']} | {row['step']} | {row['tokens_per_forward']:.2f} | {row['speedup']:.2f}x "
                f"| {row['generative_perplexity']:.2f} | {row['token_f1']:.2f} "
                f"| {'-' if accuracy is None else f'{accuracy:.2f}'} |"
            )
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    """Quality (word F1 with the AR teacher; generative perplexity) against speed-up, one point per decoder."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in results["rows"] if row["batch_size"] == 1]
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for axis, metric, label in [
        (axes[0], "token_f1", "word F1 with the AR teacher's answer (higher is better)"),
        (axes[1], "generative_perplexity", "generative perplexity under the base model (lower is better)"),
    ]:
        for row in rows:
            style = {"ar": ("*", "black", 220), "slots": ("o", "tab:blue", 60), "tokens": ("^", "tab:red", 60)}
            marker, color, size = style[row["kind"]]
            axis.scatter(row["speedup"], row[metric], marker=marker, color=color, s=size)
            axis.annotate(
                row["name"].removeprefix("AR: "),
                (row["speedup"], row[metric]),
                fontsize=7,
                xytext=(4, 4),
                textcoords="offset points",
            )
        axis.axvline(1.0, color="grey", linewidth=0.5)
        axis.set_xlabel("wall-clock speed-up over AR generate(), batch 1")
        axis.set_ylabel(label)
    axes[1].set_yscale("log")
    axes[0].set_title("ReFusion slots (o), token-level ablation (^), AR (*)", fontsize=9)
    figure.suptitle(
        f"ReFusion SmolLM2-135M vs AR: {results['prompts']} held-out prompts, {results['machine']}", fontsize=10
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--adapter", default=str(SHIPPED_ADAPTER))
    parser.add_argument("--checkpoints", nargs="*", default=[], help="training checkpoints (adapters) to track")
    parser.add_argument("--settings", nargs="*", default=list(GRID), help=f"names from the grid: {list(GRID)}")
    parser.add_argument("--batch8", action="store_true", help="also time AR and the chosen setting at batch 8")
    parser.add_argument("--repeats", type=int, default=1, help="time every decoder this often, keep the fastest")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--output_dir", default="benchmarks/results/smollm2-cpu")
    args = parser.parse_args()
    unknown = set(args.settings) - set(GRID)
    if unknown:
        parser.error(f"unknown settings {sorted(unknown)}; the grid has {list(GRID)}")

    dtype = getattr(torch, args.dtype)
    base, tokenizer = load_base()
    model, refusion_tokenizer = with_adapter(base, tokenizer, args.adapter)
    base, model = base.to(args.device, dtype).eval(), model.to(args.device, dtype)
    prompts = benchmark_prompts(args.prompts)
    prompt_ids = chat_prompt_ids(tokenizer, [p.text for p in prompts])
    base_vocab = base.get_input_embeddings().num_embeddings

    for warm_up in (base, model):  # first calls pay one-off costs (allocations, kernel selection)
        decode(warm_up, refusion_tokenizer, prompt_ids[:1], max_new_tokens=8)

    def measure(name: str, kind: str, run: DecodeRun, batch_size: int, ar: dict | None, teacher: DecodeRun) -> dict:
        if any(token >= base_vocab for answer in run.answers for token in answer):
            raise RuntimeError(f"{name}: an answer holds a token outside the base vocabulary (a [MASK]?).")
        scores = answer_nll(base, prompt_ids, run.answers)
        row = {"name": name, "kind": kind, "batch_size": batch_size}
        row |= speed(run, ar["tokens_per_second"] if ar else run.tokens_per_second)
        row |= quality(run, teacher, prompts, tokenizer, scores, correct)
        print(
            f"[{time.strftime('%H:%M:%S')}] "
            + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
            flush=True,
        )
        return row

    def timed(*decode_args, **decode_kwargs) -> DecodeRun:
        return fastest([decode(*decode_args, **decode_kwargs) for _ in range(args.repeats)])

    teacher = timed(base, tokenizer, prompt_ids, args.max_new_tokens)
    teacher_texts = [tokenizer.decode(answer, skip_special_tokens=True) for answer in teacher.answers]
    correct = [i for i, p in enumerate(prompts) if p.reference and contains_reference(teacher_texts[i], p.reference)]
    ar_row = measure(AR, "ar", teacher, 1, None, teacher)
    rows = [ar_row]
    outputs = {AR: teacher_texts}
    mask = [model.config.mask_token_id]  # never proposed by ReFusion either
    converted = timed(
        model, refusion_tokenizer, prompt_ids, args.max_new_tokens, autoregressive=True, suppress_tokens=mask
    )
    rows.append(converted_row := measure(CONVERTED_AR, "ar", converted, 1, ar_row, teacher))
    outputs[CONVERTED_AR] = [refusion_tokenizer.decode(a, skip_special_tokens=True) for a in converted.answers]
    for name in args.settings:
        kind = "tokens" if GRID[name]["slot_size"] == 1 else "slots"
        run = timed(model, refusion_tokenizer, prompt_ids, args.max_new_tokens, **GRID[name])
        rows.append(measure(name, kind, run, 1, ar_row, teacher))
        outputs[name] = [refusion_tokenizer.decode(answer, skip_special_tokens=True) for answer in run.answers]
    chosen, reason = choose_setting(rows, converted_row)
    if args.batch8:
        ar8 = timed(base, tokenizer, prompt_ids, args.max_new_tokens, batch_size=8)
        rows.append(ar8_row := measure(AR, "ar", ar8, 8, None, teacher))
        run = timed(model, refusion_tokenizer, prompt_ids, args.max_new_tokens, batch_size=8, **GRID[chosen])
        rows.append(measure(chosen, "slots", run, 8, ar8_row, teacher))

    progress = []
    for checkpoint in args.checkpoints:
        step = int(re.search(r"(\d+)$", Path(checkpoint).name.rstrip("/")).group(1))
        adapted = with_adapter(base, tokenizer, checkpoint)[0].to(args.device, dtype)
        run = decode(adapted, refusion_tokenizer, prompt_ids, args.max_new_tokens, **GRID[chosen])
        progress.append({**measure(Path(checkpoint).name, "slots", run, 1, ar_row, teacher), "step": step})
        del adapted

    results = {
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads"
        if args.device == "cpu"
        else torch.cuda.get_device_name(args.device),
        "device": args.device,
        "dtype": args.dtype,
        "torch": torch.__version__,
        "prompts": len(prompts),
        "repeats": args.repeats,
        "max_new_tokens": args.max_new_tokens,
        "adapter": args.adapter,
        "ar_correct": len(correct),
        "chosen": chosen,
        "chosen_reason": reason,
        "chosen_settings": GRID[chosen],
        "rows": rows,
        "progress": progress,
        "outputs": {"prompts": [p.text for p in prompts], **outputs},
    }
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    (output_dir / "results.md").write_text(markdown(results), encoding="utf-8")
    plot(results, output_dir / "quality_vs_speed.png")
    print(markdown(results))
    print(f"written: {output_dir}/results.json, results.md, quality_vs_speed.png")


if __name__ == "__main__":
    main()
