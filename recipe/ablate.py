"""Which training knobs buy tokens per forward: short runs from scratch, one change each, scored alike.

    python -m recipe.ablate --config recipe/smollm2.yaml [--only NAME ...] [--set ablations.steps=30 ...]

Every variant of the config's `ablations` section is the first stage's `sft` settings with the variant's changes,
trained for `ablations.steps` steps on the first `ablations.rows` distilled rows, then scored by
`recipe.evaluate.Evaluation` at the shipped decoding setting on `ablations.prompts` held-out prompts (one teacher
decoding shared by all). Results go to `artifacts_dir/ablations.json` after each variant (a rerun skips the
variants already there) and, as a table, to `ablations.md`.
"""

import argparse
import json
import re
import time
from pathlib import Path

from recipe.evaluate import Evaluation
from recipe.model import load_base
from recipe.run import DATA_FILE, config_model, load_config, read_rows, stage_settings, train_adapter, write_rows


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def variant_settings(config: dict, changes: dict) -> dict:
    """The first stage's `sft` settings, then the `ablations.sft` ones (e.g. a smaller batch), then `changes`, for
    `ablations.steps` steps and without checkpoints."""
    settings = config["ablations"]
    first = stage_settings(config, config["stages"][0])
    return {**first, **settings.get("sft", {}), **changes, "max_steps": settings["steps"], "save_strategy": "no"}


def markdown(results: dict) -> str:
    lines = [
        f"{results['steps']} LoRA steps from scratch on {results['rows']} distilled rows per variant; scored at the "
        f"shipped decoding setting ({results['decoding']}) on {results['prompts']} held-out prompts, batch 1, "
        f"{results['machine']}. Losses: mean of the last three logged steps. (Wall-clock speed-ups are left to the "
        "frontier benchmark: a short run's timing is at the mercy of whatever else the machine runs.)",
        "",
        "| variant | changes | train min | final ar_loss | final mdm_loss | tokens/forward | authors' TPF "
        "| word F1 vs AR | gen. PPL | acc. where AR correct | repeated 4-grams |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, entry in results["variants"].items():
        row, losses = entry["row"], entry["losses"]
        accuracy = row["accuracy_where_ar_correct"]
        lines.append(
            f"| {name} | {entry['changes'] or '-'} | {entry['train_minutes']:.1f} | {losses['ar_loss']:.2f} "
            f"| {losses['mdm_loss']:.2f} | {row['tokens_per_forward']:.2f} | {row['step_tokens_per_forward']:.2f} "
            f"| {row['token_f1']:.2f} | {row['generative_perplexity']:.2f} "
            f"| {'-' if accuracy is None else f'{accuracy:.2f}'} | {cell(row.get('repetition'))} |"
        )
    return "\n".join(lines) + "\n"


def cell(value: float | None) -> str:
    """A table cell: two decimals, or '-' for a figure an older run did not record."""
    return "-" if value is None else f"{value:.2f}"


def final_losses(log_history: list[dict], window: int = 3) -> dict:
    """Mean `ar_loss` and `mdm_loss` over the last `window` logged steps (one log is noisy)."""
    logs = [entry for entry in log_history if "mdm_loss" in entry][-window:]
    if not logs:
        raise ValueError("The run logged no loss: set sft.logging_steps below ablations.steps.")
    return {name: sum(entry[name] for entry in logs) / len(logs) for name in ("ar_loss", "mdm_loss")}


def ablate(config: dict, only: list[str] | None = None) -> dict:
    """Train and score every variant (or those in `only`) not yet in `ablations.json`; return the results."""
    settings = config["ablations"]
    variants = settings["variants"]
    unknown = set(only or []) - set(variants)
    if unknown:
        raise ValueError(f"Unknown variants {sorted(unknown)}; the config has {list(variants)}.")
    output_dir, artifacts = Path(config["output_dir"]) / "ablations", Path(config["artifacts_dir"])
    results_file = artifacts / "ablations.json"
    results = json.loads(results_file.read_text(encoding="utf-8")) if results_file.exists() else {}
    results.setdefault("variants", {})
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
        "machine": evaluation.machine,
        "ar": evaluation.ar_row,
    }
    for name in only or variants:
        if name in results["variants"]:
            print(f"[ablate] {name}: already measured, skipped")
            continue
        start = time.perf_counter()
        trained = output_dir / slug(name)
        state = train_adapter(variant_settings(config, variants[name]), model, data, trained)
        minutes = (time.perf_counter() - start) / 60
        row = evaluation.adapter_rows(name, trained / "adapter", converted_ar=False)["refusion"]
        results["variants"][name] = {
            "changes": variants[name],
            "train_minutes": minutes,
            "losses": final_losses(state["log_history"]),
            "row": row,
        }
        results_file.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
        (artifacts / "ablations.md").write_text(markdown(results), encoding="utf-8")
        print(f"[ablate] {name}: {row['tokens_per_forward']:.2f} tokens/forward, F1 {row['token_f1']:.2f}", flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="recipe/smollm2.yaml")
    parser.add_argument("--only", nargs="*", default=None, help="variant names to run (default: all)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args(argv)
    try:
        results = ablate(load_config(args.config, args.set), args.only)
    except ValueError as error:
        parser.error(str(error))
    print(markdown(results))


if __name__ == "__main__":
    main()
