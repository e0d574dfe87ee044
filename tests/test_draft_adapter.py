"""The draft-only adapter (`adapter_refusion`): deltas at `[MASK]` tokens only, every clean token the base model's bit
for bit; decoding with it exact (cached = recomputed, static = dynamic, batched = alone, compiled and exported
forwards = eager); saved and loaded with the model; trained alone by `finetune.sft --draft_adapter_rank`."""

import copy

import pytest
import torch
from test_batching import PROMPTS, left_padded
from test_generation import sharpened_model
from test_sft import FACTS, QUIET, converted_base, hybrid_loss, save_base, write_data
from tiny import tiny_tokenizer
from transformers import CompileConfig, DynamicCache

from compiling_refusion import decoder_function
from finetune.convert import save_model, save_refusion
from finetune.sft import main
from modeling_refusion import RefusionForCausalLM
from packages_refusion import ExportedBackbone

ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3"]
SETTINGS = {
    "fast": dict(max_new_tokens=16, slot_size=4, slot_threshold=0.5, token_threshold=0.4),
    "fused window": dict(
        max_new_tokens=16, slot_size=8, block_length=16, slot_threshold=0.5, token_threshold=0.3, fused_redraft=True,
        draft_window=2,
    ),
    "reference": dict(max_new_tokens=16, slot_size=4, slot_threshold=0.5, token_threshold=0.4, infill_mode="reference"),
}  # fmt: skip


def with_adapter(base: RefusionForCausalLM, rank: int = 4, seed: int = 0) -> RefusionForCausalLM:
    """A copy of `base` with a draft adapter whose deltas are large and random (a new one's are zero)."""
    model = copy.deepcopy(base)
    model.add_draft_adapter(rank=rank, alpha=2.0 * rank)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.draft_adapter.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * 0.5)
    return model


@pytest.fixture(scope="module", params=ARCHITECTURES)
def pair(request):
    base = sharpened_model(request.param, scale=4.0)
    return base, with_adapter(base)


