"""The recipe end to end at toy sizes: held-out prompts kept out, distilled rows trained on, adapter written."""

import copy
import json
import re
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from tiny import tiny_backbone, tiny_tokenizer

import recipe.distill
import recipe.run
from benchmarks import budget_curve
from finetune import sft
from finetune.chat import prompt_token_ids
from finetune.convert import convert_to_refusion
from recipe.ablate import ablate
from recipe.model import with_adapter
from recipe.prompts import build_prompts, split_prompts
from recipe.report import write_results
from recipe.run import ADAPTER_FILES, load_config, read_log, read_rows, run, sft_arguments, write_log


@pytest.fixture
def tiny_recipe(tmp_path, monkeypatch):
    """The CPU recipe config pointed at a tiny saved model, with toy sizes, and its base model and tokenizer."""
    # A random tiny model never ends an answer or a sentence; count its cut-off answers as finished ones.
    real_answer_batch = recipe.distill.answer_batch
    monkeypatch.setattr(
        recipe.distill, "answer_batch", lambda *args: [(text, True) for text, _ in real_answer_batch(*args)]
    )
    tokenizer = tiny_tokenizer()
    base = tiny_backbone("llama", vocab_size=len(tokenizer), initializer_range=0.2)
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    stages = [
        {"name": "first", "rows": 6, "sft": {"max_steps": 2, "save_steps": 1}},
        # learning rate 0: a continued adapter comes out exactly as it went in, a fresh one would not
        {"name": "second", "rows": 9, "sft": {"max_steps": 1, "learning_rate": 0.0, "per_device_train_batch_size": 3}},
    ]
    overrides = [
        f"model.path={tmp_path / 'base'}",
        f"output_dir={tmp_path / 'out'}",
        f"artifacts_dir={tmp_path / 'artifacts'}",
        f"stages={json.dumps(stages)}",
        "distill.batch_size=3",
        "distill.max_new_tokens=4",
        "sft.learning_rate=0.01",  # so that two steps move the weights measurably
        "sft.per_device_train_batch_size=2",
        "sft.max_length=64",
        "sft.logging_steps=1",
        "sft.save_steps=1000",
        "evaluation.prompts=2",
        "evaluation.max_new_tokens=4",
    ]
    config = load_config(Path(__file__).parents[1] / "recipe" / "smollm2.yaml", overrides)
    return config, base, tokenizer


def test_recipe_stages_write_a_small_adapter_a_log_and_lasting_data(tiny_recipe):
    config, base, tokenizer = tiny_recipe
    artifacts = Path(config["artifacts_dir"])

    run(config, only="first")

    adapter = artifacts / "adapter" / "adapter_model.safetensors"
    assert adapter.is_file() and adapter.stat().st_size <= 20 * 2**20
    assert sorted(path.name for path in adapter.parent.iterdir()) == sorted(ADAPTER_FILES)
    [first] = json.loads((artifacts / "training_log.json").read_text())["stages"]
    assert first["stage"] == "first" and first["continues"] is None and first["rows"] == 6 and first["steps"] == 2
    assert first["sft"]["learning_rate"] == 0.01 and first["sft"]["max_steps"] == 2
    assert [entry["step"] for entry in first["log_history"] if "loss" in entry] == [1, 2]
    assert all({"ar_loss", "mdm_loss"} <= entry.keys() for entry in first["log_history"] if "loss" in entry)
    evaluation = first["evaluation"]
    assert {"ar", "refusion", "converted_ar"} <= evaluation.keys()
    assert evaluation["refusion"]["forwards"] > 0 and 0.0 <= evaluation["refusion"]["token_f1"] <= 1.0
    assert [checkpoint["step"] for checkpoint in first["checkpoints"]] == [1]  # the stage's inner points
    assert first["checkpoints"][0]["row"]["forwards"] > 0
    _, held_out = split_prompts(build_prompts(), config["held_out_percent"])
    distilled = [json.loads(line) for line in (artifacts / "distilled.jsonl").read_text().splitlines()]
    assert len(distilled) == 6 and {row["query"] for row in distilled}.isdisjoint(p.text for p in held_out)
    first_adapter = load_file(adapter)

    with pytest.raises(ValueError, match="next stage is second"):
        run(config, only="first")
    run(config, evaluate=False)  # the pending stage: "second", continuing "first"

    log = json.loads((artifacts / "training_log.json").read_text())["stages"]
    assert [record["stage"] for record in log] == ["first", "second"] and log[0] == first
    assert log[1]["continues"] == "first" and log[1]["rows"] == 9 and "evaluation" not in log[1]
    grown = [json.loads(line) for line in (artifacts / "distilled.jsonl").read_text().splitlines()]
    assert len(grown) == 9 and grown[:6] == distilled  # rows are appended, never rewritten
    second_adapter = load_file(adapter)
    assert second_adapter.keys() == first_adapter.keys()
    assert all(torch.equal(second_adapter[name], value) for name, value in first_adapter.items())
    assert any(name.endswith("lora_B.weight") and value.abs().max() > 0 for name, value in first_adapter.items())
    run(config)  # nothing pending: nothing happens
    assert json.loads((artifacts / "training_log.json").read_text())["stages"] == log


