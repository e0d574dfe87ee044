"""Quality against speed: the recipe's ReFusion SmolLM2 vs the base model's autoregressive generate(), side by side.

    python -m benchmarks.quality_speed --output_dir DIR [--prompts 32] [--max_new_tokens 64]
        [--adapter recipe/artifacts/smollm2/adapter] [--settings NAME ...]
        [--checkpoints outputs/recipe-smollm2/stage-2/refusion/checkpoint-62 ...]
        [--device cpu] [--dtype float32] [--ar_dtypes float32 bfloat16] [--ar_compiled bfloat16] [--repeats 1]

Same held-out prompts (never trained on), same weights, one run. Decoders: the base model's greedy generate()
(the AR teacher, also timed eagerly in each of `--ar_dtypes` and with transformers' compiled static-cache
generate() in each of `--ar_compiled`, its one-off compile time recorded; every AR row is timed `--repeats` times
in interleaved rounds, and the fastest AR decoding, named in the table, is the 1.0x of every batch-1 speed-up), the
converted model decoded token by token with transformers' generate() (what the adapter costs, apart
from the decoding order), ReFusion over a grid of whole decoding settings (`GRID`: the shipped one, and the fast
rule with whole-slot checks at slot 16, block 32, thresholds 0.8 / 0.3 changed as each name says: infill mode
reference, the fused MDM redraft, draft windows of 2 and 4, slot sizes 4-32, block lengths 16-64, slot thresholds
0.3-0.8, token thresholds 0.1-0.9, the authors' setting), and the token-level ablation (slot size 1). ReFusion
decodes in `--dtype` (default: the dtype policy, `recipe.model.decoding_dtype`). Every decoder is scored by
`recipe.evaluate.Evaluation`: tokens/s and speed-up over AR at batch 1 (and at batch 8 for AR and the chosen
setting), forwards, tokens per forward by our definition (committed / forwards) and by the authors' (mean per-step
ratio), the share of time outside model forwards, generative perplexity under the base model, agreement with the
teacher's answer (exact match, word F1), and accuracy on the verifiable prompts the teacher answers correctly.
The chosen setting is the fastest one within 5% of AR on word F1 (against the converted model's own AR decoding)
and generative perplexity, else the best word F1 at >= 1 token per forward. With
`--checkpoints`, the chosen setting is also measured after each saved fraction of the training. Writes
`results.json` (with every row's whole setting), `results.md` and `quality_vs_speed.png` into `--output_dir`, which
has no default: a run in another dtype or with other settings names its own folder rather than overwriting the
committed results (`benchmarks/results/smollm2-cpu`).
"""

import argparse
import copy
import re
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from benchmarks.settings import WHOLE_SLOTS, generation_config, setting, shipped
from recipe.decoding import (
    DecodeRun,
    compile_mode,
    compile_refusion,
    compiled_graphs,
    compiled_refusion,
    decode,
    decode_compiled_ar,
)
from recipe.evaluate import Evaluation, fastest, speed
from recipe.model import (
    SHIPPED_ADAPTER,
    decoding_dtype,
    load_base,
    load_refusion,
    prepare_for_decoding,
    with_adapter,
)
from recipe.prompts import PROMPT_SETS
from recipe.report import cell, write_results
from settings_refusion import DECODING_FIELDS

