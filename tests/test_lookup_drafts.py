"""Drafts copied from earlier text (`lookup_drafts`): where the answer repeats itself or the prompt, the tokens that
followed an earlier occurrence of the last tokens are drafted and checked as any draft is. Only the forwards change
where a passing draft must be the model's own token; the cache paths, batching and the price schedule stay exact."""

import dataclasses

import pytest
import torch
from test_batching import assert_exact_everywhere
from test_generation import PROMPT, sharpened_model
from test_price_schedule import FLAT, STEEP, forward_queries

import compiling_refusion
from compiling_refusion import compile_forwards, compiled_steps, warm_up_copies
from decisions_refusion import copy_drafts, lookup_drafts
from executor_refusion import static_cache_columns
from settings_refusion import check_decoding

ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3"]
CYCLE = list(range(50, 57))  # the tokens the cycling model's answers go round
SETTINGS = dict(
    max_new_tokens=40, slot_size=8, block_length=16, slot_threshold=0.5, token_threshold=0.5, eos_token_id=[],
    pad_token_id=0, return_dict_in_generate=True,
)  # fmt: skip


def cycling_model(architecture: str) -> torch.nn.Module:
    """A tiny converted model whose next token depends on the current token only (attention and MLP outputs are
    zero) and is, with probability ~1, the next token of `CYCLE`: its answers go round `CYCLE`, so they repeat every
    seven tokens, while its `[MASK]` queries draft one fixed token."""
    model = sharpened_model(architecture, scale=1.0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        embeddings = model.get_input_embeddings().weight
        head = torch.zeros_like(model.get_output_embeddings().weight)
        for before, token in zip(CYCLE, CYCLE[1:] + CYCLE[:1]):
            head[token] = 30 * embeddings[before] / embeddings[before].norm()
        model.get_output_embeddings().weight = torch.nn.Parameter(head)
    return model


# ---- the pure function ---------------------------------------------------------------------------------------------
def test_copies_follow_the_last_occurrence_of_the_longest_match():
    unknown = 0
    #                   0  1  2  3  4  5  6  7  8  9 10 11
    text = torch.tensor([7, 8, 1, 2, 9, 8, 3, 4, 5, 8, 0, 0])
    drafts, found = lookup_drafts(text, torch.tensor([10]), 3, unknown)
    assert drafts.tolist() == [[3, 4, 5]] and found.tolist() == [3]  # `8` last occurred at 5: copy from 6
    text = torch.tensor([7, 8, 1, 2, 9, 8, 3, 4, 7, 8, 0, 0])
    drafts, found = lookup_drafts(text, torch.tensor([10]), 3, unknown)
    assert drafts.tolist() == [[1, 2, 9]] and found.tolist() == [3]  # `7 8` at 0 beats the later `8` at 5
    drafts, found = lookup_drafts(text, torch.tensor([10]), 3, unknown, ngram=1)
    assert drafts.tolist() == [[3, 4, 7]]


def test_unknown_tokens_end_a_copy_and_nothing_is_found_without_a_match():
    unknown = 0
    text = torch.tensor([4, 5, 0, 6, 4, 0, 0])  # 5 follows 4 at 0, then an undecoded token
    drafts, found = lookup_drafts(text, torch.tensor([5, 1, 0]), 3, unknown)
    assert found.tolist() == [1, 0, 0]  # row 2: `4` (at 0) has no earlier occurrence; row 3: nothing before it
    assert drafts[0, 0] == 5
    text = torch.tensor([4, 0, 4, 9, 0])  # the match's own suffix contains an undecoded token: no copy
    assert lookup_drafts(text, torch.tensor([2]), 2, unknown)[1].tolist() == [0]


def copied_by_definition(text: list[int], start: int, count: int, unknown: int, ngram: int) -> list[int]:
    """What `lookup_drafts` copies for one start, written as its docstring says: the known tokens after the last
    earlier occurrence of the longest known suffix (up to `ngram` tokens) before `start` that has one."""
    for size in range(min(ngram, start), 0, -1):
        suffix = text[start - size : start]
        if unknown in suffix:
            continue
        begins = [begin for begin in range(start - size) if text[begin : begin + size] == suffix]
        if begins:
            copied = []
            for token in text[begins[-1] + size : begins[-1] + size + count]:
                if token == unknown:
                    break
                copied.append(token)
            return copied
    return []


@pytest.mark.parametrize("ngram", [1, 2, 3])
def test_copies_equal_the_definition_on_random_texts(ngram):
    generator = torch.Generator().manual_seed(ngram)
    for _ in range(200):
        length = int(torch.randint(1, 30, (1,), generator=generator))
        text = torch.randint(0, 4, (length,), generator=generator)  # 0: unknown; three tokens repeat often
        starts = torch.randint(0, length + 1, (5,), generator=generator)
        drafts, found = lookup_drafts(text, starts, 3, 0, ngram=ngram)
        for row, start in enumerate(starts.tolist()):
            expected = copied_by_definition(text.tolist(), start, 3, 0, ngram)
            assert found[row] == len(expected), (text.tolist(), start)
            assert drafts[row, : len(expected)].tolist() == expected, (text.tolist(), start)


def test_copies_are_written_after_the_accepted_tokens_of_each_slot():
    """`copy_drafts` reads the text with each slot's accepted tokens in place and writes what follows the last
    occurrence of the tokens before its first open position, as far as the slot goes."""
    text = torch.tensor([5, 6, 7, 8, 9, 5, 6, 0, 0, 0, 0, 0, 0, 0, 0])  # a prompt of 5, then two slots of 5; 0: open
    at = torch.arange(5, 15).view(2, 5)
    tokens = torch.tensor([[5, 6, 1, 2, 3], [4, 0, 0, 0, 0]])  # slot 0: two accepted, then drafts
    drafts, found = copy_drafts(text, at, tokens, torch.tensor([2, 1]), 4, 0)
    assert drafts.tolist() == [[5, 6, 7, 8, 9], [4, 0, 0, 0, 0]]  # slot 0 repeats the prompt; 4 occurs nowhere
    assert found.tolist() == [3, 0]  # (only three places left in slot 0)
    drafts, found = copy_drafts(text, at, tokens, torch.tensor([1, 1]), 2, 0)  # "5" alone: its last occurrence
    assert drafts.tolist() == [[5, 6, 7, 2, 3], [4, 0, 0, 0, 0]] and found.tolist() == [2, 0]


def test_the_compiled_copies_are_the_eager_ones_and_compile_two_graphs_up_front():
    """Decodes through compiled forwards copy drafts through `compiled_steps()`: one graph for one slot, one for
    more, whatever the text's length, slot size and draft count above one (dynamic shapes); `warm_up_copies`
    compiles both."""
    warm_up_copies("cpu", 3, 0)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():  # (as in a decode: grad mode is among a graph's guards)
        for case in range(60):
            slots, size = 1 + case % 4, 2 + case % 7
            length = slots * size + int(torch.randint(1, 30, (1,), generator=generator))
            text = torch.randint(0, 4, (length,), generator=generator)  # 0: unknown
            start = int(torch.randint(0, length - slots * size + 1, (1,), generator=generator))
            at = start + torch.arange(slots * size).view(slots, size)
            tokens = torch.randint(0, 4, (slots, size), generator=generator)
            counts = torch.randint(1, size + 1, (slots,), generator=generator)
            compiled = compiled_steps().copy_drafts(text, at, tokens, counts, 3, 0)
            eager = copy_drafts(text, at, tokens, counts, 3, 0)
            assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1]), case
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


