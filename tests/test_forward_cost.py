"""The forward-cost benchmark's pieces on a tiny model, and the benchmarks' AR baseline: the fastest AR decoding."""

import copy
from collections import Counter

import pytest
import torch
from tiny import tiny_backbone, tiny_tokenizer
from transformers import DynamicCache

from benchmarks import forward_cost
from benchmarks.quality_speed import against_fastest_ar
from finetune.chat import prompt_token_ids
from finetune.convert import convert_to_refusion
from kernels_refusion import PackedLinear, packing_plan


@pytest.fixture(scope="module")
def converted():
    tokenizer = tiny_tokenizer()
    model, refusion_tokenizer = convert_to_refusion(tiny_backbone("llama", len(tokenizer)), tokenizer)
    return model.eval(), refusion_tokenizer


def test_price_between_measured_widths_is_linear_and_flat_past_the_ends():
    curve = {1: 10.0, 4: 16.0, 16: 40.0}
    assert forward_cost.price_at(curve, 1) == 10.0
    assert forward_cost.price_at(curve, 2) == pytest.approx(12.0)
    assert forward_cost.price_at(curve, 10) == pytest.approx(28.0)
    assert forward_cost.price_at(curve, 64) == 40.0


@pytest.mark.parametrize("call", [forward_cost.decoder_forward, forward_cost.causal_forward])
def test_both_calls_give_the_same_logits_for_a_causal_run(converted, call):
    model, _ = converted
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits[:, -3:]
        cache = DynamicCache()
        model(input_ids=ids[:, :4], cache=cache, use_cache=True)
        logits = []
        hook = model.register_forward_hook(lambda _m, _a, output: logits.append(output.logits))
        call(model, cache, ids[:, 4:])
        hook.remove()
    torch.testing.assert_close(logits[0], expected)
    assert cache.get_seq_length() == 7


def test_forward_times_leave_the_cache_as_they_found_it(converted):
    model, _ = converted
    times, recompiled = forward_cost.forward_times(model, 12, [1, 3], repeats=2, call=forward_cost.decoder_forward)
    assert set(times) == {1, 3} and all(milliseconds > 0 for milliseconds in times.values())
    assert recompiled == 0  # an eager forward builds no graph


def test_prepacked_rows_time_packed_copies_where_the_kernels_apply(converted):
    model, _ = converted
    timed = forward_cost.prepacked_times(model, model, 12, [1, 3], repeats=2)
    if torch.float32 not in packing_plan():
        assert timed is None
        return
    decoder, causal = timed
    assert set(decoder) == set(causal) == {1, 3} and min(decoder.values()) > 0
    assert not any(isinstance(module, PackedLinear) for module in model.modules())  # copies were packed
    float64 = copy.deepcopy(model).double()
    assert forward_cost.prepacked_times(float64, float64, 12, [1], repeats=1) is None


def test_static_compiled_rows_time_the_bucketed_decoder_and_the_compiled_ar_step(converted):
    model, tokenizer = converted
    ar = tiny_backbone("llama", len(tokenizer)).eval()  # the base model: transformers' own causal LM class
    graphs = forward_cost.compiled_graphs()
    times, ar_ms = forward_cost.static_compiled_times(model, ar, 12, [1, 3, 70], 2, "default")
    assert set(times) == {1, 3, 70} and min(times.values()) > 0 and ar_ms > 0
    # widths 1 and 3 run at the priced decoder's buckets of 1 and 4 (a graph each), 70 eagerly; the AR step is one more
    assert forward_cost.compiled_graphs() - graphs == 3


def test_decode_mix_counts_every_forward_but_each_answers_first(converted):
    model, tokenizer = converted
    prompts = prompt_token_ids(tokenizer, ["Name three colours.", "What is two plus two?"])
    seen = []
    hook = model.register_forward_pre_hook(lambda _m, _a, kwargs: seen.append(kwargs["input_ids"].shape[1]),
                                           with_kwargs=True)  # fmt: skip
    mix = forward_cost.decode_mix(model, tokenizer, prompts, max_new_tokens=12)
    hook.remove()
    assert isinstance(mix, Counter) and sum(mix.values()) == len(seen) - len(prompts)
    assert max(seen) > max(mix)  # the prefill (prompt + first plan) is the widest and left out


def test_speed_ups_are_against_the_fastest_ar_decoding():
    rows = [
        {"name": "AR: base generate()", "kind": "ar", "batch_size": 1, "tokens_per_second": 20.0, "speedup": 1.0},
        {"name": "AR: base generate(), bfloat16", "kind": "ar", "batch_size": 1, "tokens_per_second": 25.0},
        {"name": "AR: converted model, token by token", "kind": "ar", "batch_size": 1, "tokens_per_second": 30.0},
        {"name": "shipped default", "kind": "slots", "batch_size": 1, "tokens_per_second": 10.0, "speedup": 0.5},
        {"name": "shipped default", "kind": "slots", "batch_size": 8, "tokens_per_second": 50.0, "speedup": 0.8},
    ]
    assert against_fastest_ar(rows) == "AR: base generate(), bfloat16"  # the converted model is not the baseline
    assert [row["speedup"] for row in rows] == [0.8, 1.0, 1.2, 0.4, 0.8]  # batch 8 keeps its same-batch AR