def test_a_log_that_is_not_the_configs_history_is_refused(tiny_recipe):
    config, _, _ = tiny_recipe
    artifacts = Path(config["artifacts_dir"])
    artifacts.mkdir(parents=True)
    (artifacts / "training_log.json").write_text(json.dumps({"stages": [{"stage": "other"}]}))
    with pytest.raises(ValueError, match=r"holds stages \['other'\]"):
        run(config)
    (artifacts / "training_log.json").unlink()
    with pytest.raises(ValueError, match="No stage 'third'"):
        run(config, only="third")


def test_the_shipped_adapter_merges_like_peft_and_leaves_the_base_alone(tiny_recipe):
    config, base, tokenizer = tiny_recipe
    config["stages"] = config["stages"][:1]
    artifacts = run(config, evaluate=False)
    # The committed adapter loads: merged into a converted copy of the base it computes what PEFT computes unmerged,
    # and leaves the base model (the AR reference) and its tokenizer as they were.
    weights, vocabulary = copy.deepcopy(base.state_dict()), len(tokenizer)
    merged, refusion_tokenizer = with_adapter(base, tokenizer, artifacts / "adapter")
    assert all(torch.equal(value, base.state_dict()[name]) for name, value in weights.items())
    assert len(tokenizer) == vocabulary and len(refusion_tokenizer) == vocabulary + 1
    assert merged.config.mask_token_id == refusion_tokenizer.mask_token_id
    converted, _ = convert_to_refusion(copy.deepcopy(base), copy.deepcopy(tokenizer))
    inputs = torch.tensor(prompt_token_ids(tokenizer, ["What is the capital of France?"]))
    with torch.no_grad():
        plain = converted(inputs).logits
        unmerged = PeftModel.from_pretrained(converted, artifacts / "adapter").eval()(inputs).logits
        logits = merged(inputs).logits
    torch.testing.assert_close(logits, unmerged, atol=1e-5, rtol=1e-5)
    assert (logits - plain).abs().max() > 1e-4  # the adapter changed the model
    answer = merged.generate(inputs, max_new_tokens=8, slot_size=4, block_length=8)
    assert answer.shape == (1, inputs.shape[1] + 8)
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        with_adapter(base, tokenizer, Path(config["output_dir"]))


def test_a_draft_adapter_file_loads_onto_a_converted_copy_of_the_base(tmp_path):
    """`with_adapter` given a `.safetensors` file of draft-adapter deltas (as `recipe/artifacts/draft-mix` keeps
    them): the converted copy computes what the model they came from computes, and the base is left alone."""
    tokenizer = tiny_tokenizer()
    base = tiny_backbone("llama", vocab_size=len(tokenizer), initializer_range=0.2).eval()
    trained, _ = convert_to_refusion(copy.deepcopy(base), copy.deepcopy(tokenizer))
    trained.add_draft_adapter(4, alpha=8.0, target_modules=["q_proj", "down_proj"])
    with torch.no_grad():
        for name, weight in trained.named_parameters():
            if ".draft_adapter." in name:
                weight.normal_(0.0, 0.5)
    deltas = {name: tensor for name, tensor in trained.state_dict().items() if ".draft_adapter." in name}
    metadata = {"mask_token_id": str(trained.config.mask_token_id), "draft_adapter": json.dumps(
        {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "down_proj"]})}  # fmt: skip
    save_file(deltas, tmp_path / "draft_adapter.safetensors", metadata=metadata)
    weights = copy.deepcopy(base.state_dict())
    model, _ = with_adapter(base, tokenizer, tmp_path / "draft_adapter.safetensors")
    assert all(torch.equal(value, base.state_dict()[name]) for name, value in weights.items())
    inputs = torch.tensor([[5, 6, trained.config.mask_token_id, trained.config.mask_token_id, 7]])
    with torch.no_grad():
        assert torch.equal(model(inputs).logits, trained.eval()(inputs).logits)
    save_file(deltas, tmp_path / "other.safetensors", metadata={**metadata, "mask_token_id": "3"})
    with pytest.raises(ValueError, match=r"trained with \[MASK\] = token 3"):
        with_adapter(base, tokenizer, tmp_path / "other.safetensors")
    save_file(deltas, tmp_path / "bare.safetensors")
    with pytest.raises(ValueError, match="records no draft adapter's settings"):
        with_adapter(base, tokenizer, tmp_path / "bare.safetensors")


