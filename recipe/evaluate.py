"""Scoring a decoder against the autoregressive teacher on held-out prompts: the figures every table reports.

    evaluation = Evaluation(base, tokenizer, prompt_count=32, max_new_tokens=64)  # decodes the AR teacher once
    row = evaluation.adapter_row("stage 2", "recipe/artifacts/smollm2/adapter")     # ReFusion at the shipped setting

A row holds speed (tokens/s, speed-up over the teacher's AR `generate()` at the same batch size, forwards, tokens
per forward by our count and by the authors' per-step ratio, the share of time outside model forwards; for ReFusion
the acceptance profile: drafts accepted per verifying forward and per slot check, and by slot offset the share
accepted given the drafts before them were, for plan drafts and redrafts), quality against the teacher
(generative perplexity under the base model, exact match and word F1 with the teacher's answer, accuracy on the
verifiable prompts the teacher answers correctly) and repetition (share of repeated word 4-grams). The benchmark,
the ablations and the recipe's per-stage budget curve all score through this one class.
"""

import copy
import platform
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from finetune.chat import prompt_token_ids
from finetune.convert import convert_to_refusion
from recipe.decoding import DecodeRun, decode
from recipe.metrics import answer_nll, contains_reference, exact_match, perplexity, repetition, token_f1
from recipe.model import shipped_decoding, with_adapter
from recipe.prompts import PROMPT_SETS, Prompt, build_prompts, everyday_prompts, interleave_kinds, split_prompts


