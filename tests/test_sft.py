"""`python -m finetune.sft` end to end on tiny Llama and Qwen3 bases with a real tokenizer.

In-process runs cover LoRA on every data format, full fine-tuning, QLoRA, the outputs and the user errors;
subprocess runs cover two processes under `accelerate launch`, a kill followed by a resume, and the Hub push
against a loopback stand-in for the Hub with the real `huggingface_hub` client.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hub_stand_in import StandInHub
from hub_user import run_as_hub_user
from peft import PeftModel
from safetensors.torch import load_file
from tiny import tiny_backbone, tiny_tokenizer
from transformers import AutoModelForCausalLM
from trl import ModelConfig

from finetune.convert import convert_to_refusion, save_refusion
from finetune.data import load_rows, prepare_dataset
from finetune.export import STAGING, publish
from finetune.hybrid import HybridObjectiveCollator
from finetune.sft import main, make_parser
from finetune.trainer import RefusionArguments, RefusionSFTConfig, load_model
from modeling_refusion import RefusionForCausalLM
from recipe.run import sft_arguments

ROOT = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).with_name("sft_probe.py")
FACTS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("What is two plus two?", "Two plus two is four."),
    ("What is three times three?", "Three times three is nine."),
    ("When does water boil?", "Water boils at one hundred degrees."),
    ("When does ice melt?", "Ice melts at zero degrees."),
    ("Name three colours.", "Red, green and blue."),
    ("Where did the cat sit?", "A cat sat on the mat."),
]
QUIET = ["--report_to", "none", "--disable_tqdm", "true", "--seed", "0"]
REQUIRED_OUTPUTS = (
    "config.json",
    "model.safetensors",
    "configuration_refusion.py",
    "modeling_refusion.py",
    "generation_refusion.py",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
    "trainer_state.json",
)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices run fastest on one thread; on a shared 2-core machine more threads only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def save_base(folder: Path, architecture: str, tied: bool = True) -> Path:
    tokenizer = tiny_tokenizer()
    # A wider initialisation than the default 0.02: with frozen tiny embeddings no adapter could sharpen the logits.
    tiny_backbone(architecture, len(tokenizer), tie_word_embeddings=tied, initializer_range=0.2).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def rows(row_format: str) -> list[dict]:
    if row_format == "query_response":
        return [{"query": q, "response": a} for q, a in FACTS]
    if row_format == "prompt_completion":
        return [{"prompt": q, "completion": a} for q, a in FACTS]
    if row_format == "conversational":
        return [
            {"prompt": [{"role": "user", "content": q}], "completion": [{"role": "assistant", "content": a}]}
            for q, a in FACTS
        ]
    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in FACTS]


def write_data(folder: Path, row_format: str, layout: str) -> Path:
    """The rows of `row_format` as a .jsonl, a .json list, a .parquet file or a folder holding two files."""
    data = rows(row_format)
    folder.mkdir(parents=True, exist_ok=True)
    if layout == "jsonl":
        path = folder / "train.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in data), encoding="utf-8")
    elif layout == "json":
        path = folder / "train.json"
        path.write_text(json.dumps(data), encoding="utf-8")
    elif layout == "parquet":
        path = folder / "train.parquet"
        pq.write_table(pa.Table.from_pylist(data), path)
    else:
        path = folder / "shards"
        path.mkdir()
        (path / "a.json").write_text(json.dumps(data[:4]), encoding="utf-8")
        (path / "b.jsonl").write_text("".join(json.dumps(row) + "\n" for row in data[4:]), encoding="utf-8")
    return path


@torch.no_grad()
def hybrid_loss(model: RefusionForCausalLM, tokenizer, data: Path, draws: int = 6, part: str = "loss") -> float:
    """Mean hybrid loss (or its `part`: "ar_loss", "mdm_loss") over the whole set under fixed masking draws (the same
    for every model compared)."""
    examples = list(prepare_dataset(load_rows(data), tokenizer, max_length=None).dataset)
    collator = HybridObjectiveCollator(model.config.mask_token_id, tokenizer.pad_token_id, slot_sizes=(4,), seed=123)
    model.eval()
    losses = []
    for _ in range(draws):
        batch = collator(examples)
        batch.pop("slot_size")
        losses.append(model(**batch)[part].item())
    return sum(losses) / len(losses)


def converted_base(folder: Path) -> tuple[RefusionForCausalLM, object]:
    """The base as `finetune.sft` converts it before training (deterministic: the mask row is the mean)."""
    return convert_to_refusion(str(folder))


def run_cli(*args: str) -> int:
    return main([*map(str, args), *QUIET])


def logged_losses(output_dir: Path) -> list[dict]:
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return [log for log in state["log_history"] if "loss" in log]


@pytest.mark.parametrize(
    "architecture, tied, row_format, layout",
    [
        ("llama", True, "query_response", "jsonl"),
        ("qwen3", True, "prompt_completion", "json"),
        ("llama", False, "conversational", "parquet"),
        ("qwen3", False, "messages", "folder"),
    ],
)
def test_lora_overfits_a_small_set_in_every_format_and_writes_merged_model_and_adapter(
    tmp_path, architecture, tied, row_format, layout
):
    base_dir = save_base(tmp_path / "base", architecture, tied)
    data = write_data(tmp_path / "data", row_format, layout)
    output_dir = tmp_path / "out"
    status = run_cli(
        "--model_name_or_path", base_dir, "--dataset_name", data, "--output_dir", output_dir,
        "--use_peft", "--lora_r", 16, "--lora_alpha", 32, "--learning_rate", 1e-2, "--lr_scheduler_type", "constant",
        "--max_steps", 40, "--per_device_train_batch_size", 4, "--gradient_accumulation_steps", 2,
        "--logging_steps", 5, "--save_strategy", "no", "--slot_sizes", 2, 4,
    )  # fmt: skip
    assert status == 0
    assert all((output_dir / name).is_file() for name in REQUIRED_OUTPUTS)
    assert not (output_dir / STAGING).exists()

    logs = logged_losses(output_dir)
    assert [log["step"] for log in logs] == list(range(5, 41, 5))
    for log in logs:  # AR and MDM parts averaged over the same micro-batches as the loss
        assert log["loss"] == pytest.approx(log["ar_loss"] + log["mdm_loss"], abs=1e-3)

    base, tokenizer = converted_base(base_dir)
    merged = RefusionForCausalLM.from_pretrained(output_dir)
    assert merged.config.train_slot_sizes == [2, 4]
    before, after = hybrid_loss(base, tokenizer, data), hybrid_loss(merged, tokenizer, data)
    assert after < 0.6 * before

    # Only the mask token's row of the embeddings was trained; with tied embeddings the output layer follows.
    mask_id = merged.config.mask_token_id
    trained, original = merged.get_input_embeddings().weight, base.get_input_embeddings().weight
    assert torch.equal(trained[:mask_id], original[:mask_id])
    assert not torch.equal(trained[mask_id], original[mask_id])
    if tied:
        assert torch.equal(merged.lm_head.weight, trained)
    else:
        assert torch.equal(merged.lm_head.weight, base.lm_head.weight)

    # The adapter loads with PEFT onto the converted base and gives the merged model's logits.
    adapted = PeftModel.from_pretrained(base, output_dir / "adapter").eval()
    inputs = torch.tensor([tokenizer(FACTS[0][0])["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(adapted(inputs).logits, merged(inputs).logits, atol=1e-4, rtol=1e-4)


def test_lora_training_continues_from_a_saved_adapter(tmp_path, capsys):
    base_dir = save_base(tmp_path / "base", "llama")
    data = write_data(tmp_path / "data", "query_response", "jsonl")
    common = [
        "--model_name_or_path", base_dir, "--dataset_name", data, "--use_peft", "--lr_scheduler_type", "constant",
        "--per_device_train_batch_size", 4, "--logging_steps", 5, "--save_strategy", "no", "--slot_sizes", 2, 4,
    ]  # fmt: skip
    first, same, more = tmp_path / "first", tmp_path / "same", tmp_path / "more"
    assert run_cli(*common, "--output_dir", first, "--lora_r", 8, "--learning_rate", 1e-2, "--max_steps", 10,
                   "--mdm_loss_weight", 2.0, "--mask_init", "random") == 0  # fmt: skip
    for log in logged_losses(first):  # the MDM term counts twice in the loss, its part is logged unweighted
        assert log["loss"] == pytest.approx(log["ar_loss"] + 2.0 * log["mdm_loss"], abs=1e-3)
    assert RefusionForCausalLM.from_pretrained(first).config.mdm_loss_weight == 2.0

    # Learning rate 0: the continued adapter comes out exactly as it went in (its own rank 8, not --lora_r 4).
    assert run_cli(*common, "--output_dir", same, "--init_adapter", first / "adapter", "--lora_r", 4,
                   "--learning_rate", 0.0, "--max_steps", 2) == 0  # fmt: skip
    start, kept = (load_file(folder / "adapter" / "adapter_model.safetensors") for folder in (first, same))
    assert kept.keys() == start.keys() and all(torch.equal(kept[name], start[name]) for name in start)
    # More steps from there keep lowering the hybrid loss.
    assert run_cli(*common, "--output_dir", more, "--init_adapter", first / "adapter", "--learning_rate", 1e-2,
                   "--max_steps", 20) == 0  # fmt: skip
    _, tokenizer = converted_base(base_dir)
    after_first, after_more = (RefusionForCausalLM.from_pretrained(folder) for folder in (first, more))
    after_first.config.mdm_loss_weight = after_more.config.mdm_loss_weight = 1.0  # compare like with like
    assert hybrid_loss(after_more, tokenizer, data) < hybrid_loss(after_first, tokenizer, data)

    # Mistakes: no --use_peft, no adapter in the folder, an adapter that trains another row than this [MASK].
    capsys.readouterr()
    no_peft = [argument for argument in common if argument != "--use_peft"]
    assert run_cli(*no_peft, "--output_dir", tmp_path / "x", "--init_adapter", first / "adapter") == 1
    assert "add --use_peft" in capsys.readouterr().err.strip().splitlines()[-1]
    assert run_cli(*common, "--output_dir", tmp_path / "x", "--init_adapter", data.parent) == 1
    assert "holds no adapter_config.json" in capsys.readouterr().err.strip().splitlines()[-1]
    foreign = tmp_path / "foreign"
    shutil.copytree(first / "adapter", foreign)
    config = json.loads((foreign / "adapter_config.json").read_text())
    config["trainable_token_indices"] = {"embed_tokens": [3]}
    (foreign / "adapter_config.json").write_text(json.dumps(config))
    assert run_cli(*common, "--output_dir", tmp_path / "x", "--init_adapter", foreign) == 1
    assert "does not train the mask token's embedding row" in capsys.readouterr().err.strip().splitlines()[-1]


def test_full_fine_tuning_trains_every_weight_and_writes_no_adapter(tmp_path):
    base_dir = save_base(tmp_path / "base", "qwen3", tied=False)
    data = write_data(tmp_path / "data", "query_response", "jsonl")
    output_dir = tmp_path / "out"
    status = run_cli(
        "--model_name_or_path", base_dir, "--dataset_name", data, "--output_dir", output_dir,
        "--learning_rate", 3e-3, "--lr_scheduler_type", "constant", "--max_steps", 30,
        "--per_device_train_batch_size", 8, "--logging_steps", 10, "--save_strategy", "no",
    )  # fmt: skip
    assert status == 0
    assert not (output_dir / "adapter").exists()
    base, tokenizer = converted_base(base_dir)
    merged = RefusionForCausalLM.from_pretrained(output_dir)
    initial, trained = base.state_dict(), merged.state_dict()
    assert all(not torch.equal(initial[name], trained[name]) for name in initial)
    assert hybrid_loss(merged, tokenizer, data) < 0.6 * hybrid_loss(base, tokenizer, data)


def test_native_format_writes_the_backbones_class_with_the_decoder_in_custom_generate(tmp_path):
    base_dir = save_base(tmp_path / "base", "llama")
    data = write_data(tmp_path / "data", "query_response", "jsonl")
    output_dir = tmp_path / "out"
    status = run_cli(
        "--model_name_or_path", base_dir, "--dataset_name", data, "--output_dir", output_dir, "--use_peft",
        "--max_steps", 2, "--per_device_train_batch_size", 4, "--save_strategy", "no", "--format", "native",
    )  # fmt: skip
    assert status == 0
    config = json.loads((output_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "mask_token_id" in config
    decoder = (output_dir / "custom_generate" / "generate.py").read_bytes()
    assert decoder == (ROOT / "generation_refusion.py").read_bytes()
    assert "Format: `native`" in (output_dir / "README.md").read_text()
    native = AutoModelForCausalLM.from_pretrained(output_dir)
    assert type(native).__name__ == "LlamaForCausalLM"


def test_training_continues_from_a_refusion_checkpoint_and_evaluates_on_the_test_split(tmp_path, capsys):
    refusion, tokenizer = converted_base(save_base(tmp_path / "base", "llama"))
    start = save_refusion(refusion, tokenizer, tmp_path / "refusion-start")
    data = tmp_path / "data"
    data.mkdir()
    for split, pairs in (("train", FACTS), ("test", FACTS[:2])):
        lines = [json.dumps({"query": q, "response": a}) + "\n" for q, a in pairs]
        (data / f"{split}.jsonl").write_text("".join(lines), encoding="utf-8")
    output_dir = tmp_path / "out"
    common = ["--model_name_or_path", start, "--dataset_name", data, "--output_dir", output_dir]
    status = run_cli(
        *common, "--use_peft", "--max_steps", 4, "--per_device_train_batch_size", 4, "--logging_steps", 2,
        "--eval_strategy", "steps", "--eval_steps", 2, "--save_strategy", "no", "--slot_sizes", 8, "--mask_eps", 0.01,
    )  # fmt: skip
    assert status == 0
    continued = RefusionForCausalLM.from_pretrained(output_dir)
    assert continued.config.mask_token_id == refusion.config.mask_token_id
    assert continued.get_input_embeddings().num_embeddings == refusion.get_input_embeddings().num_embeddings
    assert (continued.config.train_slot_sizes, continued.config.mask_eps) == ([8], 0.01)
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    evaluations = [log for log in history if "eval_loss" in log]
    assert [log["step"] for log in evaluations] == [2, 4]
    for log in evaluations:
        assert log["eval_loss"] == pytest.approx(log["eval_ar_loss"] + log["eval_mdm_loss"], abs=1e-3)

    assert run_cli(*common, "--mask_token", "<|other|>") == 1
    assert "cannot change it" in capsys.readouterr().err.strip().splitlines()[-1]


def test_defaults_suit_a_machine_without_accelerator(tmp_path):
    defaults = RefusionSFTConfig(output_dir=str(tmp_path))
    assert (defaults.use_cpu, defaults.bf16, defaults.activation_checkpointing) == (True, False, False)
    assert defaults.remove_unused_columns is False and defaults.dataset_kwargs == {"skip_prepare_dataset": True}
    chosen = RefusionSFTConfig(output_dir=str(tmp_path), bf16=True, activation_checkpointing=True)
    assert (chosen.bf16, chosen.gradient_checkpointing) == (True, True)


def test_qlora_trains_on_cpu_and_merges_into_a_full_precision_model(tmp_path):
    base_dir = save_base(tmp_path / "base", "qwen3")
    data = write_data(tmp_path / "data", "messages", "jsonl")
    output_dir = tmp_path / "out"
    status = run_cli(
        "--model_name_or_path", base_dir, "--dataset_name", data, "--output_dir", output_dir,
        "--use_peft", "--load_in_4bit", "--max_steps", 4, "--per_device_train_batch_size", 4,
        "--logging_steps", 2, "--save_strategy", "no",
    )  # fmt: skip
    assert status == 0
    weights = load_file(output_dir / "model.safetensors")
    assert {tensor.dtype for tensor in weights.values()} == {torch.float32}  # no 4-bit leftovers
    assert "quantization_config" not in json.loads((output_dir / "config.json").read_text())
    assert (output_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert len(logged_losses(output_dir)) == 2


def test_user_mistakes_fail_in_one_line_before_training(tmp_path, capsys):
    base_dir = save_base(tmp_path / "base", "llama")
    bad = tmp_path / "bad.jsonl"
    good_rows = [{"query": q, "response": a} for q, a in FACTS[:3]]
    bad.write_text("".join(json.dumps(row) + "\n" for row in [*good_rows, {"query": "Why?", "response": ""}]))
    output_dir = tmp_path / "out"
    common = ["--model_name_or_path", base_dir, "--output_dir", output_dir, "--max_steps", 2]

    assert run_cli(*common, "--dataset_name", bad) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == "refusion-sft: error: Row 3: field 'response' is empty."
    assert not (output_dir / "config.json").exists()

    assert run_cli(*common, "--dataset_name", bad, "--load_in_4bit") == 1
    assert "add --use_peft" in capsys.readouterr().err.strip().splitlines()[-1]
    assert run_cli(*common, "--dataset_name", tmp_path / "missing.jsonl") == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("refusion-sft: error:")
    assert run_cli(*common, "--dataset_name", bad, "--resume_from_checkpoint", "true") == 1
    assert "no complete checkpoint" in capsys.readouterr().err

    with pytest.raises(SystemExit) as exit_info:
        run_cli(*common, "--dataset_name", bad, "--no_such_flag", 1)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "refusion-sft: error: Some specified arguments are not used by the HfArgumentParser: ['--no_such_flag', '1']"
    ]


def test_objective_options_from_a_recipe_config_train_and_log_the_soft_target_term(tmp_path, capsys):
    base_dir = save_base(tmp_path / "base", "llama")
    data = write_data(tmp_path / "data", "query_response", "jsonl")
    output_dir = tmp_path / "out"
    settings = {  # a recipe `sft` section: recipe.run passes each key as a flag
        "slot_masking": "mixed", "masked_slots": "tail", "acceptance_decay": 0.7, "soft_target_weight": 0.5,
        "use_peft": True,
        "lora_r": 8, "learning_rate": 1e-2, "lr_scheduler_type": "constant", "max_steps": 10,
        "per_device_train_batch_size": 4, "logging_steps": 5, "save_strategy": "no", "slot_sizes": [2, 4],
    }  # fmt: skip
    arguments = sft_arguments(settings, (str(base_dir), None), data, output_dir)
    refusion_args = make_parser().parse_args_and_config([*arguments, *QUIET])[3]
    assert (refusion_args.slot_masking, refusion_args.acceptance_decay, refusion_args.soft_target_weight) == (
        "mixed",
        0.7,
        0.5,
    )
    assert refusion_args.masked_slots == "tail"
    assert main([*arguments, *QUIET]) == 0
    logs = logged_losses(output_dir)
    assert len(logs) == 2
    for log in logs:  # the soft-target term is logged unweighted and counts with its weight
        assert log["soft_target_loss"] > 0
        assert log["loss"] == pytest.approx(log["ar_loss"] + log["mdm_loss"] + 0.5 * log["soft_target_loss"], abs=1e-3)

    capsys.readouterr()
    common = ["--model_name_or_path", base_dir, "--dataset_name", data, "--output_dir", tmp_path / "x"]
    assert run_cli(*common, "--soft_target_weight", 0.5) == 1
    assert "add --use_peft" in capsys.readouterr().err.strip().splitlines()[-1]
    assert run_cli(*common, "--use_peft", "--acceptance_decay", 1.5) == 1
    assert "--acceptance_decay must lie in (0, 1]" in capsys.readouterr().err.strip().splitlines()[-1]
    with pytest.raises(SystemExit):
        run_cli(*common, "--slot_masking", "prefix")
    assert "invalid choice: 'prefix'" in capsys.readouterr().err


def test_an_interrupted_final_write_never_leaves_a_folder_that_looks_complete(tmp_path, monkeypatch):
    output_dir = tmp_path / "out"
    checkpoint = output_dir / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text("{}")
    (output_dir / "config.json").write_text('{"from": "an earlier run"}')
    staging = output_dir / STAGING
    staging.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md"):
        (staging / name).write_text(name)

    moves = []

    def interrupted_replace(source, target):
        if len(moves) == 2:
            raise KeyboardInterrupt
        moves.append(Path(target).name)
        os.rename(source, target)

    monkeypatch.setattr("finetune.files.os.replace", interrupted_replace)
    with pytest.raises(KeyboardInterrupt):
        publish(staging, output_dir)
    assert moves and "config.json" not in moves
    assert not (output_dir / "config.json").exists()  # the old one went first: the mix never looks loadable
    assert (checkpoint / "trainer_state.json").is_file()

    monkeypatch.undo()
    publish(staging, output_dir)
    assert sorted(path.name for path in output_dir.iterdir()) == [
        "README.md",
        "checkpoint-2",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]


def test_the_final_write_keeps_the_users_files_and_clears_an_earlier_saves_weight_shards(tmp_path, monkeypatch):
    base_dir = save_base(tmp_path / "base", "llama")
    data = write_data(tmp_path / "data", "query_response", "jsonl")
    output_dir = tmp_path / "out"
    earlier, tokenizer = converted_base(base_dir)
    earlier.save_pretrained(output_dir, max_shard_size="50KB")  # a model saved here before, in shards
    tokenizer.save_pretrained(output_dir)
    shards = [path.name for path in output_dir.glob("model-*-of-*.safetensors")]
    mine = {"notes.txt": "mine", "custom_generate/mine.py": "# mine", "adapter/notes.txt": "mine too"}
    for name, text in mine.items():
        (output_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (output_dir / name).write_text(text)
    common = [
        "--model_name_or_path", base_dir, "--dataset_name", data, "--output_dir", output_dir, "--use_peft",
        "--max_steps", 1, "--per_device_train_batch_size", 4, "--save_strategy", "no",
    ]  # fmt: skip

    # Stopped once every final file is staged, before any moved in: the earlier model and the user's files stand.
    def stopped(staging, output_dir):
        assert (staging / "model.safetensors").is_file() and (staging / "adapter").is_dir()
        raise KeyboardInterrupt

    monkeypatch.setattr("finetune.export.publish", stopped)
    with pytest.raises(KeyboardInterrupt):
        run_cli(*common)
    monkeypatch.undo()
    reloaded = RefusionForCausalLM.from_pretrained(output_dir)
    assert all(torch.equal(value, earlier.state_dict()[name]) for name, value in reloaded.state_dict().items())
    assert {name: (output_dir / name).read_text() for name in mine} == mine

    assert run_cli(*common) == 0
    assert {name: (output_dir / name).read_text() for name in mine} == mine
    assert not any((output_dir / name).exists() for name in [*shards, "model.safetensors.index.json", STAGING])
    assert all((output_dir / name).is_file() for name in REQUIRED_OUTPUTS)
    assert (output_dir / "adapter" / "adapter_model.safetensors").is_file()
    RefusionForCausalLM.from_pretrained(output_dir)


def test_a_refusion_checkpoints_tokenizer_loads_without_a_question(tmp_path, monkeypatch):
    refusion, tokenizer = converted_base(save_base(tmp_path / "base", "llama"))
    start = save_refusion(refusion, tokenizer, tmp_path / "refusion-start")  # its config.json names custom code
    questions = []
    monkeypatch.setattr("builtins.input", lambda prompt="": questions.append(prompt) or "n")
    model_args = ModelConfig(model_name_or_path=str(start))
    training_args = RefusionSFTConfig(output_dir=str(tmp_path / "out"))
    model, loaded = load_model(model_args, RefusionArguments(), training_args)
    assert questions == []
    assert (loaded.mask_token, model.config.mask_token_id) == (tokenizer.mask_token, refusion.config.mask_token_id)


# ---------------------------------------------------------------------------------------------------------------
# Subprocess runs: the command line as a user types it.


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def cli_env(**extra: str) -> dict[str, str]:
    pythonpath = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    return {
        **os.environ,
        "PYTHONPATH": pythonpath,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        **extra,
    }


def test_two_processes_under_accelerate_launch_see_different_batches(tmp_path):
    base_dir = save_base(tmp_path / "base", "qwen3")
    data = write_data(tmp_path / "data", "query_response", "jsonl")
    output_dir, record = tmp_path / "out", tmp_path / "record"
    record.mkdir()
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", ROOT / "configs" / "accelerate" / "cpu_2proc.yaml", "--main_process_port", free_port(),
        PROBE, "--model_name_or_path", base_dir, "--dataset_name", data, "--output_dir", output_dir,
        "--use_peft", "--max_steps", 4, "--per_device_train_batch_size", 2, "--logging_steps", 2,
        "--save_steps", 2, *QUIET,
    ]  # fmt: skip
    result = subprocess.run(
        list(map(str, command)), env=cli_env(SFT_PROBE_RECORD=str(record)), capture_output=True, text=True, timeout=400
    )
    assert result.returncode == 0, result.stderr[-3000:]

    seen = {
        rank: [json.loads(line) for line in (record / f"rank{rank}.jsonl").read_text().splitlines()] for rank in (0, 1)
    }
    assert len(seen[0]) == len(seen[1]) == 4  # 8 rows, 2 per process per step: an epoch is 2 steps
    for epoch in (slice(0, 2), slice(2, 4)):
        rank0 = {tuple(prompt) for batch in seen[0][epoch] for prompt in batch}
        rank1 = {tuple(prompt) for batch in seen[1][epoch] for prompt in batch}
        assert len(rank0) == len(rank1) == 4 and not rank0 & rank1
    state = json.loads((output_dir / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and state["epoch"] == 2.0
    assert [log["step"] for log in logged_losses(output_dir)] == [2, 4]
    assert all((output_dir / name).is_file() for name in REQUIRED_OUTPUTS)


def test_a_run_killed_mid_way_resumes_to_the_same_step_count_without_losing_checkpoints(tmp_path):
    base_dir = save_base(tmp_path / "base", "llama")
    data = write_data(tmp_path / "data", "query_response", "jsonl")
    output_dir = tmp_path / "out"
    args = [
        PROBE, "--model_name_or_path", base_dir, "--dataset_name", data, "--output_dir", output_dir,
        "--use_peft", "--max_steps", 10, "--per_device_train_batch_size", 2, "--save_steps", 2,
        "--logging_steps", 1, *QUIET,
    ]  # fmt: skip
    first = subprocess.Popen(
        [sys.executable, *map(str, args)],
        env=cli_env(SFT_PROBE_STEP_DELAY="0.5"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while not (output_dir / "checkpoint-4" / "trainer_state.json").is_file():
        assert first.poll() is None and time.monotonic() < deadline, "the first run ended before checkpoint-4"
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert not (output_dir / "config.json").exists() and not (output_dir / "checkpoint-10").exists()

    # A checkpoint torn by the kill (no trainer_state.json) is skipped when resuming, then rewritten.
    checkpoints = sorted(int(path.name.split("-")[1]) for path in output_dir.glob("checkpoint-*"))
    torn = output_dir / f"checkpoint-{checkpoints[-1] + 2}"
    torn.mkdir()
    (torn / "adapter_model.safetensors").write_bytes(b"torn")

    resumed = subprocess.run(
        [sys.executable, *map(str, args), "--resume_from_checkpoint", "true"],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    state = json.loads((output_dir / "trainer_state.json").read_text())
    assert state["global_step"] == 10
    for step in range(2, 11, 2):
        checkpoint_state = json.loads((output_dir / f"checkpoint-{step}" / "trainer_state.json").read_text())
        assert checkpoint_state["global_step"] == step
    assert [log["step"] for log in state["log_history"] if "loss" in log] == list(range(1, 11))
    assert (output_dir / "config.json").is_file()


HUB_USER = """
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained({folder!r}, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained({folder!r}, trust_remote_code=True)
messages = [{{"role": "user", "content": "What is the capital of France?"}}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
print(json.dumps({{"class": type(model).__name__, "mask_token": tokenizer.mask_token,
                  "prompt_length": inputs["input_ids"].shape[1], "output_length": output.shape[1]}}))
"""


def test_push_to_hub_sends_the_merged_model_code_card_and_adapter_with_the_real_client(tmp_path):
    base_dir = save_base(tmp_path / "base", "qwen3")
    data = write_data(tmp_path / "data", "messages", "jsonl")
    output_dir = tmp_path / "refusion-tiny"
    with StandInHub() as hub:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "finetune.sft",
                "--model_name_or_path",
                str(base_dir),
                "--dataset_name",
                str(data),
                "--output_dir",
                str(output_dir),
                "--use_peft",
                "--max_steps",
                "2",
                "--save_steps",
                "1",
                "--push_to_hub",
                "--hub_model_id",
                "stand-in-org/refusion-tiny",
                "--hub_token",
                "hf_stand_in_token",
                *QUIET,
            ],  # fmt: skip
            env=cli_env(HF_ENDPOINT=hub.endpoint, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_OFFLINE="0"),
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert result.returncode == 0, result.stderr[-3000:]
    posts = [path for method, path in hub.requests if method == "POST"]
    assert posts == [
        "/api/repos/create",
        "/api/validate-yaml",
        "/api/models/stand-in-org/refusion-tiny/preupload/main",
        "/api/models/stand-in-org/refusion-tiny/commit/main",
    ]
    assert hub.created == [{"name": "refusion-tiny", "organization": "stand-in-org"}]
    assert hub.tokens == {"Bearer hf_stand_in_token"}
    sent = hub.files["stand-in-org/refusion-tiny"]
    assert set(REQUIRED_OUTPUTS) <= set(sent)
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= set(sent)
    assert not any(path.startswith(("checkpoint-", ".")) for path in sent)  # training checkpoints stay local
    for name in REQUIRED_OUTPUTS:
        assert sent[name] == (output_dir / name).read_bytes()
    config = json.loads(sent["config.json"])
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_refusion.RefusionForCausalLM"
    assert config["model_type"] == "refusion" and config["text_config"]["model_type"] == "qwen3"
    card = sent["README.md"].decode()
    assert hub.validated_cards == [card] and "stand-in-org/refusion-tiny" in card and "trust_remote_code=True" in card

    # What was sent loads as a Hub user would (only torch + transformers, remote code) and generates.
    downloaded = tmp_path / "downloaded"
    for name, content in sent.items():
        (downloaded / name).parent.mkdir(parents=True, exist_ok=True)
        (downloaded / name).write_bytes(content)
    report = run_as_hub_user(HUB_USER.format(folder=str(downloaded)), tmp_path)
    assert report["class"] == "RefusionForCausalLM" and report["mask_token"] == "<|mask|>"
    assert report["prompt_length"] < report["output_length"] <= report["prompt_length"] + 8
