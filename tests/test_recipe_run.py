"""The recipe end to end at toy sizes: held-out prompts kept out, distilled rows trained on, adapter written."""

import copy
import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from tiny import tiny_backbone, tiny_tokenizer

import recipe.distill
from finetune.convert import convert_to_refusion
from recipe.decoding import chat_prompt_ids
from recipe.model import with_adapter
from recipe.run import ADAPTER_FILES, load_config, run


def test_recipe_writes_a_small_adapter_and_a_log_from_distilled_data(tmp_path, monkeypatch):
    # A random tiny model never ends an answer or a sentence; count its cut-off answers as finished ones.
    real_answer_batch = recipe.distill.answer_batch
    monkeypatch.setattr(
        recipe.distill, "answer_batch", lambda *args: [(text, True) for text, _ in real_answer_batch(*args)]
    )
    tokenizer = tiny_tokenizer()
    base = tiny_backbone("llama", vocab_size=len(tokenizer), initializer_range=0.2)
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    overrides = [
        f"model.path={tmp_path / 'base'}",
        f"output_dir={tmp_path / 'out'}",
        f"artifacts_dir={tmp_path / 'artifacts'}",
        "distill.train_prompts=6",
        "distill.batch_size=3",
        "distill.max_new_tokens=4",
        "sft.max_steps=2",
        "sft.learning_rate=0.01",  # so that two steps move the weights measurably
        "sft.per_device_train_batch_size=2",
        "sft.max_length=64",
        "sft.logging_steps=1",
    ]
    config = load_config(Path(__file__).parents[1] / "recipe" / "smollm2.yaml", overrides)
    assert config["distill"]["train_prompts"] == 6 and config["sft"]["use_peft"] is True

    artifacts = run(config)

    adapter = artifacts / "adapter" / "adapter_model.safetensors"
    assert adapter.is_file() and adapter.stat().st_size <= 20 * 2**20
    assert sorted(path.name for path in adapter.parent.iterdir()) == sorted(ADAPTER_FILES)
    log = json.loads((artifacts / "training_log.json").read_text())
    assert [entry["step"] for entry in log if "loss" in entry] == [1, 2]
    assert all({"ar_loss", "mdm_loss"} <= entry.keys() for entry in log if "loss" in entry)
    held_out = {json.loads(line)["prompt"] for line in (tmp_path / "out" / "held_out.jsonl").read_text().splitlines()}
    distilled = [json.loads(line) for line in (tmp_path / "out" / "distilled.jsonl").read_text().splitlines()]
    assert distilled and held_out.isdisjoint(row["query"] for row in distilled)

    # The committed adapter loads: merged into a converted copy of the base it computes what PEFT computes unmerged,
    # and leaves the base model (the AR reference) and its tokenizer as they were.
    weights, vocabulary = copy.deepcopy(base.state_dict()), len(tokenizer)
    merged, refusion_tokenizer = with_adapter(base, tokenizer, artifacts / "adapter")
    assert all(torch.equal(value, base.state_dict()[name]) for name, value in weights.items())
    assert len(tokenizer) == vocabulary and len(refusion_tokenizer) == vocabulary + 1
    assert merged.config.mask_token_id == refusion_tokenizer.mask_token_id
    converted, _ = convert_to_refusion(copy.deepcopy(base), copy.deepcopy(tokenizer))
    inputs = torch.tensor(chat_prompt_ids(tokenizer, ["What is the capital of France?"]))
    with torch.no_grad():
        plain = converted(inputs).logits
        unmerged = PeftModel.from_pretrained(converted, artifacts / "adapter").eval()(inputs).logits
        logits = merged(inputs).logits
    torch.testing.assert_close(logits, unmerged, atol=1e-5, rtol=1e-5)
    assert (logits - plain).abs().max() > 1e-4  # the adapter changed the model
    answer = merged.generate(inputs, max_new_tokens=8, slot_size=4, block_length=8)
    assert answer.shape == (1, inputs.shape[1] + 8)
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        with_adapter(base, tokenizer, tmp_path / "out")


def test_gpu_config_is_the_cpu_recipe_with_other_sizes():
    folder = Path(__file__).parents[1] / "recipe"
    cpu, gpu = load_config(folder / "smollm2.yaml", []), load_config(folder / "smollm2-gpu.yaml", [])
    assert cpu.keys() == gpu.keys() and cpu["distill"].keys() == gpu["distill"].keys()
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
