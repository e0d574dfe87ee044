"""The recipe end to end at toy sizes: held-out prompts kept out, distilled rows trained on, adapter written."""

import json
from pathlib import Path

from tiny import tiny_backbone, tiny_tokenizer

from recipe.run import load_config, run


def test_recipe_writes_a_small_adapter_and_a_log_from_distilled_data(tmp_path):
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
        "sft.per_device_train_batch_size=2",
        "sft.max_length=64",
        "sft.logging_steps=1",
    ]
    config = load_config(Path(__file__).parents[1] / "recipe" / "smollm2.yaml", overrides)
    assert config["distill"]["train_prompts"] == 6 and config["sft"]["use_peft"] is True

    artifacts = run(config)

    adapter = artifacts / "adapter" / "adapter_model.safetensors"
    assert adapter.is_file() and adapter.stat().st_size <= 20 * 2**20
    log = json.loads((artifacts / "training_log.json").read_text())
    assert [entry["step"] for entry in log if "loss" in entry] == [1, 2]
    assert all({"ar_loss", "mdm_loss"} <= entry.keys() for entry in log if "loss" in entry)
    held_out = {json.loads(line)["prompt"] for line in (tmp_path / "out" / "held_out.jsonl").read_text().splitlines()}
    distilled = [json.loads(line) for line in (tmp_path / "out" / "distilled.jsonl").read_text().splitlines()]
    assert distilled and held_out.isdisjoint(row["query"] for row in distilled)
