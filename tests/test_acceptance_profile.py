"""The decoder's acceptance profile on the oracle (see oracle.py), whose drafts are right exactly at the slot offsets
below `right_drafts` and whose autoregressive checks are always right.

64 tokens in 2 blocks of 32, slots of 8: 8 slots, each checked once by its block's verify forward (plan drafts).
"""

import pytest
import torch
from oracle import oracle_model, oracle_run
from tiny import tiny_tokenizer

from benchmarks import quality_speed
from recipe.decoding import decode
from recipe.evaluate import speed

SETTINGS = dict(block_length=32, slot_threshold=0.8, token_threshold=0.3)


def per_offset(*offsets: int, count: int = 8) -> list[int]:
    return [count if k in offsets else 0 for k in range(8)]


@pytest.mark.parametrize(
    ("right_drafts", "settings", "offered", "accepted", "runs", "verify_forwards"),
    [
        # Every draft right: offsets 1-7 of every slot pass in the verify forward; nothing is left to redraft.
        (8, {}, [per_offset(*range(1, 8)), per_offset()], [per_offset(*range(1, 8)), per_offset()], [8, 0], 2),
        # Plan drafts right below offset 3: accepted at 1-2, rejected at 3 (the model's token replaces it); the
        # redrafts after it are the model's own tokens, all accepted in one infill round per block.
        (3, {}, [per_offset(1, 2, 3), per_offset(4, 5, 6, 7)], [per_offset(1, 2), per_offset(4, 5, 6, 7)], [8, 8], 4),
        (1, {}, [per_offset(1), per_offset(*range(2, 8))], [per_offset(), per_offset(*range(2, 8))], [8, 8], 4),
        # Fused redraft from [MASK] queries that are always wrong: each round checks one draft and rejects it.
        (1, {"fused_redraft": True}, [per_offset(1), per_offset(*range(2, 8))], [per_offset(), per_offset()],
         [8, 48], 14),
        # The reference rule: offset 7 is accepted unchecked after the rejection, so no redraft is ever checked.
        (7, {"infill_mode": "reference"}, [per_offset(*range(1, 8)), per_offset()],
         [per_offset(*range(1, 7)), per_offset()], [8, 0], 4),
    ],
)  # fmt: skip
def test_profile_counts_each_offsets_checks_given_the_drafts_before_it_passed(
    right_drafts, settings, offered, accepted, runs, verify_forwards
):
    output, truth = oracle_run(8, right_drafts, **SETTINGS, **settings)
    assert output.draft_offered.tolist() == offered
    assert output.draft_accepted.tolist() == accepted
    assert output.draft_runs.tolist() == runs
    assert output.verify_forwards == verify_forwards
    # In the fast infill every forward that is not a plan (one per block here) checks drafts; the reference rule
    # spends one more forward per round on [MASK] redrafts.
    plans_and_redrafts = 2 + (verify_forwards - 2 if settings.get("infill_mode") == "reference" else 0)
    assert output.num_forward_passes == plans_and_redrafts + verify_forwards


def test_profile_is_the_same_recomputed_from_scratch_and_has_no_checks_with_slots_of_one():
    cached, _ = oracle_run(8, 3, **SETTINGS)
    uncached, _ = oracle_run(8, 3, use_cache=False, **SETTINGS)
    for name in ("draft_offered", "draft_accepted", "draft_runs"):
        assert torch.equal(getattr(cached, name), getattr(uncached, name)), name
    assert cached.verify_forwards == uncached.verify_forwards
    single, _ = oracle_run(1, 1, **SETTINGS)  # a slot's first token always passes: nothing to check
    assert single.draft_offered.sum() == 0 and single.verify_forwards == 0


def test_decode_sums_the_profile_over_batches_and_the_benchmark_tabulates_it():
    generator = torch.Generator().manual_seed(0)
    truth = torch.randint(10, 250, (65,), generator=generator)
    model = oracle_model(truth, prompt_length=6, slot_size=8, right_drafts=3)
    prompts = [[5, 6, 7, 8, 9, 10]] * 2
    run = decode(model, tiny_tokenizer(), prompts, 64, batch_size=1, slot_size=8, eos_token_id=[], **SETTINGS)
    # Per prompt: plan drafts pass at offsets 1-2 and fail at 3; the redrafts at 4-7 pass; 4 verifying forwards.
    assert run.acceptance.offered == [per_offset(1, 2, 3, count=16), per_offset(4, 5, 6, 7, count=16)]
    assert run.acceptance.accepted == [per_offset(1, 2, count=16), per_offset(4, 5, 6, 7, count=16)]
    assert run.acceptance.runs == [16, 16] and run.acceptance.verify_forwards == 8
    assert run.acceptance.run_per_verify == (32 + 64) / 8 and run.acceptance.run_per_check == (32 + 64) / 32
    row = {"name": "oracle", "batch_size": 1, **speed(run, ar_tokens_per_second=1.0)}
    assert row["acceptance_by_offset"] == {
        "plan": [None, 1.0, 1.0, 0.0, None, None, None, None],
        "redraft": [None, None, None, None, 1.0, 1.0, 1.0, 1.0],
    }
    table = "\n".join(quality_speed.acceptance_table([row]))
    assert "| oracle | plan | 3.00 | 1.00 | 1.00 | 0.00 | - | - | - | - |" in table
    assert "| oracle | redraft | 3.00 | - | - | - | 1.00 | 1.00 | 1.00 | 1.00 |" in table
    assert quality_speed.acceptance_table([{**row, "acceptance_by_offset": None}]) == []  # AR rows have none
