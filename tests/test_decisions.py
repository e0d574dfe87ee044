"""The decoder's decisions as pure functions on plain tensors, without a model."""

import torch

from decisions_refusion import (
    accept_and_correct,
    accept_reference,
    accepted_lengths,
    choose_slots,
    eos_offsets,
    first_argmax,
    first_rejected,
    greedy_distributions,
    greedy_logsumexp,
    leading_complete,
    pick_tokens,
    score_recheck,
    score_redraft,
)

T = torch.tensor


def test_slots_above_the_threshold_are_chosen_else_the_single_most_confident():
    assert choose_slots(T([0.9, 0.2, 0.85]), 0.8).tolist() == [True, False, True]
    assert choose_slots(T([0.3, 0.7, 0.5]), 0.8).tolist() == [False, True, False]
    assert choose_slots(T([0.8, 0.1]), 0.8).tolist() == [True, False]  # strictly above: none passes, the best is taken
    assert choose_slots(T([0.0, 0.1]), 0.0).tolist() == [True, True]  # threshold 0 takes every slot


def test_accepted_length_is_the_leading_run_of_passes():
    passed = T([[True, True, False, True], [True, True, True, True], [False, True, True, True]])
    assert accepted_lengths(passed).tolist() == [2, 4, 0]


def test_eos_offset_counts_only_accepted_tokens():
    tokens = T([[5, 2, 7, 2], [5, 6, 7, 2], [2, 6, 7, 8]])
    assert eos_offsets(tokens, T([4, 3, 4]), T([2])).tolist() == [1, 4, 0]
    assert eos_offsets(tokens, T([4, 4, 4]), T([], dtype=torch.long)).tolist() == [4, 4, 4]


def test_leading_complete_slots_stop_at_the_first_partial_one_or_after_an_eos():
    assert leading_complete([4, 4, 2, 4], [4, 4, 4, 4], 4) == 2
    assert leading_complete([4, 3, 4], [4, 1, 4], 4) == 2  # the second slot ends at its accepted EOS
    assert leading_complete([4, 4], [0, 4], 4) == 1  # nothing after an EOS
    assert leading_complete([2, 4], [4, 4], 4) == 0


def test_fast_check_keeps_passing_drafts_takes_the_models_token_at_the_first_rejection_and_redrafts_the_rest():
    tokens = T([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]])
    counts = T([1, 2])
    probability = T([[1.0, 0.9, 0.1, 0.9, 0.9], [1.0, 1.0, 0.9, 0.9, 0.9]])
    own = T([[0, 0, 32, 33, 34], [0, 0, 0, 0, 0]])
    redrafts = T([[0, 0, 0, 43, 44], [0, 0, 0, 0, 0]])
    new_tokens, new_counts = accept_and_correct(tokens, counts, probability, own, redrafts, threshold=0.5)
    assert new_tokens.tolist() == [[10, 11, 32, 43, 44], [20, 21, 22, 23, 24]]
    assert new_counts.tolist() == [3, 5]
    rejected = first_rejected(counts, probability, 0.5)  # given by a caller that has it: the same decision
    assert first_rejected(counts, probability, 0.5).tolist() == [2, 5]
    again = accept_and_correct(tokens, counts, probability, own, redrafts, 0.5, rejected=rejected)
    assert again[0].tolist() == new_tokens.tolist() and again[1].tolist() == new_counts.tolist()


def test_already_accepted_tokens_are_never_rechecked():
    tokens, probability = T([[1, 2, 3]]), T([[0.0, 0.0, 0.0]])
    new_tokens, new_counts = accept_and_correct(tokens, T([2]), probability, T([[7, 8, 9]]), T([[4, 5, 6]]), 0.5)
    assert new_tokens.tolist() == [[1, 2, 9]] and new_counts.tolist() == [3]


