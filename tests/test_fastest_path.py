"""The fastest path as one call: `model.fastest_generation_config()` (`settings_refusion.fastest_settings`)."""

import pytest
import torch
from test_generation import PROMPT, sharpened_model

from settings_refusion import fastest_settings


def test_the_fastest_config_is_a_copy_with_the_measured_fastest_settings_of_the_device(tmp_path):
    model = sharpened_model("llama", scale=4.0)
    own = model.generation_config.to_dict()
    config = model.fastest_generation_config(compile_cache_dir=tmp_path)
    assert model.generation_config.to_dict() == own  # (the model's own config untouched)
    assert (config.cache_implementation, config.draft_schedule, config.lookup_drafts, config.token_threshold) == (
        "static",
        "price",
        4,
        0.5,
    )
    assert config.compile_cache_dir == str(tmp_path) and config.slot_size == model.generation_config.slot_size
    assert config.compile_config.mode == "max-autotune-no-cudagraphs" and config.compile_config.options == {
        "freezing": True
    }
    assert model.fastest_generation_config(tmp_path, frozen=False).compile_config.options == {"freezing": False}
    assert not hasattr(model.fastest_generation_config(), "compile_cache_dir")
    assert model.fastest_generation_config(tmp_path, compile_cache_max_gb=4).compile_cache_max_gb == 4
    cuda = fastest_settings(torch.device("cuda"))
    assert cuda["compile_config"].mode == "reduce-overhead" and not cuda["compile_config"].options
    with pytest.raises(ValueError, match="compile_cache_dir keeps AOTInductor packages for CPU decoding"):
        fastest_settings("cuda", tmp_path)


def test_a_decode_on_the_fastest_path_answers_the_model_s_greedy_answer():
    """Compiled, frozen, priced and with copied drafts, the answer is the plain decode's at the same threshold.
    (Without autotuning here, which costs minutes on a CPU: autotuned packages equal eager forwards in
    `test_saved_forwards_cpu_kinds`.)"""
    model = sharpened_model("qwen2", scale=4.0).float()
    settings = dict(max_new_tokens=8, slot_size=4, block_length=8, eos_token_id=[], pad_token_id=0)
    fastest = model.fastest_generation_config()
    fastest.compile_config.mode = None
    output = model.generate(PROMPT, generation_config=fastest, return_dict_in_generate=True, **settings)
    plain = model.generate(PROMPT, token_threshold=0.5, **settings)
    assert torch.equal(output.sequences, plain)
    assert output.forward_prices  # (priced: the table it measured)
