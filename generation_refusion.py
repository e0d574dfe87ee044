"""ReFusion decoding: iterative plan-and-infill over slots with exact KV-cache reuse.

The answer is cut into slots of `slot_size` consecutive tokens, grouped into serial blocks of `block_length`
tokens. Inside a block every step runs:

1. **plan**   one forward over the block's masked slots (after everything committed) drafts every masked token;
              a slot's confidence is the probability of its first draft token. Slots above `slot_threshold`
              are chosen, or the single most confident one.
2. **verify** one forward over the chosen drafts gives every drafted token its autoregressive probability: as
              one causal run in position order by the authors' rule; by the fast rule each slot apart, against the
              sequence as the plan found it (so how many drafts a forward takes never changes a greedy answer at a
              `token_threshold` of 0.5 or more). The leading chosen slots whose tokens all pass `token_threshold` (a
              slot's first token always passes) are committed with the K/V of this very forward.
3. **infill** the other chosen slots are completed, each attending only to the committed sequence and to itself.
              How depends on `infill_mode`:
              - `"fast"` (default): every verify or infill forward keeps the passing drafts *and* the model's own
                token at the first rejected draft, and redrafts the rest from that same forward (from its
                autoregressive predictions, or with `fused_redraft=True` from `[MASK]` queries added to it), so no
                forward is spent re-checking drafts in a context that already rejected them. One forward a round.
              - `"reference"`: the rule of the authors' released decoder. Only when no leading slot was accepted
                are the chosen slots infilled (otherwise they return to `[MASK]`); a round is two forwards: the
                unaccepted positions are redrafted as `[MASK]` queries, then checked causally, and the first
                unaccepted position is accepted with its masked-diffusion draft without a check.
4. **commit** finished slots join the sequence and the KV cache in commit order with their own position ids.

This file is the entry point (`generate`, `refusion_generate`); the work is in its siblings, each owning one thing:

- `settings_refusion`: the decoding settings, their checks and the logits processors;
- `decisions_refusion`: pure tensor functions that decide (choose slots, accept drafts, size forwards, masks);
- `decoder_refusion`: one row's state machine (`SlotDecoder`: `request()`, `score(logits)`, `advance(values)`);
- `acceptance_refusion`: what a row's draft checks showed (`AcceptanceProfile`), read by the price schedule;
- `executor_refusion`: the KV cache (`SlotCache`) and `execute`, which runs all rows' requests as one forward;
- `compiling_refusion`: compiled forwards and step functions (`compile_config=`, `compile_forwards`);
- `prices_refusion`: the price schedule (`draft_schedule="price"`);
- `packages_refusion`: forwards compiled ahead of time and kept on disk (`compile_cache_dir=`), imported only then.

They use torch and transformers only. Saved ReFusion folders carry them in `custom_generate/` (this file as
`generate.py`), so that its `generate(model, ...)` decodes any supported causal LM that has a mask token:
`model.generate(input_ids, custom_generate="<folder or Hub repo>", trust_remote_code=True)`.

What a decode keeps on the model between calls, all of it caches that only save time (a decode without them gives
the same tokens): the compiled backbone of the last `compile_config` (`model._refusion_compiled`), the static cache
(`model._refusion_slot_cache`; `del` frees it), the forward price tables and which were measured in this process
(`model._refusion_prices`, `model._refusion_prices_measured`), the prompt forward's measured cost per width bucket
(`model._refusion_prompt_prices`), and on a CPU the linear layers' prepacked weights (`kernels_refusion`). Nothing
else is written to the model (a draft adapter's gate, `adapter_refusion`, is its latest forward's and is set anew by
each).
"""

import contextlib
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    DynamicCache,
    GenerationConfig,
    StoppingCriteriaList,
)
from transformers.generation import logits_process as lp
from transformers.utils import ModelOutput

try:
    from .acceptance_refusion import AcceptanceProfile
    from .compiling_refusion import DECODING_FILES, compiled_backbone, step_functions
    from .decoder_refusion import SlotDecoder
    from .executor_refusion import SlotCache, cache_length, execute, slot_cache, static_cache_columns, width_buckets
    from .prices_refusion import ForwardPrices, forget_stale_prices, measured_prices
    from .settings_refusion import (
        build_logits_processors,
        check_model,
        checked_input_ids,
        documents_settings,
        inferred_attention_mask,
        resolve_settings,
        stopping_criteria_for,
    )
except ImportError:  # installed as top-level modules rather than loaded as Hub remote code
    from acceptance_refusion import AcceptanceProfile
    from compiling_refusion import DECODING_FILES, compiled_backbone, step_functions
    from decoder_refusion import SlotDecoder
    from executor_refusion import SlotCache, cache_length, execute, slot_cache, static_cache_columns, width_buckets
    from prices_refusion import ForwardPrices, forget_stale_prices, measured_prices
    from settings_refusion import (
        build_logits_processors,
        check_model,
        checked_input_ids,
        documents_settings,
        inferred_attention_mask,
        resolve_settings,
        stopping_criteria_for,
    )


