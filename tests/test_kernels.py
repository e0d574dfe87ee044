"""Linear layers through oneDNN with prepacked weights (kernels_refusion): the same logits, state, gradients and
tokens as plain nn.Linear; a weight changed after packing is never computed with from a stale pack."""

import copy
import pickle
from collections import Counter

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_generation import PROMPT, sharpened_model
from tiny import ARCHITECTURES, tiny_backbone
from torch import nn
from transformers import DynamicCache

import kernels_refusion
from kernels_refusion import (
    GROUPED_ATTENTION,
    PackedLinear,
    grouped_attention,
    packing_plan,
    prepack_linears,
    unpack_linears,
)

onednn = pytest.mark.skipif(not kernels_refusion.onednn_available(), reason="this PyTorch has no oneDNN on this CPU")
VOCAB = 320
FLOAT32 = dict(rtol=1e-5, atol=1e-5)
EXACT = dict(rtol=0, atol=0)
ATEN, ONEDNN = "aten::linear", "mkldnn::_linear_pointwise"
IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])


def model_of(architecture: str = "llama", seed: int = 0) -> nn.Module:
    """A tiny random float32 causal LM with weights large enough for logits to spread."""
    return tiny_backbone(architecture, VOCAB, seed=seed, initializer_range=0.2)


def packed_copy(model: nn.Module, dtypes=(torch.float32,)) -> nn.Module:
    """A copy of `model` with its linear layers packed (from one row on, whatever the default plan says)."""
    packed = copy.deepcopy(model)
    assert prepack_linears(packed, dtypes=dtypes) == len(linears(model))
    return packed


def linears(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if isinstance(module, nn.Linear)]


