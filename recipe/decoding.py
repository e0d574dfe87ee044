"""Timed decoding of chat prompts, autoregressive or ReFusion, as the demo and the benchmark measure it.

Every run decodes the prompts in left-padded batches of `batch_size` and reports the answers (token ids, cut at
the first stop token), the wall time spent in `generate()`, and the model forwards it took, so that tokens/s and
tokens per forward of the two decoders are computed the same way; a ReFusion run also reports how its drafts fared
(`Acceptance`).

`decode_compiled_ar` decodes token by token with transformers' compiled static-cache `generate()`, the fastest AR a
transformers user gets on many machines: it compiles once (reported as `compile_seconds`) before the timed decode, and
counts the graphs compiled during it (`recompiles`: 0 when one static cache length serves every prompt).
`decode_static_ar` decodes token by token over ReFusion's own static cache and compiled (optionally frozen) forward:
the AR whose step costs what ReFusion's one-query forward costs.

`paired_runs` times several decoders prompt by prompt, back to back, and `paired_speedup` compares them: on a shared
machine that is the comparison that holds still.
"""

import importlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from types import ModuleType

import torch
from transformers import CompileConfig, GenerationConfig, GenerationMixin, PreTrainedModel, PreTrainedTokenizerBase

import compiling_refusion
import executor_refusion
import generation_refusion
from settings_refusion import DECODING_DEFAULTS

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
    forward_seconds: float | None = 0.0  # of `seconds`, the time spent inside model forwards (None: not timed)
    step_tokens_per_forward: list[float] | None = None  # ReFusion: the authors' per-step figure, per batch
    acceptance: Acceptance | None = None  # ReFusion: its draft checks, summed over batches
    compile_seconds: float | None = None  # compiled AR: the warm-up before `seconds` (compiling, if not done before)
    recompiles: int | None = None  # compiled AR: graphs compiled during the timed decode (after the warm-up)

    @property
    def orchestration(self) -> float | None:
        """Share of the decode time spent outside model forwards (None where forwards were not timed)."""
        return None if self.forward_seconds is None else 1.0 - self.forward_seconds / self.seconds

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
    time_forwards: bool = True,
    **generate_kwargs,
) -> DecodeRun:
    """Greedy `model.generate()` over `prompts` (token ids) in batches; ReFusion models take their decoding
    settings (`slot_size`, thresholds, `block_length`, `infill_mode`) in `generate_kwargs`. `autoregressive`:
    decode with transformers' own token-by-token `generate()` even when the model is a ReFusion model.

    Forwards are what the decoder reports: ReFusion's `num_forward_passes`; for token-by-token decoding, one per
    generated position (transformers' `generate()` runs one forward per new token). Hooks on the model only time
    the forwards, to split the wall time into model and orchestration; `time_forwards=False` goes without them
    (`forward_seconds` None), as a compiled forward must: torch.compile would trace the hooks into it."""
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

    if not autoregressive and prompts:
        generate_kwargs = with_fixed_prices(model, tokenizer, prompts[:batch_size], max_new_tokens, generate_kwargs)
    hooks = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave)] if time_forwards else []
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
    timed = forward_seconds if time_forwards else None
    return DecodeRun(answers, seconds, forwards, timed, step_ratios or None, acceptance)


