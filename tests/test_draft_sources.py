"""`benchmarks.draft_sources`: its [MASK] queries see what a plan forward's [MASK]s see."""

import torch

from benchmarks.draft_sources import draft_queries, query_mask


def test_a_query_sees_the_prompt_its_answer_point_and_the_earlier_masks_of_its_slot():
    prompt_length, answer_length, max_distance = 3, 4, 3
    seen, distance, target = draft_queries(prompt_length, answer_length, max_distance)
    assert torch.equal(target, seen + distance - 1) and int(target.max()) == answer_length - 1
    visible = query_mask(prompt_length, answer_length, seen, torch.float32)[0, 0] == 0
    length = prompt_length + answer_length
    assert torch.equal(visible[:length, :length], torch.ones(length, length).tril().bool())  # the text: causal
    assert not visible[:length, length:].any()  # the text never sees a query
    for row, (a, d) in enumerate(zip(seen.tolist(), distance.tolist())):
        sees = visible[length + row]
        assert sees[: prompt_length + a].all() and not sees[prompt_length + a : length].any()
        expected = [(other_a == a and other_d <= d) for other_a, other_d in zip(seen.tolist(), distance.tolist())]
        assert sees[length:].tolist() == expected  # the slot's [MASK]s before it, and itself