def mixed_inputs(mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of clean tokens followed by [MASK]s (a plan forward's shape), and which positions are clean with no
    [MASK] before them."""
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    ids[0, 7:] = mask_token_id
    ids[1, 10:] = mask_token_id
    clean_before_any_mask = (ids == mask_token_id).cumsum(dim=1) == 0
    return ids, clean_before_any_mask


@torch.no_grad()
def test_clean_tokens_give_the_base_models_logits_and_cache_bit_for_bit(pair):
    base, model = pair
    ids, clean = mixed_inputs(model.config.mask_token_id)
    positions = torch.arange(ids.shape[1]).flip(0).expand_as(ids)  # stored out of reading order, as decoding does
    base_cache, cache = DynamicCache(config=base.config.text_config), DynamicCache(config=model.config.text_config)
    expected = base(ids, position_ids=positions, cache=base_cache, use_cache=True).logits
    logits = model(ids, position_ids=positions, cache=cache, use_cache=True).logits
    assert torch.equal(logits[clean], expected[clean])
    assert (logits[~clean] - expected[~clean]).abs().amax(dim=-1).min() > 1e-3  # every [MASK] row moved
    for base_layer, layer in zip(base_cache.layers, cache.layers):
        keep = clean[:, None, :, None].expand_as(layer.keys)
        assert torch.equal(layer.keys[keep], base_layer.keys[keep])
        assert torch.equal(layer.values[keep], base_layer.values[keep])
    clean_only = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(2))
    assert torch.equal(model(clean_only).logits, base(clean_only).logits)


@torch.no_grad()
def test_a_new_adapter_changes_nothing_until_it_is_trained():
    base = sharpened_model("llama", scale=4.0)
    model = copy.deepcopy(base)
    model.add_draft_adapter(rank=8)
    assert model.config.draft_adapter == {
        "rank": 8,
        "alpha": 32.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    }
    assert len(model.draft_adapter.deltas) == 7 * base.config.text_config.num_hidden_layers
    assert all(parameter.dtype == torch.float64 for parameter in model.draft_adapter.parameters())
    ids, _ = mixed_inputs(model.config.mask_token_id)
    assert torch.equal(model(ids).logits, base(ids).logits)
    settings = dict(SETTINGS["fast"], eos_token_id=[], pad_token_id=0)
    prompts, mask = left_padded(PROMPTS)
    assert torch.equal(
        model.generate(prompts, attention_mask=mask, **settings),
        base.generate(prompts, attention_mask=mask, **settings),
    )


@pytest.mark.parametrize("name", list(SETTINGS))
def test_decoding_with_an_adapter_is_exact_and_follows_the_adapter(pair, name):
    base, model = pair
    settings = dict(SETTINGS[name], eos_token_id=[], pad_token_id=0)
    ids, mask = left_padded(PROMPTS)
    static = model.generate(ids, attention_mask=mask, cache_implementation="static", **settings)
    dynamic = model.generate(ids, attention_mask=mask, **settings)
    recomputed = model.generate(ids, attention_mask=mask, use_cache=False, **settings)
    assert torch.equal(static, dynamic) and torch.equal(static, recomputed)
    for row, prompt in enumerate(PROMPTS):
        alone = model.generate(torch.tensor([prompt]), **settings)[0, len(prompt) :]
        assert torch.equal(static[row, ids.shape[1] :], alone)
    # The drafts come from the adapter: the base model's own decode differs somewhere.
    assert not torch.equal(static, base.generate(ids, attention_mask=mask, **settings))


@pytest.mark.parametrize("name", list(SETTINGS))
def test_no_clean_token_attends_to_a_mask_query_so_every_check_is_the_base_models(pair, name):
    """Together with the forward's bit-exact clean rows: in every forward of a decode, a clean token (prompt, fresh
    answer token, a draft to check) sees no [MASK] query, so its hidden states, KV and logits are the base model's."""
    _, model = pair
    mask_token_id, counts = model.config.mask_token_id, dict(mixed=0, clean_sees_new=0, violations=0)

    def check(backbone, args, kwargs):
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        assert mask.dim() == 4  # the decoder always passes its storage-order mask
        new_keys = mask[:, 0, :, mask.shape[-1] - ids.shape[1] :] == 0  # [batch, query, new key]: visible
        is_mask = ids == mask_token_id
        clean_rows = ~is_mask[:, :, None]
        counts["mixed"] += int(is_mask.any() and (~is_mask).any())
        counts["clean_sees_new"] += int((new_keys & clean_rows & ~is_mask[:, None, :]).sum())
        counts["violations"] += int((new_keys & clean_rows & is_mask[:, None, :]).sum())

    ids, mask = left_padded(PROMPTS)
    hook = model.model.register_forward_pre_hook(check, with_kwargs=True)
    try:
        model.generate(ids, attention_mask=mask, **SETTINGS[name], eos_token_id=[], pad_token_id=0)
    finally:
        hook.remove()
    assert counts["mixed"] > 0 and counts["clean_sees_new"] > 0  # forwards mixed [MASK] and clean queries
    assert counts["violations"] == 0


@torch.no_grad()
def test_compiled_and_exported_backbones_apply_the_adapter_as_eager_does():
    base = sharpened_model("qwen3", scale=4.0)
    model = with_adapter(base)
    ids, clean = mixed_inputs(model.config.mask_token_id)
    inputs = dict(input_ids=ids, position_ids=torch.arange(ids.shape[1]).expand_as(ids), use_cache=False)
    eager = model.model(**inputs).last_hidden_state
    assert (eager - base.model(**inputs).last_hidden_state)[~clean].abs().amax(dim=-1).min() > 1e-2
    # (inductor's kernels differ from eager ones by ~1e-6 here, the base model's as much)
    compiled = torch.compile(decoder_function(model, logits_width=0), fullgraph=True)
    torch.testing.assert_close(compiled(inputs), eager, rtol=1e-4, atol=1e-4)

    class Backbone(torch.nn.Module):  # `ExportedBackbone` without a cache: the same call of the backbone
        def __init__(self, decoder):
            super().__init__()
            self.decoder = decoder

        def forward(self, input_ids, position_ids):
            return self.decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state

    assert ExportedBackbone.forward.__code__.co_names.count("decoder")  # the saved packages call the backbone so
    exported = torch.export.export(Backbone(model.model), (ids, inputs["position_ids"]), strict=False)
    assert any("draft_adapter" in name for name in exported.state_dict)  # its deltas are the program's weights
    torch.testing.assert_close(exported.module()(ids, inputs["position_ids"]), eager, rtol=1e-4, atol=1e-4)


def test_a_compiled_decode_with_an_adapter_gives_the_eager_tokens():
    model = with_adapter(sharpened_model("llama", scale=4.0))
    config = CompileConfig(fullgraph=True, dynamic=False, mode="default")
    settings = dict(SETTINGS["fast"], max_new_tokens=8, eos_token_id=[], pad_token_id=0, cache_implementation="static")
    prompt = torch.tensor([PROMPTS[0]])
    assert torch.equal(model.generate(prompt, compile_config=config, **settings), model.generate(prompt, **settings))


def test_the_adapter_is_saved_loaded_and_refused_where_it_cannot_apply(tmp_path):
    model = with_adapter(sharpened_model("mistral", scale=4.0)).float()
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"mask_token": "<|mask|>"})
    folder = save_refusion(model, tokenizer, tmp_path / "saved")
    assert (folder / "adapter_refusion.py").is_file()
    assert (folder / "custom_generate" / "adapter_refusion.py").is_file()
    loaded = RefusionForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert loaded.config.draft_adapter == model.config.draft_adapter
    saved, reloaded = model.state_dict(), loaded.state_dict()
    assert saved.keys() == reloaded.keys() and all(torch.equal(saved[name], reloaded[name]) for name in saved)
    ids, _ = mixed_inputs(model.config.mask_token_id)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)

    with pytest.raises(ValueError, match="only ReFusion's own class applies"):
        save_model(model, tmp_path / "native", format="native")
    with pytest.raises(ValueError, match="needs input_ids"), torch.no_grad():
        model(inputs_embeds=model.get_input_embeddings()(ids))
    with pytest.raises(ValueError, match="already has a draft adapter"):
        model.add_draft_adapter()
    bare = sharpened_model("qwen2", scale=1.0)
    with pytest.raises(ValueError, match=r"\['w_proj'\] name no linear layer"):
        bare.add_draft_adapter(target_modules=["q_proj", "w_proj"])
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        bare.add_draft_adapter(rank=0)
    config = copy.deepcopy(bare.config).to_dict()
    config["draft_adapter"], config["mask_token_id"] = {"rank": 2}, None
    with pytest.raises(ValueError, match="set mask_token_id too"):
        type(bare.config).from_dict(config)