GRID = {  # name -> a whole decoding setting: the whole-slot fast rule changed as the name says, and what ships
    "shipped default": shipped(),  # the recipe config's `decoding` section (recipe/smollm2.yaml), as it is now
    "shipped, priced drafts": setting(shipped(), draft_schedule="price"),  # drafts per forward chosen by price
    "shipped, priced, copied drafts": setting(shipped(), draft_schedule="price", lookup_drafts=4),  # from the text
    "shipped, priced, copied drafts, token thr 0.5": setting(  # only a draft the model ranks first passes its check
        shipped(), draft_schedule="price", lookup_drafts=4, token_threshold=0.5
    ),
    "whole slots": WHOLE_SLOTS,
    "reference": setting(WHOLE_SLOTS, infill_mode="reference"),
    "fused redraft": setting(WHOLE_SLOTS, fused_redraft=True),
    "slot 4": setting(WHOLE_SLOTS, slot_size=4),
    "slot 8": setting(WHOLE_SLOTS, slot_size=8),
    "slot 32": setting(WHOLE_SLOTS, slot_size=32),
    "block 16": setting(WHOLE_SLOTS, block_length=16),
    "block 64": setting(WHOLE_SLOTS, block_length=64),
    "slot thr 0.5": setting(WHOLE_SLOTS, slot_threshold=0.5),
    "slot thr 0.3": setting(WHOLE_SLOTS, slot_threshold=0.3),
    "token thr 0.1": setting(WHOLE_SLOTS, token_threshold=0.1),
    "token thr 0.9": setting(WHOLE_SLOTS, token_threshold=0.9),
    "slot thr 0.5, token thr 0.1": setting(WHOLE_SLOTS, slot_threshold=0.5, token_threshold=0.1),
    "slot 8 + fused redraft": setting(WHOLE_SLOTS, slot_size=8, fused_redraft=True),
    "draft window 2": setting(WHOLE_SLOTS, draft_window=2),
    "draft window 4": setting(WHOLE_SLOTS, draft_window=4),
    "block 16, draft window 2": setting(WHOLE_SLOTS, block_length=16, draft_window=2),
    "fused redraft, draft window 4": setting(WHOLE_SLOTS, fused_redraft=True, draft_window=4),
    "reference, slot 4, block 16, 0.6/0.3 (authors')": setting(
        WHOLE_SLOTS, infill_mode="reference", slot_size=4, block_length=16, slot_threshold=0.6
    ),
    "slot 1 (tokens), 0.5": setting(WHOLE_SLOTS, slot_size=1, slot_threshold=0.5),
}
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


def interleaved(decoders: dict[str, Callable[[], DecodeRun]], repeats: int) -> dict[str, DecodeRun]:
    """Each decoder's fastest of `repeats` runs, timed in rounds (every decoder once a round), so that a busy spell
    of the machine slows them alike; a compiled decoder's `compile_seconds` is that of its first run (the one that
    compiled), its `recompiles` those of all its runs."""
    runs = {name: [] for name in decoders}
    for _ in range(repeats):
        for name, run in decoders.items():
            runs[name].append(run())
    best = {name: copy.copy(fastest(timed)) for name, timed in runs.items()}
    for name, run in best.items():
        if run.compile_seconds is not None:
            run.compile_seconds = runs[name][0].compile_seconds
            run.recompiles = sum(timed.recompiles for timed in runs[name])
    return best


def against_fastest_ar(rows: list[dict]) -> str:
    """Rescale the batch-1 speed-ups to the fastest batch-1 AR row of the base model (eager in several dtypes and
    compiled); return its name."""
    base_ar = [row for row in rows if row["name"].startswith(AR) and row["batch_size"] == 1]
    fastest = max(base_ar, key=lambda row: row["tokens_per_second"])
    for row in rows:
        if row["batch_size"] == 1:
            row["speedup"] = row["tokens_per_second"] / fastest["tokens_per_second"]
    return fastest["name"]


