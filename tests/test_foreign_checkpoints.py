"""ReFusion checkpoints we did not make: one shaped like the authors' release (a plain Qwen3 class, two added special
tokens, `config.mask_token_id`, no tokenizer mask token, sampling defaults), decoded through transformers'
`custom_generate`, converted, and exported in the backbone's native format; every saved config is clean."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hub_user import run_as_hub_user
from tiny import tiny_backbone, tiny_tokenizer
from transformers import GenerationConfig

from compiling_refusion import DECODING_FILES
from finetune.convert import convert_to_refusion, main, save_refusion

ROOT = Path(__file__).resolve().parents[1]
MASK = "<|diffusion_mask|>"  # not the converter's default string: found through config.mask_token_id only
ROW = 0.123  # the mask token's trained embedding row, distinctive
PROMPT = [5, 6, 7, 8, 9, 10]
DECODING = dict(max_new_tokens=16, slot_size=4, block_length=8, slot_threshold=0.5, token_threshold=0.3)


@pytest.fixture(scope="module")
def authors_checkpoint(tmp_path_factory) -> Path:
    """A tiny checkpoint shaped like GSAI-ML/ReFusion."""
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|beginoftext|>", MASK]})
    model = tiny_backbone("qwen3", vocab_size=len(tokenizer), initializer_range=0.2)
    mask_id = tokenizer.convert_tokens_to_ids(MASK)
    with torch.no_grad():
        model.model.norm.weight.mul_(4.0)  # spread-out probabilities, so that the thresholds matter
        model.get_input_embeddings().weight[mask_id] = ROW
    model.config.mask_token_id = mask_id
    model.generation_config = GenerationConfig(
        do_sample=True, temperature=0.6, top_k=20, top_p=0.95, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("authors") / "refusion-release"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert tokenizer.mask_token is None
    assert "use_cache" not in json.loads((folder / "generation_config.json").read_text())
    return folder


@pytest.fixture(scope="module")
def converted(authors_checkpoint, tmp_path_factory):
    model, tokenizer = convert_to_refusion(authors_checkpoint)
    folder = tmp_path_factory.mktemp("converted")
    return (
        model,
        tokenizer,
        save_refusion(model, tokenizer, folder / "refusion"),
        save_refusion(model, tokenizer, folder / "native", format="native"),
    )


def test_conversion_keeps_the_recorded_mask_token_and_its_row_and_decodes_greedily(authors_checkpoint, converted):
    model, tokenizer, _, _ = converted
    mask_id = json.loads((authors_checkpoint / "config.json").read_text())["mask_token_id"]
    assert model.config.mask_token_id == tokenizer.mask_token_id == mask_id and tokenizer.mask_token == MASK
    assert torch.all(model.get_input_embeddings().weight[mask_id] == ROW)
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer)  # nothing added
    assert model.generation_config.do_sample is False
    sampled, _ = convert_to_refusion(authors_checkpoint, do_sample=True)
    assert sampled.generation_config.do_sample is True


def test_every_saved_folder_carries_the_decoder_byte_for_byte(converted):
    _, _, refusion, native = converted
    source = (ROOT / "generation_refusion.py").read_bytes()
    for folder in (refusion, native):
        assert (folder / "custom_generate" / "generate.py").read_bytes() == source
        for name in DECODING_FILES:  # the modules it imports, beside it
            assert (folder / "custom_generate" / name).read_bytes() == (ROOT / name).read_bytes()
    for name in ("generation_refusion.py", *DECODING_FILES):  # and the remote-code model's own copy
        assert (refusion / name).read_bytes() == (ROOT / name).read_bytes()


def test_native_export_is_the_backbones_own_config(converted):
    model, _, _, native = converted
    config = json.loads((native / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    assert "auto_map" not in config and config["mask_token_id"] == model.config.mask_token_id
    generation = json.loads((native / "generation_config.json").read_text())
    assert generation["slot_size"] == 8 and generation["do_sample"] is False
    assert not list(native.glob("*.py"))  # no model code: every engine that serves Qwen3 loads it


HUB_USER = """
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

