"""Run the recipe in stages: self-distilled answers -> LoRA fine-tuning under the hybrid objective -> adapter.

    python -m recipe.run --config recipe/smollm2.yaml [--stage NAME] [--set sft.max_steps=20 ...] [--no_eval]

The config's `stages` are the shipped adapter's history. The first stage trains a fresh LoRA adapter; every later
stage continues the adapter the stage before it left in `artifacts_dir` (`init_adapter`), with its own `sft`
settings over the shared ones and its own number of training rows. A run trains the stages that the artifacts'
training log does not hold yet, in order (or only `--stage NAME`, which must be the next one).

Training data lasts: the distilled rows live in `artifacts_dir/distilled.jsonl` (committed). A stage asking for
`rows` rows trains on the file's first `rows` rows, and distillation first answers just enough new training
prompts (never a held-out one) to reach that count, appending to the file; rows are never rewritten, so every
stage's data is the same on every rerun. After each stage the artifacts hold its adapter, the training log gets the
stage's record (settings, rows, steps, minutes, the trainer's log) and, unless `--no_eval`, the stage's point on the
budget curve: the model scored on held-out prompts at the shipped decoding setting (`recipe.evaluate`).
"""

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import yaml

from finetune import sft
from finetune.files import read_json, read_jsonl, write_text_atomically
from finetune.trainer import last_complete_checkpoint
from recipe.distill import distill
from recipe.evaluate import Evaluation
from recipe.model import base_location, load_base
from recipe.prompts import build_prompts, interleave_kinds, split_prompts

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
DATA_FILE = "distilled.jsonl"
LOG_FILE = "training_log.json"


# What the recipe reads of its config: each key (dotted; `stages[]` for every stage) with the types it may hold; those
# in OPTIONAL_KEYS may be absent. Sections the recipe does not read (ablations, ...) are checked where they are read.
MISSING = object()
INTEGER, NUMBER, TEXT, MAPPING = (int,), (int, float), (str,), (dict,)
CONFIG_KEYS = {
    "model": MAPPING,
    "model.path": (str, type(None)),
    "model.gguf_file": (str, type(None)),
    "output_dir": TEXT,
    "artifacts_dir": TEXT,
    "held_out_percent": NUMBER,
    "distill": MAPPING,
    "distill.batch_size": INTEGER,
    "distill.max_new_tokens": INTEGER,
    "sft": MAPPING,
    "stages": (list,),
    "stages[].name": TEXT,
    "stages[].rows": INTEGER,
    "evaluation": MAPPING,
    "evaluation.prompts": INTEGER,
    "evaluation.max_new_tokens": INTEGER,
}
OPTIONAL_KEYS = {"model.path", "model.gguf_file"}
KIND = {
    INTEGER: "an integer",
    NUMBER: "a number",
    TEXT: "a string",
    MAPPING: "a mapping (key: value lines)",
    (list,): "a list",
    (str, type(None)): "a string or null",
}


def load_config(path: str | Path, overrides: list[str]) -> dict:
    """The YAML config with `section.key=value` overrides (values parsed as YAML), checked (`check_config`): a
    missing file, bad YAML, a malformed override or a missing or mistyped key raises a `ValueError` naming it."""
    path = Path(path)
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ValueError(f"Cannot read the recipe config {path}: {error.strerror}.") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path} is not valid YAML: {' '.join(str(error).split())}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a mapping of sections, not {type(config).__name__}.")
    for override in overrides:
        dotted, equals, value = override.partition("=")
        if not equals or not dotted:
            raise ValueError(f"--set {override!r} must read SECTION.KEY=VALUE.")
        *sections, key = dotted.split(".")
        node = config
        for depth, section in enumerate(sections):
            node = node.setdefault(section, {})
            if not isinstance(node, dict):
                where = ".".join(sections[: depth + 1])
                raise ValueError(f"--set {override!r}: {where} in {path} is not a section but {node!r}.")
        try:
            node[key] = yaml.safe_load(value)
        except yaml.YAMLError as error:
            raise ValueError(f"--set {override!r}: the value is not valid YAML ({error}).") from None
    return check_config(config, path)