def test_reference_round_accepts_the_first_unaccepted_position_unchecked_then_passing_ones():
    probability = T([[1.0, 1.0, 0.0, 0.9, 0.1], [1.0, 0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    assert accept_reference(T([1, 1, 5]), probability, 0.5).tolist() == [2, 2, 5]
    probability[0, 2] = 0.9
    assert accept_reference(T([1, 1, 5]), probability, 0.5).tolist() == [4, 2, 5]


def test_greedy_pick_never_proposes_the_mask_token():
    probabilities = T([[0.125, 0.625, 0.25], [0.5, 0.25, 0.25]])
    tokens, chosen = pick_tokens(probabilities, mask_token_id=1, do_sample=False)
    assert tokens.tolist() == [2, 0] and chosen.tolist() == [0.25, 0.5]
    torch.manual_seed(0)
    sampled, _ = pick_tokens(probabilities[:1].expand(500, 3), mask_token_id=1, do_sample=True)
    assert not (sampled == 1).any() and set(sampled.tolist()) == {0, 2}


def test_first_argmax_is_argmax_with_ties_to_the_lowest_index():
    generator = torch.Generator().manual_seed(0)
    shapes = [(5, 49152), (3, 4, 300), (7, 100), (2, 128), (9, 129), (4, 257), (6,), (1, 1), (0, 300)]
    for shape in shapes:  # widths below, at and past whole runs of 128 columns, any leading dimensions
        for ties in (False, True):
            values = torch.randn(shape, generator=generator)
            if ties:  # three values only: the maximum recurs in most rows
                values = torch.randint(0, 3, shape, generator=generator).float()
            assert torch.equal(first_argmax(values), values.argmax(dim=-1)), (shape, ties)
    values = torch.zeros(3, 300)
    values[0, [5, 200]] = 1.0  # a tie across runs
    values[1, [260, 299]] = 1.0  # a tie inside the shorter last run
    values[2, [100, 290]] = T([1.0, 2.0])  # the last run strictly larger
    assert first_argmax(values).tolist() == [5, 260, 290]


def test_greedy_pick_breaks_ties_as_argmax_does():
    probabilities = torch.zeros(2, 300)
    probabilities[0, [7, 150]] = 0.5
    probabilities[1, [3, 9, 280]] = T([0.375, 0.375, 0.25])
    tokens, chosen = pick_tokens(probabilities, mask_token_id=3, do_sample=False)
    assert tokens.tolist() == [7, 9] and chosen.tolist() == [0.5, 0.375]


def hard_scores(generator, dtype, mask_token_id: int) -> torch.Tensor:
    """Six rows of 300 scores in `dtype`, with a tie at the top (row 1: ids 5 and 250), the mask token on top (row 2)
    and every token tied (row 3)."""
    scores = (torch.randn(6, 300, generator=generator) * 4).to(dtype)
    scores[1, [5, 250]] = scores[1].max() + 1
    scores[2, mask_token_id] = scores[2].max() + 1
    scores[3] = 0.0
    return scores


def test_greedy_distributions_pick_what_softmax_then_pick_tokens_picks():
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        for mask_token_id in (0, 77, 299):
            scores = hard_scores(generator, dtype, mask_token_id)
            expected = scores.to(torch.promote_types(dtype, torch.float32)).softmax(dim=-1)
            tokens, chosen = pick_tokens(expected, mask_token_id, do_sample=False)
            probabilities, picked = greedy_distributions(scores, mask_token_id)
            assert torch.equal(picked, tokens) and picked[1] == 5 and picked[3] == (mask_token_id == 0)
            assert torch.equal(probabilities.gather(-1, picked[:, None])[:, 0], chosen)
            others = torch.arange(300) != mask_token_id
            assert torch.equal(probabilities[:, others], expected[:, others])
            assert (probabilities[:, mask_token_id] == -1).all()
    probabilities, picked = greedy_distributions(torch.zeros(0, 300), 3)  # no rows to score
    assert probabilities.shape == (0, 300) and picked.shape == (0,)


def test_greedy_logsumexp_picks_what_greedy_distributions_picks_and_gives_its_probabilities():
    generator = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        for mask_token_id in (0, 77, 299):
            scores = hard_scores(generator, dtype, mask_token_id)
            scores[4, :150] = float("-inf")  # tokens a processor ruled out
            probabilities, picked = greedy_distributions(scores, mask_token_id)
            logsumexp, greedy = greedy_logsumexp(scores, mask_token_id)
            assert logsumexp.dtype == probabilities.dtype
            wide = scores.to(logsumexp.dtype)
            assert torch.equal(greedy, picked) and greedy[1] == 5 and greedy[3] == (mask_token_id == 0)
            assert greedy[4] >= 150 and (greedy != mask_token_id).all()
            others = torch.arange(300) != mask_token_id
            from_log = (wide - logsumexp[:, None]).exp()
            tolerance = 1e-12 if dtype == torch.float64 else 1e-6
            assert torch.allclose(from_log[:, others], probabilities[:, others], rtol=tolerance, atol=tolerance)
            assert torch.allclose(from_log.sum(dim=-1), torch.ones(6, dtype=wide.dtype), atol=tolerance * 10)


def test_a_redraft_forward_writes_each_drafting_positions_greedy_token_from_its_own_row():
    tokens = T([[5, 6, 7, 8], [5, 6, 7, 8]])
    drafting = T([[False, False, True, True], [False, True, True, True]])
    row_of = T([[0, 0, 1, 2], [0, 3, 4, 5]])  # (rows of positions that draft nothing are never read)
    logits = torch.zeros(6, 12)
    logits[torch.arange(6), T([9, 10, 8, 3, 4, 1])] = 5.0
    logits[1, 11] = 9.0  # the mask token's column (11) is never picked
    assert score_redraft(logits, tokens, drafting, row_of, 11).tolist() == [[5, 6, 10, 8], [5, 3, 4, 1]]


def test_a_recheck_forward_accepts_by_the_authors_rule_from_the_row_before_each_position():
    """Each position after a slot's first unaccepted one is scored by the row of the position before it; the first
    unaccepted position passes unchecked; the new counts come with their EOS offsets and the positions scored."""
    tokens = T([[5, 6, 7, 8], [4, 6, 2, 9]])
    counts = T([1, 0])
    row_of = T([[0, 1, 2, 3], [4, 5, 6, 7]])
    logits = torch.full((8, 12), -20.0)
    logits[T([1, 2, 4, 5]), T([7, 9, 6, 2])] = 20.0  # slot 0: 7 passes after 6, 8 fails; slot 1: 6 and 2 pass
    values, scored = score_recheck(logits, tokens, counts, row_of, T([2, -1, -1]), 11, 0.5)
    assert values.tolist() == [3, 3, 4, 2]  # counts, then EOS offsets (slot 1's accepted 2 at offset 2)
    assert scored.tolist() == [[False, False, True, True], [False, True, True, True]]
    expected = accept_reference(counts, T([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]]), 0.5)
    assert values[:2].tolist() == expected.tolist()