def linear_ops(call) -> Counter:
    """How often `call()` ran each linear kernel: aten's (F.linear) and oneDNN's prepacked one."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        call()
    return Counter({event.key: event.count for event in profile.key_averages() if event.key in (ATEN, ONEDNN)})


def forward(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def kernels_of(packed: nn.Module, model: nn.Module, ids: torch.Tensor = IDS, **tolerance) -> Counter:
    """The linear kernels a no-grad forward of `packed` runs on `ids`, after checking that its logits equal those of
    `model` (to float32 tolerance unless told)."""
    expected, outputs = forward(model, ids), []
    ops = linear_ops(lambda: outputs.append(forward(packed, ids)))
    torch.testing.assert_close(outputs[0], expected, **(tolerance or FLOAT32))
    return ops


def logits_with_cache(model: nn.Module, prompt: torch.Tensor, widths=(1, 2, 4, 8)) -> list[torch.Tensor]:
    """Logits of a prefill of `prompt`, then of forwards of each width of new tokens after the cache grown so far."""
    generator = torch.Generator().manual_seed(1)
    cache, outputs = DynamicCache(), []
    with torch.no_grad():
        outputs.append(model(input_ids=prompt, cache=cache, use_cache=True).logits)
        for width in widths:
            ids = torch.randint(0, VOCAB, (prompt.shape[0], width), generator=generator)
            outputs.append(model(input_ids=ids, cache=cache, use_cache=True).logits)
    return outputs


@onednn
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
@pytest.mark.parametrize("batch", [1, 2])
def test_packed_logits_equal_plain_ones_at_every_width_with_a_cache(architecture, batch):
    model = model_of(architecture)
    packed = packed_copy(model)
    prompt = torch.randint(0, VOCAB, (batch, 12), generator=torch.Generator().manual_seed(0))
    expected, actual = logits_with_cache(model, prompt), []
    ops = linear_ops(lambda: actual.extend(logits_with_cache(packed, prompt)))
    assert ops == Counter({ONEDNN: 5 * len(linears(model))})  # the prefill and widths 1, 2, 4, 8: all packed
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, want, **FLOAT32)


@onednn
@pytest.mark.parametrize("architecture", ["llama", "qwen2"])  # tied lm_head / biased q, k, v projections
def test_parameters_state_dict_and_saved_files_do_not_change(architecture, tmp_path):
    model = model_of(architecture)
    parameters, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    state = model.state_dict()
    model.save_pretrained(tmp_path / "plain")
    prepack_linears(model, dtypes=(torch.float32,))
    forward(model, IDS)
    assert dict(model.named_parameters()) == parameters  # the same objects under the same names
    assert dict(model.named_buffers()).keys() == buffers.keys()
    packed_state = model.state_dict()
    assert list(packed_state) == list(state)
    for name, tensor in state.items():
        assert packed_state[name].data_ptr() == tensor.data_ptr() and torch.equal(packed_state[name], tensor)
    model.save_pretrained(tmp_path / "packed")
    for path in (tmp_path / "plain").iterdir():
        assert (tmp_path / "packed" / path.name).read_bytes() == path.read_bytes(), path.name
    if architecture == "llama":
        assert model.lm_head.weight is model.model.embed_tokens.weight


@onednn
def test_a_weight_changed_in_place_after_packing_is_honoured():
    model = model_of("llama")
    packed = packed_copy(model)
    kernels_of(packed, model)
    changes = [
        lambda m: m.model.layers[0].self_attn.q_proj.weight.mul_(1.5),
        lambda m: m.model.layers[1].mlp.down_proj.weight.add_(0.1),
        lambda m: m.model.embed_tokens.weight.mul_(-1.0),  # the tied lm_head sees it through the shared parameter
        lambda m: m.load_state_dict(model_of("llama", seed=3).state_dict()),
    ]
    for change in changes:
        with torch.no_grad():
            change(model)
            change(packed)
        assert kernels_of(packed, model) == Counter({ONEDNN: len(linears(model))})  # repacked, not fallen back


@onednn
def test_a_weight_replaced_through_data_is_honoured_and_a_data_alias_write_at_the_next_prepack():
    model = model_of("llama")
    packed = packed_copy(model)
    kernels_of(packed, model)
    for m in (model, packed):
        layer = m.model.layers[0].mlp.up_proj
        layer.weight.data = layer.weight.data * 2  # a new tensor: new storage, seen by the forward
    kernels_of(packed, model)
    for m in (model, packed):
        m.model.layers[1].self_attn.o_proj.weight.data.mul_(3)  # PyTorch counts no version for this write
    assert prepack_linears(packed, dtypes=(torch.float32,)) == len(linears(model))  # the checksum sees it
    assert kernels_of(packed, model) == Counter({ONEDNN: len(linears(model))})


@onednn
@pytest.mark.parametrize("safe_merge", [False, True])
def test_a_lora_merge_after_packing_is_honoured(safe_merge):
    model = model_of("qwen2")
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    torch.manual_seed(0)
    adapted = get_peft_model(copy.deepcopy(model), config).eval()
    packed = copy.deepcopy(adapted)
    prepack_linears(packed, dtypes=(torch.float32,))
    kernels_of(packed, adapted)  # packs the base layers and the adapters' own linears
    merged = adapted.merge_and_unload(safe_merge=safe_merge)
    packed_merged = packed.merge_and_unload(safe_merge=safe_merge)
    # PEFT writes the merged weight through a `.data` alias (`+= delta`; under safe_merge `.copy_`, from PEFT 0.22),
    # which no forward can see: the next prepack_linears does
    prepack_linears(packed_merged, dtypes=(torch.float32,))
    assert kernels_of(packed_merged, merged) == Counter({ONEDNN: len(linears(model))})
    assert not torch.allclose(forward(merged, IDS), forward(model, IDS))  # the merge changed the logits


@onednn
def test_other_dtypes_fall_back_and_float32_repacks_after_a_round_trip():
    model = model_of("qwen3")
    packed = packed_copy(model)
    kernels_of(packed, model)
    packed.to(torch.float32)  # a no-op keeps the packs
    assert all("_refusion_pack" in layer.__dict__ for layer in linears(packed))
    model, packed = model.double(), packed.double()
    assert all("_refusion_pack" not in layer.__dict__ for layer in linears(packed))  # stale packs freed at once
    assert kernels_of(packed, model, **EXACT) == Counter({ATEN: len(linears(model))})
    model, packed = model.to(torch.bfloat16), packed.to(torch.bfloat16)  # float32 only here: F.linear, bit for bit
    assert kernels_of(packed, model, **EXACT) == Counter({ATEN: len(linears(model))})
    model, packed = model.float(), packed.float()
    assert kernels_of(packed, model) == Counter({ONEDNN: len(linears(model))})


@onednn
@pytest.mark.parametrize("native", [True, False], ids=["bf16-kernels", "float32-packs"])
def test_bfloat16_packs_equal_plain_bfloat16_to_its_rounding(native, monkeypatch):
    """With oneDNN's bfloat16 kernels, or packed as float32 where the CPU has none (the input converted up, the
    output rounded back): bfloat16 logits either way, equal to F.linear's to bfloat16 rounding."""
    if native and not kernels_refusion._onednn_bfloat16():
        pytest.skip("oneDNN has no bfloat16 kernels on this CPU")
    monkeypatch.setattr(kernels_refusion, "_onednn_bfloat16", lambda: native)
    model = model_of("mistral").to(torch.bfloat16)
    packed = packed_copy(model, dtypes=(torch.float32, torch.bfloat16))
    packs = [layer.__dict__["_refusion_pack"].packed for layer in linears(packed)]
    assert {pack.dtype for pack in packs} == {torch.bfloat16 if native else torch.float32}
    prompt = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    expected, actual = logits_with_cache(model, prompt), []
    assert linear_ops(lambda: actual.extend(logits_with_cache(packed, prompt))) == Counter({ONEDNN: 5 * 15})
    for got, want in zip(actual, expected, strict=True):  # a few bf16 roundings of logits up to ~5
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=5e-2)