def check_config(config: dict, source: str | Path) -> dict:
    """`config` when it holds every key the recipe reads, each of its type (`CONFIG_KEYS`), and stages of distinct
    names; else a `ValueError` naming the key and `source`."""
    check_keys(config, CONFIG_KEYS, source, OPTIONAL_KEYS)
    for index, stage in enumerate(config["stages"]):
        if not isinstance(stage.get("sft", {}), dict):
            raise ValueError(f"{source}: stages[{index}].sft must be {KIND[MAPPING]}, got {stage['sft']!r}.")
    names = [stage["name"] for stage in config["stages"]]
    if len(set(names)) != len(names):
        raise ValueError(f"{source}: stage names must differ, got {names}.")
    return config


def check_keys(config: dict, keys: dict[str, tuple], source: str | Path, optional: set[str] = frozenset()) -> None:
    """Raise a `ValueError` naming `source` and the key when one of `keys` (dotted, `list[].key` for each item of a
    list; with the types it may hold) is missing from `config` (unless `optional`) or of another type."""
    for dotted, types in keys.items():
        head, _, rest = dotted.partition("[].")
        found = [(head, lookup(config, head))]
        if rest:  # one key per stage
            for index, item in enumerate(found[0][1]):
                if not isinstance(item, dict):
                    raise ValueError(f"{source}: {head}[{index}] must be {KIND[MAPPING]}, got {item!r}.")
            found = [(f"{head}[{index}].{rest}", lookup(item, rest)) for index, item in enumerate(found[0][1])]
        for name, value in found:
            if value is MISSING:
                if dotted not in optional:
                    raise ValueError(f"{source}: the key {name} is missing.")
            elif not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                kind = KIND[types]
                raise ValueError(f"{source}: {name} must be {kind}, got {value!r}.")


def lookup(node: object, dotted: str) -> object:
    """The value at `dotted` ("section.key") in `node`, or `MISSING`."""
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return MISSING
        node = node[key]
    return node


def sft_arguments(settings: dict, model: tuple[str, str | None], data: Path, output_dir: Path) -> list[str]:
    """The `finetune.sft` command line for `settings` (flag -> value): `true` and `false` are passed as such (a
    flag whose default is on must be turnable off), a list as several values."""
    folder, gguf_file = model
    arguments = ["--model_name_or_path", folder, "--dataset_name", str(data), "--output_dir", str(output_dir)]
    if gguf_file:
        arguments += ["--gguf_file", gguf_file]
    for key, value in settings.items():
        if value is None:
            continue
        values = value if isinstance(value, list) else [value]
        arguments += [f"--{key}", *(str(item).lower() if isinstance(item, bool) else str(item) for item in values)]
    return arguments


def train_adapter(settings: dict, model: tuple[str, str | None], data: Path, output_dir: Path) -> dict:
    """Fine-tune with `finetune.sft`; return the trainer's state (`trainer_state.json`)."""
    status = sft.main(sft_arguments(settings, model, data, output_dir))
    if status != 0:
        raise SystemExit(status)
    return json.loads((output_dir / "trainer_state.json").read_text(encoding="utf-8"))


def read_rows(path: Path) -> list[dict]:
    """The distilled rows of a JSONL file (none when it does not exist), each a `{"query", "response"}` object; a
    line that is not raises a `ValueError` naming the file and the line (a last line cut off by a stopped run is
    dropped with a warning: `finetune.files.read_jsonl`)."""
    return read_jsonl(path, required=("query", "response"))


def write_rows(path: Path, rows: list[dict]) -> None:
    write_text_atomically(path, "".join(json.dumps(row) + "\n" for row in rows))


def config_model(config: dict) -> tuple[str, str | None]:
    """Folder (or Hub id) and GGUF file of the config's base model."""
    return base_location(config["model"].get("path"), config["model"].get("gguf_file"))


def read_log(artifacts: Path) -> dict:
    """The training log: `stages` (one record per stage trained so far) and, once measured, `untrained` (the
    converted model before any training: the budget curve's first point)."""
    path = artifacts / LOG_FILE
    log = read_json(path, default={})
    if not isinstance(log, dict) or not isinstance(log.setdefault("stages", []), list):
        raise ValueError(f"{path} is not a training log (an object whose 'stages' is a list).")
    return log