def test_false_and_list_values_reach_the_sft_command_line():
    arguments = sft_arguments(
        {"bf16": False, "use_peft": True, "slot_sizes": [8, 16], "seed": None}, ("m", None), "d", "o"
    )
    assert arguments[6:] == ["--bf16", "false", "--use_peft", "true", "--slot_sizes", "8", "16"]
    parsed = sft.make_parser().parse_args_and_config([*arguments, "--use_cpu", "true"])
    training_args, model_args, refusion_args = parsed[1], parsed[2], parsed[3]
    assert training_args.bf16 is False and model_args.use_peft is True and refusion_args.slot_sizes == [8, 16]


def test_the_committed_recipe_history_matches_its_config_and_data():
    root = Path(__file__).parents[1] / "recipe"
    config = load_config(root / "smollm2.yaml", [])
    artifacts = root / "artifacts" / "smollm2"
    log = json.loads((artifacts / "training_log.json").read_text())["stages"]
    assert [record["stage"] for record in log] == [stage["name"] for stage in config["stages"]]
    for record, stage in zip(log, config["stages"]):
        assert record["rows"] == stage["rows"] and record["sft"] == {**config["sft"], **stage.get("sft", {})}
        assert record["steps"] == record["sft"]["max_steps"]
    rows = [json.loads(line) for line in (artifacts / "distilled.jsonl").read_text().splitlines()]
    assert len(rows) >= max(stage["rows"] for stage in config["stages"])
    assert all(row["query"].strip() and row["response"].strip() for row in rows)
    _, held_out = split_prompts(build_prompts(), config["held_out_percent"])
    assert {row["query"] for row in rows}.isdisjoint(p.text for p in held_out)
    assert (artifacts / "adapter" / "adapter_model.safetensors").stat().st_size <= 20 * 2**20


def test_gpu_config_is_the_cpu_recipe_with_other_sizes():
    folder = Path(__file__).parents[1] / "recipe"
    cpu, gpu = load_config(folder / "smollm2.yaml", []), load_config(folder / "smollm2-gpu.yaml", [])
    assert cpu.keys() == gpu.keys() and cpu["distill"].keys() == gpu["distill"].keys()
    assert cpu["decoding"] == gpu["decoding"]
    assert cpu["ablations"]["variants"].keys() == gpu["ablations"]["variants"].keys()
    assert set(gpu["sft"]) - set(cpu["sft"]) == {"bf16"}  # mixed precision is the only new training flag
    assert {key for key in cpu["sft"] if cpu["sft"][key] != gpu["sft"][key]} <= {
        "lora_r",
        "lora_alpha",
        "max_steps",
        "per_device_train_batch_size",
        "max_length",
        "logging_steps",
        "save_steps",
    }


