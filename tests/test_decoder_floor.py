"""No wasted forward, measured with an oracle whose drafts we control (see oracle.py).

Two blocks of 32 tokens in slots of 8: the floor is 4 forwards, one plan and one verify per block.
"""

import pytest
import torch
from oracle import oracle_run

SETTINGS = dict(block_length=32, slot_threshold=0.8, token_threshold=0.3)
PROMPT_LENGTH = 6


@pytest.mark.parametrize("fused_redraft", [False, True])
@pytest.mark.parametrize("right_drafts", [8, 7])
def test_right_drafts_or_only_each_slots_last_wrong_reach_the_floor(right_drafts, fused_redraft):
    output, truth = oracle_run(8, right_drafts, fused_redraft=fused_redraft, **SETTINGS)
    assert torch.equal(output.sequences[0, PROMPT_LENGTH:], truth)
    # the verify forward's own token replaces each slot's wrong last draft: nothing is checked twice
    assert output.num_forward_passes == 4


def test_one_right_draft_per_slot_costs_one_infill_round_per_block():
    output, truth = oracle_run(8, 1, **SETTINGS)
    assert torch.equal(output.sequences[0, PROMPT_LENGTH:], truth)
    # verify: the second token is the model's own, the rest are redrafted from that forward; one round checks them
    assert output.num_forward_passes == 6


def test_fused_redraft_advances_every_round_even_when_every_mask_draft_is_wrong():
    output, truth = oracle_run(8, 1, fused_redraft=True, **SETTINGS)
    assert torch.equal(output.sequences[0, PROMPT_LENGTH:], truth)
    assert output.num_forward_passes == 2 * (2 + 6)  # each round adds the model's token: slots finish in 6 rounds


@pytest.mark.parametrize(("right_drafts", "forwards"), [(8, 4), (7, 8), (1, 32)])
def test_reference_rule_spends_two_forwards_a_round_and_accepts_one_draft_unchecked(right_drafts, forwards):
    output, truth = oracle_run(8, right_drafts, infill_mode="reference", **SETTINGS)
    assert output.num_forward_passes == forwards
    answer = output.sequences[0, PROMPT_LENGTH:]
    unchecked = torch.arange(truth.shape[0]) % 8 >= right_drafts  # masked drafts accepted without a check
    assert torch.equal(answer[~unchecked], truth[~unchecked])
    assert not (answer[unchecked] == truth[unchecked]).any()


def test_thresholds_zero_take_every_slot_of_a_block_at_once():
    output, truth = oracle_run(8, 3, **{**SETTINGS, "slot_threshold": 0.0, "token_threshold": 0.0})
    assert output.num_forward_passes == 4 and output.tokens_per_forward == 16  # wrong drafts pass a 0 threshold
    assert not torch.equal(output.sequences[0, PROMPT_LENGTH:], truth)
