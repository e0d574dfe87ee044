"""Property tests of the hybrid-objective batch builder and its collator (`finetune/hybrid.py`)."""

import itertools
import random
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from finetune.hybrid import IGNORE_INDEX, HybridObjectiveCollator, build_hybrid_batch

MASK = 127
PAD = 0  # deliberately also a real token id in the examples: padding must be told apart by the attention mask
SLOT_SIZE_SETS = [(1,), (3,), (4, 8, 16, 32), (1, 2, 5), (7,)]
DTYPES = {
    "input_ids": torch.long,
    "attention_mask": torch.long,
    "position_ids": torch.long,
    "labels": torch.long,
    "is_masked": torch.bool,
    "noise_level": torch.float32,
    "response_length": torch.long,
    "slot_size": torch.long,
}


def random_examples(rng: random.Random, count: int, slot_sizes: tuple[int, ...]) -> tuple[list, list]:
    """Draw prompt/response pairs whose response lengths hit the edge cases of the given slot sizes."""
    prompts, responses = [], []
    for _ in range(count):
        size = rng.choice(slot_sizes)
        length = rng.choice([1, max(size - 1, 1), size, 2 * size, 3 * size + 1, rng.randint(1, 40)])
        prompts.append([rng.randrange(MASK) for _ in range(rng.randint(1, 6))])
        responses.append([rng.randrange(MASK) for _ in range(length)])
    return prompts, responses