def with_fixed_prices(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts, max_new_tokens: int, settings: dict
) -> dict:
    """`settings`, with a price table fixed for the run where they price drafts below `token_threshold` 0.5 with no
    table of their own (where `generate()` refuses a measured one: the drafts then decide what passes, and a timing
    taken mid-run would change the answers): the table a priced decode of `prompts` at 0.5 measures, before the
    timing, as `generate()` would have measured it. Settings not in `settings` are read from its `generation_config`
    (else the model's), as `generate()` reads them."""
    config = settings.get("generation_config") or model.generation_config
    threshold = settings.get("token_threshold", getattr(config, "token_threshold", None))
    schedule = settings.get("draft_schedule", getattr(config, "draft_schedule", None))
    if schedule != "price" or threshold is None or threshold >= 0.5 or "forward_prices" in settings:
        return settings
    if getattr(config, "forward_prices", None) is not None:
        return settings
    fixed = model.__dict__.setdefault("_recipe_fixed_prices", {})  # one measuring decode per shape and setting
    key = (len(prompts), max(map(len, prompts)), max_new_tokens, repr(sorted(settings.items())))
    if key not in fixed:
        input_ids, attention_mask = left_padded(prompts, tokenizer.pad_token_id)
        measuring = dict(settings, token_threshold=0.5, return_dict_in_generate=True, do_sample=False)
        output = model.generate(input_ids.to(model.device), attention_mask=attention_mask.to(model.device),
                                max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                **measuring)  # fmt: skip
        fixed[key] = output.forward_prices
    return dict(settings, forward_prices=fixed[key])


CACHE_BUCKET = 128  # compiled AR: static cache lengths are multiples of this, so prompt sets share a compiled graph


def compile_mode(device: str | torch.device) -> str:
    """The torch.compile mode of compiled AR decoding on `device`: CUDA graphs on CUDA ("reduce-overhead",
    transformers' default), elsewhere inductor with its GEMM templates tried and timed, without CUDA graphs."""
    return "reduce-overhead" if torch.device(device).type == "cuda" else "max-autotune-no-cudagraphs"


def compiled_refusion(
    device: str | torch.device, mode: str | None = None, freeze: bool = False, compile_cache_dir: str | None = None
) -> dict:
    """The `generate()` options that decode ReFusion with compiled forwards over its static cache on `device`, in
    `mode` (default: `compile_mode`): transformers' `cache_implementation="static"` and a `compile_config` (given, it
    compiles on every device; `settings_refusion.compile_config_for`). With
    `freeze`, inductor freezes the weights into the graphs (`options={"freezing": True}`, which ReFusion's decoder
    applies itself): faster forwards on a CPU, but a long compile (minutes; on the AMX CPU inductor's disk cache did
    not keep such graphs, on the AVX2 CPU it did). With `compile_cache_dir` the forwards are compiled ahead of time
    and kept in that folder (AOTInductor packages), which a later process loads in seconds."""
    options = {"freezing": True} if freeze else None
    config = CompileConfig(fullgraph=True, dynamic=False, mode=mode or compile_mode(device), options=options)
    saved = {"compile_cache_dir": compile_cache_dir} if compile_cache_dir is not None else {}
    return {"cache_implementation": "static", "compile_config": config, **saved}


def decoder_module(model: PreTrainedModel, name: str | None = None) -> ModuleType:
    """The module of the ReFusion decoder `model.generate()` runs: a loaded folder's `custom_generate/generate.py`
    (transformers binds its `generate` to the instance), the `generation_refusion` a remote-code model class imports,
    or this package's; with a `name` ("compiling_refusion", ...), that sibling module of it. Its static cache and
    compiled forwards are the ones `generate()` reuses."""
    generate = model.generate
    function = (
        generate.func
        if isinstance(generate, partial)
        else getattr(sys.modules[type(model).__module__], "slot_generate", None)
    )
    entry = sys.modules[function.__module__] if function is not None else generation_refusion
    if name is None:
        return entry
    package = entry.__name__.rpartition(".")[0]
    return importlib.import_module(f"{package}.{name}" if package else name)