def write_log(artifacts: Path, log: dict) -> None:
    write_text_atomically(artifacts / LOG_FILE, json.dumps(log, indent=1) + "\n")


def stage_settings(config: dict, stage: dict) -> dict:
    """The `finetune.sft` settings of a stage: the shared `sft` section with the stage's own over it."""
    return {**config["sft"], **stage.get("sft", {})}


def grow_data(config: dict, data_file: Path, rows: int, model: tuple[str, str | None]) -> float:
    """Distill new training prompts (interleaved by kind, in a fixed order) until `data_file` holds `rows` rows;
    return the minutes spent. Answers that come out empty are skipped, so it may take a few more prompts."""
    start = time.perf_counter()
    train, _ = split_prompts(build_prompts(), config["held_out_percent"])
    done = {row["query"] for row in read_rows(data_file)}
    if len(done) >= rows:
        return 0.0
    steps = config["distill"]
    teacher, tokenizer = load_base(*model)
    device = steps.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    teacher.to(device, getattr(torch, steps.get("dtype") or "float32"))
    candidates = [prompt.text for prompt in interleave_kinds(train) if prompt.text not in done]
    while len(done) < rows and candidates:
        wanted = rows - len(done)
        batch, candidates = candidates[:wanted], candidates[wanted:]
        distill(
            teacher, tokenizer, batch, data_file, batch_size=steps["batch_size"], max_new_tokens=steps["max_new_tokens"]
        )
        done = {row["query"] for row in read_rows(data_file)}
    if len(done) < rows:
        raise ValueError(f"Only {len(done)} training rows can be distilled; a stage asks for {rows}.")
    return (time.perf_counter() - start) / 60


def run_stage(config: dict, stage: dict, log: dict, evaluate: bool = True) -> dict:
    """Distill what the stage needs, train it (continuing the previous stage's adapter), update the artifacts and
    the log; return the stage's record."""
    stages_done = log["stages"]
    output_dir, artifacts = Path(config["output_dir"]), Path(config["artifacts_dir"])
    output_dir.mkdir(parents=True, exist_ok=True)
    artifacts.mkdir(parents=True, exist_ok=True)
    model = config_model(config)
    data_file = artifacts / DATA_FILE
    distill_minutes = grow_data(config, data_file, stage["rows"], model)
    stage_data = output_dir / stage["name"] / DATA_FILE  # exactly the rows this stage trains on
    stage_data.parent.mkdir(parents=True, exist_ok=True)
    write_rows(stage_data, read_rows(data_file)[: stage["rows"]])

    settings = stage_settings(config, stage)
    if stages_done:
        settings["init_adapter"] = str(output_dir / stage["name"] / "previous-adapter")
        shutil.copytree(artifacts / "adapter", settings["init_adapter"], dirs_exist_ok=True)
    trained = output_dir / stage["name"] / "refusion"
    resume = {"resume_from_checkpoint": "last"} if last_complete_checkpoint(trained) else {}  # an interrupted run
    start = time.perf_counter()
    state = train_adapter({**settings, **resume}, model, stage_data, trained)
    train_minutes = (time.perf_counter() - start) / 60

    (artifacts / "adapter").mkdir(exist_ok=True)
    for name in ADAPTER_FILES:  # not PEFT's blank card, the tokenizer (the base one + [MASK]), the pickled args
        partial = artifacts / "adapter" / f".{name}.partial"  # a stopped copy never leaves a torn adapter
        shutil.copy2(trained / "adapter" / name, partial)
        os.replace(partial, artifacts / "adapter" / name)
    record = {
        "stage": stage["name"],
        "continues": stages_done[-1]["stage"] if stages_done else None,
        "rows": stage["rows"],
        "steps": state["global_step"],
        "distill_minutes": round(distill_minutes, 1),
        "train_minutes": round(train_minutes, 1),
        "sft": {key: value for key, value in settings.items() if key != "init_adapter"},
        "log_history": state["log_history"],
    }
    if evaluate:
        evaluation = stage_evaluation(config, model)
        record["evaluation"] = evaluation.adapter_points("ReFusion", artifacts / "adapter")
        record["checkpoints"] = [
            {"step": step, "row": evaluation.adapter_rows(f"step {step}", folder, converted_ar=False)["refusion"]}
            for step, folder in checkpoints(trained)
            if step < record["steps"]
        ]
    log["stages"] = [*stages_done, record]
    write_log(artifacts, log)
    write_text_atomically(artifacts / "recipe.yaml", yaml.safe_dump(config, sort_keys=False))
    return record