def split_slots(positions: list[int], prompt_length: int, size: int, response_length: int) -> list[int]:
    """Cut a run of stored position ids into whole slots (asserting it is one) and return their slot indices."""
    slots, i = [], 0
    while i < len(positions):
        start = positions[i] - prompt_length
        assert start % size == 0, f"stored run starts mid-slot at response index {start}"
        length = min(size, response_length - start)
        assert positions[i : i + length] == list(range(positions[i], positions[i] + length)), "slot not contiguous"
        slots.append(start // size)
        i += length
    return slots


def check_row(batch: dict, b: int, prompt: list[int], response: list[int], slot_sizes, eps: float) -> tuple[int, int]:
    """Assert every layout and label property of row `b`; return (masked slots, slots)."""
    ids, pos = batch["input_ids"][b].tolist(), batch["position_ids"][b].tolist()
    labels, masked = batch["labels"][b].tolist(), batch["is_masked"][b].tolist()
    original = prompt + response
    n_prompt, n_response, n = len(prompt), len(response), len(prompt) + len(response)
    size = int(batch["slot_size"][b])
    p = float(batch["noise_level"][b])

    assert size in slot_sizes
    assert eps - 1e-7 <= p <= 1.0
    assert int(batch["response_length"][b]) == n_response
    assert batch["attention_mask"][b].tolist() == [1] * n + [0] * (len(ids) - n)
    # Padding: pad id, position 0, no label, not masked.
    assert ids[n:] == [PAD] * (len(ids) - n) and pos[n:] == [0] * (len(ids) - n)
    assert set(labels[n:]) <= {IGNORE_INDEX} and not any(masked[n:])

    # Every real token keeps its reading-order position exactly once.
    assert sorted(pos[:n]) == list(range(n))
    # Prompt first, in order, unlabelled.
    assert ids[:n_prompt] == prompt and pos[:n_prompt] == list(range(n_prompt))
    assert labels[:n_prompt] == [IGNORE_INDEX] * n_prompt and not any(masked[:n_prompt])

    # Response: clean region, then masked region (is_masked never goes back to False).
    n_clean = n_response - sum(masked[:n])
    assert masked[n_prompt : n_prompt + n_clean] == [False] * n_clean
    assert masked[n_prompt + n_clean : n] == [True] * (n - n_prompt - n_clean)
    clean_pos = pos[n_prompt : n_prompt + n_clean]
    masked_pos = pos[n_prompt + n_clean : n]
    clean_slots = split_slots(clean_pos, n_prompt, size, n_response)
    masked_slots = split_slots(masked_pos, n_prompt, size, n_response)
    assert masked_pos == sorted(masked_pos), "masked slots must stay in reading order"
    assert sorted(clean_slots + masked_slots) == list(range(-(-n_response // size))), "masking is by whole slots"

    for i in range(n_prompt, n):
        q = pos[i]
        if masked[i]:
            assert ids[i] == MASK and labels[i] == original[q]
        else:
            assert ids[i] == original[q]
            same_slot = q + 1 < n and (q + 1 - n_prompt) % size != 0
            assert labels[i] == (original[q + 1] if same_slot else IGNORE_INDEX)
    return len(masked_slots), len(clean_slots) + len(masked_slots)


@pytest.mark.parametrize("slot_sizes", SLOT_SIZE_SETS)
def test_layout_and_labels_over_many_seeds(slot_sizes):
    rng = random.Random(sum(slot_sizes))
    eps = 1e-3
    for seed in range(40):
        prompts, responses = random_examples(rng, rng.randint(1, 6), slot_sizes)
        generator = torch.Generator().manual_seed(seed)
        batch = build_hybrid_batch(
            prompts,
            responses,
            mask_token_id=MASK,
            pad_token_id=PAD,
            slot_sizes=slot_sizes,
            eps=eps,
            generator=generator,
        )
        longest = max(len(p) + len(r) for p, r in zip(prompts, responses))
        assert batch["input_ids"].shape == (len(prompts), longest)
        assert {key: value.dtype for key, value in batch.items()} == DTYPES
        for b, (prompt, response) in enumerate(zip(prompts, responses)):
            check_row(batch, b, prompt, response, slot_sizes, eps)


def test_tensor_inputs_match_list_inputs():
    prompts, responses = random_examples(random.Random(0), 5, (4,))
    as_tensors = [torch.tensor(x, dtype=torch.int32) for x in prompts], [torch.tensor(x) for x in responses]
    from_lists = build_hybrid_batch(
        prompts, responses, mask_token_id=MASK, pad_token_id=PAD, generator=torch.Generator().manual_seed(1)
    )
    from_tensors = build_hybrid_batch(
        *as_tensors, mask_token_id=MASK, pad_token_id=PAD, generator=torch.Generator().manual_seed(1)
    )
    assert from_lists.keys() == from_tensors.keys()
    for key in from_lists:
        assert torch.equal(from_lists[key], from_tensors[key]), key


def draw_many(count: int, slot_sizes: tuple[int, ...], response_length: int, seed: int = 0) -> dict:
    """One batch of `count` identical-shape examples, for statistics over the random draws."""
    prompts = [[1, 2]] * count
    responses = [list(range(3, 3 + response_length))] * count
    generator = torch.Generator().manual_seed(seed)
    return build_hybrid_batch(
        prompts, responses, mask_token_id=MASK, pad_token_id=PAD, slot_sizes=slot_sizes, generator=generator
    )


def test_noise_level_and_masked_fraction_statistics():
    eps = 1e-3
    batch = draw_many(2000, (4,), response_length=40)  # 10 slots per example
    p = batch["noise_level"].double()
    masked_fraction = batch["is_masked"].double().sum(1) / 40
    assert p.min() >= eps - 1e-7 and p.max() <= 1.0
    assert abs(p.mean().item() - 0.5) < 0.03  # t ~ U(0, 1)
    assert abs((masked_fraction - p).mean().item()) < 0.02  # E[fraction | p] = p
    assert torch.corrcoef(torch.stack([p, masked_fraction]))[0, 1] > 0.9
    low, high = masked_fraction[p < 0.2].mean().item(), masked_fraction[p > 0.8].mean().item()
    assert low < 0.2 and high > 0.8


def test_slot_sizes_drawn_uniformly():
    sizes = Counter(draw_many(2000, (4, 8, 16, 32), response_length=20)["slot_size"].tolist())
    assert set(sizes) == {4, 8, 16, 32}
    assert all(400 < count < 600 for count in sizes.values()), sizes


def test_clean_slots_are_shuffled_uniformly():
    batch = draw_many(3000, (1,), response_length=3)
    all_clean = ~batch["is_masked"].any(1)
    orders = Counter(tuple(row[2:5].tolist()) for row in batch["position_ids"][all_clean])
    assert set(orders) == set(itertools.permutations([2, 3, 4]))
    assert all(count > 0.6 * all_clean.sum().item() / 6 for count in orders.values()), orders


def test_same_seed_same_batch_different_seed_different_batch():
    prompts, responses = random_examples(random.Random(3), 8, (4, 8, 16, 32))

    def build(seed):
        generator = torch.Generator().manual_seed(seed)
        return build_hybrid_batch(prompts, responses, mask_token_id=MASK, pad_token_id=PAD, generator=generator)

    first, again, other = build(5), build(5), build(6)
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not all(torch.equal(first[key], other[key]) for key in first)


def test_collator_on_list_features():
    rng = random.Random(7)
    prompts, responses = random_examples(rng, 4, (2, 3))
    features = [{"prompt_ids": p, "response_ids": r} for p, r in zip(prompts, responses)]
    collator = HybridObjectiveCollator(mask_token_id=MASK, pad_token_id=PAD, slot_sizes=(2, 3), seed=11)
    batch = collator(features)
    for b, (prompt, response) in enumerate(zip(prompts, responses)):
        check_row(batch, b, prompt, response, (2, 3), collator.eps)
    # Same seed replays the same sequence of batches; successive calls draw fresh noise.
    replay = HybridObjectiveCollator(mask_token_id=MASK, pad_token_id=PAD, slot_sizes=(2, 3), seed=11)
    assert all(torch.equal(batch[key], value) for key, value in replay(features).items())
    next_batches = [collator(features) for _ in range(5)]
    assert any(not torch.equal(batch["noise_level"], later["noise_level"]) for later in next_batches)


def test_collator_without_seed_follows_global_seed():
    features = [{"prompt_ids": [1, 2], "response_ids": list(range(3, 30))}] * 3
    torch.manual_seed(0)
    first = HybridObjectiveCollator(mask_token_id=MASK, pad_token_id=PAD)(features)
    torch.manual_seed(0)
    again = HybridObjectiveCollator(mask_token_id=MASK, pad_token_id=PAD)(features)
    assert all(torch.equal(first[key], again[key]) for key in first)


def test_collator_from_config():
    # A stand-in with RefusionConfig's field names; tests/test_hybrid_loss.py uses the real RefusionConfig.
    config = SimpleNamespace(mask_token_id=MASK, train_slot_sizes=[2, 6], mask_eps=0.05)
    collator = HybridObjectiveCollator.from_config(config, pad_token_id=PAD, seed=0)
    assert (collator.mask_token_id, collator.pad_token_id, collator.slot_sizes, collator.eps) == (
        MASK,
        PAD,
        (2, 6),
        0.05,
    )
    batch = collator([{"prompt_ids": [5], "response_ids": list(range(1, 13))}] * 50)
    assert set(batch["slot_size"].tolist()) == {2, 6} and batch["noise_level"].min() >= 0.05 - 1e-7
    with pytest.raises(ValueError, match="mask_token_id"):
        HybridObjectiveCollator.from_config(
            SimpleNamespace(mask_token_id=None, train_slot_sizes=[4], mask_eps=0.1), PAD
        )


def test_collator_in_dataloader_workers_draws_distinct_noise():
    features = [{"prompt_ids": [1], "response_ids": list(range(2, 40))}] * 8
    collator = HybridObjectiveCollator(mask_token_id=MASK, pad_token_id=PAD, slot_sizes=(1,), seed=0)
    loader = torch.utils.data.DataLoader(features, batch_size=4, num_workers=2, collate_fn=collator)
    first, second = (batch["noise_level"] for batch in loader)  # one batch from each worker
    assert not torch.equal(first, second)


GOOD = {"prompts": [[1, 2]], "responses": [[3, 4, 5]]}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"responses": [[]]}, "response of example 0 is empty"),
        ({"prompts": [[1], []], "responses": [[2], [3]]}, "prompt of example 1 is empty"),
        ({"prompts": [[1], [2]]}, "2 prompts but 1 responses"),
        ({"prompts": [], "responses": []}, "zero examples"),
        ({"responses": [[3, MASK, 5]]}, "response of example 0 contains mask_token_id"),
        ({"prompts": [[MASK]]}, "prompt of example 0 contains mask_token_id"),
        ({"prompts": [[[1, 2]]]}, "must be 1-D"),
        ({"slot_sizes": ()}, "slot_sizes"),
        ({"slot_sizes": (4, 0)}, "slot_sizes"),
        ({"slot_sizes": (2.5,)}, "slot_sizes"),
        ({"eps": 0.0}, "eps"),
        ({"eps": 1.0}, "eps"),
    ],
)
def test_bad_inputs_raise(change, message):
    kwargs = {**GOOD, "slot_sizes": (4,), "eps": 1e-3, **change}
    with pytest.raises(ValueError, match=message):
        build_hybrid_batch(
            kwargs["prompts"],
            kwargs["responses"],
            mask_token_id=MASK,
            pad_token_id=PAD,
            slot_sizes=kwargs["slot_sizes"],
            eps=kwargs["eps"],
        )


