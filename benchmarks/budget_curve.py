"""The budget curve: what the shipped model's decoding reaches after each stage of training, against CPU minutes.

    python -m benchmarks.budget_curve --output_dir DIR [--artifacts recipe/artifacts/smollm2]

Reads the recipe's training log (`python -m recipe.run` scores every stage, and the checkpoints inside it, on the
same held-out prompts at the shipped decoding setting; `--evaluate_missing` adds the untrained conversion) and
writes `budget_curve.md` (a table) and `budget_curve.png`: tokens per forward (ours and the authors' per-step
ratio), wall-clock speed-up over the base model's AR `generate()`, word F1 against the teacher (with the converted
model's own AR decoding for reference), generative perplexity, accepted drafts per verifying forward and repeated
4-grams (with the base model's AR answers' for reference), each against cumulative minutes (distillation +
training) on the machine that trained it. `--output_dir` has no default: the curve of another recipe's artifacts
names its own folder rather than overwriting the committed one (`benchmarks/results/smollm2-cpu`).
"""

import argparse
import json
from pathlib import Path

from recipe.report import cell, write_results

METRICS = {  # key -> column title
    "tokens_per_forward": "tokens/forward",
    "step_tokens_per_forward": "authors' TPF",
    "speedup": "speed-up vs AR",
    "token_f1": "word F1 vs AR",
    "generative_perplexity": "gen. PPL",
    "accuracy_where_ar_correct": "acc. where AR correct",
    "accepted_run_per_verify": "accepted drafts / verify",
    "repetition": "repeated 4-grams",
}


def points(log: dict) -> list[dict]:
    """One point per measurement, in training order: `name`, `minutes` (cumulative), `steps` (cumulative), the
    ReFusion row and, where measured, the converted model's AR row."""
    found = []
    if "untrained" in log:
        found.append({"name": "untrained", "minutes": 0.0, "steps": 0, **log["untrained"]})
    minutes, steps = 0.0, 0
    for record in log["stages"]:
        minutes += record["distill_minutes"]
        for checkpoint in record.get("checkpoints", []):
            share = checkpoint["step"] / record["steps"]
            found.append(
                {
                    "name": f"{record['stage']}, step {checkpoint['step']}",
                    "minutes": minutes + share * record["train_minutes"],
                    "steps": steps + checkpoint["step"],
                    "refusion": checkpoint["row"],
                }
            )
        minutes += record["train_minutes"]
        steps += record["steps"]
        if "evaluation" in record:
            found.append({"name": record["stage"], "minutes": minutes, "steps": steps, **record["evaluation"]})
    return found


def markdown(found: list[dict]) -> str:
    lines = [
        "| point | CPU minutes | LoRA steps | "
        + " | ".join(METRICS.values())
        + " | converted AR word F1 | AR repeated 4-grams |",
        "| --- | ---: | ---: | " + " | ".join("---:" for _ in METRICS) + " | ---: | ---: |",
    ]
    for point in found:
        row, converted = point["refusion"], point.get("converted_ar")
        values = " | ".join(cell(row.get(key)) for key in METRICS)
        reference = cell(converted["token_f1"]) if converted else "-"
        ar_repetition = cell(point["ar"].get("repetition")) if "ar" in point else "-"
        head = f"| {point['name']} | {point['minutes']:.0f} | {point['steps']}"
        lines.append(f"{head} | {values} | {reference} | {ar_repetition} |")
    return "\n".join(lines) + "\n"


def plot(found: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [point["minutes"] for point in found]
    figure, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    panels = [
        (
            axes[0, 0],
            [("tokens_per_forward", "ours"), ("step_tokens_per_forward", "authors' per-step")],
            "tokens/forward",
        ),
        (axes[0, 1], [("speedup", "ReFusion")], "wall-clock speed-up over AR generate()"),
        (axes[1, 0], [("token_f1", "ReFusion")], "word F1 with the AR teacher"),
        (axes[1, 1], [("generative_perplexity", "ReFusion")], "generative perplexity (AR-scored)"),
    ]
    for axis, series, label in panels:
        for key, name in series:
            values = [point["refusion"].get(key) for point in found]
            axis.plot(minutes, values, marker="o", label=name)
        axis.set_xlabel("CPU minutes of distillation + training")
        axis.set_ylabel(label)
    converted = [(point["minutes"], point["converted_ar"]["token_f1"]) for point in found if "converted_ar" in point]
    if converted:
        axes[1, 0].plot(*zip(*converted), marker="s", linestyle="--", label="converted model, token by token")
    axes[0, 1].axhline(1.0, color="grey", linewidth=0.5)
    for axis in axes.flat:
        axis.legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifacts", default="recipe/artifacts/smollm2")
    parser.add_argument("--output_dir", required=True, help="where budget_curve.md and .png go (overwritten)")
    args = parser.parse_args(argv)
    log = json.loads((Path(args.artifacts) / "training_log.json").read_text(encoding="utf-8"))
    found = points(log)
    if not found:
        parser.error(f"{args.artifacts}/training_log.json holds no evaluated point; run `python -m recipe.run`.")
    table = markdown(found)
    title = f"ReFusion SmolLM2-135M: the budget curve ({args.artifacts})"
    print(table)
    write_results(args.output_dir, "budget_curve", table, plot=lambda path: plot(found, path, title))


if __name__ == "__main__":
    main()
