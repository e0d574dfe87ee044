"""The decoder and QLoRA on a CUDA GPU (run by scripts/device_check.sh); skipped on machines without one."""

import math

import pytest
import torch
from test_batching import PROMPTS, left_padded
from test_generation import PROMPT, check_well_formed, sharpened_model

from compiling_refusion import warm_up_steps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SETTINGS = dict(slot_size=4, slot_threshold=0.5, token_threshold=0.4, eos_token_id=[], pad_token_id=0)


@pytest.fixture(scope="module")
def model():
    # float64: equality of cached and recomputed decoding must not hinge on which attention kernel a shape gets
    return sharpened_model("qwen3", scale=4.0).to("cuda")


@pytest.mark.parametrize("draft_window", [None, 2])
def test_cached_decoding_equals_recomputation_on_cuda(model, draft_window):
    prompt = PROMPT.to("cuda")
    settings = dict(max_new_tokens=24, draft_window=draft_window, return_dict_in_generate=True, **SETTINGS)
    cached = model.generate(prompt, **settings)
    recomputed = model.generate(prompt, use_cache=False, **settings)
    assert cached.sequences.device.type == "cuda"
    assert torch.equal(cached.sequences, recomputed.sequences)
    assert cached.num_forward_passes == recomputed.num_forward_passes


def test_batched_decoding_equals_each_prompt_alone_on_cuda(model):
    ids, mask = left_padded(PROMPTS)
    batched = model.generate(ids.to("cuda"), attention_mask=mask.to("cuda"), max_new_tokens=18, **SETTINGS)
    for row, prompt in enumerate(PROMPTS):
        alone = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=18, **SETTINGS)[0, len(prompt) :]
        assert torch.equal(batched[row, ids.shape[1] : ids.shape[1] + alone.shape[0]], alone)


def test_static_cache_with_cuda_graphs_gives_the_same_tokens_and_compiles_once(model):
    """On CUDA a static cache compiles the forwards by default (transformers' rule), with CUDA graphs."""
    settings = dict(max_new_tokens=16, block_length=8, fused_redraft=True, **SETTINGS)
    prompts = [PROMPT.to("cuda"), torch.tensor([[11, 12, 13]], device="cuda")]
    dynamic = [model.generate(prompt, **settings) for prompt in prompts]
    assert torch.equal(model.generate(prompts[0], cache_implementation="static", **settings), dynamic[0])
    warm_up_steps(model)  # the step functions' graphs for one row or slot and for several, whichever the decode met
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs >= 1  # the forwards were compiled
    for prompt, expected in zip(prompts, dynamic):
        assert torch.equal(model.generate(prompt, cache_implementation="static", **settings), expected)
    eager = model.generate(prompts[0], cache_implementation="static", disable_compile=True, **settings)
    assert torch.equal(eager, dynamic[0])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs <= 2  # widths the second prompt met first


def test_bfloat16_decoding_on_cuda_is_well_formed():
    bf16 = sharpened_model("qwen3", scale=4.0).to("cuda", torch.bfloat16)
    sequences = bf16.generate(PROMPT.to("cuda"), max_new_tokens=21, **SETTINGS).cpu()
    check_well_formed(sequences, PROMPT, 21, [], 0, bf16.config.mask_token_id)


def test_qlora_step_with_bitsandbytes_on_cuda(tmp_path):
    pytest.importorskip("bitsandbytes")
    from test_sft import logged_losses, run_cli, save_base, write_data  # TRL and datasets: this test's alone

    base_dir = save_base(tmp_path / "base", "llama")
    data = write_data(tmp_path / "data", "messages", "jsonl")
    output_dir = tmp_path / "out"
    status = run_cli(
        "--model_name_or_path", base_dir, "--dataset_name", data, "--output_dir", output_dir,
        "--use_peft", "--load_in_4bit", "--max_steps", 4, "--per_device_train_batch_size", 4,
        "--logging_steps", 2, "--save_strategy", "no",
    )  # fmt: skip
    assert status == 0
    assert (output_dir / "adapter" / "adapter_model.safetensors").is_file()
    losses = [log["loss"] for log in logged_losses(output_dir)]
    assert len(losses) == 2 and all(math.isfinite(loss) and loss > 0 for loss in losses)