def stage_evaluation(config: dict, model: tuple[str, str | None]) -> Evaluation:
    """The config's held-out evaluation (`evaluation.prompts` prompts, `evaluation.max_new_tokens` tokens)."""
    settings = config["evaluation"]
    base, tokenizer = load_base(*model)
    return Evaluation(base, tokenizer, settings["prompts"], settings["max_new_tokens"])


def checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """The `checkpoint-N` folders of a training run, by step."""
    found = [(int(path.name.removeprefix("checkpoint-")), path) for path in folder.glob("checkpoint-*")]
    return sorted((step, path) for step, path in found if (path / "adapter_config.json").is_file())


def evaluate_missing(config: dict) -> None:
    """Fill in the budget-curve points the log lacks: the untrained conversion's and the last stage's (whose
    adapter is the one in the artifacts; earlier stages' adapters are gone)."""
    artifacts = Path(config["artifacts_dir"])
    log = read_log(artifacts)
    missing_last = bool(log["stages"]) and "evaluation" not in log["stages"][-1]
    if "untrained" in log and not missing_last:
        return
    evaluation = stage_evaluation(config, config_model(config))
    if "untrained" not in log:
        log["untrained"] = evaluation.adapter_points("untrained", None)
    if missing_last:
        log["stages"][-1]["evaluation"] = evaluation.adapter_points("ReFusion", artifacts / "adapter")
    write_log(artifacts, log)


def pending_stages(config: dict, stages_done: list[dict], only: str | None) -> list[dict]:
    """The configured stages the log does not hold yet, after checking that the log is the config's history."""
    stages = config["stages"]
    names = [stage["name"] for stage in stages]
    done = [record["stage"] for record in stages_done]
    if done != names[: len(done)]:
        raise ValueError(f"The training log holds stages {done}, which are not the start of the config's {names}.")
    pending = stages[len(done) :]
    if only is not None:
        if only not in names:
            raise ValueError(f"No stage {only!r} in the config; its stages are {names}.")
        if not pending or pending[0]["name"] != only:
            following = pending[0]["name"] if pending else "none (all are done)"
            raise ValueError(f"Stage {only!r} cannot run now: the next stage is {following}.")
        pending = pending[:1]
    return pending


def run(config: dict, only: str | None = None, evaluate: bool = True) -> Path:
    """Every pending stage of the recipe (or only the stage `only`); returns the artifacts folder."""
    artifacts = Path(config["artifacts_dir"])
    log = read_log(artifacts)
    for stage in pending_stages(config, log["stages"], only):
        record = run_stage(config, stage, log, evaluate)
        print(f"[stage]   {stage['name']}: {record['steps']} steps on {record['rows']} rows in {artifacts}")
    return artifacts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="recipe/smollm2.yaml")
    parser.add_argument("--stage", default=None, help="run only this stage (the next pending one)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--no_eval", action="store_true", help="skip the per-stage evaluation (budget curve)")
    parser.add_argument(
        "--evaluate_missing",
        action="store_true",
        help="train nothing; measure the budget-curve points the log lacks (untrained, last stage)",
    )
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.set)
        if args.evaluate_missing:
            evaluate_missing(config)
        else:
            run(config, args.stage, not args.no_eval)
    except ValueError as error:  # a bad config, data file or log: one line naming it
        parser.exit(1, f"recipe.run: error: {' '.join(str(error).split())}\n")


if __name__ == "__main__":
    sys.exit(main())
