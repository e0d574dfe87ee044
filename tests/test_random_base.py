"""A weightless copy of a base model's architecture (`recipe.model.save_architecture`) and a random model of it
(`random_base`): what a GPU machine that cannot fetch the shipped model times (`benchmarks.compiled_rounds
--random_base`)."""

import pytest
import torch
from tiny import tiny_backbone, tiny_tokenizer

from recipe.model import random_base, save_architecture


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_a_random_base_has_the_architecture_and_tokenizer_but_not_the_weights(tmp_path, architecture):
    tokenizer = tiny_tokenizer()
    base = tiny_backbone(architecture, len(tokenizer), seed=7)  # random_base draws from seed 0
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")

    folder = save_architecture(tmp_path / "architecture", tmp_path / "base")
    assert not list(folder.glob("*.safetensors")) and not list(folder.glob("*.bin"))  # no weights travel
    model, loaded_tokenizer = random_base(folder)

    assert type(model) is type(base) and model.dtype == torch.float32
    ignored = {"dtype": None, "_name_or_path": None}
    assert model.config.to_dict() | ignored == base.config.to_dict() | ignored
    shapes = {name: tensor.shape for name, tensor in model.state_dict().items()}
    assert shapes == {name: tensor.shape for name, tensor in base.state_dict().items()}
    assert not torch.equal(model.lm_head.weight, base.lm_head.weight)
    assert torch.equal(random_base(folder)[0].lm_head.weight, model.lm_head.weight)  # seeded: the same model
    assert loaded_tokenizer.get_vocab() == tokenizer.get_vocab()
    assert loaded_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == (
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    )