def test_sft_trains_the_draft_adapter_alone(tmp_path, capsys):
    base_dir = save_base(tmp_path / "base", "llama")
    data = write_data(tmp_path / "data", "query_response", "jsonl")
    output_dir = tmp_path / "out"
    status = main([
        "--model_name_or_path", str(base_dir), "--dataset_name", str(data), "--output_dir", str(output_dir),
        "--draft_adapter_rank", "8", "--soft_target_weight", "0.5", "--learning_rate", "1e-2",
        "--lr_scheduler_type", "constant", "--max_steps", "30", "--per_device_train_batch_size", "4",
        "--logging_steps", "10", "--save_strategy", "no", "--slot_sizes", "2", "4", *QUIET,
    ])  # fmt: skip
    assert status == 0
    assert not (output_dir / "adapter").exists()
    base, tokenizer = converted_base(base_dir)
    trained = RefusionForCausalLM.from_pretrained(output_dir)
    assert trained.config.draft_adapter["rank"] == 8 and trained.config.draft_adapter["alpha"] == 16.0
    initial, weights = base.state_dict(), trained.state_dict()
    assert all(torch.equal(initial[name], weights[name]) for name in initial)  # every base weight as it was
    assert any(weights[name].abs().max() > 0 for name in weights if name.endswith(".up"))
    prompt = torch.tensor([tokenizer(FACTS[0][0])["input_ids"]])
    with torch.no_grad():
        assert torch.equal(trained(prompt).logits, base(prompt).logits)
    # The [MASK] predictions learned (5.7 -> 4.2 in these 30 steps; LoRA reaches lower by moving the base weights
    # too); the AR part cannot move.
    assert hybrid_loss(trained, tokenizer, data, part="mdm_loss") < 0.8 * hybrid_loss(
        base, tokenizer, data, part="mdm_loss"
    )
    assert hybrid_loss(trained, tokenizer, data, part="ar_loss") == hybrid_loss(base, tokenizer, data, part="ar_loss")

    # Continuing it from the saved model: the same settings go on, others are refused.
    again = tmp_path / "again"
    common = ["--model_name_or_path", str(output_dir), "--dataset_name", str(data), "--max_steps", "2", *QUIET]
    assert main([*common, "--output_dir", str(again), "--draft_adapter_rank", "8", "--learning_rate", "0"]) == 0
    continued = RefusionForCausalLM.from_pretrained(again).state_dict()
    assert all(torch.equal(continued[name], weights[name]) for name in weights)
    capsys.readouterr()
    assert main([*common, "--output_dir", str(tmp_path / "x"), "--draft_adapter_rank", "4"]) == 1
    assert "draft adapter has {'rank': 8" in capsys.readouterr().err
    assert main([*common, "--output_dir", str(tmp_path / "x"), "--draft_adapter_rank", "8", "--use_peft"]) == 1
    assert "drop --use_peft" in capsys.readouterr().err
    assert main([*common, "--output_dir", str(tmp_path / "x"), "--draft_adapter_alpha", "4"]) == 1
    assert "go with --draft_adapter_rank" in capsys.readouterr().err
