"""Run the recipe: prompts -> self-distilled answers -> LoRA fine-tuning under the hybrid objective -> adapter.

    python -m recipe.run --config recipe/smollm2.yaml [--set distill.train_prompts=64 --set sft.max_steps=20]

Writes into the config's `output_dir` (held-out prompts, distilled rows, the fine-tuned model) and copies the LoRA
adapter and the training log into `artifacts_dir`, the part that is committed.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
import yaml

from finetune import sft
from finetune.convert import load_causal_lm
from finetune.smollm2 import SMOLLM2_GGUF, fetch_smollm2
from recipe.distill import distill
from recipe.prompts import build_prompts, interleave_kinds, split_prompts

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def load_config(path: str | Path, overrides: list[str]) -> dict:
    """The YAML config with `section.key=value` overrides (values parsed as YAML)."""
    config = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    for override in overrides:
        dotted, _, value = override.partition("=")
        *sections, key = dotted.split(".")
        node = config
        for section in sections:
            node = node.setdefault(section, {})
        node[key] = yaml.safe_load(value)
    return config


def model_location(config: dict) -> tuple[str, str | None]:
    """Folder (and GGUF file name) of the base model."""
    if config["model"].get("path"):
        return str(config["model"]["path"]), config["model"].get("gguf_file")
    return str(fetch_smollm2()), SMOLLM2_GGUF


def sft_arguments(config: dict, model: tuple[str, str | None], data: Path, output_dir: Path) -> list[str]:
    """The `finetune.sft` command line for the config's `sft` section."""
    folder, gguf_file = model
    arguments = ["--model_name_or_path", folder, "--dataset_name", str(data), "--output_dir", str(output_dir)]
    if gguf_file:
        arguments += ["--gguf_file", gguf_file]
    for key, value in config["sft"].items():
        arguments += [f"--{key}"] if value is True else [] if value is False else [f"--{key}", str(value)]
    return arguments


def run(config: dict) -> Path:
    """Every step of the recipe; returns the artifacts folder."""
    output_dir, artifacts = Path(config["output_dir"]), Path(config["artifacts_dir"])
    output_dir.mkdir(parents=True, exist_ok=True)
    train, held_out = split_prompts(build_prompts(), config["held_out_percent"])
    with (output_dir / "held_out.jsonl").open("w", encoding="utf-8") as sink:
        for prompt in held_out:
            sink.write(json.dumps({"prompt": prompt.text, "kind": prompt.kind, "reference": prompt.reference}) + "\n")

    model = model_location(config)
    teacher, tokenizer = load_causal_lm(model[0], gguf_file=model[1])
    steps = config["distill"]
    device = steps.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    teacher.to(device, getattr(torch, steps.get("dtype") or "float32"))
    rows = distill(
        teacher,
        tokenizer,
        [prompt.text for prompt in interleave_kinds(train)[: steps["train_prompts"]]],
        output_dir / "distilled.jsonl",
        batch_size=steps["batch_size"],
        max_new_tokens=steps["max_new_tokens"],
    )
    print(f"[distill] {rows} training rows in {output_dir / 'distilled.jsonl'}")
    del teacher

    trained = output_dir / "refusion"
    status = sft.main(sft_arguments(config, model, output_dir / "distilled.jsonl", trained))
    if status != 0:
        raise SystemExit(status)
    artifacts.mkdir(parents=True, exist_ok=True)
    (artifacts / "adapter").mkdir(exist_ok=True)
    for name in ADAPTER_FILES:  # not PEFT's blank card, the tokenizer (the base one + [MASK]), the pickled args
        shutil.copy2(trained / "adapter" / name, artifacts / "adapter" / name)
    state = json.loads((trained / "trainer_state.json").read_text(encoding="utf-8"))
    (artifacts / "training_log.json").write_text(json.dumps(state["log_history"], indent=1), encoding="utf-8")
    (artifacts / "recipe.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    print(f"[done]    adapter and training log in {artifacts}")
    return artifacts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="recipe/smollm2.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args(argv)
    run(load_config(args.config, args.set))


if __name__ == "__main__":
    sys.exit(main())