def benchmark_prompts(count: int, prompt_set: str = "held_out") -> list[Prompt]:
    """`count` prompts of `prompt_set`: the recipe's held-out ones (half verifiable: factual, arithmetic; half
    open-ended; kinds interleaved), or the first `count` everyday ones (`recipe.prompts.everyday_prompts`)."""
    if prompt_set not in PROMPT_SETS:
        raise ValueError(f"prompt_set must be one of {PROMPT_SETS}, got {prompt_set!r}.")
    if prompt_set == "everyday":
        prompts = everyday_prompts()
        if count > len(prompts):
            raise ValueError(f"The everyday set holds {len(prompts)} prompts, fewer than the {count} asked.")
        return prompts[:count]
    _, held_out = split_prompts(build_prompts())
    verifiable = interleave_kinds([p for p in held_out if p.reference is not None])
    open_ended = interleave_kinds([p for p in held_out if p.reference is None])
    return verifiable[: count // 2] + open_ended[: count - count // 2]


def fastest(runs: Sequence[DecodeRun]) -> DecodeRun:
    """The quickest of repeated runs: greedy decoding gives the same answers every time, a busy machine only adds
    time."""
    if any(run.answers != runs[0].answers for run in runs):
        raise RuntimeError("Repeated greedy runs gave different answers.")
    return min(runs, key=lambda run: run.seconds)


def speed(run: DecodeRun, ar_tokens_per_second: float) -> dict:
    steps = run.step_tokens_per_forward
    return {
        "tokens": run.tokens,
        "seconds": run.seconds,
        "tokens_per_second": run.tokens_per_second,
        "speedup": run.tokens_per_second / ar_tokens_per_second,
        "forwards": run.forwards,
        "tokens_per_forward": run.tokens_per_forward,
        "step_tokens_per_forward": sum(steps) / len(steps) if steps else None,
        "orchestration": run.orchestration,
        "accepted_run_per_verify": run.acceptance.run_per_verify if run.acceptance else None,
        "accepted_run_per_check": run.acceptance.run_per_check if run.acceptance else None,
        "acceptance_by_offset": run.acceptance.rates() if run.acceptance else None,
    }


class Evaluation:
    """Held-out prompts, the base model's greedy answers to them (the teacher) and the scoring of other decoders.

    `base` is the autoregressive model: it decodes the teacher's answers here and scores every answer's
    generative perplexity. Decoders are timed `repeats` times and the fastest run is kept.
    """

    def __init__(
        self,
        base: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        prompt_count: int = 32,
        max_new_tokens: int = 64,
        repeats: int = 1,
        prompt_set: str = "held_out",
    ):
        self.base, self.tokenizer = base, tokenizer
        self.max_new_tokens, self.repeats = max_new_tokens, repeats
        self.prompts = benchmark_prompts(prompt_count, prompt_set)
        self.prompt_ids = prompt_token_ids(tokenizer, [prompt.text for prompt in self.prompts])
        self.base_vocab = base.get_input_embeddings().num_embeddings
        decode(base, tokenizer, self.prompt_ids[:1], max_new_tokens=8)  # first calls pay one-off costs
        self.teacher = self.timed(base, tokenizer)
        self.teacher_texts = self.texts(self.teacher, tokenizer)
        self.correct = [
            i
            for i, prompt in enumerate(self.prompts)
            if prompt.reference and contains_reference(self.teacher_texts[i], prompt.reference)
        ]
        self._ar_rows = {1: self.row("AR: base generate()", "ar", self.teacher, 1, self.teacher)}
        self.ar_row = self._ar_rows[1]

    def timed(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, batch_size: int = 1, **generate_kwargs
    ) -> DecodeRun:
        """The fastest of `repeats` greedy decodings of the prompts."""
        return fastest(
            [
                decode(model, tokenizer, self.prompt_ids, self.max_new_tokens, batch_size=batch_size, **generate_kwargs)
                for _ in range(self.repeats)
            ]
        )

    def ar_row_at(self, batch_size: int) -> dict:
        """The teacher's row at `batch_size` (decoded once per batch size)."""
        if batch_size not in self._ar_rows:
            run = self.timed(self.base, self.tokenizer, batch_size=batch_size)
            self._ar_rows[batch_size] = self.row("AR: base generate()", "ar", run, batch_size, run)
        return self._ar_rows[batch_size]

    @property
    def machine(self) -> str:
        """Where the figures come from: the CPU and its torch threads, or the GPU's name."""
        device = self.base.device
        if device.type == "cuda":
            return torch.cuda.get_device_name(device)
        return f"{platform.machine()} CPU, {torch.get_num_threads()} threads"

    @staticmethod
    def texts(run: DecodeRun, tokenizer: PreTrainedTokenizerBase) -> list[str]:
        return [tokenizer.decode(answer, skip_special_tokens=True) for answer in run.answers]

    def row(self, name: str, kind: str, run: DecodeRun, batch_size: int = 1, ar: DecodeRun | None = None) -> dict:
        """Speed (against `ar`, by default the teacher decoded at the same batch size) and quality (against the
        teacher's answers) of `run`."""
        if any(token >= self.base_vocab for answer in run.answers for token in answer):
            raise RuntimeError(f"{name}: an answer holds a token outside the base vocabulary (a [MASK]?).")
        texts = self.texts(run, self.tokenizer)
        ar_tokens_per_second = ar.tokens_per_second if ar else self.ar_row_at(batch_size)["tokens_per_second"]
        verifiable = [i for i, prompt in enumerate(self.prompts) if prompt.reference is not None]
        references = self.teacher_texts
        row = {"name": name, "kind": kind, "batch_size": batch_size}
        row |= speed(run, ar_tokens_per_second)
        row |= {
            "generative_perplexity": perplexity(answer_nll(self.base, self.prompt_ids, run.answers)),
            "exact_match": sum(exact_match(t, r) for t, r in zip(texts, references)) / len(texts),
            "token_f1": sum(token_f1(t, r) for t, r in zip(texts, references)) / len(texts),
            "accuracy_where_ar_correct": (
                sum(contains_reference(texts[i], self.prompts[i].reference) for i in self.correct) / len(self.correct)
                if self.correct
                else None
            ),
            "accuracy_verifiable": sum(contains_reference(texts[i], self.prompts[i].reference) for i in verifiable)
            / max(len(verifiable), 1),
            "repetition": repetition(texts),
        }
        return row

    def refusion_rows(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        name: str,
        converted_ar: bool = True,
        **decoding,
    ) -> dict[str, dict]:
        """A ReFusion model scored with its own decoder (generation-config defaults, `decoding` overriding them)
        and, with `converted_ar`, decoded token by token by transformers' `generate()` (the adapter's cost apart
        from the decoding order)."""
        rows = {"refusion": self.row(name, "slots", self.timed(model, tokenizer, **decoding))}
        if converted_ar:
            run = self.converted_ar_run(model, tokenizer)
            rows["converted_ar"] = self.row(f"{name}: converted model, token by token", "ar", run)
        return rows

    def converted_ar_run(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> DecodeRun:
        """A ReFusion model decoded token by token by transformers' `generate()`, never proposing the mask token
        (as ReFusion's own decoder never does)."""
        return self.timed(model, tokenizer, autoregressive=True, suppress_tokens=[model.config.mask_token_id])

    def adapter_points(self, name: str, adapter: str | Path | None) -> dict[str, dict]:
        """`adapter_rows` with the teacher's own row (`ar`): one point of the budget curve. (Without an adapter
        the converted model's AR decoding is the teacher's, conversion keeping the function: not decoded again.)"""
        return {"ar": self.ar_row, **self.adapter_rows(name, adapter, converted_ar=adapter is not None)}

    def adapter_rows(
        self, name: str, adapter: str | Path | None, converted_ar: bool = True, **decoding
    ) -> dict[str, dict]:
        """`refusion_rows` of the base with `adapter` merged in (None: converted, untrained), decoding at the
        shipped defaults unless `decoding` says otherwise."""
        if adapter is None:
            base, tokenizer = copy.deepcopy(self.base), copy.deepcopy(self.tokenizer)
            model, tokenizer = convert_to_refusion(base, tokenizer, **shipped_decoding())
        else:
            model, tokenizer = with_adapter(self.base, self.tokenizer, adapter)
        model = model.to(self.base.device, self.base.dtype)
        return self.refusion_rows(model, tokenizer, name, converted_ar, **decoding)
