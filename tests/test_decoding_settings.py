"""One table of decoding settings (`DECODING_SETTINGS`) and transformers' semantics for options: a passed option wins
over the generation config, a configured option the chosen rule does not use is set aside, an explicit None turns an
option off, and two passed options that conflict are refused by name. Everything that lists the settings comes from
the table."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_generation import PROMPT, sharpened_model

from finetune.convert import parse_args
from finetune.model_card import TrainingSummary, render_model_card
from modeling_refusion import RefusionForCausalLM
from settings_refusion import (
    DECODING_DEFAULTS,
    DECODING_FIELDS,
    DECODING_SETTINGS,
    DecodingSettings,
    check_decoding,
    settings_table,
)

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = dict(
    slot_size=8, block_length=16, slot_threshold=0.5, token_threshold=0.3, fused_redraft=True, draft_window=4
)


@pytest.fixture(scope="module")
def shipped_like():
    """A tiny model whose generation config turns on what the shipped model's does (fused redraft, a window of 4)."""
    model = sharpened_model("llama", scale=4.0)
    for name, value in SHIPPED.items():
        setattr(model.generation_config, name, value)
    return model


def decode(model, **options):
    options = dict(max_new_tokens=20, eos_token_id=[], pad_token_id=0, return_dict_in_generate=True, **options)
    return model.generate(PROMPT, **options)


# ---- the table -----------------------------------------------------------------------------------------------------
def test_every_default_is_valid_and_the_record_has_a_field_per_setting():
    assert DECODING_FIELDS == tuple(setting.name for setting in DECODING_SETTINGS)
    assert check_decoding({}) == DECODING_DEFAULTS
    fields = [field.name for field in dataclasses.fields(DecodingSettings)]
    assert fields[: len(DECODING_FIELDS)] == list(DECODING_FIELDS)


@pytest.mark.parametrize(
    ("name", "bad"),
    [("slot_size", 0), ("slot_size", 2.0), ("slot_size", True), ("slot_threshold", 1.5), ("token_threshold", -0.1),
     ("token_threshold", "high"), ("block_length", 0), ("infill_mode", "slow"), ("fused_redraft", 1),
     ("draft_window", 0), ("draft_window", 2.5)],
)  # fmt: skip
def test_a_bad_value_is_refused_naming_the_setting_and_its_values(name, bad):
    setting = next(setting for setting in DECODING_SETTINGS if setting.name == name)
    with pytest.raises(ValueError, match=f"^{re.escape(f'{name} must be {setting.values()}, got')}"):
        check_decoding({name: bad})
    with pytest.raises(ValueError, match=f"^{name} must be"):  # a bad configured value too
        check_decoding({}, {name: bad})


def test_command_line_words_parse_to_the_tables_values():
    setting = {setting.name: setting for setting in DECODING_SETTINGS}
    assert setting["draft_window"].parse("none") is None and setting["draft_window"].parse("4") == 4
    assert setting["fused_redraft"].parse("True") is True and setting["fused_redraft"].parse("false") is False
    assert setting["slot_threshold"].parse("0.6") == 0.6 and setting["infill_mode"].parse("reference") == "reference"
    for name, word in (("slot_size", "none"), ("slot_size", "eight"), ("fused_redraft", "maybe")):
        with pytest.raises(ValueError, match=f"^{name} must be"):
            setting[name].parse(word)


# ---- transformers' semantics ---------------------------------------------------------------------------------------
def test_a_passed_option_wins_over_the_configured_one():
    assert check_decoding({"slot_size": 4}, {"slot_size": 16, "block_length": 32})["slot_size"] == 4
    assert check_decoding({}, {"slot_size": 16, "block_length": 32})["slot_size"] == 16


def test_a_configured_option_the_chosen_rule_does_not_use_is_set_aside():
    decoding = check_decoding({"infill_mode": "reference"}, SHIPPED)
    assert (decoding["infill_mode"], decoding["fused_redraft"], decoding["draft_window"]) == ("reference", False, None)
    assert decoding["slot_size"] == SHIPPED["slot_size"]  # options every rule uses stay


def test_an_explicit_none_turns_an_option_off_or_keeps_the_configured_value():
    decoding = check_decoding({"draft_window": None, "fused_redraft": None, "slot_threshold": None}, SHIPPED)
    assert decoding["draft_window"] is None and decoding["fused_redraft"] is False
    assert decoding["slot_threshold"] == SHIPPED["slot_threshold"]  # no off value: None means "not passed"