# ---- decoding ------------------------------------------------------------------------------------------------------
def test_compiled_decodes_copy_through_the_compiled_copies_and_give_the_eager_tokens(monkeypatch):
    from test_static_cache import compile_config

    calls = []
    compiled = compiled_steps()

    def counted(name):  # the steps that copy drafts, with the number each copies
        def call(*arguments):
            calls.append((name, arguments[copies_argument[name]]))
            return getattr(compiled, name)(*arguments)

        return call

    copies_argument = {"copy_drafts": 4, "score_plan": 7, "score_verify": 8, "score_infill": 10}
    copying = tuple(copies_argument)
    steps = dataclasses.replace(compiled, **{name: counted(name) for name in copying})
    monkeypatch.setattr(compiling_refusion, "compiled_steps", lambda: steps)
    model = cycling_model("llama")
    settings = dict(SETTINGS, lookup_drafts=4, cache_implementation="static", compile_config=compile_config())
    eager = model.generate(PROMPT, **{**settings, "compile_config": None})
    assert not calls  # eager forwards copy eagerly
    columns = static_cache_columns(PROMPT.shape[1], SETTINGS["max_new_tokens"], 8, 16)
    compile_forwards(model, settings["compile_config"], 1, columns, lookup_drafts=4)
    assert [count for name, count in calls if name == "copy_drafts"] == [4, 4]  # the warm-up: one start, several
    calls.clear()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    output = model.generate(PROMPT, **settings)
    assert torch.equal(output.sequences, eager.sequences) and output.num_forward_passes == eager.num_forward_passes
    # a greedy decode copies inside its plans', verify forwards' and infill rounds' compiled scoring
    assert {name for name, _ in calls} == set(copying[1:]) and {count for _, count in calls} == {4}
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # compile_forwards compiled it all


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_where_the_answer_repeats_copies_give_the_same_tokens_in_fewer_forwards(architecture):
    """Only the model's own token passes a threshold of 0.5: copied drafts change how many forwards it takes, not
    the answer."""
    model = cycling_model(architecture)
    plain = model.generate(PROMPT, **SETTINGS)
    copied = model.generate(PROMPT, lookup_drafts=4, **SETTINGS)
    answer = copied.sequences[0, PROMPT.shape[1] :].tolist()
    assert set(answer) <= set(CYCLE)
    assert torch.equal(plain.sequences, copied.sequences)
    assert copied.num_forward_passes < plain.num_forward_passes
    assert copied.draft_accepted.sum() > plain.draft_accepted.sum()
    assert copied.draft_accepted[0].sum() > 0  # copies checked in verify forwards too, after each plan's first token