def test_ablations_train_each_variant_from_scratch_and_tabulate_them(tiny_recipe, capsys):
    config, _, _ = tiny_recipe
    config["stages"] = config["stages"][:1]
    run(config, evaluate=False)
    config["ablations"] |= {"steps": 2, "rows": 6, "prompts": 2, "sft": {"logging_steps": 1}}
    results = ablate(config, only=["baseline", "MDM weight 3"])
    assert list(results["variants"]) == ["baseline", "MDM weight 3"]
    for entry in results["variants"].values():
        assert entry["row"]["forwards"] > 0 and entry["losses"]["mdm_loss"] > 0
    weighted = json.loads((Path(config["output_dir"]) / "ablations" / "mdm-weight-3" / "config.json").read_text())
    assert weighted["mdm_loss_weight"] == 3.0
    table = (Path(config["artifacts_dir"]) / "ablations.md").read_text()
    assert "| baseline | - |" in table and "| MDM weight 3 | {'mdm_loss_weight': 3.0} |" in table
    ablate(config, only=["baseline"])  # measured already: skipped, not retrained
    assert "baseline: already measured" in capsys.readouterr().out
    with pytest.raises(ValueError, match="Unknown variants"):
        ablate(config, only=["no such variant"])


def test_an_ablation_section_can_continue_an_adapter_train_the_objective_options_and_score_the_fused_redraft(
    tiny_recipe,
):
    config, _, _ = tiny_recipe
    config["stages"] = config["stages"][:1]
    run(config, evaluate=False)
    artifacts = Path(config["artifacts_dir"])
    config["objective_ablations"] = {
        "steps": 2, "rows": 6, "prompts": 2, "score_fused": True,
        "sft": {"init_adapter": str(artifacts / "adapter"), "logging_steps": 1},
        "variants": {"baseline": {}, "mixed + decay + soft": {
            "slot_masking": "mixed", "acceptance_decay": 0.7, "soft_target_weight": 1.0}},
    }  # fmt: skip
    results = ablate(config, section="objective_ablations")
    assert list(results["variants"]) == ["baseline", "mixed + decay + soft"]
    assert results["init_adapter"] == str(artifacts / "adapter")
    for entry in results["variants"].values():
        assert entry["row"]["acceptance_by_offset"] is not None and entry["fused_row"]["forwards"] > 0
    state = json.loads((Path(config["output_dir"]) / "objective_ablations" / "mixed-decay-soft" /
                        "trainer_state.json").read_text())  # fmt: skip
    assert any("soft_target_loss" in log for log in state["log_history"])
    table = (artifacts / "objective_ablations.md").read_text()
    assert table.startswith("2 LoRA steps continuing ") and "| mixed + decay + soft |" in table
    assert not (artifacts / "ablations.json").exists()  # each section keeps its own results
    with pytest.raises(ValueError, match="no 'nothing' section"):
        ablate(config, section="nothing")


def test_budget_curve_points_follow_the_stages_minutes_and_steps(tmp_path):
    row = {"tokens_per_forward": 1.0, "step_tokens_per_forward": 1.5, "speedup": 0.7, "token_f1": 0.5,
           "generative_perplexity": 2.0, "accuracy_where_ar_correct": 1.0, "repetition": 0.25}  # fmt: skip
    evaluation = {"ar": row, "refusion": row, "converted_ar": row}
    log = {
        "untrained": evaluation,
        "stages": [
            {"stage": "stage-1", "distill_minutes": 20, "train_minutes": 50, "steps": 100, "evaluation": evaluation,
             "checkpoints": [{"step": 50, "row": row}]},
            {"stage": "stage-2", "distill_minutes": 10, "train_minutes": 40, "steps": 80, "evaluation": evaluation},
        ],
    }  # fmt: skip
    found = budget_curve.points(log)
    assert [(p["name"], p["minutes"], p["steps"]) for p in found] == [
        ("untrained", 0.0, 0),
        ("stage-1, step 50", 45.0, 50),
        ("stage-1", 70.0, 100),
        ("stage-2", 120.0, 180),
    ]
    table = budget_curve.markdown(found)
    assert "| stage-1, step 50 | 45 | 50 | 1.00 | 1.50 | 0.70 | 0.50 | 2.00 | 1.00 | - | 0.25 | - | - |" in table
    assert "| stage-1 | 70 | 100 | 1.00 | 1.50 | 0.70 | 0.50 | 2.00 | 1.00 | - | 0.25 | 0.50 | 0.25 |" in table
    budget_curve.plot(found, tmp_path / "curve.png", "test")
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"


RECIPE = Path(__file__).parents[1] / "recipe" / "smollm2.yaml"


