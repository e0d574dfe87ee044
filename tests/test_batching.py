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


def test_a_forwards_fields_are_each_row_left_padded_to_the_width():
    """`padded_batch`: each row's request left-padded with the padding column to the forward's width (a row without a
    request is padding only); one row at its own width gives its fields as they are."""
    from decoder_refusion import FIELDS, PADDING, Request, upload
    from executor_refusion import padded_batch

    padding = upload(list(PADDING.values()), "cpu")[:, None]
    one = Request(torch.arange(18).view(6, 3), num_queries=2)
    two = Request(torch.arange(100, 112).view(6, 2), num_queries=1)
    batch = padded_batch([one, None, two], 4, padding)
    for row, request in enumerate([one, None, two]):
        for index, name in enumerate(FIELDS):
            size = len(request) if request else 0
            expected = [PADDING[name]] * (4 - size) + (request.fields[index].tolist() if request else [])
            assert batch[name][row].tolist() == expected, (row, name)
    alone = padded_batch([one], 3, padding)
    assert all(torch.equal(alone[name][0], one.fields[index]) for index, name in enumerate(FIELDS))
    assert alone["ids"].shape == (1, 3)
    assert padded_batch([one], 5, padding)["groups"][0].tolist() == [PADDING["groups"]] * 2 + [12, 13, 14]


def test_host_lists_go_to_the_device_as_long_tensors():
    """`upload`: a flat list of ints (negative ones too; an empty list) as a 1-D long tensor that owns its values."""
    from decoder_refusion import upload

    values = [3, -1, 0, 2**40, True]
    tensor = upload(values, "cpu")
    assert tensor.dtype == torch.long and tensor.tolist() == [3, -1, 0, 2**40, 1]
    values[0] = 7  # the list is not the tensor's storage
    assert tensor[0] == 3
    assert upload([], "cpu").shape == (0,) and upload([], "cpu").dtype == torch.long