def test_collator_rejects_bad_features():
    collator = HybridObjectiveCollator(mask_token_id=MASK, pad_token_id=PAD, seed=0)
    with pytest.raises(ValueError, match="response of example 1 is empty"):
        collator([{"prompt_ids": [1], "response_ids": [2]}, {"prompt_ids": [1], "response_ids": []}])


def check_masked_slots(batch: dict, b: int, prompt: list[int], response: list[int], masking: str) -> list[int]:
    """Assert the layout of row `b` under `masking` (clean slots, then masked slots in reading order, each masked
    slot a clean prefix followed by its [MASK]s) and return the clean prefix length of every masked slot."""
    ids, pos = batch["input_ids"][b].tolist(), batch["position_ids"][b].tolist()
    labels, masked = batch["labels"][b].tolist(), batch["is_masked"][b].tolist()
    original = prompt + response
    n_prompt, n = len(prompt), len(prompt) + len(response)
    size = int(batch["slot_size"][b])
    assert sorted(pos[:n]) == list(range(n)) and pos[:n_prompt] == list(range(n_prompt))
    slot_of = [(q - n_prompt) // size for q in pos[n_prompt:n]]
    masked_slots = {s for s, hidden in zip(slot_of, masked[n_prompt:n]) if hidden}
    in_masked = [s in masked_slots for s in slot_of]
    # Storage: every clean slot's tokens, then every masked slot's tokens, the latter in reading order.
    assert in_masked == sorted(in_masked)
    start = n_prompt + in_masked.index(True) if masked_slots else n
    assert pos[start:n] == sorted(pos[start:n])
    prefixes = []
    for s in sorted(masked_slots):
        stored = [i for i in range(start, n) if (pos[i] - n_prompt) // size == s]
        hidden = [masked[i] for i in stored]
        prefix = hidden.index(True)
        assert hidden == [False] * prefix + [True] * (len(stored) - prefix), "clean prefix, then masks only"
        for i in stored[:prefix]:  # visible context of the slot's masks, not a target
            assert ids[i] == original[pos[i]] and labels[i] == IGNORE_INDEX
        for i in stored[prefix:]:
            assert ids[i] == MASK and labels[i] == original[pos[i]]
        prefixes.append(prefix)
    if masking == "whole":
        assert set(prefixes) <= {0}
    for i in range(n_prompt, start):  # clean slots keep their next-token labels
        q = pos[i]
        same_slot = q + 1 < n and (q + 1 - n_prompt) % size != 0
        assert ids[i] == original[q] and labels[i] == (original[q + 1] if same_slot else IGNORE_INDEX)
    return prefixes


@pytest.mark.parametrize("masking", ["whole", "suffix", "mixed"])
@pytest.mark.parametrize("slot_sizes", SLOT_SIZE_SETS)
def test_slot_masking_layout_and_labels_over_many_seeds(masking, slot_sizes):
    rng = random.Random(sum(slot_sizes))
    prefixes = []
    for seed in range(40):
        prompts, responses = random_examples(rng, rng.randint(1, 6), slot_sizes)
        batch = build_hybrid_batch(
            prompts,
            responses,
            mask_token_id=MASK,
            pad_token_id=PAD,
            slot_sizes=slot_sizes,
            generator=torch.Generator().manual_seed(seed),
            slot_masking=masking,
        )
        assert {key: value.dtype for key, value in batch.items()} == DTYPES
        for b, (prompt, response) in enumerate(zip(prompts, responses)):
            prefixes += check_masked_slots(batch, b, prompt, response, masking)
    if masking != "whole" and max(slot_sizes) > 1:
        assert max(prefixes) > 0, "suffix masking never kept a clean prefix"


def test_suffix_masking_keeps_the_papers_draws_and_changes_only_the_inside_of_masked_slots():
    prompts, responses = random_examples(random.Random(5), 8, (4, 8))
    whole, suffix = (
        build_hybrid_batch(
            prompts,
            responses,
            mask_token_id=MASK,
            pad_token_id=PAD,
            slot_sizes=(4, 8),
            generator=torch.Generator().manual_seed(9),
            slot_masking=masking,
        )
        for masking in ("whole", "suffix")
    )
    for key in ("noise_level", "slot_size", "response_length", "attention_mask", "position_ids"):
        assert torch.equal(whole[key], suffix[key]), key
    revealed = whole["is_masked"] & ~suffix["is_masked"]
    assert revealed.any() and not (suffix["is_masked"] & ~whole["is_masked"]).any()
    assert torch.equal(suffix["labels"][revealed], torch.full_like(suffix["labels"][revealed], IGNORE_INDEX))
    same = ~revealed
    for key in ("input_ids", "labels", "is_masked"):
        assert torch.equal(whole[key][same], suffix[key][same]), key


@pytest.mark.parametrize("masking", ["suffix", "mixed"])
def test_clean_prefix_length_is_uniform_in_suffix_and_half_the_time_zero_in_mixed(masking):
    generator = torch.Generator().manual_seed(0)
    batch = build_hybrid_batch(
        [[1, 2]] * 2000,
        [list(range(3, 43))] * 2000,  # 10 slots of 4
        mask_token_id=MASK,
        pad_token_id=PAD,
        slot_sizes=(4,),
        generator=generator,
        slot_masking=masking,
    )
    counts = Counter()
    for b in range(2000):
        counts.update(check_masked_slots(batch, b, [1, 2], list(range(3, 43)), masking))
    total = sum(counts.values())
    expected = [0.25] * 4 if masking == "suffix" else [0.625, 0.125, 0.125, 0.125]
    assert set(counts) == {0, 1, 2, 3}
    for prefix, share in enumerate(expected):
        assert abs(counts[prefix] / total - share) < 0.015, (prefix, counts)


def test_acceptance_weights_decay_geometrically_over_a_slots_masks_and_keep_its_total():
    decay = 0.5
    prompt, response = [1, 2, 3], list(range(10, 33))  # slots of 4; the last one holds 3 tokens
    seen = set()
    for seed in range(30):
        batch = build_hybrid_batch(
            [prompt],
            [response],
            mask_token_id=MASK,
            pad_token_id=PAD,
            slot_sizes=(4,),
            generator=torch.Generator().manual_seed(seed),
            slot_masking="suffix",
            acceptance_decay=decay,
        )
        weight, masked = batch["mdm_token_weight"][0].tolist(), batch["is_masked"][0].tolist()
        pos = batch["position_ids"][0].tolist()
        assert all(w == 0.0 for w, hidden in zip(weight, masked) if not hidden)
        for s in range(6):
            stored = [i for i in range(len(pos)) if masked[i] and pos[i] >= 3 and (pos[i] - 3) // 4 == s]
            if not stored:
                continue
            count = len(stored)
            expected = [count * decay**k / sum(decay**j for j in range(count)) for k in range(count)]
            assert [weight[i] for i in stored] == pytest.approx(expected, rel=1e-6)
            seen.add(count)
    assert seen == {1, 2, 3, 4}


def test_acceptance_decay_one_weighs_every_mask_alike_and_bad_options_raise():
    kwargs = dict(mask_token_id=MASK, pad_token_id=PAD, slot_sizes=(4,), generator=torch.Generator().manual_seed(0))
    batch = build_hybrid_batch([[1]] * 4, [list(range(2, 30))] * 4, acceptance_decay=1.0, **kwargs)
    assert torch.equal(batch["mdm_token_weight"], batch["is_masked"].float())
    assert "mdm_token_weight" not in build_hybrid_batch([[1]], [[2, 3]], **kwargs)
    with pytest.raises(ValueError, match="slot_masking"):
        build_hybrid_batch([[1]], [[2, 3]], slot_masking="prefix", **kwargs)
    for decay in (0.0, 1.5):
        with pytest.raises(ValueError, match="acceptance_decay"):
            build_hybrid_batch([[1]], [[2, 3]], acceptance_decay=decay, **kwargs)


def test_collator_carries_the_objective_options():
    config = SimpleNamespace(mask_token_id=MASK, train_slot_sizes=[4], mask_eps=1e-3)
    collator = HybridObjectiveCollator.from_config(config, PAD, seed=3, slot_masking="suffix", acceptance_decay=0.7)
    features = [{"prompt_ids": [1, 2], "response_ids": list(range(3, 40))}] * 16
    batch = collator(features)
    expected = build_hybrid_batch(
        [[1, 2]] * 16,
        [list(range(3, 40))] * 16,
        mask_token_id=MASK,
        pad_token_id=PAD,
        slot_sizes=(4,),
        generator=torch.Generator().manual_seed(3),
        slot_masking="suffix",
        acceptance_decay=0.7,
    )
    assert batch.keys() == expected.keys() and all(torch.equal(batch[key], expected[key]) for key in batch)


@pytest.mark.parametrize("slot_sizes", SLOT_SIZE_SETS)
def test_tail_masking_masks_the_last_slots_so_every_mask_sees_only_text_before_it(slot_sizes):
    rng = random.Random(7 + sum(slot_sizes))
    for seed in range(30):
        prompts, responses = random_examples(rng, rng.randint(1, 6), slot_sizes)
        batch = build_hybrid_batch(prompts, responses, mask_token_id=MASK, pad_token_id=PAD, slot_sizes=slot_sizes,
                                   generator=torch.Generator().manual_seed(seed), masked_slots="tail")  # fmt: skip
        for b, (prompt, response) in enumerate(zip(prompts, responses)):
            masked_slots, slots = check_row(batch, b, prompt, response, slot_sizes, 1e-3)  # the paper's layout rules
            size = int(batch["slot_size"][b])
            in_masked_slots = len(response) - (slots - masked_slots) * size
            assert masked_slots >= 1 and float(batch["noise_level"][b]) == pytest.approx(
                in_masked_slots / len(response)
            )
            real = batch["attention_mask"][b].bool()
            positions, is_masked = batch["position_ids"][b][real], batch["is_masked"][b][real]
            response_positions = positions[len(prompt) :]
            masked_positions = positions[is_masked]
            clean_positions = response_positions[~is_masked[len(prompt) :]]
            # Every [MASK] lies after every clean response token in reading order: it sees only text before it.
            assert clean_positions.numel() == 0 or int(clean_positions.max()) < int(masked_positions.min())


def test_tail_masking_keeps_the_papers_draws_of_everything_but_which_slots_are_masked_and_refuses_other_layouts():
    prompts, responses = random_examples(random.Random(11), 8, (4, 8))
    common = dict(mask_token_id=MASK, pad_token_id=PAD, slot_sizes=(4, 8))
    randomly, tail = (
        build_hybrid_batch(
            prompts, responses, generator=torch.Generator().manual_seed(4), masked_slots=layout, **common
        )  # fmt: skip
        for layout in ("random", "tail")
    )
    for key in ("slot_size", "response_length", "attention_mask"):
        assert torch.equal(randomly[key], tail[key]), key
    drawn = randomly["noise_level"]  # the tail masks the last ceil(p * slots) slots for the p drawn
    slots = (tail["response_length"] + tail["slot_size"] - 1) // tail["slot_size"]
    masked = slots - (tail["response_length"] * (1 - tail["noise_level"])).round().long() // tail["slot_size"]
    assert torch.equal(masked, (drawn * slots).ceil().long().clamp(min=1))
    assert not torch.equal(randomly["is_masked"], tail["is_masked"])
    default = build_hybrid_batch(prompts, responses, generator=torch.Generator().manual_seed(4), **common)
    assert all(torch.equal(default[key], randomly[key]) for key in default)  # "random" is the paper's, as before
    with pytest.raises(ValueError, match="masked_slots must be one of random, tail"):
        build_hybrid_batch(prompts, responses, masked_slots="head", **common)
    collator = HybridObjectiveCollator.from_config(
        SimpleNamespace(mask_token_id=MASK, train_slot_sizes=[4, 8], mask_eps=1e-3), PAD, seed=4, masked_slots="tail"
    )
    features = [{"prompt_ids": p, "response_ids": r} for p, r in zip(prompts, responses)]
    assert torch.equal(collator(features)["is_masked"], tail["is_masked"])
