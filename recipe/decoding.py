"""Timed decoding of chat prompts, autoregressive or ReFusion, as the demo and the benchmark measure it.

Every run decodes the prompts in left-padded batches of `batch_size` and reports the answers (token ids, cut at
the first stop token), the wall time spent in `generate()`, and the model forwards it took, so that tokens/s and
tokens per forward of the two decoders are computed the same way; a ReFusion run also reports how its drafts fared
(`Acceptance`).
"""

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
from transformers import GenerationMixin, PreTrainedModel, PreTrainedTokenizerBase

SOURCES = ("plan", "redraft")  # rows of the decoder's acceptance counts


@dataclass
class Acceptance:
    """ReFusion's draft checks over a run, by source (`SOURCES`) and slot offset (see `RefusionGenerateOutput`)."""

    offered: list[list[int]]  # drafts checked at offset k with every draft before them in the check accepted
    accepted: list[list[int]]  # of those, the ones that passed
    runs: list[int]  # slot checks, one accepted run each
    verify_forwards: int  # forwards that checked drafts

    @classmethod
    def of(cls, output) -> "Acceptance":
        """The counts of one `generate()` output."""
        offered, accepted, runs = (
            getattr(output, name).tolist() for name in ("draft_offered", "draft_accepted", "draft_runs")
        )
        return cls(offered, accepted, runs, output.verify_forwards)

    def __add__(self, other: "Acceptance") -> "Acceptance":
        def add(a: list, b: list) -> list:
            return [add(x, y) if isinstance(x, list) else x + y for x, y in zip(a, b)]

        return Acceptance(
            add(self.offered, other.offered),
            add(self.accepted, other.accepted),
            add(self.runs, other.runs),
            self.verify_forwards + other.verify_forwards,
        )

    @property
    def run_per_verify(self) -> float | None:
        """Drafts accepted per forward that checked drafts (every slot it checked together)."""
        return sum(map(sum, self.accepted)) / self.verify_forwards if self.verify_forwards else None

    @property
    def run_per_check(self) -> float | None:
        """Drafts accepted per slot check: the mean accepted run."""
        return sum(map(sum, self.accepted)) / sum(self.runs) if sum(self.runs) else None

    def rates(self) -> dict[str, list[float | None]]:
        """Per source, the share of the drafts at each slot offset that passed given that the drafts before them
        in the same check did (None where none was checked)."""
        return {
            source: [a / o if o else None for a, o in zip(accepted, offered)]
            for source, accepted, offered in zip(SOURCES, self.accepted, self.offered)
        }


@dataclass
class DecodeRun:
    answers: list[list[int]]  # per prompt, without the stop token and what follows it
    seconds: float
    forwards: int
    forward_seconds: float = 0.0  # of `seconds`, the time spent inside model forwards
    step_tokens_per_forward: list[float] | None = None  # ReFusion: the authors' per-step figure, per batch
    acceptance: Acceptance | None = None  # ReFusion: its draft checks, summed over batches

    @property
    def orchestration(self) -> float:
        """Share of the decode time spent outside model forwards."""
        return 1.0 - self.forward_seconds / self.seconds

    @property
    def tokens(self) -> int:
        return sum(len(answer) for answer in self.answers)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.forwards


def stop_token_ids(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, eos_token_id: int | list[int] | None = None
) -> set[int]:
    """EOS ids of the model's generation config and the tokenizer, and the pad id (what follows an end); with
    `eos_token_id` (what `generate()` was told; `[]`: never stop), those ids only."""
    if eos_token_id is not None:
        return set(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id])
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id, tokenizer.pad_token_id}
    return {token for token in ids if token is not None}


def cut_answer(tokens: Sequence[int], stop_ids: set[int]) -> list[int]:
    """`tokens` up to (without) the first stop token."""
    answer = []
    for token in tokens:
        if token in stop_ids:
            break
        answer.append(token)
    return answer


def left_padded(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids, attention_mask


def synchronize(device: torch.device) -> None:
    """Wait for the device to finish its queued work (CUDA), so that host timers measure it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def decode(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    batch_size: int = 1,
    autoregressive: bool = False,
    **generate_kwargs,
) -> DecodeRun:
    """Greedy `model.generate()` over `prompts` (token ids) in batches; ReFusion models take their decoding
    settings (`slot_size`, thresholds, `block_length`, `infill_mode`) in `generate_kwargs`. `autoregressive`:
    decode with transformers' own token-by-token `generate()` even when the model is a ReFusion model.

    Forwards are what the decoder reports: ReFusion's `num_forward_passes`; for token-by-token decoding, one per
    generated position (transformers' `generate()` runs one forward per new token). Hooks on the model only time
    the forwards, to split the wall time into model and orchestration."""
    stop_ids = stop_token_ids(model, tokenizer, generate_kwargs.get("eos_token_id"))
    forwards, forward_seconds, started = 0, 0.0, 0.0

    def enter(*_):
        nonlocal started
        synchronize(model.device)
        started = time.perf_counter()

    def leave(*_):
        nonlocal forward_seconds
        synchronize(model.device)
        forward_seconds += time.perf_counter() - started

    hooks = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave)]
    # The bound `model.generate`: a native export loaded with trust_remote_code carries ReFusion's decoder as an
    # instance attribute (transformers' custom_generate), which the class's method would bypass.
    generate = partial(GenerationMixin.generate, model) if autoregressive else model.generate
    refusion = not autoregressive and getattr(model.generation_config, "slot_size", None) is not None
    answers, seconds, step_ratios, acceptance = [], 0.0, [], None
    try:
        for start in range(0, len(prompts), batch_size):
            input_ids, attention_mask = left_padded(prompts[start : start + batch_size], tokenizer.pad_token_id)
            input_ids, attention_mask = input_ids.to(model.device), attention_mask.to(model.device)
            synchronize(model.device)
            begin = time.perf_counter()
            output = generate(
                input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                **({"return_dict_in_generate": True} if refusion else {}),
                **generate_kwargs,
            )
            synchronize(model.device)
            seconds += time.perf_counter() - begin
            sequences = output if isinstance(output, torch.Tensor) else output.sequences
            answers += [cut_answer(row, stop_ids) for row in sequences[:, input_ids.shape[1] :].tolist()]
            if refusion:
                forwards += output.num_forward_passes
                step_ratios.append(output.step_tokens_per_forward)
                counts = Acceptance.of(output)
                acceptance = counts if acceptance is None else acceptance + counts
            else:
                forwards += sequences.shape[1] - input_ids.shape[1]
    finally:
        for hook in hooks:
            hook.remove()
    return DecodeRun(answers, seconds, forwards, forward_seconds, step_ratios or None, acceptance)
