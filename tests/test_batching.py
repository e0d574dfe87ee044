"""Batched ReFusion decoding: every row of a left-padded batch decodes exactly as its prompt alone."""

import pytest
import torch
from test_generation import sharpened_model

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28], [30], [40, 41, 42, 43]]


def left_padded(prompts, pad=0):
    width = max(len(prompt) for prompt in prompts)
    ids = torch.tensor([[pad] * (width - len(prompt)) + prompt for prompt in prompts])
    mask = torch.tensor([[0] * (width - len(prompt)) + [1] * len(prompt) for prompt in prompts])
    return ids, mask


def assert_exact_everywhere(model, settings, prompts=PROMPTS):
    """Decoding `prompts` as a left-padded batch gives the same tokens over the dynamic cache, the static cache and
    recomputed from scratch, and each row's answer is its prompt's decoded alone."""
    ids, mask = left_padded(prompts)
    dynamic = model.generate(ids, attention_mask=mask, **settings)
    static = model.generate(ids, attention_mask=mask, cache_implementation="static", **settings)
    recomputed = model.generate(ids, attention_mask=mask, use_cache=False, **settings)
    assert torch.equal(dynamic.sequences, static.sequences)
    assert torch.equal(dynamic.sequences, recomputed.sequences)
    for row, prompt in enumerate(prompts):
        alone = model.generate(torch.tensor([prompt]), **settings).sequences[0, len(prompt) :]
        assert torch.equal(dynamic.sequences[row, ids.shape[1] : ids.shape[1] + alone.shape[0]], alone)


@pytest.fixture(scope="module")
def model():
    return sharpened_model("llama", scale=4.0)


@pytest.mark.parametrize(
    ("slot_size", "slot_threshold", "token_threshold"), [(4, 0.5, 0.5), (8, 0.0, 0.3), (1, 0.6, 0.0), (4, 1.0, 1.0)]
)
@pytest.mark.parametrize("with_eos", [False, True])
def test_each_row_equals_its_prompt_decoded_alone(model, slot_size, slot_threshold, token_threshold, with_eos):
    settings = dict(
        max_new_tokens=18, slot_size=slot_size, slot_threshold=slot_threshold, token_threshold=token_threshold,
        block_length=8 if slot_size < 8 else 16, pad_token_id=0,
    )  # fmt: skip
    if with_eos:  # a token that some rows produce early, so that rows end at different times
        first_answer = model.generate(torch.tensor([PROMPTS[0]]), eos_token_id=[], **settings)[0, len(PROMPTS[0]) :]
        settings["eos_token_id"] = int(first_answer[3])
    else:
        settings["eos_token_id"] = []
    ids, mask = left_padded(PROMPTS)
    batched = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **settings)
    alone = [model.generate(torch.tensor([prompt]), return_dict_in_generate=True, **settings) for prompt in PROMPTS]
    for row, single in enumerate(alone):
        answer = single.sequences[0, len(PROMPTS[row]) :]
        batched_answer = batched.sequences[row, ids.shape[1] :]
        assert torch.equal(batched_answer[: answer.shape[0]], answer)
        assert (batched_answer[answer.shape[0] :] == 0).all()
    if with_eos:
        assert min(single.sequences.shape[1] - len(p) for single, p in zip(alone, PROMPTS)) < 18
    # one batched forward per step: never more forwards than the slowest row needs alone
    assert batched.num_forward_passes == max(single.num_forward_passes for single in alone)


def test_batched_cached_decoding_equals_the_recomputed_reference(model):
    ids, mask = left_padded(PROMPTS)
    settings = dict(max_new_tokens=20, slot_size=4, slot_threshold=0.5, token_threshold=0.4, eos_token_id=[])
    cached = model.generate(ids, attention_mask=mask, **settings)
    recomputed = model.generate(ids, attention_mask=mask, use_cache=False, **settings)
    assert torch.equal(cached, recomputed)
