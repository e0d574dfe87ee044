"""The decoder-overhead benchmark's record and replay on a tiny model: the replay makes the recorded decode's
decisions without the model, and a tape that is not the decode's is refused."""

import pytest
import torch
from test_generation import sharpened_model
from tiny import tiny_tokenizer

from benchmarks.decoder_overhead import AVX2_PRICES, CountedOperations, operations, recorded, replayed

SETTINGS = dict(draft_schedule="price", forward_prices=AVX2_PRICES, lookup_drafts=2, token_threshold=0.3,
                cache_implementation="static", slot_size=4, block_length=8, eos_token_id=[])  # fmt: skip
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 5, 6, 7, 8]]


@pytest.fixture(scope="module")
def model():
    return sharpened_model("llama", scale=4.0)


def test_a_replay_runs_no_forward_and_makes_the_recorded_decisions(model):
    tokenizer = tiny_tokenizer()
    run, tape = recorded(model, tokenizer, PROMPTS, 12, **SETTINGS)
    assert len(tape) == run.forwards and all(logits.dtype == model.dtype for logits in tape)
    forwards = []
    hook = model.register_forward_hook(lambda *_: forwards.append(1))
    try:
        assert replayed(model, tokenizer, PROMPTS, 12, tape, run, **SETTINGS) > 0
        assert not forwards  # the model never ran
        again, _ = recorded(model, tokenizer, PROMPTS, 12, **SETTINGS)  # and runs again after the replay
    finally:
        hook.remove()
    assert len(forwards) == run.forwards and again.answers == run.answers


def test_a_tape_that_is_not_the_decode_s_is_refused(model):
    tokenizer = tiny_tokenizer()
    run, tape = recorded(model, tokenizer, PROMPTS, 12, **SETTINGS)
    flipped = [torch.flip(logits, dims=[-1]) for logits in tape]  # other tokens win every forward
    with pytest.raises(RuntimeError, match="did not follow the recorded one"):
        replayed(model, tokenizer, PROMPTS, 12, flipped, run, **SETTINGS)


def test_the_decoder_s_operations_are_counted_without_the_model_s(model):
    tokenizer = tiny_tokenizer()
    with CountedOperations() as whole:
        run, tape = recorded(model, tokenizer, PROMPTS, 12, **SETTINGS)
    counted, calls = operations(model, tokenizer, PROMPTS, 12, tape, run, **SETTINGS)
    assert (counted, calls) == operations(model, tokenizer, PROMPTS, 12, tape, run, **SETTINGS)  # the same decisions
    assert calls == 0  # eager step functions
    with CountedOperations() as forwards:  # about what the recorded decode's forwards dispatched
        for _ in range(run.forwards):
            model(torch.tensor([PROMPTS[0]]))
    assert 10 * run.forwards < counted < whole.count - forwards.count // 2  # the decoder's alone


def test_compiled_step_functions_replay_the_same_decisions_and_count_as_calls(model):
    """Replayed with the step functions compiled (as decodes through compiled forwards run them), the decode makes
    the recorded decisions; each forward's mask is one compiled call instead of its operations, and so are the
    copies."""
    tokenizer = tiny_tokenizer()
    run, tape = recorded(model, tokenizer, PROMPTS, 12, **SETTINGS)
    assert replayed(model, tokenizer, PROMPTS, 12, tape, run, compiled_steps=True, **SETTINGS) > 0
    eager, _ = operations(model, tokenizer, PROMPTS, 12, tape, run, **SETTINGS)
    counted, calls = operations(model, tokenizer, PROMPTS, 12, tape, run, compiled_steps=True, **SETTINGS)
    assert calls > run.forwards  # a mask a forward, and copies
    assert counted < eager - 10 * run.forwards
    compiled_run, _ = recorded(model, tokenizer, PROMPTS, 12, compiled_steps=True, **SETTINGS)
    assert compiled_run.answers == run.answers and compiled_run.forwards == run.forwards
