"""The decoding dtype policy: bfloat16 where the hardware multiplies it natively, float32 elsewhere, overridable,
and recorded by a saved folder so that `dtype="auto"` loads it back in the same dtype."""

import pytest
import torch
from tiny import tiny_backbone, tiny_tokenizer
from transformers import AutoModelForCausalLM

from finetune.convert import convert_to_refusion, save_refusion
from recipe.model import decoding_dtype, native_bfloat16

AVX2_ONLY = {"avx2": True, "avx512_f": False, "avx512_bf16": False, "amx_bf16": False}


@pytest.mark.parametrize(
    ("capabilities", "expected"),
    [
        (AVX2_ONLY, torch.float32),  # e.g. AMD Zen 3: bf16 matmuls are emulated
        ({**AVX2_ONLY, "avx512_f": True}, torch.float32),  # AVX512 without its BF16 extension
        ({**AVX2_ONLY, "avx512_f": True, "avx512_bf16": True}, torch.bfloat16),
        ({**AVX2_ONLY, "amx_bf16": True}, torch.bfloat16),  # Sapphire Rapids and later
    ],
)
def test_cpu_decodes_in_bfloat16_only_where_it_is_native(monkeypatch, capabilities, expected):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: capabilities)
    assert decoding_dtype(device="cpu") == expected
    assert native_bfloat16("cpu") == (expected == torch.bfloat16)


@pytest.mark.parametrize(
    ("available", "bf16", "expected"), [(True, True, torch.bfloat16), (True, False, torch.float32)]
)
def test_cuda_decodes_in_bfloat16_where_the_gpu_has_it(monkeypatch, available, bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16)
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {**AVX2_ONLY, "amx_bf16": True})
    assert decoding_dtype(device="cuda") == expected
    assert decoding_dtype(device=torch.device("cuda", 0)) == expected


def test_a_requested_dtype_wins_over_the_policy(monkeypatch):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: AVX2_ONLY)
    assert decoding_dtype("bfloat16") == torch.bfloat16
    assert decoding_dtype(torch.float16, device="cuda") == torch.float16


@pytest.mark.parametrize("requested", ["int8", "long", "fp32", "bfloat", torch.int64])
def test_a_dtype_that_is_not_a_float_dtype_is_refused_by_name(requested):
    with pytest.raises(ValueError, match=repr(requested)):
        decoding_dtype(requested)


def test_a_folder_saved_in_bfloat16_loads_back_in_bfloat16_with_dtype_auto(tmp_path):
    tokenizer = tiny_tokenizer()
    model, refusion_tokenizer = convert_to_refusion(tiny_backbone("llama", len(tokenizer)), tokenizer)
    folder = save_refusion(model.to(torch.bfloat16), refusion_tokenizer, tmp_path / "bf16")
    loaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype="auto")
    assert loaded.dtype == torch.bfloat16
    inputs = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(loaded(inputs).logits, model(inputs).logits)