class InOrderWatcher:
    """Streams, and applies stopping criteria to, the in-order prefix of one answer as it grows. ReFusion commits
    slots out of reading order; only the contiguous prefix is final text. (Both read the answer to the host.)"""

    def __init__(self, prompt: torch.Tensor, streamer=None, criteria=None):
        self.prompt, self.streamer, self.criteria, self.emitted = prompt, streamer, criteria, 0
        if streamer is not None:
            streamer.put(prompt[None].cpu())

    def advance(self, answer: torch.Tensor, frontier: int) -> int | None:
        """Take the answer final up to `frontier`; return where a criterion ends it, if one fires."""
        if frontier <= self.emitted:
            return None
        stop = None
        if self.criteria:
            for length in range(self.emitted + 1, frontier + 1):
                if self.criteria(torch.cat([self.prompt, answer[:length]])[None], None).any():
                    stop = frontier = length
                    break
        if self.streamer is not None:
            self.streamer.put(answer[self.emitted : frontier].cpu())
        self.emitted = frontier
        return stop

    def end(self) -> None:
        if self.streamer is not None:
            self.streamer.end()


@dataclass
class RefusionGenerateOutput(ModelOutput):
    """`sequences` (prompt + answer), the model calls, answer tokens committed per call, and the authors' figure:
    the mean over plan steps of (slot_size x slots committed) / forwards of the step.

    The acceptance profile, summed over rows (row 0: drafts from the plan, checked by the verify forward; row 1:
    drafts checked in an infill round, after a slot's first correction): `draft_offered[s, k]` counts the drafts at
    slot offset k checked with every draft before them in the same check accepted, `draft_accepted[s, k]` those
    that passed, `draft_runs[s]` the slot checks (one accepted run each), `verify_forwards` the forwards that
    checked drafts. `forward_prices`: the table that priced the forwards under `draft_schedule="price"` (the caller's,
    or the one measured on this machine), which a later decode can pass as `forward_prices` to take the same
    decisions."""

    sequences: torch.LongTensor | None = None
    num_forward_passes: int | None = None
    tokens_per_forward: float | None = None
    step_tokens_per_forward: float | None = None
    draft_offered: torch.LongTensor | None = None
    draft_accepted: torch.LongTensor | None = None
    draft_runs: torch.LongTensor | None = None
    verify_forwards: int | None = None
    forward_prices: dict[int, float] | None = None


