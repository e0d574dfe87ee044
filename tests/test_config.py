"""RefusionConfig: JSON round trip for every supported backbone, validation, unsupported backbones."""

import json

import pytest
from tiny import ARCHITECTURES, tiny_backbone
from transformers import GPT2Config

from configuration_refusion import SUPPORTED_BACKBONES, RefusionConfig


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_config_round_trips_through_json(tmp_path, architecture):
    backbone = tiny_backbone(architecture, vocab_size=64).config
    config = RefusionConfig(text_config=backbone, mask_token_id=63, train_slot_sizes=[4, 16])
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    loaded = RefusionConfig.from_pretrained(tmp_path)

    assert saved["model_type"] == "refusion"
    assert saved["text_config"]["model_type"] == architecture
    assert type(loaded.text_config) is type(backbone)
    assert loaded.to_dict() == config.to_dict()
    assert (loaded.mask_token_id, loaded.train_slot_sizes) == (63, [4, 16])
    assert loaded.tie_word_embeddings == backbone.tie_word_embeddings
    assert saved["auto_map"]["AutoModelForCausalLM"] == "modeling_refusion.RefusionForCausalLM"


@pytest.mark.parametrize("text_config", [GPT2Config(), {"model_type": "gpt2"}])
def test_backbone_without_rope_is_refused_with_the_supported_list(text_config):
    with pytest.raises(ValueError) as error:
        RefusionConfig(text_config=text_config)
    assert "'gpt2'" in str(error.value)
    assert all(name in str(error.value) for name in SUPPORTED_BACKBONES)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("mask_token_id", 64, "mask_token_id"),
        ("train_slot_sizes", [], "train_slot_sizes"),
        ("mask_eps", 0.0, "mask_eps"),
    ],
)
def test_out_of_range_fields_are_named(field, value, message):
    backbone = tiny_backbone("llama", vocab_size=64).config
    with pytest.raises(ValueError, match=message):
        RefusionConfig(text_config=backbone, **{field: value})
