"""Which training knobs buy tokens per forward: short runs, one change each, scored alike.

    python -m recipe.ablate --config recipe/smollm2.yaml [--section ablations] [--only NAME ...] [--set ...]

Every variant of the config's ablation section (`ablations` by default) is the first stage's `sft` settings, then
the section's own `sft` (which may continue an adapter with `init_adapter`), then the variant's changes, trained for
`steps` steps on the first `rows` distilled rows, then scored by `recipe.evaluate.Evaluation` at the shipped
decoding setting (and with the fused redraft too when the section says `score_fused: true`) on `prompts` held-out
prompts (one teacher decoding shared by all). Results go to `artifacts_dir/<section>.json` after each variant (a
rerun skips the variants already there) and, as a table, to `<section>.md`.
"""

import argparse
import re
import time
from pathlib import Path

from finetune.files import read_json
from recipe.evaluate import Evaluation
from recipe.model import load_base
from recipe.report import cell, write_results
from recipe.run import (
    DATA_FILE,
    INTEGER,
    MAPPING,
    check_keys,
    config_model,
    load_config,
    read_rows,
    stage_settings,
    train_adapter,
    write_rows,
)


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def variant_settings(config: dict, changes: dict, section: str = "ablations") -> dict:
    """The first stage's `sft` settings, then the section's `sft` ones (e.g. a smaller batch), then `changes`, for
    the section's `steps` steps and without checkpoints."""
    settings = config[section]
    first = stage_settings(config, config["stages"][0])
    return {**first, **settings.get("sft", {}), **changes, "max_steps": settings["steps"], "save_strategy": "no"}


def markdown(results: dict) -> str:
    origin = f"continuing {results['init_adapter']}" if results.get("init_adapter") else "from scratch"
    lines = [
        f"{results['steps']} LoRA steps {origin} on {results['rows']} distilled rows per variant; scored at the "
        f"shipped decoding setting ({results['decoding']}) on {results['prompts']} held-out prompts, batch 1, "
        f"{results['machine']}. Losses: mean of the last three logged steps. (Wall-clock speed-ups are left to the "
        "frontier benchmark: a short run's timing is at the mercy of whatever else the machine runs.) Accepted "
        "drafts per verifying forward and plan k=1 (the share of plan drafts accepted at slot offset 1) come from "
        "the decoder's acceptance profile; the fused columns score the same adapter with `fused_redraft=True`.",
        "",
        "| variant | changes | train min | final ar_loss | final mdm_loss | tokens/forward | authors' TPF "
        "| accepted / verify | plan k=1 | word F1 vs AR | gen. PPL | acc. where AR correct | repeated 4-grams "
        "| fused: tokens/forward | fused: accepted / verify | fused: word F1 |",
        "| --- | --- |" + " ---: |" * 14,
    ]
    for name, entry in results["variants"].items():
        row, losses, fused = entry["row"], entry["losses"], entry.get("fused_row") or {}
        accuracy = row["accuracy_where_ar_correct"]
        plan = (row.get("acceptance_by_offset") or {}).get("plan", [None, None])[1]
        lines.append(
            f"| {name} | {entry['changes'] or '-'} | {entry['train_minutes']:.1f} | {losses['ar_loss']:.2f} "
            f"| {losses['mdm_loss']:.2f} | {row['tokens_per_forward']:.2f} | {row['step_tokens_per_forward']:.2f} "
            f"| {cell(row.get('accepted_run_per_verify'))} | {cell(plan)} "
            f"| {row['token_f1']:.2f} | {row['generative_perplexity']:.2f} "
            f"| {cell(accuracy)} | {cell(row.get('repetition'))} | {cell(fused.get('tokens_per_forward'))} "
            f"| {cell(fused.get('accepted_run_per_verify'))} | {cell(fused.get('token_f1'))} |"
        )
    return "\n".join(lines) + "\n"


