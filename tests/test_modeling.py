"""RefusionForCausalLM: backbone parameter names, tied embeddings, out-of-order storage with RoPE positions."""

import pytest
import torch
from tiny import ARCHITECTURES, tiny_backbone
from transformers import AutoModel, AutoModelForCausalLM, DynamicCache

from configuration_refusion import RefusionConfig
from kernels_refusion import GROUPED_ATTENTION, register_grouped_attention
from modeling_refusion import RefusionForCausalLM

VOCAB = 64


def refusion_from(base, attn_implementation="sdpa"):
    if attn_implementation == GROUPED_ATTENTION:
        register_grouped_attention()
    config = RefusionConfig(text_config=base.config.to_dict(), mask_token_id=VOCAB - 1)
    config.text_config._attn_implementation = attn_implementation
    model = RefusionForCausalLM(config)
    model.load_state_dict(base.state_dict())
    return model.double().eval()


# Storage order: prompt (positions 0-3), then a slot decoded early (8-11), then the slot before it (4-7).
POSITIONS = torch.tensor([[0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7]])


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_parameter_names_are_the_base_models(architecture):
    base = tiny_backbone(architecture, vocab_size=VOCAB)
    model = refusion_from(base)
    assert dict(model.named_parameters()).keys() == dict(base.named_parameters()).keys()
    assert model.state_dict().keys() == base.state_dict().keys()
    tied = base.config.tie_word_embeddings
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_tied_embeddings_stay_tied_after_save_and_load(tmp_path, architecture):
    model = refusion_from(tiny_backbone(architecture, vocab_size=VOCAB))
    model.save_pretrained(tmp_path)
    loaded = RefusionForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == model.config.tie_word_embeddings
    assert all(torch.equal(loaded.state_dict()[name], value) for name, value in model.state_dict().items())


def test_auto_classes_resolve_to_the_causal_lm(tmp_path):
    model = refusion_from(tiny_backbone("qwen3", vocab_size=VOCAB))
    model.save_pretrained(tmp_path)
    for auto_class in (AutoModel, AutoModelForCausalLM):
        loaded = auto_class.from_pretrained(tmp_path, trust_remote_code=True)
        assert type(loaded).__name__ == "RefusionForCausalLM"


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager", GROUPED_ATTENTION])
def test_cached_out_of_order_forward_equals_one_pass(architecture, attn_implementation):
    """Slots stored out of reading order give the same logits whether computed at once or piece by piece."""
    model = refusion_from(tiny_backbone(architecture, vocab_size=VOCAB), attn_implementation)
    tokens = torch.randint(3, VOCAB - 1, POSITIONS.shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(tokens, position_ids=POSITIONS).logits
        cache = DynamicCache(config=model.config.text_config)
        pieces = [
            model(tokens[:, span], position_ids=POSITIONS[:, span], cache=cache, use_cache=True).logits
            for span in (slice(0, 4), slice(4, 8), slice(8, 12))
        ]
    tolerance = 1e-10 if attn_implementation == "sdpa" else 1e-6  # eager takes its softmax in float32
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, rtol=0, atol=tolerance)
    assert cache.get_seq_length() == POSITIONS.shape[1]


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_position_jumps_are_not_treated_as_packed_sequences(architecture):
    """Every stored token sees all tokens stored before it, whatever their position ids."""
    model = refusion_from(tiny_backbone(architecture, vocab_size=VOCAB))
    tokens = torch.randint(3, VOCAB - 1, POSITIONS.shape, generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[0, 0] = (tokens[0, 0] + 1) % (VOCAB - 4) + 3
    with torch.no_grad():
        logits = model(tokens, position_ids=POSITIONS).logits
        logits_changed = model(changed, position_ids=POSITIONS).logits
    # storage order is causal: every later token depends on the first one, none is cut off at a position jump
    assert ((logits - logits_changed).abs().amax(dim=-1)[0] > 1e-6).all()


def test_rope_follows_position_ids_not_storage_order():
    model = refusion_from(tiny_backbone("llama", vocab_size=VOCAB))
    tokens = torch.randint(3, VOCAB - 1, POSITIONS.shape, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out_of_order = model(tokens, position_ids=POSITIONS).logits
        storage_positions = model(tokens).logits
        shifted = model(tokens, position_ids=POSITIONS + 5).logits
    assert (out_of_order[0, 4:] - storage_positions[0, 4:]).abs().max() > 1e-4
    torch.testing.assert_close(shifted, out_of_order)  # RoPE is relative: a common shift changes nothing


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_sdpa_eager_and_grouped_attention_agree_on_out_of_order_input(architecture):
    base = tiny_backbone(architecture, vocab_size=VOCAB)
    tokens = torch.randint(3, VOCAB - 1, POSITIONS.shape, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        sdpa, eager, grouped = (
            refusion_from(base, name)(tokens, position_ids=POSITIONS).logits
            for name in ("sdpa", "eager", GROUPED_ATTENTION)
        )
    torch.testing.assert_close(sdpa, eager, rtol=0, atol=1e-6)  # eager takes its softmax in float32
    torch.testing.assert_close(grouped, sdpa, rtol=0, atol=1e-12)  # SDPA over the key/value heads it shares


@pytest.mark.parametrize("attn_implementation", ["flash_attention_2", "flex_attention"])
def test_attention_that_would_misread_positions_is_refused(attn_implementation):
    model = refusion_from(tiny_backbone("llama", vocab_size=VOCAB))
    model.config.text_config._attn_implementation = attn_implementation
    with pytest.raises(ValueError, match=attn_implementation):
        model(torch.tensor([[3, 4, 5]]))