def compile_refusion(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    compile_config: CompileConfig,
    batch_size: int = 1,
    generation_config: GenerationConfig | None = None,
    draft_schedule: str | None = None,
    compile_cache_dir: str | None = None,
    lookup_drafts: int | None = None,
) -> float:
    """Compile ReFusion's forwards for decoding `prompts` in batches of `batch_size` (every width bucket of
    `draft_schedule`, over a static cache long enough for the longest prompt, with the slot and block sizes and the
    draft schedule of `generation_config`, the model's by default), and the copying of `lookup_drafts` drafts (default:
    the config's) where there is any, so that the timed decode compiles nothing; returns the seconds it took (the
    one-off compile time; with `compile_cache_dir`, loading what is kept there)."""
    compiling, executor = decoder_module(model, "compiling_refusion"), decoder_module(model, "executor_refusion")
    config = generation_config or model.generation_config
    slot_size = getattr(config, "slot_size", None) or DECODING_DEFAULTS["slot_size"]
    block_length = getattr(config, "block_length", None) or DECODING_DEFAULTS["block_length"]
    block_length = -(-block_length // slot_size) * slot_size
    columns = executor.static_cache_columns(max(map(len, prompts)), max_new_tokens, slot_size, block_length)
    synchronize(model.device)
    started = time.perf_counter()
    schedule = draft_schedule or getattr(config, "draft_schedule", None) or DECODING_DEFAULTS["draft_schedule"]
    lookup = getattr(config, "lookup_drafts", 0) if lookup_drafts is None else lookup_drafts
    copying = {"lookup_drafts": lookup} if lookup else {}  # (a folder's older decoder module does not take it)
    compiling.compile_forwards(
        model, compile_config, min(batch_size, len(prompts)), columns, schedule, compile_cache_dir, **copying
    )
    synchronize(model.device)
    return time.perf_counter() - started


def static_cache_length(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> int:
    """A static cache long enough for every prompt and its answer: the longest prompt plus `max_new_tokens`, rounded
    up to a multiple of `CACHE_BUCKET`."""
    needed = max(len(prompt) for prompt in prompts) + max_new_tokens
    return -(-needed // CACHE_BUCKET) * CACHE_BUCKET


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@torch.no_grad()
def decode_compiled_ar(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    batch_size: int = 1,
    mode: str | None = None,
    max_cache_len: int | None = None,
    **generate_kwargs,
) -> DecodeRun:
    """Greedy token-by-token `decode` with transformers' compiled static-cache `generate()`:
    `generate(cache_implementation="static", compile_config=CompileConfig(mode=...))`, compiled on every device
    (transformers compiles on CUDA only, unless `CompileConfig._compile_all_devices`), in `mode` (default:
    `compile_mode`), over a static cache of `max_cache_len` (default: `static_cache_length`).

    transformers runs the prefill eagerly and the one-token steps through the compiled forward, whose shapes are the
    batch size and the cache length: one graph serves every prompt that fits the cache, and the model keeps the
    longest cache it has used, so a later call with a shorter one reuses it. A longer cache, or a batch of another
    size (the last one, where `batch_size` does not divide the prompts), compiles another graph.

    A warm-up first decodes the first batch for 3 tokens (past any stop token): it compiles the graph unless the
    model has compiled it before, and its wall time is the run's `compile_seconds`. Then the timed decode, without
    forward hooks (torch.compile would trace them into the graph, so `forward_seconds` is None; forwards are counted
    as for every AR decode, one per generated position), and `recompiles`: graphs compiled during it (0 expected)."""
    settings = compiled_ar_settings(model, prompts, max_new_tokens, batch_size, mode, max_cache_len)
    warm_up = warm_up_compiled_ar(model, tokenizer, prompts[:batch_size], settings | generate_kwargs)
    graphs = compiled_graphs()
    run = decode(model, tokenizer, prompts, max_new_tokens, **settings, **generate_kwargs)
    run.compile_seconds, run.recompiles = warm_up.seconds, compiled_graphs() - graphs
    return run


def compiled_ar_settings(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    batch_size: int = 1,
    mode: str | None = None,
    max_cache_len: int | None = None,
) -> dict:
    """The `decode` options of `decode_compiled_ar`: token by token, static cache (`max_cache_len`, default one long
    enough for every prompt of `prompts`), compiled in `mode` on every device, no forward hooks."""
    config = CompileConfig(mode=mode or compile_mode(model.device))
    config._compile_all_devices = True  # transformers' own generate() compiles off CUDA only with this private flag
    return dict(
        batch_size=batch_size,
        autoregressive=True,
        time_forwards=False,
        cache_implementation="static",
        compile_config=config,
        max_cache_len=max_cache_len or static_cache_length(prompts, max_new_tokens),
    )


def warm_up_compiled_ar(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts, settings: dict):
    """Decode `prompts` (one batch) for 3 tokens, past any stop token, with the compiled AR `settings`: compiles the
    graph unless the model has compiled it before. Raises if transformers chose not to compile."""
    warm_up = decode(model, tokenizer, prompts, 3, **{**settings, "eos_token_id": []})
    if getattr(model, "_compiled_call", None) is None:  # transformers skipped compiling, and warned why
        raise RuntimeError(f"transformers' generate() did not compile {type(model).__name__} on {model.device}.")
    return warm_up


@torch.no_grad()
def decode_static_ar(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    compile_config: CompileConfig | None = None,
    max_cache_len: int | None = None,
    eos_token_id: int | list[int] | None = None,
    compile_cache_dir: str | None = None,
) -> DecodeRun:
    """Greedy token-by-token decoding of each prompt alone over ReFusion's static cache (`SlotCache`) and through its
    compiled backbone (`compiled_backbone(model, compile_config, compile_cache_dir)`; eager without a config): the
    AR whose step is exactly ReFusion's one-query forward. With weights frozen into the graphs
    (`compiled_refusion(freeze=True)`) it is the frozen AR that transformers' compiled `generate()` cannot give (its
    static cache write fails under freezing), so frozen ReFusion has a like-for-like reference.

    The prompt runs as ReFusion's first forward does (`executor_refusion.prompt_runs_eagerly`): eagerly at its own
    width, or through the compiled backbone padded on the right to a width bucket (the padding's keys and values go
    to the columns after the prompt, which the steps overwrite before they see them). Then each step feeds the last
    token as one query at the next cache column and RoPE position, the output layer as in ReFusion's forwards
    (`run_model`), and reads the argmax (the one wait per token, for the stop check that `generate()` makes too).
    The cache holds `max_cache_len` columns (default: the longest prompt plus `max_new_tokens`, rounded up by the
    decoder); a compiled step has one graph per cache length. Forwards are counted as for every AR decode, one per
    generated position; they are not timed apart."""
    stop_ids = stop_token_ids(model, tokenizer, eos_token_id)
    stop = torch.tensor(sorted(stop_ids), device=model.device)
    needed = max_cache_len or max(len(prompt) for prompt in prompts) + max_new_tokens
    cache = executor_refusion.slot_cache(model, 1, needed)
    columns = torch.arange(cache.max_cache_len, device=model.device)
    causal = additive_mask(columns[None, :] <= columns[:, None], model.dtype)  # row i: the query at column i
    compiled = None
    if compile_config is not None:
        compiled = compiling_refusion.compiled_backbone(model, compile_config, compile_cache_dir)

    answers, seconds, forwards = [], 0.0, 0
    for prompt in prompts:
        if len(prompt) + max_new_tokens > needed:
            raise ValueError(f"A prompt of {len(prompt)} tokens and {max_new_tokens} new ones need more than the "
                             f"{needed} cache columns asked for (max_cache_len).")  # fmt: skip
        synchronize(model.device)
        begin = time.perf_counter()
        length = len(prompt)
        ids = torch.tensor([prompt], device=model.device)
        buckets = executor_refusion.WIDTH_BUCKETS
        width = executor_refusion.pad_width(length, buckets)
        in_graph = compiled is not None and width <= min(buckets[-1], cache.max_cache_len)
        if in_graph and not executor_refusion.prompt_runs_eagerly(model, compiled, cache, length, buckets):
            cache.columns = columns[None, :width]
            padded = dict(ids=torch.nn.functional.pad(ids, (0, width - length)), positions=cache.columns)
            logits = executor_refusion.run_model(model, compiled, padded, causal[:, :, :width], cache,
                                                 width - length + 1)[:, :1]  # fmt: skip
        else:
            cache.columns = columns[None, :length]
            logits = model(input_ids=ids, position_ids=cache.columns, cache=cache, use_cache=True, logits_to_keep=1,
                           attention_mask=causal[:, :, :length]).logits  # fmt: skip
        tokens = []
        while True:
            token = logits[:, -1].argmax(dim=-1, keepdim=True)
            tokens.append(token)
            if torch.isin(token, stop).item() or len(tokens) == max_new_tokens:
                break
            cache.columns = columns[None, length : length + 1]
            mask = causal[:, :, length : length + 1]
            if compiled is None:
                logits = model(input_ids=token, position_ids=cache.columns, attention_mask=mask, cache=cache,
                               use_cache=True, logits_to_keep=1).logits  # fmt: skip
            else:
                step = dict(ids=token, positions=cache.columns)
                logits = executor_refusion.run_model(model, compiled, step, mask, cache, 1)
            length += 1
        synchronize(model.device)
        seconds += time.perf_counter() - begin
        generated = torch.cat(tokens, dim=1)[0].tolist()
        answers.append(cut_answer(generated, stop_ids))
        forwards += len(generated)
    return DecodeRun(answers, seconds, forwards, None)


def additive_mask(sees: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The `[1, 1, queries, keys]` additive attention mask in `dtype` of a boolean `[queries, keys]` visibility."""
    mask = torch.zeros(sees.shape, dtype=dtype, device=sees.device)
    return mask.masked_fill(~sees, torch.finfo(dtype).min)[None, None]


def paired_runs(
    decoders: dict[str, Callable[[list[Sequence[int]]], DecodeRun]], prompts: Sequence[Sequence[int]], rounds: int = 1
) -> dict[str, list[DecodeRun]]:
    """Every decoder's runs of each prompt alone, the decoders back to back on a prompt before the next prompt, and
    which goes first rotating from prompt to prompt; `rounds` times over the prompts. Each decoder's list holds one
    run per (round, prompt), in the same order for all.

    On a shared machine the speed moves by tens of percent within minutes. Decoders timed on the same prompt seconds
    apart see the same machine, so the ratio of their times on one prompt is far steadier than the ratio of two
    passes over the whole set (`paired_speedup`)."""
    names, runs = list(decoders), {name: [] for name in decoders}
    for round_index in range(rounds):
        for index, prompt in enumerate(prompts):
            shift = (round_index * len(prompts) + index) % len(names)
            for name in names[shift:] + names[:shift]:
                runs[name].append(decoders[name]([prompt]))
    return runs


@dataclass
class PairedSpeedup:
    """Speed of one decoder against a reference over the same paired runs."""

    ratio: float  # tokens/s over all runs, against the reference's
    median: float  # of the per-prompt ratios of tokens/s
    low: float  # their first quartile
    high: float  # their third quartile
    tokens_per_forward: float  # of the decoder, over all runs


def paired_speedup(runs: Sequence[DecodeRun], reference: Sequence[DecodeRun]) -> PairedSpeedup:
    """`runs` against the `reference` runs of the same prompts (`paired_runs`). The per-prompt ratios leave out the
    prompts that either side answered with no token (an immediate stop token has no speed)."""
    pairs = list(zip(runs, reference, strict=True))
    if not any(base.tokens for base in reference):
        raise ValueError("The reference runs decoded no tokens, so there is no speed to compare against.")
    ratios = sorted(run.tokens_per_second / base.tokens_per_second for run, base in pairs if run.tokens and base.tokens)
    low, median, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios or [0.0]) * 3
    speedup = overall_speed(runs) / overall_speed(reference)
    return PairedSpeedup(speedup, median, low, high, overall_tokens_per_forward(runs))


def overall_speed(runs: Sequence[DecodeRun]) -> float:
    """Tokens/s of `runs` together."""
    return sum(run.tokens for run in runs) / sum(run.seconds for run in runs)


def overall_tokens_per_forward(runs: Sequence[DecodeRun]) -> float:
    """Tokens per forward of `runs` together."""
    return sum(run.tokens for run in runs) / sum(run.forwards for run in runs)