def final_losses(log_history: list[dict], window: int = 3) -> dict:
    """Mean `ar_loss` and `mdm_loss` over the last `window` logged steps (one log is noisy)."""
    logs = [entry for entry in log_history if "mdm_loss" in entry][-window:]
    if not logs:
        raise ValueError("The run logged no loss: set sft.logging_steps below ablations.steps.")
    return {name: sum(entry[name] for entry in logs) / len(logs) for name in ("ar_loss", "mdm_loss")}


def ablate(config: dict, only: list[str] | None = None, section: str = "ablations") -> dict:
    """Train and score every variant of `section` (or those in `only`) not yet in `<section>.json`; return the
    results."""
    if section not in config:
        raise ValueError(f"The config has no {section!r} section.")
    keys = {section: MAPPING, f"{section}.variants": MAPPING, f"{section}.sft": MAPPING}
    keys |= {f"{section}.{name}": INTEGER for name in ("steps", "rows", "prompts")}
    check_keys(config, keys, "the config", optional={f"{section}.sft"})
    settings = config[section]
    variants = settings["variants"]
    for name, changes in variants.items():
        if not isinstance(changes, dict):
            raise ValueError(
                f"the config: {section}.variants.{name} must be a mapping of sft settings, got {changes!r}."
            )
    unknown = set(only or []) - set(variants)
    if unknown:
        raise ValueError(f"Unknown variants {sorted(unknown)}; the config has {list(variants)}.")
    output_dir, artifacts = Path(config["output_dir"]) / section, Path(config["artifacts_dir"])
    results_file = artifacts / f"{section}.json"
    results = read_json(results_file, default={})  # a file that is not JSON raises, naming it
    if not isinstance(results, dict) or not isinstance(results.setdefault("variants", {}), dict):
        raise ValueError(f"{results_file} does not hold an ablation's results (an object with 'variants').")
    rows = read_rows(artifacts / DATA_FILE)[: settings["rows"]]
    if len(rows) < settings["rows"]:
        raise ValueError(f"{artifacts / DATA_FILE} holds {len(rows)} rows; run the recipe's first stage first.")
    output_dir.mkdir(parents=True, exist_ok=True)
    data = output_dir / DATA_FILE
    write_rows(data, rows)

    model = config_model(config)
    base, tokenizer = load_base(*model)
    evaluation = Evaluation(base, tokenizer, settings["prompts"], config["evaluation"]["max_new_tokens"])
    results |= {
        "steps": settings["steps"],
        "rows": settings["rows"],
        "prompts": settings["prompts"],
        "decoding": config["decoding"],
        "init_adapter": settings.get("sft", {}).get("init_adapter"),
        "machine": evaluation.machine,
        "ar": evaluation.ar_row,
    }
    for name in only or variants:
        if name in results["variants"]:
            print(f"[ablate] {name}: already measured, skipped")
            continue
        start = time.perf_counter()
        trained = output_dir / slug(name)
        state = train_adapter(variant_settings(config, variants[name], section), model, data, trained)
        minutes = (time.perf_counter() - start) / 60
        row = evaluation.adapter_rows(name, trained / "adapter", converted_ar=False)["refusion"]
        results["variants"][name] = {
            "changes": variants[name],
            "train_minutes": minutes,
            "losses": final_losses(state["log_history"]),
            "row": row,
        }
        if settings.get("score_fused"):
            fused = evaluation.adapter_rows(name, trained / "adapter", converted_ar=False, fused_redraft=True)
            results["variants"][name]["fused_row"] = fused["refusion"]
        write_results(artifacts, section, markdown(results), results)
        print(f"[ablate] {name}: {row['tokens_per_forward']:.2f} tokens/forward, F1 {row['token_f1']:.2f}", flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="recipe/smollm2.yaml")
    parser.add_argument("--section", default="ablations", help="the config section holding the variants")
    parser.add_argument("--only", nargs="*", default=None, help="variant names to run (default: all)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args(argv)
    try:
        results = ablate(load_config(args.config, args.set), args.only, args.section)
    except ValueError as error:
        parser.error(str(error))
    print(markdown(results))


if __name__ == "__main__":
    main()