@onednn
def test_the_default_plan_packs_float32_everywhere_and_bfloat16_natively_or_as_float32_without_its_arithmetic():
    plan = packing_plan()
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    assert plan[torch.float32] == (4 if avx512 else 1)  # MKL's GEMV wins below 4 rows on Intel's AVX-512
    # bfloat16 arithmetic (AVX512-BF16, AMX): bfloat16 from one row; none: from four, as float32
    assert plan[torch.bfloat16] == (1 if kernels_refusion._onednn_bfloat16() else 4)
    model = model_of("llama").to(torch.bfloat16)
    assert prepack_linears(model) == (len(linears(model)) if torch.bfloat16 in plan else 0)
    if plan.get(torch.bfloat16) == 4:  # one to three rows stay F.linear in bfloat16; four take the float32 packs
        plain, bf16, layers = model_of("llama").to(torch.bfloat16), dict(rtol=2e-2, atol=5e-2), len(linears(model))
        assert kernels_of(model, plain, IDS[:, :3], **bf16) == Counter({ATEN: layers})
        assert kernels_of(model, plain, IDS[:, :4], **bf16) == Counter({ONEDNN: layers})


@onednn
def test_forwards_narrower_than_the_plan_s_rows_use_f_linear_and_keep_the_pack():
    model = model_of("qwen3")
    packed = copy.deepcopy(model)
    prepack_linears(packed, dtypes={torch.float32: 4})
    batch = torch.cat([IDS[:, :2], IDS[:, 2:4]])  # 2 rows of 2 tokens: 4 in all
    for ids, kernel in ((IDS[:, :3], ATEN), (IDS[:, :4], ONEDNN), (batch, ONEDNN), (IDS[:, :1], ATEN)):
        assert kernels_of(packed, model, ids) == Counter({kernel: len(linears(model))})
    assert all("_refusion_pack" in layer.__dict__ for layer in linears(packed))