@pytest.mark.parametrize(
    ("config_text", "overrides", "says"),
    [
        (None, ["stages=3"], "smollm2.yaml: stages must be a list, got 3."),
        (None, ["distill.batch_size=many"], "smollm2.yaml: distill.batch_size must be an integer, got 'many'."),
        (None, ["stages=[{name: one}]"], "smollm2.yaml: the key stages[0].rows is missing."),
        (None, ["held_out_percent.x=1"], "--set 'held_out_percent.x=1': held_out_percent in"),
        (None, ["sft.max_steps"], "--set 'sft.max_steps' must read SECTION.KEY=VALUE."),
        ("model: {path: null}\n", [], "bad.yaml: the key output_dir is missing."),
        ("stages: [\n", [], "bad.yaml is not valid YAML"),
        ("- a list\n", [], "bad.yaml must hold a mapping of sections, not list."),
    ],
)
def test_config_mistakes_stop_with_one_line_naming_the_file_and_the_key(tmp_path, capsys, config_text, overrides, says):
    path = RECIPE
    if config_text is not None:
        path = tmp_path / "bad.yaml"
        path.write_text(config_text)
    arguments = ["--config", str(path), *(argument for override in overrides for argument in ("--set", override))]
    with pytest.raises(SystemExit) as exit_info:
        recipe.run.main(arguments)
    assert exit_info.value.code == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("recipe.run: error: ") and says in line
    assert not (tmp_path / "artifacts").exists()


def test_distilled_rows_name_a_bad_line_and_a_cut_off_last_row_is_answered_again(tmp_path, monkeypatch, caplog):
    data = tmp_path / "distilled.jsonl"
    rows = [{"query": f"Question {number}?", "response": f"Answer {number}."} for number in range(3)]
    data.write_text(json.dumps(rows[0]) + "\nnot json\n" + json.dumps(rows[1]) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{data}:2: not a JSON line")):
        read_rows(data)
    data.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps({"query": "Question 1?"}) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{data}:3: the field 'response' must be a string, got None.")):
        read_rows(data)

    # A run stopped while appending leaves a cut-off last row: it is dropped, and answered again on the next run.
    data.write_text("".join(json.dumps(row) + "\n" for row in rows[:2]) + json.dumps(rows[2])[:20])
    with caplog.at_level("WARNING", logger="finetune.files"):
        assert read_rows(data) == rows[:2]
    assert f"{data}:3: an incomplete last line" in caplog.text

    def answers(model, tokenizer, prompts, max_new_tokens):  # "Question 2?" -> "Answer 2.", finished
        return [(prompt.replace("Question", "Answer").replace("?", "."), True) for prompt in prompts]

    monkeypatch.setattr(recipe.distill, "answer_batch", answers)
    assert recipe.distill.distill(None, None, [row["query"] for row in rows], data) == 3
    assert read_rows(data) == rows
    assert data.read_text().count("\n") == 3


def test_the_training_log_and_results_are_never_left_truncated(tmp_path, monkeypatch):
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    write_log(artifacts, {"stages": [{"stage": "first"}]})
    write_results(artifacts, "ablations", "| table |\n", {"variants": {"a": 1}})
    before = {path.name: path.read_text() for path in artifacts.iterdir()}

    def stopped(descriptor):  # the new text is written but not yet in place: a stop here must not cost the old one
        raise KeyboardInterrupt

    monkeypatch.setattr("finetune.files.os.fsync", stopped)
    with pytest.raises(KeyboardInterrupt):
        write_log(artifacts, {"stages": [{"stage": "first"}, {"stage": "second"}]})
    with pytest.raises(KeyboardInterrupt):
        write_results(artifacts, "ablations", "| new table |\n", {"variants": {"a": 2}})
    monkeypatch.undo()
    assert {path.name: path.read_text() for path in artifacts.iterdir()} == before  # and no partial file left

    (artifacts / "training_log.json").write_text('{"stages": [')  # torn by an older version, or by hand
    with pytest.raises(ValueError, match="training_log.json is not valid JSON"):
        read_log(artifacts)
    (artifacts / "ablations.json").write_text("[1, 2]")
    config = load_config(RECIPE, [f"artifacts_dir={artifacts}", f"output_dir={tmp_path / 'out'}"])
    with pytest.raises(ValueError, match="ablations.json does not hold an ablation's results"):
        ablate(config)