def markdown(results: dict) -> str:
    """The results as Markdown tables."""
    ar = results["rows"][0]
    lines = [
        f"Held-out prompts: {results['prompts']}, max_new_tokens {results['max_new_tokens']}, "
        f"{results['machine']}, {results['dtype']}. AR generative perplexity {ar['generative_perplexity']:.2f}; "
        f"AR accuracy on the verifiable prompts {ar['accuracy_verifiable']:.2f} ({results['ar_correct']} correct). "
        f"Times: the fastest of {results.get('repeats', 1)} run(s) of each decoder. Speed-ups at batch 1 are against "
        f"the fastest AR decoding: {results.get('fastest_ar', AR)}.{compiled_note(results)} ReFusion's linear "
        f"layers through oneDNN with prepacked weights: {results.get('refusion_prepacked_linears', 0)}.",
        "",
        f"Chosen: **{results['chosen']}** ({results['chosen_reason']}).",
        *settings_table(results.get("settings", {})),
        "",
        "| decoder | batch | tokens/s | speed-up vs AR (same batch) | forwards | tokens/forward | authors' TPF "
        "| accepted drafts / verify | outside forwards | gen. PPL (AR-scored) | exact match vs AR | word F1 vs AR "
        "| acc. where AR correct | repeated 4-grams |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in results["rows"]:
        per_forward = cell(row["tokens_per_forward"] if row["batch_size"] == 1 else None)  # batch: rows differ
        lines.append(
            f"| {row['name']} | {row['batch_size']} | {row['tokens_per_second']:.1f} | {row['speedup']:.2f}x "
            f"| {row['forwards']} | {per_forward} | {cell(row.get('step_tokens_per_forward'))} "
            f"| {cell(row['accepted_run_per_verify'])} | {cell(row['orchestration'], '.0%')} "
            f"| {row['generative_perplexity']:.2f} "
            f"| {row['exact_match']:.2f} | {row['token_f1']:.2f} | {cell(row['accuracy_where_ar_correct'])} "
            f"| {row['repetition']:.2f} |"
        )
    lines += acceptance_table(results["rows"])
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
            lines.append(
                f"| {row['name']} | {row['step']} | {row['tokens_per_forward']:.2f} | {row['speedup']:.2f}x "
                f"| {row['generative_perplexity']:.2f} | {row['token_f1']:.2f} "
                f"| {cell(row['accuracy_where_ar_correct'])} |"
            )
    return "\n".join(lines) + "\n"


def compiled_note(results: dict) -> str:
    """What the compiled rows (AR, and ReFusion's with `--refusion_compiled`) are, and what compiling them cost once
    (nothing for a run without them)."""
    compiled = [row for row in results["rows"] if row.get("compile_seconds") is not None]
    if not compiled:
        return ""
    costs = ", ".join(f"{row['name']} {row['compile_seconds']:.0f} s" for row in compiled)
    recompiles = sum(row["recompiles"] for row in compiled)
    return (
        f' Compiled AR: transformers\' generate(cache_implementation="static", compile_config=CompileConfig(mode='
        f'"{results["ar_compile_mode"]}")), compiled on every device; one-off compile (the warm-up before the '
        f"first timed run): {costs}; graphs compiled after the warm-ups: {recompiles}. Compiled ReFusion: "
        'generate(cache_implementation="static", compile_config=...) in the same mode: forwards padded to width '
        "buckets over ReFusion's static cache. Compiled forwards are not timed apart ('outside forwards': -)."
    )


def settings_table(settings: dict[str, dict]) -> list[str]:
    """Markdown lines: the whole decoding setting of every ReFusion row measured (none for an older run, which
    did not record them)."""
    if not settings:
        return []
    lines = [
        "",
        "Decoding settings of the ReFusion rows:",
        "",
        "| setting | " + " | ".join(DECODING_FIELDS) + " |",
        "| --- |" + " --- |" * len(DECODING_FIELDS),
    ]
    for name, decoding in settings.items():
        lines.append(f"| {name} | " + " | ".join(str(decoding[field]) for field in DECODING_FIELDS) + " |")
    return lines


def acceptance_table(rows: list[dict], offsets: int = 7) -> list[str]:
    """Markdown lines: for every ReFusion row at batch 1, the share of drafts accepted at slot offsets 1..`offsets`
    given the drafts before them in the same check were, for plan drafts and for redrafts."""
    profiled = [row for row in rows if row["batch_size"] == 1 and row["acceptance_by_offset"]]
    if not profiled:
        return []
    header = " | ".join(f"k={k}" for k in range(1, offsets + 1))
    lines = [
        "",
        "Acceptance profile (batch 1): share of the drafts at slot offset k that pass the check, given that the "
        "drafts before them in the same check did; plan drafts are checked by the verify forward, redrafts in infill "
        "rounds ('-': never checked). Accepted run: drafts accepted per slot check.",
        "",
        f"| decoder | source | accepted run | {header} |",
        "| --- | --- | ---: |" + " ---: |" * offsets,
    ]
    for row in profiled:
        for source, rates in row["acceptance_by_offset"].items():
            cells = " | ".join(cell(rate) for rate in (rates[1 : offsets + 1] + [None] * offsets)[:offsets])
            lines.append(f"| {row['name']} | {source} | {cell(row['accepted_run_per_check'])} | {cells} |")
    return lines


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
    parser.add_argument("--prompt_set", default="held_out", choices=PROMPT_SETS,
                        help="the recipe's held-out prompts, or the everyday ones (benchmarks/data)")  # fmt: skip
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--adapter", default=str(SHIPPED_ADAPTER))
    parser.add_argument(
        "--model", default=None, help="a saved ReFusion folder (e.g. a finetune.sft output) in place of --adapter"
    )
    parser.add_argument("--checkpoints", nargs="*", default=[], help="training checkpoints (adapters) to track")
    parser.add_argument("--settings", nargs="*", default=list(GRID), help=f"names from the grid: {list(GRID)}")
    parser.add_argument("--batch8", action="store_true", help="also time AR and the chosen setting at batch 8")
    parser.add_argument("--repeats", type=int, default=1, help="time every decoder this often, keep the fastest")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 where native, else float32")
    parser.add_argument(
        "--ar_dtypes", nargs="*", default=["float32", "bfloat16"], help="AR is also timed in these; the fastest is 1.0x"
    )
    parser.add_argument(
        "--ar_compiled",
        nargs="*",
        default=["bfloat16"],
        help="AR is also timed with transformers' compiled static-cache generate() in these dtypes (each compiles "
        "once: minutes on a 2-core CPU, less with inductor's disk cache warm; `none` or no dtype: skip); default "
        "bfloat16, the fastest AR measured on the project's AVX2 CPU and native on GPUs",
    )
    parser.add_argument(
        "--ar_compile_mode", default=None, help="torch.compile mode of --ar_compiled (default: by device)"
    )
    parser.add_argument(
        "--refusion_compiled",
        action="store_true",
        help="also decode each setting with compiled forwards over ReFusion's static cache (compiling its width "
        "buckets once: minutes on a 2-core CPU, less with inductor's disk cache warm), in --ar_compile_mode",
    )
    parser.add_argument(
        "--no_kernels", action="store_true", help="ReFusion without the policy's prepacked oneDNN linear layers"
    )
    parser.add_argument(
        "--output_dir", required=True, help="where results.json, results.md and quality_vs_speed.png go (overwritten)"
    )
    args = parser.parse_args()
    unknown = set(args.settings) - set(GRID)
    if unknown:
        parser.error(f"unknown settings {sorted(unknown)}; the grid has {list(GRID)}")

    dtype = decoding_dtype(args.dtype, args.device)
    base, tokenizer = load_base()
    if args.model is None:
        model, refusion_tokenizer = with_adapter(base.eval(), tokenizer, args.adapter)  # merged in float32, then cast
    else:
        model, refusion_tokenizer = load_refusion(args.model)
    eager_models = {  # the teacher decodes in `dtype`
        other: copy.deepcopy(base).to(args.device, other)
        for other in map(decoding_dtype, args.ar_dtypes)
        if other != dtype
    }
    compiled_models = {
        other: copy.deepcopy(base).to(args.device, other)
        for other in map(decoding_dtype, [name for name in args.ar_compiled if name != "none"])
    }
    mode = args.ar_compile_mode or compile_mode(args.device)
    base, model = base.to(args.device, dtype), model.to(args.device, dtype)
    packed = prepare_for_decoding(model, kernels=not args.no_kernels)  # ReFusion's forwards: the decoding policy
    evaluation = Evaluation(base, tokenizer, args.prompts, args.max_new_tokens, args.repeats, args.prompt_set)
    decode(model, refusion_tokenizer, evaluation.prompt_ids[:1], max_new_tokens=8)  # one-off costs of first calls
    configs = {name: generation_config(model, GRID[name]) for name in GRID}  # each setting whole, as named

    def scored(name: str, kind: str, run: DecodeRun, batch_size: int = 1) -> dict:
        row = evaluation.row(name, kind, run, batch_size)
        outputs.setdefault(name, evaluation.texts(run, refusion_tokenizer))
        print(
            f"[{time.strftime('%H:%M:%S')}] {name}, batch {batch_size}: "
            f"{row['tokens_per_forward']:.2f} tokens/forward, {row['speedup']:.2f}x AR, "
            f"F1 {row['token_f1']:.2f}, PPL {row['generative_perplexity']:.2f}",
            flush=True,
        )
        return row

    outputs = {AR: evaluation.teacher_texts}
    prompt_ids, max_new_tokens = evaluation.prompt_ids, args.max_new_tokens
    ar_decoders = {AR: partial(decode, base, tokenizer, prompt_ids, max_new_tokens)}  # the teacher: timed again
    for other, ar_model in eager_models.items():
        decode(ar_model, tokenizer, prompt_ids[:1], max_new_tokens=8)  # one-off costs of first calls
        ar_decoders[f"{AR}, {str(other).removeprefix('torch.')}"] = partial(
            decode, ar_model, tokenizer, prompt_ids, max_new_tokens
        )
    for other, ar_model in compiled_models.items():  # each run warms up (compiling the first time) before timing
        ar_decoders[f"{AR}, {str(other).removeprefix('torch.')}, compiled"] = partial(
            decode_compiled_ar, ar_model, tokenizer, prompt_ids, max_new_tokens, mode=mode
        )
    rows = [evaluation.ar_row]
    for name, run in interleaved(ar_decoders, args.repeats).items():
        if name == AR:
            evaluation.ar_row.update(speed(run, run.tokens_per_second))  # the same answers, timed in the rounds
            continue
        rows.append(row := evaluation.row(name, "ar", run, 1, evaluation.teacher))
        outputs[name] = evaluation.texts(run, tokenizer)
        row |= {"compile_seconds": run.compile_seconds, "recompiles": run.recompiles}
        compiled = f", compiled in {run.compile_seconds:.1f} s" if run.compile_seconds is not None else ""
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {run.tokens_per_second:.1f} tokens/s{compiled}", flush=True)
    del eager_models, compiled_models
    converted = evaluation.converted_ar_run(model, refusion_tokenizer)
    rows.append(converted_row := scored(CONVERTED_AR, "ar", converted))
    for name in args.settings:
        kind = "tokens" if GRID[name]["slot_size"] == 1 else "slots"
        rows.append(scored(name, kind, evaluation.timed(model, refusion_tokenizer, generation_config=configs[name])))
    if args.refusion_compiled:  # each setting again, through compiled forwards over the static cache
        options = dict(compiled_refusion(args.device, args.ar_compile_mode), time_forwards=False)
        for name in args.settings:
            kind = "tokens" if GRID[name]["slot_size"] == 1 else "slots"
            config = configs[name]  # warm-up: every width bucket compiled, then one decode's other one-off costs
            warm_up = compile_refusion(model, prompt_ids, max_new_tokens, options["compile_config"], 1, config)
            decode(model, refusion_tokenizer, prompt_ids[:1], 8, generation_config=config, **options)
            graphs = compiled_graphs()
            run = evaluation.timed(model, refusion_tokenizer, generation_config=configs[name], **options)
            rows.append(row := scored(f"{name}, compiled", kind, run))
            row |= {"compiled": True, "compile_seconds": warm_up, "recompiles": compiled_graphs() - graphs}
    fastest_ar = against_fastest_ar(rows)
    chosen, reason = choose_setting([row for row in rows if not row.get("compiled")], converted_row)
    if args.batch8:
        rows.append(evaluation.ar_row_at(8))
        run = evaluation.timed(model, refusion_tokenizer, batch_size=8, generation_config=configs[chosen])
        rows.append(scored(chosen, "slots", run, 8))

    progress = []
    for checkpoint in args.checkpoints:
        step = int(re.search(r"(\d+)$", Path(checkpoint).name.rstrip("/")).group(1))
        name = Path(checkpoint).name  # the checkpoint's model is converted as `model` was: its config fits
        row = evaluation.adapter_rows(name, checkpoint, converted_ar=False, generation_config=configs[chosen])
        progress.append({**row["refusion"], "step": step})

    prompts = evaluation.prompts
    results = {
        "machine": evaluation.machine,
        "device": args.device,
        "dtype": str(dtype).removeprefix("torch."),
        "fastest_ar": fastest_ar,
        "refusion_prepacked_linears": packed,
        "ar_compile_mode": mode,
        "torch": torch.__version__,
        "prompts": len(prompts),
        "prompt_set": args.prompt_set,
        "repeats": args.repeats,
        "max_new_tokens": args.max_new_tokens,
        "adapter": args.adapter,
        "ar_correct": len(evaluation.correct),
        "chosen": chosen,
        "chosen_reason": reason,
        "chosen_settings": GRID[chosen],
        "settings": {name: GRID[name] for name in args.settings},
        "rows": rows,
        "progress": progress,
        "outputs": {"prompts": [p.text for p in prompts], **outputs},
    }
    table = markdown(results)
    print(table)
    plotted = dict(plot=lambda path: plot(results, path), plot_stem="quality_vs_speed")
    write_results(args.output_dir, "results", table, results, **plotted)


if __name__ == "__main__":
    main()