@pytest.mark.parametrize("option", [dict(draft_window=4), dict(fused_redraft=True)])
def test_two_passed_options_that_conflict_are_refused_naming_both(option):
    ((name, value),) = option.items()
    with pytest.raises(ValueError, match=rf"{name}={value!r} and infill_mode='reference' were both passed"):
        check_decoding({"infill_mode": "reference", **option})


def test_a_passed_option_the_configured_rule_does_not_use_says_which_rule_to_pass():
    with pytest.raises(
        ValueError, match=r"draft_window=2 applies to .*infill_mode='reference': pass infill_mode='fast'"
    ):
        check_decoding({"draft_window": 2}, {"infill_mode": "reference"})


def test_a_configured_block_length_is_rounded_up_to_the_slot_size_but_a_passed_one_is_checked():
    assert check_decoding({"slot_size": 12}, {"block_length": 32})["block_length"] == 36
    with pytest.raises(ValueError, match=r"block_length \(32\) must be a multiple of slot_size \(12\)"):
        check_decoding({"slot_size": 12, "block_length": 32})


# ---- generate() on a model configured like the shipped one ---------------------------------------------------------
def test_the_authors_rule_runs_on_a_model_whose_config_turns_on_fast_only_options(shipped_like):
    reference = decode(shipped_like, infill_mode="reference")
    plain = dict(SHIPPED, fused_redraft=False, draft_window=None, infill_mode="reference")
    expected = decode(shipped_like, generation_config=shipped_like.generation_config.__class__(**plain))
    assert torch.equal(reference.sequences, expected.sequences)
    assert reference.num_forward_passes == expected.num_forward_passes


def test_draft_window_none_checks_whole_slots_on_a_windowed_model(shipped_like):
    whole = decode(shipped_like, draft_window=None)
    configured = decode(shipped_like, generation_config=shipped_like.generation_config.__class__(
        **dict(SHIPPED, draft_window=None)))  # fmt: skip
    queries = []  # the queries of each forward (the tokens whose logits it keeps)
    hook = shipped_like.register_forward_pre_hook(
        lambda module, args, kwargs: queries.append(kwargs["logits_to_keep"]), with_kwargs=True
    )
    try:
        decode(shipped_like, draft_window=None)
        whole_queries, queries[:] = sum(queries), []
        windowed = decode(shipped_like)
    finally:
        hook.remove()
    assert torch.equal(whole.sequences, configured.sequences)
    assert whole.num_forward_passes == configured.num_forward_passes
    assert sum(queries) < whole_queries  # the window mattered: narrower forwards
    assert windowed.num_forward_passes >= whole.num_forward_passes


def test_generate_refuses_conflicting_passed_options_by_name(shipped_like):
    with pytest.raises(ValueError, match="fused_redraft=True and infill_mode='reference' were both passed"):
        decode(shipped_like, infill_mode="reference", fused_redraft=True)


# ---- everything that lists the settings comes from the table -------------------------------------------------------
def test_generate_docstrings_list_every_setting():
    for function in (RefusionForCausalLM.generate, sys.modules["generation_refusion"].generate):
        assert "{settings}" not in function.__doc__
        for setting in DECODING_SETTINGS:
            assert f"`{setting.name}` ({setting.values()}; default {setting.default!r}" in function.__doc__


def test_the_readme_carries_the_current_table():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = f"<!-- decoding-settings:begin -->\n{settings_table()}\n<!-- decoding-settings:end -->"
    assert block in readme, "The README's decoding table is stale: run python scripts/settings_table.py"


def test_the_table_writer_replaces_only_the_marked_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- decoding-settings:begin -->\nSTALE\n<!-- decoding-settings:end -->\noutro\n")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "settings_table.py"), str(readme)], check=True)
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("\noutro\n")
    assert settings_table() in text and "STALE" not in text


def test_the_model_card_carries_the_table():
    summary = TrainingSummary(
        base_model="org/base", dataset="org/data", method="full fine-tuning", rows=10, max_length=256,
        slot_sizes=[4, 8], mask_eps=1e-3, steps=5, epochs=1.0, learning_rate=1e-4, batch_size=8,
    )  # fmt: skip
    assert settings_table() in render_model_card("user/model", summary)


def test_convert_has_a_flag_for_every_setting_and_keeps_unpassed_ones_unset():
    flags = [word for setting in DECODING_SETTINGS for word in (f"--{setting.name}", str(setting.default))]
    args = parse_args(["--model_name_or_path", "m", "--output_dir", "o", *flags])
    assert {name: getattr(args, name) for name in DECODING_FIELDS} == DECODING_DEFAULTS
    args = parse_args(["--model_name_or_path", "m", "--output_dir", "o", "--fused_redraft", "true"])
    assert args.fused_redraft is True and not hasattr(args, "draft_window")