@onednn
def test_a_forward_that_records_gradients_falls_back_and_gradients_flow():
    model = model_of("mistral")
    packed = packed_copy(model)
    plain_loss = model(input_ids=IDS, labels=IDS).loss
    plain_loss.backward()
    losses = []
    assert linear_ops(lambda: losses.append(packed(input_ids=IDS, labels=IDS).loss)) == Counter({ATEN: 15})
    losses[0].backward()
    torch.testing.assert_close(losses[0], plain_loss, **FLOAT32)
    for (name, parameter), other in zip(model.named_parameters(), packed.parameters(), strict=True):
        torch.testing.assert_close(other.grad, parameter.grad, **FLOAT32, msg=name)
    with torch.no_grad():  # an optimizer step changes every weight in place: the next inference forward repacks
        for parameter in (*model.parameters(), *packed.parameters()):
            parameter.sub_(0.1 * parameter.grad)
    assert kernels_of(packed, model) == Counter({ONEDNN: 15})
    model.requires_grad_(False)  # frozen weights, grad mode on, nothing to record: packed
    packed.requires_grad_(False)
    expected, outputs = model(IDS).logits, []
    assert linear_ops(lambda: outputs.append(packed(IDS).logits)) == Counter({ONEDNN: 15})
    torch.testing.assert_close(outputs[0], expected, **FLOAT32)


@onednn
def test_inference_mode_and_autocast():
    model = model_of("qwen2")
    packed = packed_copy(model)
    with torch.inference_mode():
        torch.testing.assert_close(packed(IDS).logits, model(IDS).logits, **FLOAT32)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast's bf16 F.linear, not a float32 kernel
        assert set(kernels_of(packed, model, **EXACT)) == {ATEN}  # (the profiler lists autocast's call twice)


@onednn
def test_copies_and_pickles_repack_on_their_own():
    model = model_of("llama")
    packed = packed_copy(model)
    kernels_of(packed, model)
    for other in (copy.deepcopy(packed), pickle.loads(pickle.dumps(packed))):
        assert all(type(layer) is PackedLinear and "_refusion_pack" not in layer.__dict__ for layer in linears(other))
        assert kernels_of(other, model) == Counter({ONEDNN: len(linears(model))})
    kernels_of(packed, model)


@onednn
def test_unpack_restores_plain_linears():
    plain = model_of("qwen3")
    model = packed_copy(plain)
    forward(model, IDS)
    assert unpack_linears(model) == len(linears(plain))
    for layer, original in zip(linears(model), linears(plain), strict=True):
        assert type(layer) is nn.Linear and set(layer.__dict__) == set(original.__dict__)
    assert repr(model) == repr(plain)
    assert kernels_of(model, plain, **EXACT) == Counter({ATEN: len(linears(plain))})


def test_subclasses_of_linear_are_left_alone_and_nothing_changes_without_onednn(monkeypatch):
    class Custom(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 4), Custom(4, 4))
    if kernels_refusion.onednn_available():
        assert prepack_linears(model, dtypes=(torch.float32,)) == 1
        assert type(model[0]) is PackedLinear and type(model[1]) is Custom
        unpack_linears(model)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert packing_plan() == {} and prepack_linears(model) == 0
    assert [type(layer) for layer in model] == [nn.Linear, Custom]


@onednn
def test_refusion_generate_gives_the_same_tokens_packed():
    model = sharpened_model("qwen3", scale=4.0).float()
    packed = packed_copy(model)
    for settings in (dict(slot_size=4), dict(slot_size=8, slot_threshold=0.5, token_threshold=0.5)):
        settings.update(max_new_tokens=24, eos_token_id=[], return_dict_in_generate=True)
        expected, outputs = model.generate(PROMPT, **settings), []
        ops = linear_ops(lambda settings=settings, outputs=outputs: outputs.append(packed.generate(PROMPT, **settings)))
        assert set(ops) == {ONEDNN}
        assert torch.equal(outputs[0].sequences, expected.sequences)
        assert outputs[0].num_forward_passes == expected.num_forward_passes


