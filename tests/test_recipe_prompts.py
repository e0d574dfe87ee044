"""The recipe's in-repo prompt set: size, variety, a stable held-out split, correct references."""

import json
import re
from pathlib import Path

import pytest

from recipe.evaluate import benchmark_prompts
from recipe.prompts import CAPITALS, COLOURS, SOUNDS, build_prompts, everyday_prompts, interleave_kinds, split_prompts

KINDS = {"factual", "explanation", "list", "code", "rewriting", "arithmetic"}


def test_prompt_set_is_large_varied_and_unique():
    prompts = build_prompts()
    assert len(prompts) >= 3000
    assert len({prompt.text for prompt in prompts}) == len(prompts)
    counts = {kind: sum(prompt.kind == kind for prompt in prompts) for kind in KINDS}
    assert min(counts.values()) >= 50, counts
    assert build_prompts() == prompts  # reproducible


def test_held_out_split_is_disjoint_stable_and_verifiable():
    prompts = build_prompts()
    train, held_out = split_prompts(prompts)
    assert {p.text for p in train}.isdisjoint({p.text for p in held_out})
    assert len(train) + len(held_out) == len(prompts)
    assert 0.05 <= len(held_out) / len(prompts) <= 0.15
    assert split_prompts(list(reversed(prompts)))[1] == list(reversed(held_out))  # by text, not by position
    assert {p.kind for p in held_out} == KINDS
    assert sum(p.reference is not None for p in held_out) >= 30


def test_prompts_held_out_before_the_set_grew_stay_held_out():
    before = json.loads((Path(__file__).parent / "data" / "held_out_before_growth.json").read_text())
    train, held_out = split_prompts(build_prompts())
    assert len(before) == 134 and set(before) <= {p.text for p in held_out}
    assert set(before).isdisjoint(p.text for p in train)


def test_references_are_correct():
    for prompt in build_prompts():
        if prompt.kind == "arithmetic":
            first, second = (int(number) for number in re.findall(r"\d+", prompt.text)[:2])
            if "gets" in prompt.text:
                expected = first + second
            elif "gave away" in prompt.text:
                expected = first - second
            else:
                expected = first * second
            assert prompt.reference == str(expected), prompt.text
        elif "capital" in prompt.text:
            country = next(country for country in CAPITALS if country in prompt.text)
            assert prompt.reference == CAPITALS[country]
        elif prompt.kind == "factual" and "colour" in prompt.text:
            thing = next(thing for thing in COLOURS if thing in prompt.text.lower())
            assert prompt.reference == COLOURS[thing]
        elif prompt.kind == "factual" and ("sound" in prompt.text or "noise" in prompt.text):
            animal = next(animal for animal in SOUNDS if f" {animal} " in prompt.text)
            assert prompt.reference == SOUNDS[animal]
        elif prompt.kind in {"explanation", "list", "code", "rewriting"}:
            assert prompt.reference is None


def test_training_prompts_are_interleaved_so_any_prefix_covers_every_kind():
    train, _ = split_prompts(build_prompts())
    ordered = interleave_kinds(train)
    assert sorted(p.text for p in ordered) == sorted(p.text for p in train)  # a permutation
    assert interleave_kinds(train) == ordered  # seeded
    first = ordered[: 6 * 40]
    assert all(sum(p.kind == kind for p in first) == 40 for kind in KINDS)
    capitals = [p for p in ordered[:60] if p.kind == "factual"]
    assert len({p.text.split()[-1] for p in capitals}) > 5  # shuffled within a kind too, not one template's run


def test_the_everyday_set_is_a_second_evaluation_set_never_trained_on():
    """At least 64 hand-written prompts of six kinds taking turns, none of them a recipe prompt (the recipe distills
    and trains only on `build_prompts()`); `benchmark_prompts` serves either set and names a set it does not know."""
    everyday = everyday_prompts()
    texts = [prompt.text for prompt in everyday]
    assert len(everyday) >= 64 and len(set(texts)) == len(texts)
    assert set(texts).isdisjoint(prompt.text for prompt in build_prompts())
    kinds = [prompt.kind for prompt in everyday]
    assert len(set(kinds)) == 6 and len(set(kinds[:12])) == 6  # any prefix is balanced
    assert benchmark_prompts(12, "everyday") == everyday[:12]
    assert {prompt.text for prompt in benchmark_prompts(8)} <= {p.text for p in split_prompts(build_prompts())[1]}
    with pytest.raises(ValueError, match="prompt_set must be one of"):
        benchmark_prompts(8, "held-out")
    with pytest.raises(ValueError, match="fewer than the 1000 asked"):
        benchmark_prompts(1000, "everyday")