prompt = torch.tensor([{prompt}])
settings = {settings}
results = {{}}
plain = AutoModelForCausalLM.from_pretrained({authors!r})
results["plain_class"] = type(plain).__name__
results["plain_custom"] = plain.generate(
    prompt, custom_generate={refusion!r}, trust_remote_code=True, do_sample=False, **settings
)[0].tolist()
converted = AutoModelForCausalLM.from_pretrained({refusion!r}, trust_remote_code=True)
results["converted"] = converted.generate(prompt, **settings)[0].tolist()
native = AutoModelForCausalLM.from_pretrained({native!r}, trust_remote_code=True)
results["native_class"] = type(native).__module__ + "." + type(native).__name__
results["native"] = native.generate(prompt, **settings)[0].tolist()
serving = AutoModelForCausalLM.from_pretrained({native!r})
results["serving_ar"] = serving.generate(prompt, max_new_tokens=4, do_sample=False)[0].tolist()
expected_ar = prompt
with torch.no_grad():
    for _ in range(4):
        expected_ar = torch.cat([expected_ar, serving(expected_ar).logits[:, -1:].argmax(-1)], dim=1)
results["expected_ar"] = expected_ar[0].tolist()
results["native_tokenizer_mask"] = AutoTokenizer.from_pretrained({native!r}).mask_token
print(json.dumps(results))
"""


def test_plain_checkpoint_custom_generate_and_native_export_decode_like_the_converted_model(
    authors_checkpoint, converted, tmp_path
):
    model, _, refusion, native = converted
    expected = model.generate(torch.tensor([PROMPT]), **DECODING)[0].tolist()
    code = HUB_USER.format(
        prompt=PROMPT, settings=DECODING, authors=str(authors_checkpoint), refusion=str(refusion), native=str(native)
    )
    report = run_as_hub_user(code, tmp_path)
    assert report["plain_class"] == "Qwen3ForCausalLM"
    assert report["plain_custom"] == expected
    assert report["converted"] == expected
    assert report["native_class"] == "transformers.models.qwen3.modeling_qwen3.Qwen3ForCausalLM"
    assert report["native"] == expected
    assert report["serving_ar"] == report["expected_ar"]  # without remote code: an ordinary causal LM
    assert report["native_tokenizer_mask"] == MASK  # loads with no custom-code prompt


def test_custom_generate_refuses_attention_that_misreads_positions_and_unsupported_backbones(converted):
    from generation_refusion import generate

    model, _, _, native = converted
    from transformers import AutoModelForCausalLM

    flash = AutoModelForCausalLM.from_pretrained(native, attn_implementation="flex_attention")
    with pytest.raises(ValueError, match="flex_attention"):
        generate(flash, torch.tensor([PROMPT]), **DECODING)
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=50))
    with pytest.raises(ValueError, match="gpt2"):
        generate(gpt2, torch.tensor([[1, 2]]), mask_token_id=49, max_new_tokens=4)


def test_cli_native_format(authors_checkpoint, tmp_path):
    assert main(["--model_name_or_path", str(authors_checkpoint), "--output_dir", str(tmp_path / "n"), "--format",
                 "native"]) == 0  # fmt: skip
    assert json.loads((tmp_path / "n" / "config.json").read_text())["model_type"] == "qwen3"
    assert (tmp_path / "n" / "custom_generate" / "generate.py").is_file()


def saved_text(folder: Path) -> str:
    return "\n".join(path.read_text() for path in folder.rglob("*") if path.suffix in (".json", ".md"))


def test_saved_configs_hold_no_path_of_the_converting_machine(authors_checkpoint, converted):
    _, _, refusion, native = converted
    for folder in (refusion, native):
        text = saved_text(folder)
        assert str(authors_checkpoint) not in text and str(Path.home()) not in text and "/tmp/" not in text


def test_native_export_decodes_the_same_under_tensor_parallelism_on_two_cpu_processes(converted, tmp_path):
    model, _, _, native = converted
    expected = model.generate(torch.tensor([PROMPT]), **DECODING)[0].tolist()
    probe, report = Path(__file__).with_name("tp_probe.py"), tmp_path / "tp.json"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", probe, native, report],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env={"HF_HUB_OFFLINE": "1", "PATH": ""},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(report.read_text())
    rows = model.config.text_config.num_attention_heads * model.config.text_config.head_dim
    assert report["world_size"] == 2 and report["local_q_rows"] == rows // 2  # each process holds half of q_proj
    assert report["answer"] == expected