@onednn
def test_under_torch_compile_a_packed_layer_is_an_ordinary_linear():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    prepack_linears(model, dtypes=(torch.float32,))
    inputs = torch.randn(3, 8)
    with torch.no_grad():
        expected = model(inputs)
        compiled = torch.compile(model, fullgraph=True)  # no graph break: inductor sees F.linear and packs for itself
        torch.testing.assert_close(compiled(inputs), expected, **FLOAT32)


@onednn
def test_the_decoding_policy_prepacks_a_cpu_model_unless_told_not_to():
    from recipe.model import prepare_for_decoding

    model = sharpened_model("llama", scale=4.0).float()
    plain = model.generate(PROMPT, max_new_tokens=16, eos_token_id=[], return_dict_in_generate=True)
    assert prepare_for_decoding(model, kernels=False) == 0 and not any(
        isinstance(m, PackedLinear) for m in linears(model)
    )
    assert prepare_for_decoding(model) == len(linears(model)) > 0
    assert model.config._attn_implementation == "sdpa"  # eager attention is for compiled forwards only
    packed = model.generate(PROMPT, max_new_tokens=16, eos_token_id=[], return_dict_in_generate=True)
    assert torch.equal(packed.sequences, plain.sequences)
    assert packed.num_forward_passes == plain.num_forward_passes
    prepare_for_decoding(model, compiled=True)
    assert model.config._attn_implementation == GROUPED_ATTENTION
    grouped = model.generate(PROMPT, max_new_tokens=16, eos_token_id=[], return_dict_in_generate=True)
    assert torch.equal(grouped.sequences, plain.sequences)
    assert grouped.num_forward_passes == plain.num_forward_passes


# ---- grouped attention ----------------------------------------------------------------------------------------------
class AttentionLayer(nn.Module):
    """What transformers' attention functions read of the layer that calls them."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups


def attention_inputs(groups: int, queries: int, columns: int = 9, dtype=torch.float64, seed: int = 0):
    """Queries, keys, values and a 4-D additive mask that hides some columns from some queries (not causally: as a
    decode's reordered slots do), two rows."""
    generator = torch.Generator().manual_seed(seed)
    kv_heads, dim = 2, 8
    query = torch.randn(2, kv_heads * groups, queries, dim, generator=generator, dtype=dtype)
    key, value = (torch.randn(2, kv_heads, columns, dim, generator=generator, dtype=dtype) for _ in range(2))
    seen = torch.rand(2, 1, queries, columns, generator=generator) < 0.7
    seen[..., 0] = True  # every query sees a column
    mask = torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, torch.finfo(dtype).min)
    return query, key, value, mask


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("queries", [1, 5])
def test_grouped_attention_equals_transformers_sdpa_and_eager_attention(groups, queries):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama.modeling_llama import eager_attention_forward

    layer = AttentionLayer(groups).eval()
    query, key, value, mask = attention_inputs(groups, queries)
    output, weights = grouped_attention(layer, query, key, value, mask, scaling=0.3)
    expected, _ = sdpa_attention_forward(layer, query, key, value, mask, scaling=0.3)  # over copied key/value heads
    assert output.shape == expected.shape and weights is None  # no attention weights, as transformers' SDPA
    torch.testing.assert_close(output, expected, rtol=0, atol=1e-12)
    eager, _ = eager_attention_forward(layer, query, key, value, mask, scaling=0.3)
    torch.testing.assert_close(output, eager, rtol=0, atol=1e-6)  # eager takes its softmax in float32
    # a column hidden from every query changes nothing, whatever its value
    hidden = mask.clone()
    hidden[..., 0] = torch.finfo(mask.dtype).min
    hidden[..., 1] = 0
    changed = value.clone()
    changed[:, :, 0] += 5.0
    torch.testing.assert_close(
        grouped_attention(layer, query, key, changed, hidden, scaling=0.3)[0],
        grouped_attention(layer, query, key, value, hidden, scaling=0.3)[0],
        rtol=0,
        atol=1e-12,
    )


