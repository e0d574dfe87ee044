"""The decoder's own work between forwards, timed apart from the model (prints a table).

    python -m benchmarks.decoder_overhead [--prompts 8] [--max_new_tokens 64] [--dtype bfloat16] [--repeats 5]
        [--lookup_drafts 4] [--token_threshold 0.5] [--forward_prices '{"1": 1, "2": 1, "4": 1.34}'] [--profile 25]

Per answer token ReFusion pays for its forwards and, between them, for its own decoding work: scoring the logits,
deciding, copying drafts from the text, building the next queries and the attention mask. On a CPU that work can
cost a forward several times what an AR step's argmax costs, enough to keep ReFusion behind the fastest AR (the
records in benchmarks/results/README.md). This times it alone and repeatably: a decode of held-out prompts
records the logits of every forward, then the same decode runs again with the recorded logits in place of the model
(`executor_refusion.run_model`), so every decision is the same (the answers must be equal, or it stops) and the
time is the decoder's own. The decode is greedy, batch 1, over the static cache, eager, with priced drafts at the
given `--forward_prices` (no measuring; default: ratios measured on the AVX2 CPU) and the shipped settings otherwise;
it is replayed with the decoder's step functions eager and compiled (as decodes through compiled forwards run them:
`decisions_refusion.StepFunctions`), interleaved.
Prints milliseconds per forward and per answer token (fastest of `--repeats` replays), the ATen operations the decoder
dispatches per forward (each a kernel launch or more on a GPU, paid even where the decode's forwards run as CUDA
graphs), its calls of compiled step functions per forward (each a kernel or a few) and, with `--profile N`, the N
functions of most own time in one replay with compiled step functions (cProfile).
"""

import argparse
import cProfile
import dataclasses
import json
import pstats
import time
from collections.abc import Sequence
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from finetune.chat import prompt_token_ids
from recipe.decoding import DecodeRun, decode, decoder_module
from recipe.evaluate import benchmark_prompts
from recipe.model import decoding_dtype, load_base, prepare_for_decoding, with_adapter

# SmolLM2's forward prices on the AVX2 CPU relative to one query (frozen, saved, bfloat16; 2026-12-03)
AVX2_PRICES = {1: 1.0, 2: 0.93, 4: 1.34, 8: 2.38, 16: 6.2, 32: 12.1, 64: 24.1}


@contextmanager
def model_calls(model, call, compiled_steps: bool = False, counter: "CountedOperations | None" = None):
    """Within it, the decoder of `model` runs its forwards through `call(run_model, *arguments)`, and its step
    functions (`decisions_refusion.StepFunctions`) compiled where `compiled_steps`, as decodes through compiled
    forwards run them, else eagerly, as the eager forwards here would have them; with a `counter`, each call of a
    compiled step function counts as one and runs outside it (dynamo compiles nothing under a dispatch mode)."""
    entry, executor = decoder_module(model), decoder_module(model, "executor_refusion")
    run_model, step_functions = executor.run_model, entry.step_functions
    steps = step_functions(compiled_steps)
    if counter is not None and compiled_steps:
        steps = dataclasses.replace(steps, **{
            field.name: counter.outside(getattr(steps, field.name)) for field in dataclasses.fields(steps)
        })  # fmt: skip
    executor.run_model = lambda *arguments: call(run_model, *arguments)
    entry.step_functions = lambda compiled: steps
    try:
        yield
    finally:
        executor.run_model, entry.step_functions = run_model, step_functions


def recorded(model, tokenizer, prompts: Sequence[Sequence[int]], max_new_tokens: int, compiled_steps: bool = False,
             **settings):  # fmt: skip
    """A decode of `prompts` and the logits of each of its forwards, in order."""
    tape = []

    def record(run_model, *arguments):
        logits = run_model(*arguments)
        tape.append(logits.clone())
        return logits

    with model_calls(model, record, compiled_steps):
        run = decode(model, tokenizer, prompts, max_new_tokens, time_forwards=False, **settings)
    return run, tape


