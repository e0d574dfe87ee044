"""`draft_window`: at most that many drafts of a slot go through one verify or infill forward, so that forwards stay
narrow where a wide one costs more than its accepted drafts earn (a CPU in float32); tokens stay exact."""

import pytest
import torch
from oracle import oracle_run
from test_batching import PROMPTS, left_padded
from test_generation import PROMPT, sharpened_model

from decisions_refusion import accept_and_correct
from settings_refusion import check_decoding

T = torch.tensor
SETTINGS = dict(block_length=32, slot_threshold=0.8, token_threshold=0.3)
PROMPT_LENGTH = 6


def test_a_check_accepts_nothing_past_the_positions_it_scored():
    tokens = T([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]])
    probability = T([[1.0, 0.9, 0.9, 1.0, 1.0, 1.0], [1.0, 0.9, 0.1, 1.0, 1.0, 1.0]])  # 1.0: not scored
    own = T([[0, 31, 32, 13, 14, 15], [0, 41, 42, 23, 24, 25]])
    new_tokens, new_counts = accept_and_correct(tokens, T([1, 1]), probability, own, own, 0.5, T([3, 3]))
    # row 0: both scored drafts pass and nothing after them counts; row 1: the model's token at the rejection
    assert new_counts.tolist() == [3, 3]
    assert new_tokens.tolist() == [[10, 11, 12, 13, 14, 15], [20, 21, 42, 23, 24, 25]]


def test_a_slot_wide_window_is_the_default_check():
    tokens, counts = T([[1, 2, 3, 4]]), T([1])
    probability, own, redrafts = T([[1.0, 0.9, 0.2, 0.9]]), T([[0, 0, 7, 8]]), T([[0, 0, 0, 9]])
    windowed = accept_and_correct(tokens, counts, probability, own, redrafts, 0.5, T([4]))
    default = accept_and_correct(tokens, counts, probability, own, redrafts, 0.5)
    assert all(torch.equal(a, b) for a, b in zip(windowed, default))
    assert default[1].tolist() == [3] and default[0].tolist() == [[1, 2, 7, 9]]


@pytest.mark.parametrize(("window", "right_drafts", "forwards"), [(2, 8, 8), (8, 8, 4), (2, 1, 10), (3, 1, 10)])
def test_right_drafts_advance_a_window_and_a_bonus_token_per_forward(window, right_drafts, forwards):
    output, truth = oracle_run(8, right_drafts, draft_window=window, **SETTINGS)
    assert torch.equal(output.sequences[0, PROMPT_LENGTH:], truth)
    # right drafts: verify accepts window + 1 tokens of each slot (the last checked by the window's last query),
    # every infill round as many; one right draft per slot: each round corrects one draft and its AR successor
    assert output.num_forward_passes == forwards


@pytest.mark.parametrize("fused_redraft", [False, True])
@pytest.mark.parametrize("window", [1, 2, 5])
def test_windowed_decoding_is_exact_cached_batched_and_alone(fused_redraft, window):
    model = sharpened_model("llama", scale=4.0)
    settings = dict(
        max_new_tokens=20, slot_size=8, block_length=16, slot_threshold=0.5, token_threshold=0.3, eos_token_id=[],
        pad_token_id=0, draft_window=window, fused_redraft=fused_redraft, return_dict_in_generate=True,
    )  # fmt: skip
    cached = model.generate(PROMPT, **settings)
    assert torch.equal(cached.sequences, model.generate(PROMPT, use_cache=False, **settings).sequences)
    ids, mask = left_padded(PROMPTS)
    batched = model.generate(ids, attention_mask=mask, **settings).sequences
    for row, prompt in enumerate(PROMPTS):
        alone = model.generate(torch.tensor([prompt]), **settings).sequences[0, len(prompt) :]
        assert torch.equal(batched[row, ids.shape[1] : ids.shape[1] + alone.shape[0]], alone)


def test_a_window_as_wide_as_the_slot_changes_nothing():
    model = sharpened_model("qwen3", scale=4.0)
    settings = dict(max_new_tokens=24, slot_size=4, slot_threshold=0.5, token_threshold=0.4, eos_token_id=[])
    default = model.generate(PROMPT, return_dict_in_generate=True, **settings)
    for window in (4, 9):
        wide = model.generate(PROMPT, return_dict_in_generate=True, draft_window=window, **settings)
        assert torch.equal(wide.sequences, default.sequences)
        assert wide.num_forward_passes == default.num_forward_passes


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (dict(draft_window=0), "draft_window must be None or an integer >= 1"),
        (dict(draft_window=2.5), "draft_window must be None or an integer >= 1"),
        (dict(draft_window=True), "draft_window must be None or an integer >= 1"),
        (dict(draft_window=2, infill_mode="reference"), "draft_window=2 and infill_mode='reference' were both passed"),
    ],
)
def test_a_bad_window_is_refused_by_name(given, message):
    with pytest.raises(ValueError, match=message):
        check_decoding(given)


@pytest.mark.parametrize("window", [4, None])
def test_the_shipped_combination_is_exact_with_answers_that_end_inside_slots(window):
    """Fused redraft with a window of 4 (what the shipped model decodes with) and fused without a window: cached ==
    recomputed and batched == alone, with an EOS that ends answers inside slots and rows at different times."""
    model = sharpened_model("llama", scale=4.0)
    settings = dict(
        max_new_tokens=24, slot_size=8, block_length=16, slot_threshold=0.5, token_threshold=0.3, pad_token_id=0,
        fused_redraft=True, draft_window=window, return_dict_in_generate=True,
    )  # fmt: skip
    free = model.generate(torch.tensor([PROMPTS[0]]), eos_token_id=[], **settings).sequences[0, len(PROMPTS[0]) :]
    settings["eos_token_id"] = int(free[5])  # mid-slot in the first answer; other rows meet it elsewhere or never
    ids, mask = left_padded(PROMPTS)
    batched = model.generate(ids, attention_mask=mask, **settings)
    lengths = []
    for row, prompt in enumerate(PROMPTS):
        alone = model.generate(torch.tensor([prompt]), **settings)
        recomputed = model.generate(torch.tensor([prompt]), use_cache=False, **settings)
        assert torch.equal(alone.sequences, recomputed.sequences)
        answer = alone.sequences[0, len(prompt) :]
        assert torch.equal(batched.sequences[row, ids.shape[1] : ids.shape[1] + answer.shape[0]], answer)
        assert (batched.sequences[row, ids.shape[1] + answer.shape[0] :] == 0).all()
        lengths.append(answer.shape[0])
    assert torch.equal(
        batched.sequences, model.generate(ids, attention_mask=mask, use_cache=False, **settings).sequences
    )
    assert lengths[0] <= 6 and max(lengths) > min(lengths), lengths  # answers ended early, at different times
    assert any(length % 8 for length in lengths), lengths  # and inside a slot
