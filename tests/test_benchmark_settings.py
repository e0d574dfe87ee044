"""The benchmarks' named decoding settings are whole and fixed, decode as stated on a model with other defaults, and
every benchmark writes its results through one writer."""

import importlib
import json
import sys

import pytest
import torch
from tiny import tiny_backbone, tiny_tokenizer

import benchmarks.settings
from benchmarks import budget_curve, forward_cost, quality_speed, serving
from benchmarks import decode as decode_benchmark
from benchmarks.settings import WHOLE_SLOTS, generation_config, setting, shipped
from finetune.chat import prompt_token_ids
from finetune.convert import convert_to_refusion
from recipe.decoding import decode
from recipe.model import shipped_decoding
from recipe.report import cell, write_results
from settings_refusion import DECODING_DEFAULTS, DECODING_FIELDS

PROMPTS = ["What is the capital of France?", "Explain rain to me."]


def test_a_setting_states_every_decoding_field_and_nothing_else():
    assert list(WHOLE_SLOTS) == list(DECODING_FIELDS)
    changed = setting(WHOLE_SLOTS, slot_size=4, draft_window=2)
    assert list(changed) == list(DECODING_FIELDS)
    assert changed == {**WHOLE_SLOTS, "slot_size": 4, "draft_window": 2}
    with pytest.raises(ValueError, match="missing: .*'token_threshold'"):
        setting({}, slot_size=4)
    with pytest.raises(ValueError, match=r"not decoding settings: \['slot'\]"):
        setting(WHOLE_SLOTS, slot=4)


def test_the_shipped_rows_are_the_recipe_decoding_section():
    expected = {**DECODING_DEFAULTS, **shipped_decoding()}
    assert shipped() == expected
    assert quality_speed.GRID["shipped default"] == expected
    assert decode_benchmark.SETTINGS["shipped default"] == expected


def test_only_the_shipped_rows_move_with_the_shipped_default(monkeypatch):
    before = {"quality_speed": dict(quality_speed.GRID), "decode": dict(decode_benchmark.SETTINGS)}
    other = {**WHOLE_SLOTS, "slot_size": 4, "block_length": 8, "infill_mode": "reference"}
    try:
        with monkeypatch.context() as patch:
            patch.setattr(benchmarks.settings, "shipped_decoding", lambda: other)
            after = {"quality_speed": importlib.reload(quality_speed).GRID}
            after["decode"] = importlib.reload(decode_benchmark).SETTINGS
    finally:
        importlib.reload(quality_speed), importlib.reload(decode_benchmark)
    for grid, rows in before.items():
        assert after[grid]["shipped default"] == other
        if "shipped, priced drafts" in after[grid]:  # the shipped setting with one change, as named
            assert after[grid]["shipped, priced drafts"] == {**other, "draft_schedule": "price"}
        assert {name: row for name, row in after[grid].items() if not name.startswith("shipped")} == {
            name: row for name, row in rows.items() if not name.startswith("shipped")
        }


@pytest.fixture(scope="module")
def shipped_model():
    """A tiny converted model whose generation defaults are the shipped decoding setting (fused redraft, a draft
    window), as the recipe's model has; and its tokenizer."""
    tokenizer = tiny_tokenizer()
    backbone = tiny_backbone("qwen3", vocab_size=len(tokenizer), initializer_range=0.2)
    model, tokenizer = convert_to_refusion(backbone, tokenizer, **shipped())
    with torch.no_grad():
        model.model.norm.weight.mul_(4.0)  # spread-out probabilities, so thresholds matter
    return model.double().eval(), tokenizer


@pytest.mark.parametrize(
    "name",
    [
        "shipped default",
        "whole slots",
        "reference",
        "draft window 2",
        "slot 8 + fused redraft",
        "reference, slot 4, block 16, 0.6/0.3 (authors')",
        "slot 1 (tokens), 0.5",
    ],
)
def test_a_named_setting_decodes_as_stated_on_a_model_with_the_shipped_defaults(shipped_model, name):
    """Through `generation_config`, a row decodes exactly as a model whose own defaults are that row: none of the
    shipped defaults (fused redraft, draft window 4) shows through, and the reference rows run."""
    model, tokenizer = shipped_model
    decoding = quality_speed.GRID[name]
    prompts = prompt_token_ids(tokenizer, PROMPTS)
    run = decode(model, tokenizer, prompts, 20, eos_token_id=[], generation_config=generation_config(model, decoding))
    own_defaults = model.generation_config
    try:
        model.generation_config = generation_config(model, decoding)  # the row as the model's own defaults
        expected = decode(model, tokenizer, prompts, 20, eos_token_id=[])
    finally:
        model.generation_config = own_defaults
    assert run.answers == expected.answers and run.forwards == expected.forwards
    assert {name: getattr(model.generation_config, name) for name in DECODING_FIELDS} == shipped()  # untouched


def test_one_writer_writes_json_table_and_plot(tmp_path, capsys):
    results = {"rows": [{"name": "a", "value": None}]}
    written = write_results(tmp_path / "out", "bench", "| a |\n", results, lambda path: path.write_bytes(b"png"))
    assert [path.name for path in written] == ["bench.json", "bench.md", "bench.png"]
    assert json.loads(written[0].read_text(encoding="utf-8")) == results
    assert written[1].read_text(encoding="utf-8") == "| a |\n" and written[2].read_bytes() == b"png"
    assert "written: " in capsys.readouterr().out
    only_table = write_results(tmp_path / "out", "curve", "| b |\n", plot=lambda path: None, plot_stem="curve_plot")
    assert [path.name for path in only_table] == ["curve.md", "curve_plot.png"]


def test_a_table_cell_is_a_formatted_figure_or_a_dash():
    assert cell(None) == "-" and cell(0.125) == "0.12" and cell(3.14159, ".1f") == "3.1" and cell(0.0) == "0.00"


@pytest.mark.parametrize("module", [quality_speed, forward_cost, serving, budget_curve])
def test_a_benchmark_that_writes_results_is_told_where(module, monkeypatch, capsys):
    """No default folder: a run in another dtype or with other settings cannot overwrite the committed results."""
    monkeypatch.setattr(sys, "argv", [module.__name__])
    with pytest.raises(SystemExit) as stopped:
        module.main()
    assert stopped.value.code == 2 and "--output_dir" in capsys.readouterr().err