def replayed(model, tokenizer, prompts, max_new_tokens: int, tape: list[torch.Tensor], expected: DecodeRun,
             compiled_steps: bool = False, counter: "CountedOperations | None" = None, **settings):  # fmt: skip
    """The same decode with the `tape`'s logits in place of the model's forwards; returns its seconds. Raises if its
    answers differ from `expected`'s (the tape is not this decode's)."""
    position = iter(tape)
    refusal = "The replayed decode did not follow the recorded one: its answers or forwards differ."

    def replay(run_model, *arguments):
        logits = next(position, None)
        if logits is None:
            raise RuntimeError(refusal)
        return logits

    with model_calls(model, replay, compiled_steps, counter):
        started = time.perf_counter()
        run = decode(model, tokenizer, prompts, max_new_tokens, time_forwards=False, **settings)
        seconds = time.perf_counter() - started
    if run.answers != expected.answers or next(position, None) is not None:
        raise RuntimeError(refusal)
    return seconds


class CountedOperations(TorchDispatchMode):
    """Counts the ATen operations dispatched while it is on (what a compiled region runs counts as its kernels do
    not pass through the dispatcher)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.compiled_calls = 0  # calls of compiled code (`outside`)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))

    def outside(self, compiled):
        """`compiled` (a compiled function) run outside the count while it is on, each call counted in
        `compiled_calls`."""

        def call(*arguments):
            self.compiled_calls += 1
            with _disable_current_modes():
                return compiled(*arguments)

        return call


def operations(model, tokenizer, prompts, max_new_tokens: int, tape: list[torch.Tensor], expected: DecodeRun,
               compiled_steps: bool = False, **settings) -> tuple[int, int]:  # fmt: skip
    """The ATen operations the decoder dispatches in a replay of `tape` (`replayed`), and its calls of compiled step
    functions: on a GPU each operation is a kernel launch at least, which is what the decoder's work between forwards
    cost there (see the module's docstring); a compiled call, a launch or a few."""
    counted = CountedOperations()
    with counted:
        replayed(model, tokenizer, prompts, max_new_tokens, tape, expected, compiled_steps, counted, **settings)
    return counted.count, counted.compiled_calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", help="the model's dtype (the recorded logits are in it)")
    parser.add_argument("--repeats", type=int, default=5, help="replays timed; the fastest is reported")
    parser.add_argument("--lookup_drafts", type=int, default=4)
    parser.add_argument("--token_threshold", type=float, default=0.5)
    parser.add_argument("--forward_prices", type=json.loads, default=AVX2_PRICES, help="JSON {width: price}")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print the N functions of most own time")
    args = parser.parse_args()

    base, tokenizer = load_base()
    model, refusion_tokenizer = with_adapter(base.eval(), tokenizer)
    model = model.to(decoding_dtype(args.dtype))
    prepare_for_decoding(model)
    prompts = prompt_token_ids(tokenizer, [prompt.text for prompt in benchmark_prompts(args.prompts)])
    settings = dict(draft_schedule="price", forward_prices=args.forward_prices, lookup_drafts=args.lookup_drafts,
                    token_threshold=args.token_threshold, cache_implementation="static")  # fmt: skip
    run, tape = recorded(model, refusion_tokenizer, prompts, args.max_new_tokens, **settings)
    replay = (model, refusion_tokenizer, prompts, args.max_new_tokens, tape, run)
    replayed(*replay, compiled_steps=True, **settings)  # compiles the step functions (the decisions are the same)
    seconds = {False: [], True: []}
    for _ in range(max(args.repeats, 1)):  # interleaved
        for compiled in seconds:
            seconds[compiled].append(replayed(*replay, compiled_steps=compiled, **settings))
    tokens = sum(len(answer) for answer in run.answers)
    print(f"{args.prompts} held-out prompts, {args.max_new_tokens} new tokens, batch 1, {model.dtype}, priced drafts, "
          f"lookup_drafts={args.lookup_drafts}, token_threshold={args.token_threshold}, "
          f"{torch.get_num_threads()} threads; fastest of {args.repeats} replays, interleaved")  # fmt: skip
    print("| step functions | forwards | answer tokens | decoder seconds | ms per forward | ms per answer token | "
          "operations/forward | compiled calls/forward |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for compiled, times in seconds.items():
        counted, calls = operations(*replay, compiled_steps=compiled, **settings)
        best = min(times)
        print(f"| {'compiled' if compiled else 'eager'} | {run.forwards} | {tokens} | {best:.3f} | "
              f"{1000 * best / run.forwards:.2f} | {1000 * best / max(tokens, 1):.2f} | {counted / run.forwards:.0f} | "
              f"{calls / run.forwards:.1f} |")  # fmt: skip
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(replayed, *replay, compiled_steps=True, **settings)
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