def test_with_copies_a_plan_drafts_each_slots_first_token_only():
    model = cycling_model("llama")
    slots_per_block = SETTINGS["block_length"] // SETTINGS["slot_size"]
    plain = forward_queries(model, lambda: model.generate(PROMPT, **SETTINGS))
    copied = forward_queries(model, lambda: model.generate(PROMPT, lookup_drafts=4, **SETTINGS))
    assert plain[0] == SETTINGS["block_length"] and copied[0] == slots_per_block


def test_the_price_schedule_takes_every_copy_where_width_is_free_and_none_where_it_is_dear():
    model = cycling_model("llama")
    fixed = model.generate(PROMPT, lookup_drafts=4, **SETTINGS)
    free = model.generate(PROMPT, lookup_drafts=4, draft_schedule="price", forward_prices=FLAT, **SETTINGS)
    assert torch.equal(free.sequences, fixed.sequences) and free.num_forward_passes == fixed.num_forward_passes
    dear = dict(SETTINGS, draft_schedule="price", forward_prices=STEEP)
    with_copies = forward_queries(model, lambda: model.generate(PROMPT, lookup_drafts=4, **dear))
    without = forward_queries(model, lambda: model.generate(PROMPT, **dear))
    assert with_copies == without


@pytest.mark.parametrize("prices", [None, FLAT, STEEP], ids=["fixed", "free", "dear"])
@pytest.mark.parametrize("make", [cycling_model, lambda name: sharpened_model(name, scale=4.0)], ids=["cycle", "any"])
def test_copied_drafts_are_exact_static_recomputed_batched_and_alone(make, prices):
    model = make("qwen3")
    settings = dict(SETTINGS, token_threshold=0.3, lookup_drafts=3)
    if prices is not None:
        settings.update(draft_schedule="price", forward_prices=prices, draft_prior=0.1)
    assert_exact_everywhere(model, settings)


def test_lookup_drafts_is_a_fast_rule_count():
    assert check_decoding({})["lookup_drafts"] == 0
    assert check_decoding({}, {"infill_mode": "reference", "lookup_drafts": 4})["lookup_drafts"] == 0
    with pytest.raises(ValueError, match="lookup_drafts must be an integer >= 0, got -1"):
        check_decoding({"lookup_drafts": -1})
    with pytest.raises(ValueError, match="lookup_drafts=4 and infill_mode='reference' were both passed"):
        check_decoding({"lookup_drafts": 4, "infill_mode": "reference"})