def refusion_generate(
    model,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None = None,
    generation_config: GenerationConfig | None = None,
    return_dict_in_generate: bool | None = None,
    streamer=None,
    stopping_criteria: StoppingCriteriaList | None = None,
    logits_processor: lp.LogitsProcessorList | None = None,
    tokenizer=None,
    **kwargs,
) -> torch.LongTensor | RefusionGenerateOutput:
    """ReFusion decoding of a left-padded batch: one batched forward per step for all rows (with the cache), or
    each row recomputed from scratch at every forward (`use_cache=False`, the reference). `streamer` receives, and
    `stopping_criteria`, `stop_strings` and `max_time` act on, the in-order prefix of each answer; the generation
    config's logits processors (and `logits_processor`) shape every draft and every check."""
    input_ids = checked_input_ids(input_ids, model.get_input_embeddings().num_embeddings)
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise ValueError(f"attention_mask must be a tensor (batch, length), got {type(attention_mask).__name__}.")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids {tuple(input_ids.shape)}.")
    for name in ("prefix_allowed_tokens_fn", "assistant_model", "negative_prompt_ids", "synced_gpus"):
        if kwargs.get(name):
            raise ValueError(f"ReFusion slot decoding cannot apply the generate() argument {name}.")
        kwargs.pop(name, None)
    kwargs.pop("negative_prompt_attention_mask", None)
    settings, config = resolve_settings(model, generation_config, input_ids.shape[1], kwargs)
    inferred = attention_mask is None
    if inferred:
        attention_mask = inferred_attention_mask(input_ids, config.pad_token_id, settings.eos_token_ids)
    if return_dict_in_generate is None:
        return_dict_in_generate = bool(config.return_dict_in_generate)
    num_return_sequences = config.num_return_sequences or 1
    if num_return_sequences > 1 and not settings.do_sample:
        raise ValueError("num_return_sequences > 1 needs do_sample=True: greedy decoding gives one answer.")
    if streamer is not None and input_ids.shape[0] * num_return_sequences > 1:
        raise ValueError("A streamer follows a single answer: use batch size 1 and num_return_sequences=1.")
    criteria = stopping_criteria_for(config, stopping_criteria, tokenizer)
    input_ids = input_ids.repeat_interleave(num_return_sequences, dim=0)
    attention_mask = attention_mask.repeat_interleave(num_return_sequences, dim=0)
    prompts = []
    for row, mask in zip(input_ids, attention_mask.bool()):
        prompt = row[mask]
        if prompt.shape[0] == 0:
            raise ValueError("Every prompt in the batch needs at least one token (attention_mask has an empty row).")
        if not mask[mask.long().argmax() :].all():
            where = f" (inferred from the pad token {config.pad_token_id}: pass attention_mask)" if inferred else ""
            raise ValueError(f"Prompts must be left-padded: attention_mask has a gap inside a row{where}.")
        if (prompt == settings.mask_token_id).any():
            raise ValueError(
                f"A prompt contains the mask token (id {settings.mask_token_id}); it marks undecoded tokens only."
            )
        prompts.append(prompt)

    with torch.no_grad():
        batch_size = len(prompts) if settings.use_cache else 1  # without a cache each row decodes alone
        prompt_width = max(prompt.shape[0] for prompt in prompts)  # the first forward's
        columns = static_cache_columns(prompt_width, settings.max_new_tokens, settings.slot_size, settings.block_length)
        cache, compiled, buckets = None, None, None
        if settings.use_cache and settings.cache_implementation == "static":
            columns = max(columns, settings.max_cache_len or 0)
            # compiled forwards are specialised to the cache's tensors: that cache stays with the model for later calls
            cache = slot_cache(model, batch_size, columns, keep=settings.compile_config is not None)
            if settings.compile_config:
                compiled = compiled_backbone(
                    model, settings.compile_config, settings.compile_cache_dir, settings.compile_cache_max_gb
                )
                buckets = width_buckets(settings.draft_schedule)
        elif settings.use_cache:
            cache = DynamicCache()
        with cache.claimed() if isinstance(cache, SlotCache) else contextlib.nullcontext():
            prices = None
            if settings.draft_schedule == "price" and settings.forward_prices is not None:
                prices = ForwardPrices(settings.forward_prices, buckets)
            elif settings.draft_schedule == "price":  # measured over the decode's own cache, or one like it
                priced = cache if isinstance(cache, SlotCache) else SlotCache(model, batch_size, cache_length(columns))
                prices = measured_prices(model, settings.compile_config, priced, compiled, buckets, prompt_width)
            steps = step_functions(compiled)
            decoders = []
            for prompt in prompts:
                processors = build_logits_processors(config, settings, prompt.shape[0], prompt.device, logits_processor)
                watcher = InOrderWatcher(prompt, streamer, criteria) if streamer is not None or criteria else None
                decoders.append(SlotDecoder(prompt, settings, processors, watcher, prices, steps))
            if settings.use_cache:
                forwards = execute(model, decoders, cache, compiled, buckets)
            else:
                forwards = sum(execute(model, [decoder], None) for decoder in decoders)
            forget_stale_prices(model, prices)
    if streamer is not None:
        decoders[0].watcher.end()
    ends = [decoder.answer_length() for decoder in decoders]
    answers = torch.stack([decoder.result() for decoder in decoders])
    sequences = torch.cat([input_ids, answers[:, : max(ends)]], dim=1)
    if not return_dict_in_generate:
        return sequences
    ratios = [ratio for decoder in decoders for ratio in decoder.step_ratios]
    return RefusionGenerateOutput(
        sequences=sequences,
        num_forward_passes=forwards,
        tokens_per_forward=sum(ends) / max(forwards, 1),
        step_tokens_per_forward=sum(ratios) / max(len(ratios), 1),
        **AcceptanceProfile.output_fields([decoder.profile for decoder in decoders]),
        forward_prices=None if prices is None else dict(prices.table),
    )


@torch.no_grad()
@documents_settings
def generate(*args, **kwargs) -> torch.LongTensor | RefusionGenerateOutput:
    """ReFusion decoding of any supported causal LM that has a mask token (`mask_token_id` in its config or
    generation config): `RefusionForCausalLM.generate`, and transformers' `custom_generate` entry point.

    Called as `generate(model, inputs, generation_config, **options)`, or with `model=` as a keyword, which is how
    transformers calls it (for `custom_generate=`, and when a loaded folder's `custom_generate/` becomes the model's
    `generate`, with the caller's positional arguments after it). The decoding parameters (defaults from the
    generation config, then from this table; see `check_decoding` for how passed and configured ones combine):

    {settings}
    """
    if "model" in kwargs:
        model = kwargs.pop("model")
    elif args:
        model, args = args[0], args[1:]
    else:
        raise TypeError("generate() needs the model.")
    if len(args) > 2:
        raise TypeError("generate() takes inputs and generation_config by position; pass the other options by name.")
    inputs, generation_config = (*args, None, None)[:2]
    inputs = kwargs.pop("input_ids", kwargs.pop("inputs", inputs))
    generation_config = kwargs.pop("generation_config", generation_config)
    check_model(model)
    return refusion_generate(model, inputs, kwargs.pop("attention_mask", None), generation_config, **kwargs)


def write_custom_generate(folder) -> Path:
    """Write this file as `folder/custom_generate/generate.py`, with the modules it imports beside it (transformers
    copies a custom `generate`'s relative imports from its folder): transformers then runs its `generate` in place of
    the model's own, for `custom_generate="<folder or repo>"` and for a model loaded from the folder with
    `trust_remote_code=True`."""
    target = Path(folder) / "custom_generate" / "generate.py"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(__file__, target)
    for name in DECODING_FILES:
        shutil.copyfile(Path(__file__).parent / name, target.parent / name)
    return target