def test_grouped_attention_compiled_equals_eager_in_bfloat16():
    layer = AttentionLayer(3).eval()
    inputs = attention_inputs(3, 4, columns=16, dtype=torch.bfloat16, seed=1)
    expected, _ = grouped_attention(layer, *inputs, scaling=0.35)
    compiled = torch.compile(grouped_attention, fullgraph=True, dynamic=False)
    output, _ = compiled(layer, *inputs, scaling=0.35)
    torch.testing.assert_close(output, expected, rtol=2e-2, atol=2e-2)  # bfloat16 rounding of fused sums
    assert output.float().sub(expected.float()).abs().mean() < 5e-3


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_grouped_attention_decodes_the_tokens_of_eager_attention(architecture):
    model = sharpened_model(architecture, scale=4.0)
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    model.use_grouped_attention()  # the Hub class's method: kernels_refusion.use_grouped_attention
    assert model.config.get_text_config(decoder=True)._attn_implementation == GROUPED_ATTENTION
    settings = dict(max_new_tokens=24, eos_token_id=[], return_dict_in_generate=True)
    for options in (dict(slot_size=4), dict(slot_size=8, slot_threshold=0.5, cache_implementation="static")):
        expected = eager.generate(PROMPT, **settings, **options)
        output = model.generate(PROMPT, **settings, **options)
        assert torch.equal(output.sequences, expected.sequences)
        assert output.num_forward_passes == expected.num_forward_passes


def test_saved_forwards_and_prices_are_keyed_by_the_source_of_a_registered_attention(tmp_path, monkeypatch):
    """A compiled forward is traced through the attention function: a saved package or price table of an earlier
    version of a registered function (as "refusion_grouped" in kernels_refusion.py) must not be taken for its own."""
    from transformers import AttentionInterface, CompileConfig

    import executor_refusion
    import packages_refusion
    import prices_refusion

    source = tmp_path / "my_attention.py"
    source.write_text(
        "from kernels_refusion import grouped_attention\n\n\n"
        "def attend(*args, **kwargs):\n    return grouped_attention(*args, **kwargs)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_attention

    AttentionInterface.register("my_attention", my_attention.attend)
    model = sharpened_model("llama", scale=4.0)
    config = CompileConfig(fullgraph=True, dynamic=False)
    cache = executor_refusion.SlotCache(model, 1, 128)

    def keys():
        return packages_refusion.saved_forward_key(model, config), prices_refusion.price_key(model, cache, config)

    sdpa = keys()
    model.set_attn_implementation("my_attention")
    first = keys()
    source.write_text(source.read_text() + "# the function's file changed\n")
    changed = keys()
    assert all("attention sdpa" in key for key in sdpa) and all("attention my_attention " in key for key in first)
    assert first[0] != changed[0] and first[1] != changed[1] and sdpa[0] != first[0]
    model.set_attn_implementation("my_attention")
    assert keys() == changed  # the same file, the same keys


@onednn
def test_a_model_counts_as_packed_for_a_width_when_every_linear_layer_is():
    """`packed_for`, which decides whether a decode's prompt may run eagerly on prepacked kernels: every linear layer
    packed for the width's dtype from no more rows than the width; a model with an unpacked layer (first or last) or
    with none is not."""
    from executor_refusion import packed_for

    model = model_of()
    assert not packed_for(model, 64)
    packed = copy.deepcopy(model)
    prepack_linears(packed, dtypes={torch.float32: 4})
    assert packed_for(packed, 4) and packed_for(packed, 64) and not packed_for(packed, 2)
    partly = copy.deepcopy(model)
    prepack_linears(partly, dtypes={torch.float32: 4})
    linears(partly)[-1].__class__ = nn.Linear  # the output layer back to a plain one
    assert not packed_for(partly, 64)
    assert not packed_for(nn.Sequential(nn.ReLU()), 64)
