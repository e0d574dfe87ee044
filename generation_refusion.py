"""ReFusion decoding: iterative plan-and-infill over slots with exact KV-cache reuse.

The answer is cut into slots of `slot_size` consecutive tokens, grouped into serial blocks of `block_length`
tokens. Inside a block every step runs:

1. **plan**   one forward over the block's masked slots (after everything committed) drafts every masked token;
              a slot's confidence is the probability of its first draft token. Slots above `slot_threshold`
              are chosen, or the single most confident one.
2. **verify** one causal forward over the chosen drafts in position order gives every drafted token its
              autoregressive probability. The leading chosen slots whose tokens all pass `token_threshold` (a
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

The code is layered: pure decision functions on tensors (`choose_slots`, `accept_and_correct`, ...), a passive
record of what one row has stored (`StoredSequence`), a per-row state machine (`SlotDecoder`: `request()` gives the
next forward's tokens for the phase it is in, `score(logits)` reads that forward on the device into a few integers,
`advance(values)` decides from them and moves to the next phase) and a batched executor (`execute`) that runs the
requests of all rows as one forward, reads every row's integers to the host at once (a step waits for the device
once) and keeps one cache: a `DynamicCache`, or with `cache_implementation="static"` a `SlotCache` allocated once,
whose forwards can run compiled (padded to a few widths, `WIDTH_BUCKETS`). Each stored token remembers what it
attends to (a prefix of its row's sequence, its own group, and for `[MASK]` queries the group they draft for), so
`use_cache=False` recomputes every forward from scratch with the same attention and must give the same tokens. With
`draft_schedule="price"` the number of drafts in each verify and infill forward is chosen from what forwards of each
width cost (`ForwardPrices`) and the acceptance seen so far (`best_window`).

This file is self-contained (torch and transformers only). Saved ReFusion folders carry a byte-identical copy as
`custom_generate/generate.py`, so that its `generate(model, ...)` decodes any supported causal LM that has a mask
token: `model.generate(input_ids, custom_generate="<folder or Hub repo>", trust_remote_code=True)`.
"""

import array
import contextlib
import copy
import dataclasses
import functools
import hashlib
import inspect
import json
import math
import os
import platform
import re
import shutil
import tempfile
import textwrap
import threading
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field, make_dataclass
from pathlib import Path

import torch
from transformers import (
    CompileConfig,
    DynamicCache,
    GenerationConfig,
    MaxTimeCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)
from transformers import __version__ as transformers_version
from transformers.cache_utils import Cache, StaticLayer
from transformers.generation import logits_process as lp
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import ModelOutput, logging

logger = logging.get_logger(__name__)

# Backbones whose attention follows storage order, whose RoPE follows caller-given position ids and whose mask
# builder passes a prepared 4D mask through untouched; attention implementations that keep storage order with
# out-of-order position ids (flash-attention reads a position jump as a new packed sequence). "refusion_grouped" is
# SDPA over the shared key/value heads, uncopied (`kernels_refusion.use_grouped_attention` registers it).
SUPPORTED_BACKBONES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ATTENTION = ("sdpa", "eager", "refusion_grouped")
NEVER = 2**62  # storage rank of cache holes and padding: no token's prefix reaches it
NO_GROUP = -3  # the parent group of tokens that draft for no slot

# Generation options that slot decoding cannot apply, with the values that leave them off.
REFUSED_OPTIONS = {
    "num_beams": (None, 1),
    "num_beam_groups": (None, 1),
    "diversity_penalty": (None, 0.0),
    "length_penalty": (None, 1.0),
    "early_stopping": (None, False),
    "penalty_alpha": (None, 0.0),
    "constraints": (None,),
    "force_words_ids": (None,),
    "guidance_scale": (None, 1.0),
    "watermarking_config": (None,),
    "dola_layers": (None,),
    "encoder_repetition_penalty": (None, 1.0),
    "encoder_no_repeat_ngram_size": (None, 0),
    "prompt_lookup_num_tokens": (None,),
    "output_scores": (None, False),
    "output_logits": (None, False),
    "output_attentions": (None, False),
    "output_hidden_states": (None, False),
    "token_healing": (None, False),
    "use_mtp": (None, False),
    "low_memory": (None, False),
    "prefill_chunk_size": (None,),
}
REFUSED_HINTS = {
    "prompt_lookup_num_tokens": "its own drafts copied from the text are `lookup_drafts`",
    "prefill_chunk_size": "the prompt is one forward",
}
CACHE_IMPLEMENTATIONS = ("dynamic", "static")  # `generate(cache_implementation=...)`: None means "dynamic"
# Compiled forwards run at these widths: a forward's new tokens are padded up to the nearest, so that a decode compiles
# a bounded number of graphs. Wider forwards (a long plan) run eagerly over the same static cache, and so does the
# prompt's where the model's linear layers are prepacked for it and that measured cheaper (`prompt_runs_eagerly`).
# Priced drafts (`draft_schedule="price"`) also get the narrow buckets: where width is dear they choose forwards of one
# or two queries, which padded to 8 would cost what 8 cost.
WIDTH_BUCKETS = (8, 16, 32, 64)
NARROW_BUCKETS = (1, 2, 4)
RECOMPILE_LIMIT = 64  # graphs a compiled backbone may hold: width buckets x cache lengths x batch sizes
# With the weights frozen into the graphs, a compiled forward of up to this many new tokens ends with the output layer
# (over all of them), whose weight inductor then packs for its own GEMM kernels: at these widths cheaper than the eager
# output layer, prepacked or not, and most of all in bfloat16 on a CPU without oneDNN's bfloat16 kernels (AVX2), which
# has no packed eager kernel for it. Wider forwards (a prompt) keep it eager over the tokens whose logits are used
# (`run_model`).
LOGITS_IN_GRAPH_WIDTH = 8
CACHE_LENGTH_MULTIPLE = 128  # static caches are sized in these steps, so that prompts of other lengths share graphs
# A forward of up to `WINDOW_WIDTH` new tokens over a static cache attends over its first columns only, the fewest of
# `key_windows` that hold every row's stored and new tokens: a static cache is sized for the longest answer and the
# widest forward, and attention over its unwritten columns costs as if they were written. Each window is a graph of
# its own; wider forwards, rare after the prompt's, attend over the whole cache, which bounds the graphs compiled.
WINDOW_WIDTH = 8
# On some CPUs the saved forwards of up to `WINDOW_WIDTH` new tokens keep their weights outside their code, so that
# they run from one copy of them (`SavedForwards`, `SharedWeights`): inductor's configs for that.
WEIGHTS_APART = {
    "aot_inductor.package_constants_in_so": False,
    "aot_inductor.package_constants_on_disk_format": "binary_blob",
}
SHAPES_REMEMBERED = 1024  # a `SavedStep`'s runners by exact input shapes (the text's length varies by prompt)
# Where a saved forward is compiled two ways and the faster kept (`SavedForwards`), each runs this many times in turn
# on the forward's own inputs, the first of each untimed.
PACKAGE_RACE_ROUNDS = 6
# A package's partial file (`load_or_build_package`) this many seconds old was left by a build that was killed: a live
# build renames its partial within minutes (the longest wait: a rival compiled beside it, `SavedForwards.keep_faster`).
PARTIAL_STALE = 3600.0
# Inductor's CPU kernels split a loop among the threads once each thread would get `cpp.min_chunk_size` elements
# (512 by default). A decoding forward's element-wise kernels (norms, RoPE, activations, the queries stacked for
# attention) over 2-8 new tokens hold a few thousand elements, for which starting and joining the threads costs more
# than the work: compiled forwards and steps on a CPU keep loops of fewer than `CPU_MIN_CHUNK` elements a thread on
# one thread (a compile config's own `cpp.min_chunk_size` option wins). Only how the loops are shared among the threads
# changes, not what they compute.
CPU_MIN_CHUNK = 8192
# `draft_schedule="price"`: the forward widths whose price is measured (others are interpolated), and the variable
# naming the file measured prices are kept in between processes (default ~/.cache/refusion/forward_prices.json;
# empty: keep none). Measuring stops at the first width that costs `PRICE_LINEAR` times its width in one-query
# forwards (no economy of width left: wider forwards are prorated), and a width takes a warm-up and a single timed
# forward once the timed forwards have spent `PRICE_SECONDS`: a batch of 32 on a CPU would otherwise spend as long
# pricing its forwards as decoding.
PRICE_WIDTHS = (1, 2, 4, 8, 16, 32, 64)
PRICE_LINEAR = 0.9
PRICE_SECONDS = 4.0
# A kept table is measured again when a decode over the cache it was measured on ran a forward of one of its widths in
# less than this share of its price (a forward with its scoring costs no less than the forward alone, so the table was
# measured while the machine was busy, or in a state decodes are not in).
PRICE_STALE = 0.75
PRICE_CACHE_VARIABLE = "REFUSION_PRICE_CACHE"
# A measured width priced within this share above the narrowest width's price is priced as the narrowest: width that
# costs about nothing is taken as free. The schedule's expected tokens rest on the acceptance seen so far, low early in
# a prompt (`draft_prior`) and pooled over drafts of every kind, so a near-tie between widths goes to the narrower one
# where the wider would have paid: widths priced alike leave the choice to the acceptance, which takes the wider
# drafts, more tokens a forward for forwards that cost about the same. A caller's table is taken as given.
PRICE_FREE = 0.08
# Logits processors that look only at the scores, not at the tokens before them: applied once to all queries.
CONTEXT_FREE = (
    lp.TemperatureLogitsWarper,
    lp.TopKLogitsWarper,
    lp.TopPLogitsWarper,
    lp.MinPLogitsWarper,
    lp.TypicalLogitsWarper,
    lp.EpsilonLogitsWarper,
    lp.EtaLogitsWarper,
    lp.TopHLogitsWarper,
    lp.SuppressTokensLogitsProcessor,
    lp.InfNanRemoveLogitsProcessor,
    lp.LogitNormalization,
)


@dataclass
class RefusionGenerateOutput(ModelOutput):
    """`sequences` (prompt + answer), the model calls, answer tokens committed per call, and the authors' figure:
    the mean over plan steps of (slot_size x slots committed) / forwards of the step.

    The acceptance profile, summed over rows (row 0: drafts from the plan, checked by the verify forward; row 1:
    drafts checked in an infill round, after a slot's first correction): `draft_offered[s, k]` counts the drafts at
    slot offset k checked with every draft before them in the same check accepted, `draft_accepted[s, k]` those
    that passed, `draft_runs[s]` the slot checks (one accepted run each), `verify_forwards` the forwards that
    checked drafts."""

    sequences: torch.LongTensor | None = None
    num_forward_passes: int | None = None
    tokens_per_forward: float | None = None
    step_tokens_per_forward: float | None = None
    draft_offered: torch.LongTensor | None = None
    draft_accepted: torch.LongTensor | None = None
    draft_runs: torch.LongTensor | None = None
    verify_forwards: int | None = None


# ---- decoding settings: one table --------------------------------------------------------------------------------
INFILL_MODES = ("fast", "reference")
DRAFT_SCHEDULES = ("fixed", "price")
_NO_OFF = object()  # the off value of a setting that cannot be turned off


@dataclass(frozen=True)
class DecodingSetting:
    """One decoding parameter: its default, the values it takes, the infill rules it applies to, and what it does.

    `DECODING_SETTINGS` is the only place a parameter is written down: the settings record, the validation, the
    `generate()` docstrings, `finetune.convert`'s flags, the model card and the README's table come from it."""

    name: str
    default: object
    kind: type  # int, float, str or bool
    doc: str
    low: float | None = None  # inclusive bounds of a number
    high: float | None = None
    choices: tuple = ()
    optional: bool = False  # None is a value of its own, meaning "off"
    rules: tuple[str, ...] = INFILL_MODES  # the infill modes it applies to
    neutral: object = _NO_OFF  # the choice that leaves it out, for a setting of choices that some rule ignores

    @property
    def off(self):
        """The value that leaves the option out: what an explicit None means, and what the option becomes under a
        rule it does not apply to. Settings that every rule reads have none."""
        return None if self.optional else False if self.kind is bool else self.neutral

    def values(self) -> str:
        """The values it takes, in words."""
        if self.choices:
            return " or ".join(repr(choice) for choice in self.choices)
        if self.kind is bool:
            return "True or False"
        number = "an integer" if self.kind is int else "a number"
        if self.low is not None and self.high is not None:
            number = f"{number} in [{self.low:g}, {self.high:g}]"
        elif self.low is not None:
            number = f"{number} >= {self.low:g}"
        return f"None or {number}" if self.optional else number

    def check(self, value) -> None:
        """Raise a `ValueError` naming the setting unless `value` is one of its values."""
        if value is None and self.optional:
            return
        if self.choices:
            valid = value in self.choices
        elif self.kind is bool:
            valid = isinstance(value, bool)
        else:
            kinds = (int,) if self.kind is int else (int, float)
            valid = isinstance(value, kinds) and not isinstance(value, bool)
            valid = valid and (self.low is None or value >= self.low) and (self.high is None or value <= self.high)
        if not valid:
            raise ValueError(f"{self.name} must be {self.values()}, got {value!r}.")

    def parse(self, text: str):
        """The value a command-line word stands for (`none` for None, `true`/`false` for booleans), checked."""
        word = text.strip().lower()
        if word == "none" and (self.optional or self.kind is bool):
            value = self.off
        elif self.kind is bool and word in ("true", "false", "1", "0", "yes", "no"):
            value = word in ("true", "1", "yes")
        elif self.kind in (int, float):
            try:
                value = self.kind(text)
            except ValueError:
                raise ValueError(f"{self.name} must be {self.values()}, got {text!r}.") from None
        else:
            value = text
        self.check(value)
        return value

    def applies_to(self) -> str:
        """The infill rules it applies to, in words."""
        if self.rules == INFILL_MODES:
            return "every rule"
        return " or ".join(f"`infill_mode={rule!r}`" for rule in self.rules)


DECODING_SETTINGS = (
    DecodingSetting("slot_size", 8, int, "Tokens per slot: the unit that is planned, checked and committed.", low=1),
    DecodingSetting(
        "slot_threshold", 0.8, float, "A slot is chosen when its first draft's probability is above this; if none "
        "is, the most confident slot.", low=0, high=1,
    ),
    DecodingSetting(
        "token_threshold", 0.3, float, "A draft token is accepted when its autoregressive probability is above "
        "this (0 accepts every draft).", low=0, high=1,
    ),
    DecodingSetting(
        "block_length", 32, int, "Tokens per serial block: a block is finished before the next starts. A multiple "
        "of `slot_size` (a configured one is rounded up to it).", low=1,
    ),
    DecodingSetting(
        "infill_mode", "fast", str, "`fast`: every check also corrects and redrafts, one forward a round; "
        "`reference`: the authors' released rule, token for token.", choices=INFILL_MODES,
    ),
    DecodingSetting(
        "fused_redraft", False, bool, "Redraft a slot's open positions with `[MASK]` queries inside the forward "
        "that checks its drafts.", rules=("fast",),
    ),
    DecodingSetting(
        "draft_window", None, int, "At most this many drafts of a slot go into one forward; None checks whole "
        "slots.", low=1, optional=True, rules=("fast",),
    ),
    DecodingSetting(
        "draft_schedule", "fixed", str, "`fixed`: every forward takes `draft_window` drafts of a slot; `price`: "
        "each forward takes the number (0 up to `draft_window`) that maximises expected tokens per second, from "
        "the price of a forward of each width on this machine (`forward_prices`) and the acceptance seen so far.",
        choices=DRAFT_SCHEDULES, rules=("fast",), neutral="fixed",
    ),
    DecodingSetting(
        "draft_prior", 0.5, float, "`draft_schedule=\"price\"`: the share of drafts expected to pass before a "
        "prompt's first checks (worth two checked drafts; the acceptance seen outweighs it as checks come in). A "
        "model whose drafts rarely pass should say so here, or every prompt starts with wide forwards.",
        low=0, high=1, rules=("fast",), neutral=0.5,
    ),
    DecodingSetting(
        "lookup_drafts", 0, int, "Check up to this many drafts per slot and forward copied from earlier text (the "
        "tokens that followed the last earlier occurrence, in the prompt or the answer, of the one or two tokens "
        "before the slot's next position) in place of `[MASK]` drafts, which then draft each slot's first token "
        "only; 0: off. Under `draft_schedule=\"price\"` the number per forward is priced as other drafts are.",
        low=0, rules=("fast",), neutral=0,
    ),
)  # fmt: skip
SETTING = {setting.name: setting for setting in DECODING_SETTINGS}
DECODING_FIELDS = tuple(SETTING)
DECODING_DEFAULTS = {setting.name: setting.default for setting in DECODING_SETTINGS}


def check_decoding(passed: dict, configured: dict | None = None) -> dict:
    """The decoding settings of one call, validated, from the options the caller `passed` and the `configured` ones
    (a generation config's; each missing or None one takes the table's default), as transformers treats options:

    - a passed option wins over the configured one; a passed None means the option's off value (`draft_window=None`:
      whole-slot checks), or for an option that has none (a threshold, a size, the rule), "not passed";
    - an option that does not apply to the infill rule in force is set aside to its off value when the caller did
      not pass it, and refused, naming both, when the caller did;
    - a configured block length is rounded up to a multiple of the slot size unless `block_length` was passed.
    """
    configured = configured or {}
    passed = {name: value for name, value in passed.items() if value is not None or SETTING[name].off is not _NO_OFF}
    decoding, given = {}, set()
    for setting in DECODING_SETTINGS:
        if setting.name in passed:
            value = passed[setting.name]
            decoding[setting.name] = setting.off if value is None else value
            given.add(setting.name)
        else:
            value = configured.get(setting.name)
            decoding[setting.name] = setting.default if value is None else value
        setting.check(decoding[setting.name])
    rule = decoding["infill_mode"]
    for setting in DECODING_SETTINGS:
        if rule in setting.rules or decoding[setting.name] == setting.off:
            continue
        if setting.name not in given:
            decoding[setting.name] = setting.off
        elif "infill_mode" in given:
            raise ValueError(
                f"{setting.name}={decoding[setting.name]!r} and infill_mode={rule!r} were both passed, but "
                f"{setting.name} applies to {setting.applies_to()} only: drop one of them."
            )
        else:
            raise ValueError(
                f"{setting.name}={decoding[setting.name]!r} applies to {setting.applies_to()}, but the generation "
                f"config sets infill_mode={rule!r}: pass infill_mode={setting.rules[0]!r} as well."
            )
    slot_size, block_length = decoding["slot_size"], decoding["block_length"]
    if "block_length" not in given and block_length % slot_size:
        decoding["block_length"] = block_length = -(-block_length // slot_size) * slot_size
    if block_length % slot_size:
        raise ValueError(f"block_length ({block_length}) must be a multiple of slot_size ({slot_size}).")
    return decoding


def settings_table() -> str:
    """The decoding parameters as a Markdown table (the README's and the model card's)."""
    lines = ["| parameter | default | values | applies to | what it does |", "| --- | --- | --- | --- | --- |"]
    for setting in DECODING_SETTINGS:
        cells = (f"`{setting.name}`", f"`{setting.default!r}`", setting.values(), setting.applies_to(), setting.doc)
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def settings_docstring(indent: str = "    ") -> str:
    """The decoding parameters as docstring lines, 120 columns wide: `name` (values; default; rules): what it does."""
    items = (
        f"- `{setting.name}` ({setting.values()}; default {setting.default!r}; {setting.applies_to()}): {setting.doc}"
        for setting in DECODING_SETTINGS
    )
    return "\n".join(textwrap.fill(item, 120, initial_indent=indent, subsequent_indent=indent + "  ") for item in items)


def documents_settings(function):
    """List the decoding parameters in `function`'s docstring, on the line that holds a `{settings}` field."""
    line = next(line for line in function.__doc__.splitlines() if "{settings}" in line)
    indent = line[: len(line) - len(line.lstrip())]
    function.__doc__ = function.__doc__.replace(line, settings_docstring(indent))
    return function


# The settings of one `generate()` call: the decoding parameters of the table, then those read from the generation
# config and the model.
DecodingSettings = make_dataclass(
    "DecodingSettings",
    [(setting.name, setting.kind if not setting.optional else setting.kind | None) for setting in DECODING_SETTINGS]
    + [
        ("max_new_tokens", int),
        ("mask_token_id", int),
        ("eos_token_ids", tuple[int, ...]),
        ("pad_token_id", int),
        ("do_sample", bool),
        ("use_cache", bool),
        ("cache_implementation", str),
        ("compile_config", CompileConfig | None),  # compiled forwards over the static cache when set
        ("forward_prices", dict | None),  # `draft_schedule="price"`: the caller's {width: price}, checked
        ("compile_cache_dir", str | None),  # compiled forwards kept there as AOTInductor packages (`SavedForwards`)
        ("max_cache_len", int | None),  # the static cache's least number of columns
    ],
    frozen=True,
)
DecodingSettings.__doc__ = "Everything `generate` decides before decoding, validated."


def resolve_settings(
    model, generation_config: GenerationConfig | None, prompt_length: int, kwargs: dict
) -> tuple[DecodingSettings, GenerationConfig]:
    """Merge `generation_config` (the model's by default) and `kwargs` (which win, as `check_decoding` says) into
    validated decoding settings; also return the merged generation config. Raises `ValueError` naming any option that
    cannot apply."""
    config = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    passed = {name: value for name, value in kwargs.items() if name in SETTING}
    configured = {name: getattr(config, name, None) for name in DECODING_FIELDS}
    forward_prices = kwargs.pop("forward_prices", getattr(config, "forward_prices", None))
    compile_cache_dir = kwargs.pop("compile_cache_dir", getattr(config, "compile_cache_dir", None))
    unused = config.update(**{name: value for name, value in kwargs.items() if name not in SETTING})
    for name, value in unused.items():
        if name != "mask_token_id":
            raise ValueError(f"generate() got an argument ReFusion decoding does not use: {name}={value!r}.")
    for name, neutral in REFUSED_OPTIONS.items():
        value = getattr(config, name, None)
        if value not in neutral:
            hint = f" ({REFUSED_HINTS[name]})" if name in REFUSED_HINTS else ""
            raise ValueError(f"ReFusion slot decoding cannot apply the generation option {name}={value!r}{hint}.")
    check_token_options(config, model.get_input_embeddings().num_embeddings)
    decoding = check_decoding(passed, configured)
    if forward_prices is not None:
        forward_prices = check_forward_prices(forward_prices)
    cache_implementation = config.cache_implementation or "dynamic"
    if cache_implementation not in CACHE_IMPLEMENTATIONS:
        raise ValueError(
            f"ReFusion slot decoding supports cache_implementation in {CACHE_IMPLEMENTATIONS}, got "
            f"{cache_implementation!r}."
        )
    compile_config = compile_config_for(model, config, cache_implementation)
    if compile_cache_dir is not None:
        if not isinstance(compile_cache_dir, (str, os.PathLike)) or not str(compile_cache_dir):
            raise ValueError(f"compile_cache_dir must name a folder, got {compile_cache_dir!r}.")
        if compile_config is None:
            raise ValueError(
                f"compile_cache_dir={str(compile_cache_dir)!r} keeps compiled forwards, but this decode compiles none: "
                "pass cache_implementation='static' and a compile_config (off CUDA with "
                "compile_config._compile_all_devices = True), without disable_compile."
            )
        compile_cache_dir = str(compile_cache_dir)

    mask_token_id = checked_mask_token_id(model, config, kwargs)
    eos = config.eos_token_id
    eos_token_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    pad_token_id = config.pad_token_id if config.pad_token_id is not None else (eos_token_ids or (None,))[0]
    if pad_token_id is None:
        raise ValueError("generate() needs a pad_token_id or an eos_token_id to fill the answer after it ends.")
    if mask_token_id in eos_token_ids or mask_token_id == pad_token_id:
        raise ValueError(f"The mask token id {mask_token_id} must differ from the EOS and pad token ids.")

    for name in ("max_new_tokens", "max_length"):
        value = getattr(config, name)
        if value is not None and not whole(value):
            raise ValueError(f"{name} must be a whole number of tokens, got {value!r}.")
    max_new_tokens = config.max_new_tokens
    if max_new_tokens is None:
        max_new_tokens = (config.max_length if config.max_length is not None else 20) - prompt_length
    if max_new_tokens < 1:
        raise ValueError(
            f"Nothing to generate: max_new_tokens={max_new_tokens} (max_length={config.max_length}, "
            f"prompt length {prompt_length}). Pass max_new_tokens >= 1."
        )
    do_sample = bool(config.do_sample)
    if do_sample and config.temperature is not None and config.temperature <= 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {config.temperature}.")
    if config.top_p is not None and not 0.0 < config.top_p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1], got {config.top_p}.")
    if config.top_k is not None and config.top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {config.top_k}.")
    # A slot longer than the answer would draft and check tokens past its end: slots (and blocks) are cut to it.
    slot_size = decoding["slot_size"] = min(decoding["slot_size"], max_new_tokens)
    decoding["block_length"] = min(decoding["block_length"], -(-max_new_tokens // slot_size) * slot_size)
    max_cache_len = checked_max_cache_len(config, cache_implementation)
    settings = DecodingSettings(
        **decoding,
        max_new_tokens=int(max_new_tokens),
        mask_token_id=int(mask_token_id),
        eos_token_ids=eos_token_ids,
        pad_token_id=int(pad_token_id),
        do_sample=do_sample,
        use_cache=config.use_cache is not False,  # None (unset) means the cache is used, as in generate()
        cache_implementation=cache_implementation,
        compile_config=compile_config,
        forward_prices=forward_prices,
        compile_cache_dir=compile_cache_dir,
        max_cache_len=max_cache_len,
    )
    return settings, config


def whole(value, low: int | None = None, high: int | None = None) -> bool:
    """Whether `value` is an int (not a bool) in `[low, high)` (either bound left out when None)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return (low is None or value >= low) and (high is None or value < high)


TOKEN_OPTIONS = ("eos_token_id", "pad_token_id", "forced_bos_token_id", "forced_eos_token_id", "suppress_tokens",
                 "begin_suppress_tokens")  # fmt: skip


def check_token_options(config: GenerationConfig, vocabulary: int) -> None:
    """Refuse, naming it, a generation option that holds token ids (`TOKEN_OPTIONS`) outside `[0, vocabulary)`, and a
    `num_return_sequences` that is not a positive whole number: transformers' processors would fail inside torch or
    write ids no tokenizer decodes."""
    for name in TOKEN_OPTIONS:
        value = getattr(config, name, None)
        ids = [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]
        if not all(whole(id_, 0, vocabulary) for id_ in ids):
            raise ValueError(f"{name} must hold token ids in [0, {vocabulary}), got {value!r}.")
    count = config.num_return_sequences
    if count is not None and not whole(count, 1):
        raise ValueError(f"num_return_sequences must be a positive whole number, got {count!r}.")


def checked_mask_token_id(model, config: GenerationConfig, kwargs: dict) -> int:
    """The mask token id a decode uses: the one passed, else the generation config's, else the model config's. One
    that disagrees with the model config's, or lies outside the embeddings, is refused: the model was trained to
    draft at its own mask token, and another token's drafts are garbage."""
    trained = getattr(model.config, "mask_token_id", None)
    named = ("passed", kwargs.get("mask_token_id")), ("generation config's", getattr(config, "mask_token_id", None))
    where, given = next(((where, value) for where, value in named if value is not None), ("model config's", trained))
    if given is None:
        raise ValueError("The model has no mask_token_id; convert it with finetune.convert first.")
    if trained is not None and given != trained:
        raise ValueError(
            f"The {where} mask_token_id ({given!r}) differs from the model config's ({trained}), the token the model "
            "drafts at: drop it, or fix the one that is wrong."
        )
    rows = model.get_input_embeddings().num_embeddings
    if not whole(given, 0, rows):
        raise ValueError(f"mask_token_id must be a token id in [0, {rows}), got {given!r}.")
    return given


def checked_max_cache_len(config: GenerationConfig, cache_implementation: str) -> int | None:
    """The generation config's `max_cache_len` (as transformers reads it: the static cache holds at least this many
    columns, so that later and longer decodes reuse it), checked. Options of a cache ReFusion does not build are
    refused rather than ignored."""
    if getattr(config, "cache_config", None):
        raise ValueError(
            f"cache_config={config.cache_config!r} configures a cache ReFusion does not build; its static cache takes "
            "max_cache_len only."
        )
    max_cache_len = getattr(config, "max_cache_len", None)
    if max_cache_len is None:
        return None
    if cache_implementation != "static" or config.use_cache is False:
        raise ValueError(f"max_cache_len={max_cache_len!r} sizes the static cache: pass cache_implementation='static'.")
    if not whole(max_cache_len, 1):
        raise ValueError(f"max_cache_len must be a positive whole number of tokens, got {max_cache_len!r}.")
    return max_cache_len


def compile_config_for(model, config: GenerationConfig, cache_implementation: str) -> CompileConfig | None:
    """How the forwards are compiled, by transformers' rule: over a static cache, unless `disable_compile`, on CUDA
    (or XPU), and on other devices when the config's `compile_config` sets `_compile_all_devices`. None: eager."""
    if cache_implementation != "static" or config.disable_compile or config.use_cache is False:
        return None
    compile_config = config.compile_config
    if model.device.type in ("cuda", "xpu"):
        return compile_config if compile_config is not None else CompileConfig(fullgraph=True, dynamic=False)
    if compile_config is not None and getattr(compile_config, "_compile_all_devices", False):
        return compile_config
    return None


def build_logits_processors(
    config: GenerationConfig, settings: DecodingSettings, prompt_length: int, device, extra=None
) -> lp.LogitsProcessorList:
    """transformers' processors for the options `config` sets, as `generate()` orders them, for one prompt of
    `prompt_length` tokens; `extra` (the caller's `logits_processor`) is appended. Each processor sees, for a
    drafted position, the prompt and the answer before that position as far as it is known."""
    eos = torch.tensor(settings.eos_token_ids, dtype=torch.long, device=device)
    max_length = prompt_length + settings.max_new_tokens
    processors = lp.LogitsProcessorList()
    if config.sequence_bias is not None:
        processors.append(lp.SequenceBiasLogitsProcessor(sequence_bias=config.sequence_bias))
    if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
        processors.append(lp.RepetitionPenaltyLogitsProcessor(penalty=config.repetition_penalty))
    if config.no_repeat_ngram_size:
        processors.append(lp.NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size))
    if config.bad_words_ids is not None:
        processors.append(lp.NoBadWordsLogitsProcessor(config.bad_words_ids, eos))
    if config.min_length and eos.numel():
        processors.append(lp.MinLengthLogitsProcessor(config.min_length, eos, device=device))
    if config.min_new_tokens and eos.numel():
        processors.append(lp.MinNewTokensLengthLogitsProcessor(prompt_length, config.min_new_tokens, eos, device))
    if config.forced_bos_token_id is not None:
        processors.append(lp.ForcedBOSTokenLogitsProcessor(config.forced_bos_token_id))
    if config.forced_eos_token_id is not None:
        processors.append(lp.ForcedEOSTokenLogitsProcessor(max_length, config.forced_eos_token_id, device=device))
    if config.remove_invalid_values:
        processors.append(lp.InfNanRemoveLogitsProcessor())
    if config.exponential_decay_length_penalty is not None and eos.numel():
        processors.append(lp.ExponentialDecayLengthPenalty(config.exponential_decay_length_penalty, eos, prompt_length))
    if config.suppress_tokens is not None:
        processors.append(lp.SuppressTokensLogitsProcessor(config.suppress_tokens, device=device))
    if config.begin_suppress_tokens is not None:
        processors.append(lp.SuppressTokensAtBeginLogitsProcessor(config.begin_suppress_tokens, prompt_length, device))
    if settings.do_sample:
        if config.temperature is not None and config.temperature != 1.0:
            processors.append(lp.TemperatureLogitsWarper(config.temperature))
        if config.top_h is not None:
            processors.append(lp.TopHLogitsWarper(top_h=config.top_h))
        if config.top_k:
            processors.append(lp.TopKLogitsWarper(top_k=config.top_k))
        if config.top_p is not None and config.top_p < 1.0:
            processors.append(lp.TopPLogitsWarper(top_p=config.top_p))
        if config.min_p is not None:
            processors.append(lp.MinPLogitsWarper(min_p=config.min_p))
        if config.typical_p is not None and config.typical_p < 1.0:
            processors.append(lp.TypicalLogitsWarper(mass=config.typical_p))
        if config.epsilon_cutoff is not None and 0.0 < config.epsilon_cutoff < 1.0:
            processors.append(lp.EpsilonLogitsWarper(epsilon=config.epsilon_cutoff))
        if config.eta_cutoff is not None and 0.0 < config.eta_cutoff < 1.0:
            processors.append(lp.EtaLogitsWarper(epsilon=config.eta_cutoff, device=device))
    if config.renormalize_logits:
        processors.append(lp.LogitNormalization())
    processors.extend(extra or [])
    return processors


# ---- pure decisions: plain tensors in, plain tensors out -----------------------------------------------------------
def passes(probabilities: torch.Tensor, threshold: float | torch.Tensor) -> torch.Tensor:
    """A probability passes a threshold when strictly above it; threshold 0 lets every probability through (a
    position with no draft, given -1, never passes). (`threshold` may be a 0-d tensor, as step functions compiled
    ahead of time take it: `SavedStep`.)"""
    if isinstance(threshold, torch.Tensor):
        return torch.where(threshold > 0, probabilities > threshold, probabilities >= 0)
    return probabilities > threshold if threshold > 0 else probabilities >= 0


def first_argmax(values: torch.Tensor, chunk: int = 128) -> torch.Tensor:
    """`values.argmax(dim=-1)`: the first index of the largest value along the last dimension (ties go to the lowest
    index, as in transformers' greedy search). Found as the maxima of runs of `chunk` columns, the first run holding
    the row's maximum, and the first maximum inside it: on a CPU, PyTorch's `argmax` and `topk` over a
    vocabulary-wide row do not vectorise, where the maxima of runs (`amax`) do."""
    width = values.shape[-1]
    rows = values.reshape(-1, width)
    body = width - width % chunk
    if body == 0:
        return values.argmax(dim=-1)
    maxima = rows[:, :body].reshape(rows.shape[0], body // chunk, chunk).amax(dim=-1)
    run = maxima.argmax(dim=-1)
    columns = run[:, None] * chunk + torch.arange(chunk, device=values.device)
    index = run * chunk + rows.gather(1, columns).argmax(dim=-1)
    if body < width:  # the last, shorter run wins only with a strictly larger value
        tail, tail_index = rows[:, body:].max(dim=-1)
        index = torch.where(tail > maxima.amax(dim=-1), body + tail_index, index)
    return index.reshape(values.shape[:-1])


def pick_tokens(probabilities: torch.Tensor, mask_token_id: int, do_sample: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy or sampled token of every row, never the mask token, and its probability. Sampling uses the
    exponential trick (no host sync)."""
    weights = probabilities.clone()
    if do_sample:
        weights[..., mask_token_id] = 0.0
        weights /= torch.empty_like(weights).exponential_(1)
    else:
        weights[..., mask_token_id] = -1.0
    tokens = first_argmax(weights)
    return tokens, probabilities.gather(-1, tokens[..., None])[..., 0]


def greedy_distributions(scores: torch.Tensor, mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax of every row of `scores` (in float32, or wider) and its greedy token, never the mask token: what
    `pick_tokens(scores.softmax(-1), mask_token_id, do_sample=False)` picks, with no copy of the table. The mask
    token's probability reads -1 in the table returned, as a draft that is not there does (it is never picked, so
    nothing else reads it). (Converting, then the softmax: on a CPU, `softmax(dtype=torch.float32)` of bfloat16
    rows gives the same values, several times more slowly.)"""
    probabilities = scores.to(torch.promote_types(scores.dtype, torch.float32)).softmax(dim=-1)
    probabilities[..., mask_token_id] = -1.0
    return probabilities, first_argmax(probabilities)


def greedy_logsumexp(scores: torch.Tensor, mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`greedy_distributions` without the table: each row's logsumexp (in float32, or wider) and greedy token (never
    the mask token); a token's probability is `exp(score - logsumexp)`. On a CPU scoring is the exponentials over
    every column, and a table of them costs passes more over memory (a compiled scoring step, `score_infill`, reads
    the rows fewer times without it), and writes a copy of the rows in their own dtype rather than two in float32."""
    never = torch.tensor([mask_token_id], device=scores.device)
    logsumexp = scores.to(torch.promote_types(scores.dtype, torch.float32)).logsumexp(dim=-1)
    return logsumexp, first_argmax(scores.index_fill(-1, never, float("-inf")))


def probabilities_at(scores: torch.Tensor, logsumexp: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor):
    """The probabilities of `tokens` in rows `rows` of `scores`, from the rows' `greedy_logsumexp`."""
    return (scores[rows, tokens].to(logsumexp.dtype) - logsumexp[rows]).exp()


def choose_slots(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """Slots whose confidence is above `threshold`, or else the single most confident one."""
    chosen = passes(confidence, threshold)
    best = torch.arange(confidence.shape[0], device=confidence.device) == confidence.argmax()
    return chosen | (best & ~chosen.any())


def accepted_lengths(passed: torch.Tensor) -> torch.Tensor:
    """Length of each row's leading run of passing tokens."""
    return passed.long().cumprod(dim=-1).sum(dim=-1)


def eos_offsets(tokens: torch.Tensor, counts: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """Offset of the first EOS among the first `counts` tokens of each slot (`slot_size` when there is none)."""
    offsets = torch.arange(tokens.shape[1], device=tokens.device)
    is_eos = torch.isin(tokens, eos) & (offsets < counts[:, None])
    return torch.where(is_eos, offsets, tokens.shape[1]).min(dim=1).values


def leading_complete(counts: list[int], eos: list[int], slot_size: int) -> int:
    """How many leading slots are complete: accepted in full, or up to an EOS (which ends them and the answer)."""
    leading = 0
    for count, offset in zip(counts, eos):
        if offset < count:
            return leading + 1
        if count < slot_size:
            break
        leading += 1
    return leading


def first_rejected(
    counts: torch.Tensor, ar_probability: torch.Tensor, threshold: float, checked_until: torch.Tensor | None = None
) -> torch.Tensor:
    """Offset of each slot's first draft, after its `counts` accepted tokens, that fails `threshold` among the
    positions checked (below `checked_until`, default the whole slot); `checked_until` when every one passes."""
    offsets = torch.arange(ar_probability.shape[1], device=ar_probability.device)
    if checked_until is None:
        checked_until = torch.full_like(counts, ar_probability.shape[1])
    passed = (offsets < counts[:, None]) | passes(ar_probability, threshold)
    return accepted_lengths(passed & (offsets < checked_until[:, None]))


def accept_and_correct(
    tokens: torch.Tensor,
    counts: torch.Tensor,
    ar_probability: torch.Tensor,
    ar_tokens: torch.Tensor,
    redrafts: torch.Tensor,
    threshold: float,
    checked_until: torch.Tensor | None = None,
    rejected: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One fast verification of the drafts after the first `counts` (already accepted) tokens of each slot.

    `ar_probability[:, i]` / `ar_tokens[:, i]` are the probability of `tokens[:, i]` and the model's own token at
    position i, both from the logits of position i - 1; they exist below `checked_until` (default: the whole slot).
    The passing drafts are kept, the model's token replaces the first rejected one, and the positions after it take
    `redrafts`; when every checked draft passes, no position past them is accepted. Returns the new tokens and
    accepted counts. (`rejected`: `first_rejected` of these arguments, where the caller has it already.)"""
    offsets = torch.arange(tokens.shape[1], device=tokens.device)
    if checked_until is None:
        checked_until = torch.full_like(counts, tokens.shape[1])
    if rejected is None:
        rejected = first_rejected(counts, ar_probability, threshold, checked_until)
    corrected = torch.where(offsets == rejected[:, None], ar_tokens, redrafts)
    tokens = torch.where(offsets < rejected[:, None], tokens, corrected)
    return tokens, torch.where(rejected < checked_until, rejected + 1, rejected)


def accept_reference(counts: torch.Tensor, ar_probability: torch.Tensor, threshold: float) -> torch.Tensor:
    """The authors' rule for one infill round: the first unaccepted position is accepted unchecked, the positions
    after it while their probability (from the previous position's logits) passes. Returns the new counts."""
    offsets = torch.arange(ar_probability.shape[1], device=ar_probability.device)
    return accepted_lengths((offsets <= counts[:, None]) | passes(ar_probability, threshold))


def judge_infill(
    tokens: torch.Tensor,
    counts: torch.Tensor,
    until: torch.Tensor,
    checked: torch.Tensor,
    ar_probability: torch.Tensor,
    ar_tokens: torch.Tensor,
    redrafts: torch.Tensor | None,
    eos: torch.Tensor,
    threshold: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One fast-rule infill round's decision for slots' `tokens` (`[slots, slot_size]`) with `counts` accepted and
    the positions `checked` (a mask, below `until`) scored: `accept_and_correct`'s new tokens and counts (`redrafts`
    None: the model's own tokens), their EOS offsets (`eos_offsets`) and the check's marks for
    `AcceptanceProfile.record` (offered drafts, accepted ones: `[2, slots, slot_size]`). (No two tensor arguments
    are one tensor: compiled, that would be a graph of its own.)"""
    redrafts = ar_tokens if redrafts is None else redrafts
    rejected = first_rejected(counts, ar_probability, threshold, until)
    tokens, counts = accept_and_correct(tokens, counts, ar_probability, ar_tokens, redrafts, threshold, until, rejected)
    return tokens, counts, eos_offsets(tokens, counts, eos), draft_marks(checked, rejected)


def infill_masks(stored: torch.Tensor, counts: torch.Tensor, until: torch.Tensor, size: int) -> tuple:
    """Where an infill round's tokens are in its slots (`[slots, size]` masks): the `fresh` accepted tokens (from
    `stored` up to `counts`), the drafts `queried` (from `counts` up to the last before `until`: the last position
    of a window scores nothing in it) and the positions `checked` (from `counts` up to `until`)."""
    offsets = torch.arange(size, device=counts.device)
    fresh = (offsets >= stored[:, None]) & (offsets < counts[:, None])
    checked = (offsets >= counts[:, None]) & (offsets < until[:, None])
    return fresh, checked & (offsets < until[:, None] - 1), checked


def score_infill(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    stored: torch.Tensor,
    counts: torch.Tensor,
    until: torch.Tensor,
    eos: torch.Tensor,
    mask_token_id: int,
    threshold: float | torch.Tensor,
    text: torch.Tensor,
    at: torch.Tensor,
    drafts: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A greedy fast-rule infill round scored whole, from the logits of its forward to what the host reads, for slots'
    `tokens` (`[slots, slot_size]`) with `stored`, `counts` and `until` as `infill_masks` reads them: the forward's
    rows are the slots' fresh tokens, then their queried drafts (each in row-major order); position i is scored by
    the row of position i - 1. Decides as `greedy_distributions` (computed as `greedy_logsumexp`), then
    `judge_infill` with the model's own tokens as redrafts, then with `drafts` (`lookup_drafts`) `copy_drafts` from
    `text` (`at`: the slots' text positions) do. Returns the host's values (the new counts, their EOS offsets, with
    `drafts` how many drafts each slot holds, then the check's `check_counts`), the slots' new tokens and the check's
    `draft_marks`. (One function, so that a compiled decode makes one call here a forward: on a CPU a call right
    after a forward runs from a cold cache, and several calls cost several times one.)"""
    logsumexp, greedy = greedy_logsumexp(logits, mask_token_id)
    fresh, queried, checked = infill_masks(stored, counts, until, tokens.shape[1])
    fresh, queried = fresh.flatten(), queried.flatten()
    rows = torch.where(fresh, fresh.cumsum(0) - 1, fresh.sum() + queried.cumsum(0) - 1) * (fresh | queried)
    rows = rows.view_as(tokens)
    source = torch.cat([rows[:, :1], rows[:, :-1]], dim=1)  # the row scoring each position
    ar_tokens = torch.where(checked, greedy[source], tokens)
    drafted = probabilities_at(logits, logsumexp, source, tokens).masked_fill(tokens == mask_token_id, -1)
    ar_probability = torch.where(checked, drafted, 1.0)
    tokens, counts, eos_at, marks = judge_infill(
        tokens, counts, until, checked, ar_probability, ar_tokens, None, eos, threshold
    )
    values = [counts, eos_at]
    if drafts:
        tokens, found = copy_drafts(text, at, tokens, counts, drafts, mask_token_id)
        values.append(found)
    return torch.cat([*values, check_counts(marks)]), tokens, marks


def judge_verify(
    tokens: torch.Tensor,
    scored: torch.Tensor,
    ar_probability: torch.Tensor,
    ar_tokens: torch.Tensor,
    eos: torch.Tensor,
    threshold: float | torch.Tensor,
    keep_drafts: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """A verify forward's decision on the chosen slots' drafts `tokens` (`[slots, slot_size]`), the positions
    `scored` (a mask: offsets 1 up to the forward's width; offset 0 always passes) having the model's own tokens
    `ar_tokens` and the drafts' probabilities `ar_probability`: each slot's accepted length and its EOS offset, and
    for the fast rule (`keep_drafts` given, a 0-d bool tensor) the tokens and counts a slot goes on with (the model's
    token at the first rejected draft; after it the plan's drafts where `keep_drafts` (`fused_redraft`), else the
    model's tokens) and their EOS offsets. Returns those values for the host, the tokens and the check's
    `draft_marks`."""
    offsets = torch.arange(tokens.shape[1], device=tokens.device)
    accepted = accepted_lengths((offsets == 0) | (scored & passes(ar_probability, threshold)))
    values = [accepted, eos_offsets(tokens, accepted, eos)]
    marks = draft_marks(scored, accepted)
    if keep_drafts is not None:
        until = scored.sum(dim=1) + 1  # (scored: offsets 1 .. until - 1)
        redrafts = torch.where(keep_drafts, tokens, ar_tokens)
        tokens, counts = accept_and_correct(tokens, torch.ones_like(accepted), ar_probability, ar_tokens, redrafts,
                                            threshold, until)  # fmt: skip
        values += [counts, eos_offsets(tokens, counts, eos)]
    return values, tokens, marks


def score_verify(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    eos: torch.Tensor,
    mask_token_id: int,
    threshold: torch.Tensor,
    keep_drafts: torch.Tensor,
    text: torch.Tensor,
    at: torch.Tensor,
    drafts: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A greedy fast-rule verify forward scored whole, from its logits to what the host reads: the chosen slots'
    drafts `tokens` (`[slots, slot_size]`) ran as one causal run of the same number of leading tokens a slot, so its
    `logits` are `[slots, width, vocabulary]` and the row of offset i - 1 scores offset i, up to the width. Decides
    as `greedy_distributions` (computed as `greedy_logsumexp`) then `judge_verify` do, then with `drafts`
    (`lookup_drafts`) `copy_drafts` from `text` (`at`: the slots' text positions) does. Returns the host's values
    (`judge_verify`'s, with `drafts` how many drafts each slot holds, then the check's `check_counts`), the slots'
    new tokens and the check's `draft_marks`. (One call a verify forward, as `score_infill` is an infill round's.)"""
    (slots, width), size = logits.shape[:2], tokens.shape[1]
    logits = logits.reshape(slots * width, -1)
    logsumexp, greedy = greedy_logsumexp(logits, mask_token_id)
    offsets = torch.arange(size, device=tokens.device)
    scored = ((offsets > 0) & (offsets <= width)).expand(slots, size)
    rows = torch.arange(slots, device=tokens.device)[:, None] * width + (offsets - 1).clamp(min=0, max=width - 1)
    ar_tokens = torch.where(scored, greedy[rows], tokens)
    drafted = probabilities_at(logits, logsumexp, rows, tokens).masked_fill(tokens == mask_token_id, -1)
    ar_probability = torch.where(scored, drafted, 1.0)
    values, tokens, marks = judge_verify(tokens, scored, ar_probability, ar_tokens, eos, threshold, keep_drafts)
    if drafts:
        tokens, found = copy_drafts(text, at, tokens, values[2], drafts, mask_token_id)
        values.append(found)
    return torch.cat([*values, check_counts(marks)]), tokens, marks


def score_plan(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    mask_token_id: int,
    threshold: torch.Tensor,
    text: torch.Tensor,
    at: torch.Tensor,
    copies: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A greedy plan forward scored whole, from its logits to what the host reads: the masked slots' `[MASK]` queries
    (`logits` `[slots, width, vocabulary]`, the first `width` tokens of each slot) give each slot's greedy drafts,
    written over the first `width` of its `drafts` (`[slots, slot_size]`); the slots whose first draft's probability
    passes `threshold` are chosen (else the most confident, `choose_slots`), and with `copies` (`lookup_drafts`) the
    drafts after each first one are copied from `text` (`at`: the slots' text positions), as `copy_drafts` does.
    Returns the host's values (which slots are chosen, then with `copies` how many drafts each holds) and the slots'
    drafts. (One call a plan forward, as `score_infill` is an infill round's.)"""
    (slots, width), vocabulary = logits.shape[:2], logits.shape[2]
    logits = logits.reshape(slots * width, vocabulary)
    logsumexp, greedy = greedy_logsumexp(logits, mask_token_id)
    picked = probabilities_at(logits, logsumexp, torch.arange(slots * width, device=logits.device), greedy)
    offsets = torch.arange(drafts.shape[1], device=drafts.device)
    drafted = greedy.view(slots, width).gather(1, offsets.clamp(max=width - 1).expand(slots, -1))
    drafts = torch.where(offsets < width, drafted, drafts)
    values = [choose_slots(picked.view(slots, width)[:, 0], threshold).long()]
    if copies:
        drafts, found = copy_drafts(text, at, drafts, torch.ones_like(values[0]), copies, mask_token_id)
        values.append(found)
    return torch.cat(values), drafts


def draft_marks(checked: torch.Tensor, run_end: torch.Tensor) -> torch.Tensor:
    """The drafts a check offered and those it accepted, `[2, slots, slot_size]`: of the `checked` ones, those up to
    each slot's first rejected draft (at offset `run_end`, `slot_size` when none), and those before it."""
    offsets = torch.arange(checked.shape[1], device=checked.device)
    ends = run_end[:, None]
    return torch.stack([offsets <= ends, offsets < ends]) & checked


def check_counts(marks: torch.Tensor) -> torch.Tensor:
    """A check's drafts offered and accepted, `[2]`, from its `draft_marks`."""
    return marks.sum(dim=(1, 2))


def lookup_drafts(
    text: torch.Tensor, starts: torch.Tensor, count: int, unknown: int, ngram: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts copied from earlier text, as prompt lookup decoding makes them: for each position `starts[i]` of the
    1-D `text` (tokens; `unknown` where not yet decoded), the `count` tokens that followed the last occurrence before
    it of the `ngram` (else fewer, down to one) tokens just before it. Returns the drafts `[len(starts), count]` and
    how many of each row's are found: the leading ones that follow a match and are known."""
    length = text.shape[0]
    follows = torch.full_like(starts, -1)  # where the copied tokens begin; -1 where nothing matched
    # A match of d tokens is a position e before the start whose d tokens before it equal the start's d tokens before
    # it: the matches of d + 1 tokens are those of d tokens whose (d + 1)-th tokens before e and the start agree too.
    # (Positions before the text read -1, and a start's token before it -2 where it is unknown or before the text,
    # so that one comparison says all: no token is negative.)
    after = torch.arange(length, device=text.device)  # e: where the copied tokens would begin
    matches = after[None] < starts[:, None]
    for size in range(1, ngram + 1):  # a longer match overrides a shorter one
        shifted = torch.nn.functional.pad(text, (size, 0), value=-1)[:length]  # each e's size-th token before it
        before = text[(starts - size).clamp(min=0)]  # the start's
        before = before.masked_fill((before == unknown) | (starts < size), -2)
        matches &= shifted[None] == before[:, None]
        last = torch.where(matches, after, -1).amax(dim=-1)
        follows = torch.where(last >= 0, last, follows)
    at = follows[:, None] + torch.arange(count, device=text.device)
    drafts = text[at.clamp(0, length - 1)]
    known = (follows[:, None] >= 0) & (at < length) & (drafts != unknown)
    return drafts, accepted_lengths(known)


def copy_drafts(
    text: torch.Tensor, at: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor, count: int, unknown: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write into slots' `tokens` (`[slots, slot_size]`, at text positions `at`), after each one's `counts` accepted
    tokens, up to `count` drafts copied from the `text` (`lookup_drafts`) as it reads with those accepted tokens in
    place. Returns the tokens and how many drafts each slot holds now."""
    size = tokens.shape[1]
    offsets = torch.arange(size, device=tokens.device)
    accepted = offsets < counts[:, None]
    text = text.index_put((at,), torch.where(accepted, tokens, text[at]))
    drafts, found = lookup_drafts(text, at[:, 0] + counts, count, unknown)
    found = torch.minimum(found, size - counts)
    ahead = offsets - counts[:, None]
    copied = (ahead >= 0) & (ahead < found[:, None])
    return torch.where(copied, drafts.gather(1, ahead.clamp(0, count - 1)), tokens), found


def expected_tokens(rate: float, drafts: int) -> float:
    """Tokens a slot gains from a check of its first open position and `drafts` drafts after it, when each passes
    with probability `rate` given the ones before it: the first always yields one (its draft or the model's own
    token), each later one when every draft before it passed."""
    return sum(rate**step for step in range(drafts + 1))


def best_window(price, rate: float, widths: list[int], free: float = 0.0) -> int:
    """The number of drafts k per slot that maximises expected tokens per price: `widths[k]` is the forward's width
    when every slot takes k drafts, `price(width)` what such a forward costs, and a slot earns `free` plus
    `expected_tokens(rate, k)`. The fewest drafts win a tie."""
    values = [(free + expected_tokens(rate, k)) / price(width) for k, width in enumerate(widths)]
    return max(range(len(values)), key=lambda k: (values[k], -k))


def check_forward_prices(table) -> dict[int, float]:
    """`forward_prices` as `{width: price}`, sorted by width and checked: positive integer widths (a JSON file's
    digit strings too) to positive finite prices (seconds, or any unit they all share); anything else a ValueError."""

    def refuse(problem: str):
        raise ValueError(
            f"forward_prices must map forward widths (new tokens per row) to positive prices, e.g. "
            f"{{1: 0.034, 8: 0.055}}: {problem}."
        )

    if not isinstance(table, dict) or not table:
        refuse(f"got {table!r}")
    checked = {}
    for key, price in table.items():
        digits = isinstance(key, str) and key.isascii() and key.isdecimal()
        if not (digits or isinstance(key, int) and not isinstance(key, bool)) or int(key) < 1:
            refuse(f"width {key!r} is not a positive integer")
        try:
            value = float(price) if isinstance(price, (int, float)) and not isinstance(price, bool) else math.nan
        except OverflowError:  # (an integer past every float)
            value = math.inf
        if not 0 < value < math.inf:
            refuse(f"the price of width {key!r} ({price!r}) is not a positive finite number")
        checked[int(key)] = value
    return dict(sorted(checked.items()))


class ForwardPrices:
    """What a forward of `width` new tokens per row costs, from a table of measured widths: interpolated linearly
    between them, the narrowest's price below it, prorated past the widest. A width is never priced above a wider
    one (it could run padded to it), which also bounds a measurement's noise; in a measured table (`key`), no width
    within `PRICE_FREE` of the narrowest's price above it. With the width `buckets` of compiled forwards, widths are
    first padded to their bucket, as the forward runs."""

    def __init__(self, table: dict[int, float], buckets: tuple[int, ...] | None = None, key: str | None = None):
        self.table, self.buckets = check_forward_prices(table), buckets
        self.measured = dict(self.table)  # before the narrower widths are capped below
        self.widths = list(self.table)
        self.key = key  # the `price_key` of a measured table; None for the caller's
        self.seen: dict[int, float] = {}  # each measured width's fastest forward in a decode (`observe`)
        self.tried: set[int] = set()  # buckets run once at their own width before padding them (`run_width`)
        for narrower, wider in zip(reversed(self.widths[:-1]), reversed(self.widths[1:])):
            self.table[narrower] = min(self.table[narrower], self.table[wider])
        if key is not None:  # measured: widths within `PRICE_FREE` of the narrowest are free
            narrowest = self.table[self.widths[0]]
            for width, price in self.table.items():
                if price <= (1 + PRICE_FREE) * narrowest:
                    self.table[width] = narrowest

    def __call__(self, width: int) -> float:
        width = pad_width(width, self.buckets)
        widths, table = self.widths, self.table
        if width <= widths[0]:
            return table[widths[0]]
        if width >= widths[-1]:
            return table[widths[-1]] * width / widths[-1]
        above = next(index for index, known in enumerate(widths) if known >= width)
        low, high = widths[above - 1], widths[above]
        return table[low] + (table[high] - table[low]) * (width - low) / (high - low)

    def run_width(self, width: int) -> int:
        """The width a forward of `width` new tokens runs at: its bucket, or a wider bucket priced cheaper (a width's
        price being the least of its measured one and the fastest a decode saw, `observe`). A measured table's bucket
        is run once before it is padded to a wider one: a table that prices it too high (measured on a busy machine,
        or kept from another state of it) would otherwise never see it run, and so never be found stale."""
        width = pad_width(width, self.buckets)
        if self.buckets is None or width not in self.measured:
            return width
        wider = [bucket for bucket in self.buckets if bucket >= width and bucket in self.measured]
        cheapest = min(wider, key=lambda bucket: (min(self.measured[bucket], self.seen.get(bucket, math.inf)), bucket))
        if cheapest != width and self.key is not None and width not in self.tried:
            self.tried.add(width)
            return width
        return cheapest

    def observe(self, width: int, seconds: float) -> None:
        """A decode's forward of `width` (as run: padded) took `seconds`, its scoring and the host's read included."""
        if width in self.measured:
            self.seen[width] = min(seconds, self.seen.get(width, math.inf))

    def stale(self) -> tuple[int, float] | None:
        """A width whose forwards ran in less than `PRICE_STALE` of its measured price, and the fastest of them."""
        return next(
            ((width, seconds) for width, seconds in self.seen.items() if seconds < PRICE_STALE * self.measured[width]),
            None,
        )


def upload(values: list[int], device) -> torch.Tensor:
    """A flat host list of ints as a 1-D long tensor on `device`, copied without waiting for the device's queued work.
    (Read from an `array`'s buffer: `torch.tensor` converts a list item by item, which a decode paid about twice a
    forward; the buffer is read whole.)"""
    host = torch.frombuffer(array.array("q", values), dtype=torch.long) if values else torch.zeros(0, dtype=torch.long)
    return host if torch.device(device).type == "cpu" else host.to(device, non_blocking=True)


def positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Flat (row-major) indices of the true entries of `mask`, of which the host knows there are `count`: found
    without reading the mask to the host, as boolean indexing would."""
    return torch.nonzero_static(mask.flatten(), size=count)[:, 0]


# ---- the passive record of one row ---------------------------------------------------------------------------------
# What a forward's token carries, in this order, and the value of each in left padding
PADDING = {"ids": 0, "positions": 0, "ranks": NEVER, "prefixes": 0, "groups": -2, "parents": NO_GROUP}
FIELDS = tuple(PADDING)


@dataclass
class Queries:
    """Tokens of one forward after what is stored, as the rows of one `[6, n]` tensor (`FIELDS`: token ids, RoPE
    positions, ranks, prefixes, groups, parents; the ranks row is set when requested). Each token sees the stored
    tokens ranked below its `prefix`, the earlier tokens of its own group, and those of its `parent` group (a `[MASK]`
    query, the slot it drafts for)."""

    fields: torch.Tensor

    @classmethod
    def of(cls, ids, positions, prefixes, groups, parents) -> "Queries":
        return cls(torch.stack([ids, positions, ids, prefixes, groups, parents]))  # (ranks: a placeholder)

    @classmethod
    def causal(cls, ids: torch.Tensor, positions: torch.Tensor, start: int, group: int) -> "Queries":
        """A run in which each token sees everything before it."""
        prefixes = torch.arange(start, start + ids.shape[0], device=ids.device)
        return cls.of(ids, positions, prefixes, torch.full_like(ids, group), torch.full_like(ids, NO_GROUP))

    def __len__(self) -> int:
        return self.fields.shape[1]


@dataclass(frozen=True)
class Request:
    """One row's new tokens for one forward: `len - num_queries` pending stored tokens, then the queries; `fields`
    holds them as `Queries` does, ranks (storage indices) set."""

    fields: torch.Tensor
    num_queries: int

    def __len__(self) -> int:
        return self.fields.shape[1]


class StoredSequence:
    """What one row has stored, in storage order (as `Queries` fields), and how far the KV cache holds it. A stored
    token's parent is always `NO_GROUP` (only `[MASK]` queries have parents, and they are never stored)."""

    def __init__(self, device):
        self.fields = torch.zeros((len(FIELDS), 0), dtype=torch.long, device=device)
        self.computed = 0  # leading tokens whose K/V are in the cache
        self.kept = 0  # queries of the last request that stayed

    def __len__(self) -> int:
        return self.fields.shape[1]

    def append(self, queries: Queries, computed: bool = False) -> None:
        """Store tokens (whose K/V the next forward computes, unless `computed`)."""
        self.fields = torch.cat([self.fields, queries.fields], dim=1)
        if computed:
            self.computed = len(self)

    def request(self, queries: Queries, recompute: bool) -> Request:
        """The request for one forward: the pending tokens (all stored tokens when `recompute`) then `queries`."""
        start = 0 if recompute else self.computed
        fields = torch.cat([self.fields[:, start:], queries.fields], dim=1)
        fields[FIELDS.index("ranks")] = torch.arange(start, len(self) + len(queries), device=fields.device)
        self.computed, self.kept = len(self), 0
        return Request(fields, num_queries=len(queries))

    def keep(self, queries: Queries) -> None:
        """The leading `queries` of the request just run stay in the sequence with the K/V it computed."""
        self.append(queries, computed=True)
        self.kept = len(queries)


@dataclass
class Infilling:
    """Chosen slots being completed: their tokens (accepted prefix, then drafts) on the device and, known to the host,
    how many of each are accepted and stored, their attention groups, and the sequence length they all see."""

    slots: list[int]
    tokens: torch.Tensor
    counts: list[int]
    stored: list[int]
    groups: list[int]
    prefix: int
    found: list[int] | None = None  # `lookup_drafts`: the drafts copied from earlier text after each count

    @property
    def fresh(self) -> int:
        """Accepted tokens not yet stored in the cache, over all slots: the next round's forward writes them."""
        return sum(count - stored for count, stored in zip(self.counts, self.stored))

    def select(self, rows: list[int]) -> "Infilling":
        if rows == list(range(len(self.slots))):  # all of them: no copy of the tokens
            return self
        return Infilling(
            [self.slots[row] for row in rows],
            self.tokens[upload(rows, self.tokens.device)],
            [self.counts[row] for row in rows],
            [self.stored[row] for row in rows],
            [self.groups[row] for row in rows],
            self.prefix,
            None if self.found is None else [self.found[row] for row in rows],
        )


class AcceptanceProfile:
    """Draft checks of one row by source (`PLAN`, `REDRAFT`) and slot offset. Each check's marks stay on the device
    (for the tables by offset, `tables`); its two counts, drafts offered and accepted (`check_counts`), end the
    tensor the decoder's scoring gives the host, which adds them to `known` (`read`) when it reads that tensor:
    recording a check never waits for the host. `rate` uses `known`; `prior` is the rate assumed before any check."""

    PLAN, REDRAFT = range(2)

    def __init__(self, slot_size: int, device, prior: float = 0.5):
        self.prior, self.slot_size, self.device = prior, slot_size, device
        self.checks: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # per source: each check's marks
        self.forwards = 0
        self.known = [0, 0, 0, 0]  # PLAN offered, PLAN accepted, REDRAFT offered, REDRAFT accepted, as read

    def add(self, source: int, checked: torch.Tensor, run_end: torch.Tensor) -> torch.Tensor:
        """One forward's check: `checked` (`[slots, slot_size]`) marks the drafts it scored, `run_end` the offset of
        each slot's first rejected draft (`slot_size` when none): a draft counts as offered up to it, accepted
        before it. Returns the check's counts (`check_counts`), for the host to `read`."""
        marks = draft_marks(checked, run_end)
        self.record(source, marks)
        return check_counts(marks)

    def record(self, source: int, marks: torch.Tensor) -> None:
        """One forward's check as its `draft_marks` (whose counts the caller hands the host)."""
        self.checks[source].append(marks)
        self.forwards += 1

    def read(self, source: int, counts: list[int]) -> None:
        """The host's copy of a check's counts (offered, accepted), read with its forward's decision."""
        self.known[2 * source] += counts[0]
        self.known[2 * source + 1] += counts[1]

    def tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Drafts offered and accepted by source and slot offset (`[2, slot_size]` each), and the checks that
        offered any by source."""
        offered = torch.zeros(2, self.slot_size, dtype=torch.long, device=self.device)
        accepted, runs = torch.zeros_like(offered), torch.zeros_like(offered[:, 0])
        for source, checks in enumerate(self.checks):
            if checks:
                marks = torch.cat(checks, dim=1)
                offered[source], accepted[source] = marks.sum(dim=1)
                runs[source] = marks[0].any(dim=1).sum()
        return offered, accepted, runs

    def rate(self, source: int) -> float:
        """The share of `source`'s offered drafts that passed, as the host last read them, with two drafts counted in
        advance that passed at the `prior` rate (so `prior` before any check)."""
        offered, accepted = self.known[2 * source : 2 * source + 2]
        return (accepted + 2 * self.prior) / (offered + 2)

    @staticmethod
    def output_fields(profiles: list["AcceptanceProfile"]) -> dict:
        """The `RefusionGenerateOutput` fields of `profiles` summed over rows."""
        offered, accepted, runs = (sum(tables) for tables in zip(*(profile.tables() for profile in profiles)))
        return {
            "draft_offered": offered,
            "draft_accepted": accepted,
            "draft_runs": runs,
            "verify_forwards": sum(profile.forwards for profile in profiles),
        }


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


# ---- one row: a state machine the executor steps -------------------------------------------------------------------
@dataclass
class Phase:
    """Where a row's decode stands between two forwards: which forward it asks for next (`kind`) and the values that
    forward's logits are read against."""

    kind: int
    slots: list[int] = field(default_factory=list)  # PLAN: the masked slots; VERIFY: the chosen ones
    state: Infilling | None = None  # INFILL, REDRAFT, RECHECK: the slots being completed
    read: dict = field(default_factory=dict)  # what building the queries, then scoring the logits, left for later


class SlotDecoder:
    """Plan-and-infill decisions for one prompt, stepped by the executor in three calls a forward: `request()` gives
    the row's next forward (None when its answer is done); `score(logits)` reads the logits of that forward's
    queries on the device and returns, as one small integer tensor, all that the host needs to decide; the executor
    reads the tensors of all rows to the host at once, and `advance(values)` decides what is committed and what
    comes next, and returns how many of the queries stay in the sequence (with their K/V). So a decode step waits
    for the device once, however many rows it batches: slot status and every count the queries are built from are
    known to the host, and the queries are built from them without reading the device."""

    MASKED, INFILLING, DONE = range(3)  # slot status
    PLAN, VERIFY, INFILL, REDRAFT, RECHECK, FINISHED = range(6)  # phase kinds; REDRAFT/RECHECK: the reference rule
    # the phases whose scoring checks drafts, and the source it counts as (their scores end with its counts)
    CHECKS = {VERIFY: AcceptanceProfile.PLAN, INFILL: AcceptanceProfile.REDRAFT, RECHECK: AcceptanceProfile.REDRAFT}

    def __init__(
        self,
        prompt: torch.LongTensor,
        settings: DecodingSettings,
        processors=None,
        watcher=None,
        prices=None,
        steps: "StepFunctions | None" = None,
    ):
        self.settings, self.device, self.prices = settings, prompt.device, prices  # prices: `draft_schedule="price"`
        self.steps = steps or EAGER_STEPS  # compiled with the forwards (`compiled_steps()`) or not
        self.processors, self.watcher = processors or lp.LogitsProcessorList(), watcher
        self.context_free = all(isinstance(processor, CONTEXT_FREE) for processor in self.processors)
        # Greedy decoding with no processor that reads the tokens before a position scores all of a forward's rows
        # at once (`greedy_distributions`), in `score`; otherwise each decision scores the rows it reads.
        self.score_all_rows = not settings.do_sample and self.context_free
        self.forward_scores: tuple[torch.Tensor, torch.Tensor] | None = None
        # (a 0-d tensor, as step functions compiled ahead of time take it: one package serves every threshold)
        self.token_threshold = torch.tensor(settings.token_threshold, dtype=torch.float64, device=self.device)
        self.keep_drafts = torch.tensor(settings.fused_redraft, device=self.device)  # (`judge_verify`'s, so too)
        self.slot_threshold = torch.tensor(settings.slot_threshold, dtype=torch.float64, device=self.device)
        self.prompt = prompt
        size = settings.slot_size
        self.num_slots = -(-settings.max_new_tokens // size)
        self.offsets = torch.arange(size, device=self.device)
        # the prompt and the answer as one text (`_look_up` copies drafts from it); the answer is a view of it
        masks = torch.full((self.num_slots * size,), settings.mask_token_id, device=self.device)
        self.text = torch.cat([prompt, masks])
        self.answer = self.text[prompt.shape[0] :]
        self.drafts = self.answer.clone()
        # the EOS ids, and two that no token has: so that the tensor's size is never 0 or 1, which compiled step
        # functions would take as graphs of their own
        self.eos = torch.tensor([*settings.eos_token_ids, -1, -1], dtype=torch.long, device=self.device)
        self.status = [self.MASKED] * self.num_slots
        self.end = self.answer.shape[0]  # answer length; moves to just after the first committed EOS
        self.record = StoredSequence(self.device)
        self.next_group = 0
        self.forwards = self.committed_slots = 0
        self.step_ratios: list[float] = []  # per plan step: slot_size x committed slots / forwards (authors' TPF)
        self.step_start = (0, 0)  # forwards and committed slots when the current plan step began
        self.profile = AcceptanceProfile(size, self.device, settings.draft_prior)
        prompt_positions = torch.arange(prompt.shape[0], device=self.device)
        self.record.append(Queries.causal(prompt, prompt_positions, 0, self._new_group()))
        self.block = 0  # first slot of the block being decoded
        self.phase = self._next_step()

    # ---- the loop: one forward a round of calls -----------------------------------------------------------------
    def request(self) -> Request | None:
        """The row's next forward: the pending stored tokens and the queries of the current phase (None when done)."""
        build = {
            self.PLAN: self._plan_queries,
            self.VERIFY: self._verify_queries,
            self.INFILL: self._infill_queries,
            self.REDRAFT: self._redraft_queries,
            self.RECHECK: self._recheck_queries,
        }.get(self.phase.kind)
        if build is None:
            return None
        self.forwards += 1
        return self.record.request(build(self.phase), recompute=not self.settings.use_cache)

    def score(self, logits: torch.Tensor) -> torch.Tensor:
        """Read the logits of the last request's queries on the device; returns the 1-D long tensor of what the host
        must know to decide (ending with the counts of the drafts checked, in the phases that check some)."""
        score = {
            self.PLAN: self._score_plan,
            self.VERIFY: self._score_verify,
            self.INFILL: self._score_infill,
            self.REDRAFT: self._score_redraft,
            self.RECHECK: self._score_recheck,
        }[self.phase.kind]
        if self.score_all_rows and not self._scored_whole(self.phase):
            self.forward_scores = self.steps.greedy_distributions(self._processed(logits), self.settings.mask_token_id)
        values = score(self.phase, logits)
        self.forward_scores = None
        return values

    def advance(self, values: list[int]) -> int:
        """Decide from the host's copy of `score`'s tensor and move to the next phase; returns how many leading
        queries of the last request stay in the sequence."""
        source = self.CHECKS.get(self.phase.kind)
        if source is not None:
            values, checked = values[:-2], values[-2:]
            self.profile.read(source, checked)
        decide = {
            self.PLAN: self._planned,
            self.VERIFY: self._verified,
            self.INFILL: self._infilled,
            self.REDRAFT: self._redrafted,
            self.RECHECK: self._rechecked,
        }[self.phase.kind]
        self.phase = decide(self.phase, values)
        return self.record.kept

    def _next_step(self) -> Phase:
        """The next plan step: the masked slots of the first block that has any (blocks are decoded in order), or
        FINISHED when none is left."""
        slots_per_block = self.settings.block_length // self.settings.slot_size
        while self.block < self.num_slots:
            block = range(self.block, min(self.block + slots_per_block, self.num_slots))
            if masked := [slot for slot in block if self.status[slot] == self.MASKED]:
                self.step_start = (self.forwards, self.committed_slots)
                return Phase(self.PLAN, slots=masked)
            self.block += slots_per_block
        return Phase(self.FINISHED)

    def _step_done(self) -> Phase:
        """Record the plan step just finished (the authors' tokens per forward) and begin the next."""
        forwards, committed = self.step_start
        size = self.settings.slot_size
        self.step_ratios.append(size * (self.committed_slots - committed) / (self.forwards - forwards))
        return self._next_step()

    def _infilling(self, state: Infilling | None, eos: list[int] | None = None) -> Phase:
        """Go on completing `state`'s slots by the infill rule in force, or end the step when none is left (the
        reference rule commits them all at its end, `eos` being their EOS offsets)."""
        if state is None:
            return self._step_done()
        if self.settings.infill_mode != "reference":
            return Phase(self.INFILL, state=state)
        if all(count >= self.settings.slot_size for count in state.counts):
            self._settle(state, eos)
            return self._step_done()
        return Phase(self.REDRAFT, state=state)

    # ---- plan -------------------------------------------------------------------------------------------------
    def _plan_queries(self, phase: Phase) -> Queries:
        """Draft every token of the masked slots in one forward; only their first tokens (which choose the slots)
        where the price schedule finds that drafts do not pay (the slots are then completed token by token) or where
        the drafts after them are copied from the text (`lookup_drafts`)."""
        index = self._slot_index(phase.slots)
        if self.settings.lookup_drafts or self.prices is not None and not self._drafts_pay(len(phase.slots)):
            index = index[:, :1]
        index = index.flatten()
        phase.read["index"] = index
        return self._causal(torch.full_like(index, self.settings.mask_token_id), index)

    def _score_plan(self, phase: Phase, logits: torch.Tensor) -> torch.Tensor:
        """Keep the drafts; choose the slots to decode by their first draft's confidence (and, for one-token slots,
        which drafts are EOS)."""
        index, settings = phase.read["index"], self.settings
        if self._scored_whole(phase):
            slots = self._slot_index(phase.slots)
            values, self.drafts[slots] = self.steps.score_plan(
                self._processed(logits).view(len(phase.slots), -1, logits.shape[-1]), self.drafts[slots],
                settings.mask_token_id, self.slot_threshold, self.text, slots + self.prompt.shape[0],
                settings.lookup_drafts,
            )  # fmt: skip
            return values
        tokens, probabilities = self._pick(logits, torch.arange(logits.shape[0], device=self.device), index)
        self.drafts[index] = tokens
        chosen = choose_slots(probabilities.view(len(phase.slots), -1)[:, 0], settings.slot_threshold)
        if settings.slot_size == 1:
            return torch.cat([chosen.long(), torch.isin(tokens, self.eos).long()])
        if not settings.lookup_drafts:
            return chosen.long()
        # the drafts after each slot's first one, copied from the text
        slots = self._slot_index(phase.slots)
        self.drafts[slots], found = self._look_up(slots, self.drafts[slots], slots.new_ones(slots.shape[0]))
        return torch.cat([chosen.long(), found])

    def _planned(self, phase: Phase, values: list[int]) -> Phase:
        slots = len(phase.slots)
        chosen = [slot for slot, keep in zip(phase.slots, values[:slots]) if keep]
        if self.settings.slot_size > 1:
            found = [count for count, keep in zip(values[slots:], values[:slots]) if keep]
            return Phase(self.VERIFY, slots=chosen, read=dict(found=found) if found else {})
        # one-token slots: nothing to check, a slot's only token always passes; the run ends at the first EOS
        eos = [0 if is_eos else 1 for is_eos, keep in zip(values[slots:], values[:slots]) if keep]
        leading = leading_complete([1] * len(chosen), eos, 1)
        tokens = self.drafts[self._slot_index(chosen[:leading])]
        self._commit_run(chosen[:leading], tokens, eos[:leading], computed=False)
        return self._step_done()

    # ---- verify -----------------------------------------------------------------------------------------------
    def _verify_queries(self, phase: Phase) -> Queries:
        """The chosen drafts as one causal run: each slot's leading `_verify_width` tokens."""
        index = self._slot_index(phase.slots)
        tokens = self.drafts[index]
        width = self._verify_width(len(phase.slots), phase.read.get("found"))
        phase.read.update(index=index, tokens=tokens, width=width)
        return self._causal(tokens[:, :width].flatten(), index[:, :width].flatten())

    def _score_verify(self, phase: Phase, logits: torch.Tensor) -> torch.Tensor:
        """Check the drafts: each slot's accepted length and EOS offset and, for the fast rule, the tokens and counts
        it goes on with (the model's own token at the first rejected draft, redrafts after it) and their EOS."""
        read, size, settings = phase.read, self.settings.slot_size, self.settings
        index, tokens, width, slots = read["index"], read["tokens"], read["width"], len(phase.slots)
        fast = settings.infill_mode != "reference"
        if self._scored_whole(phase):
            values, read["tokens"], marks = self.steps.score_verify(
                self._processed(logits).view(slots, width, -1), tokens, self.eos, settings.mask_token_id,
                self.token_threshold, self.keep_drafts, self.text, index + self.prompt.shape[0], settings.lookup_drafts,
            )  # fmt: skip
            self.profile.record(AcceptanceProfile.PLAN, marks)  # (`values` end with its counts)
            return values
        until = min(width + 1, size)  # the logits at offset i score offset i + 1; offset 0 always passes
        scored = ((self.offsets > 0) & (self.offsets < until)).expand_as(tokens)
        at = (torch.arange(slots, device=self.device)[:, None] * size + self.offsets[1:until]).flatten()
        rows = (torch.arange(slots, device=self.device)[:, None] * width + self.offsets[: until - 1]).flatten()
        ar_tokens, ar_probability = self._ar_check(logits, rows, tokens, index, at)
        values, read["tokens"], marks = judge_verify(tokens, scored, ar_probability, ar_tokens, self.eos,
                                                     settings.token_threshold, self.keep_drafts if fast else None)
        self.profile.record(AcceptanceProfile.PLAN, marks)
        if fast and settings.lookup_drafts:
            read["tokens"], found = self._look_up(index, read["tokens"], values[2])
            values.append(found)
        return torch.cat([*values, check_counts(marks)])

    def _verified(self, phase: Phase, values: list[int]) -> Phase:
        """Commit the leading complete slots with this forward's K/V; infill the other chosen slots."""
        chosen, read, size = phase.slots, phase.read, self.settings.slot_size
        slots = len(chosen)
        accepted, eos = values[:slots], values[slots : 2 * slots]
        leading = leading_complete(accepted, eos, size) if read["width"] == size else 0  # else not all computed
        self._commit_run(chosen[:leading], read["tokens"][:leading], eos[:leading], computed=True)
        groups = self._new_groups(slots - leading)
        if self.settings.infill_mode == "reference":
            if leading:  # the other chosen slots return to [MASK] and are planned again
                return self._step_done()
            state = Infilling(chosen, read["tokens"], accepted, [0] * slots, groups, len(self.record))
            return self._infilling(state, eos)
        counts, eos = values[2 * slots + leading : 3 * slots], values[3 * slots + leading : 4 * slots]
        found = values[4 * slots + leading :] if self.settings.lookup_drafts else None
        state = Infilling(chosen[leading:], read["tokens"][leading:], counts, [0] * len(counts), groups,
                          len(self.record), found)  # fmt: skip
        return self._infilling(self._settle(state, eos))

    # ---- infill, fast rule ------------------------------------------------------------------------------------
    def _infill_queries(self, phase: Phase) -> Queries:
        """One round for all the slots: `[fresh accepted tokens | MASK queries (fused) | drafts]`. Fresh tokens stay
        in the sequence (in their slot's group); the drafts are checked, the model's own token replaces the first
        rejected one, and the rest are redrafted from the same forward. Every field but the token ids is known to
        the host and goes to the device with the round's layout (`_infill_layout`); the ids are gathered from the
        slots' tokens."""
        state = phase.state
        windows = self._infill_windows(state)
        spans = [("fresh", state.groups, None)]
        if self.settings.fused_redraft and not self.settings.lookup_drafts and max(windows) > 0:
            # (with no drafts there is nothing to redraft; copied drafts are found again after each round)
            spans.append(("checked", self._new_groups(len(state.slots)), state.groups))
        spans.append(("queried", state.groups, None))
        layout = self._infill_layout(state, windows, spans)
        fields, at = layout["fields"], layout["at"]
        ids = state.tokens.flatten()[at]
        sizes = [len(layout[name]) for name, _, _ in spans]
        if len(spans) == 3:
            ids[sizes[0] : sizes[0] + sizes[1]] = self.settings.mask_token_id
        queries = Queries(torch.cat([ids[None], fields]))
        phase.read.update(layout, sizes=sizes, fresh_queries=Queries(queries.fields[:, : sizes[0]]))
        return queries

    def _scored_whole(self, phase: Phase) -> bool:
        """Whether the phase's logits are scored by one step function: a greedy infill round with no `[MASK]` queries
        (`fused_redraft`; `score_infill`), a greedy verify forward of the fast rule (`score_verify`), or a greedy plan
        of slots of more than one token (`score_plan`)."""
        if not self.score_all_rows:
            return False
        if phase.kind == self.PLAN:
            return self.settings.slot_size > 1
        if phase.kind == self.VERIFY:
            return self.settings.infill_mode != "reference"
        return phase.kind == self.INFILL and len(phase.read["sizes"]) == 2

    def _score_infill(self, phase: Phase, logits: torch.Tensor) -> torch.Tensor:
        """Check the drafts and correct the first rejected one: each slot's new accepted count and EOS offset."""
        state, read = phase.state, phase.read
        if self._scored_whole(phase):
            settings = self.settings
            values, read["tokens"], marks = self.steps.score_infill(
                self._processed(logits), state.tokens, read["stored"], read["counts"], read["until"], self.eos,
                settings.mask_token_id, self.token_threshold, self.text, read["index"] + self.prompt.shape[0],
                settings.lookup_drafts,
            )  # fmt: skip
            self.profile.record(AcceptanceProfile.REDRAFT, marks)  # (`values` end with its counts)
            return values
        index = read["index"]
        at = [read[name] for name in ("fresh", "queried", "checked")]
        fresh, queried, checked = upload(sum(at, []), self.device).split(list(map(len, at)))
        num_fresh, num_queried = read["sizes"][0], read["sizes"][-1]
        row_of = torch.zeros_like(index)
        row_of.view(-1)[fresh] = torch.arange(num_fresh, device=self.device)
        row_of.view(-1)[queried] = len(logits) - num_queried + torch.arange(num_queried, device=self.device)
        source = torch.cat([row_of[:, :1], row_of[:, :-1]], dim=1)  # position i is scored by position i - 1
        ar_tokens, ar_probability = self._ar_check(logits, source.flatten()[checked], state.tokens, index, checked)
        redrafts = None  # the model's own tokens
        if len(read["sizes"]) == 3:  # fused: the [MASK] queries' drafts
            mask_rows = torch.arange(num_fresh, len(logits) - num_queried, device=self.device)
            redrafts = state.tokens.clone()
            redrafts.view(-1)[checked] = self._pick(logits, mask_rows, index.flatten()[checked], state.tokens,
                                                    checked)[0]  # fmt: skip
        _, _, checked_mask = infill_masks(read["stored"], read["counts"], read["until"], self.settings.slot_size)
        read["tokens"], counts, eos, marks = self.steps.judge_infill(
            state.tokens, read["counts"], read["until"], checked_mask, ar_probability, ar_tokens, redrafts, self.eos,
            self.settings.token_threshold,
        )  # fmt: skip
        self.profile.record(AcceptanceProfile.REDRAFT, marks)
        values = [counts, eos]
        if self.settings.lookup_drafts:
            read["tokens"], found = self._look_up(index, read["tokens"], counts)
            values.append(found)
        return torch.cat([*values, check_counts(marks)])

    def _infilled(self, phase: Phase, values: list[int]) -> Phase:
        state, slots = phase.state, len(phase.state.slots)
        self.record.keep(phase.read["fresh_queries"])
        state.stored, state.tokens, state.counts = state.counts, phase.read["tokens"], values[:slots]
        if self.settings.lookup_drafts:
            state.found = values[2 * slots :]
        return self._infilling(self._settle(state, values[slots : 2 * slots]))

    # ---- infill, the authors' rule ------------------------------------------------------------------------------
    # A round of two forwards over the slots not yet complete: the unaccepted positions are redrafted by `[MASK]`
    # queries after the accepted tokens, then the slot is checked causally and the first unaccepted position is
    # accepted unchecked. After each round the first slot with an accepted EOS completes and the slots after it are
    # dropped. All slots are committed together at the end.
    def _redraft_queries(self, phase: Phase) -> Queries:
        state, size = phase.state, self.settings.slot_size
        index = self._slot_index(state.slots)
        counts = upload(state.counts, self.device)
        live_rows = sum(count < size for count in state.counts)
        live = positions((counts < size)[:, None].expand_as(index), live_rows * size)
        row_of = torch.zeros_like(index)
        row_of.view(-1)[live] = torch.arange(live_rows * size, device=self.device)
        drafting_mask = self.offsets >= counts[:, None]
        drafting = positions(drafting_mask, sum(size - count for count in state.counts))
        masked = torch.where(drafting_mask, self.settings.mask_token_id, state.tokens)
        phase.read.update(index=index, counts=counts, live=live, row_of=row_of, drafting=drafting)
        return self._grouped(state, index, live, masked, upload(self._new_groups(len(state.slots)), self.device))

    def _score_redraft(self, phase: Phase, logits: torch.Tensor) -> torch.Tensor:
        state, read = phase.state, phase.read
        drafting, index = read["drafting"], read["index"]
        tokens = state.tokens.clone()
        picked = self._pick(logits, read["row_of"].flatten()[drafting], index.flatten()[drafting], state.tokens,
                            drafting)[0]  # fmt: skip
        tokens.view(-1)[drafting] = picked
        read["tokens"] = tokens
        return tokens.new_zeros(0)  # nothing for the host: the check comes next

    def _redrafted(self, phase: Phase, values: list[int]) -> Phase:
        return Phase(self.RECHECK, state=phase.state, read=phase.read)

    def _recheck_queries(self, phase: Phase) -> Queries:
        state, read = phase.state, phase.read
        groups = upload(self._new_groups(len(state.slots)), self.device)
        return self._grouped(state, read["index"], read["live"], read["tokens"], groups)

    def _score_recheck(self, phase: Phase, logits: torch.Tensor) -> torch.Tensor:
        """Accept by the authors' rule: each slot's new count and EOS offset."""
        state, read, size = phase.state, phase.read, self.settings.slot_size
        index, tokens, counts, row_of = read["index"], read["tokens"], read["counts"], read["row_of"]
        scored_mask = self.offsets > counts[:, None]  # by the checked position before it
        scored = positions(scored_mask, sum(max(size - count - 1, 0) for count in state.counts))
        source = torch.cat([row_of[:, :1], row_of[:, :-1]], dim=1)
        _, ar_probability = self._ar_check(logits, source.flatten()[scored], tokens, index, scored)
        counts = accept_reference(counts, ar_probability, self.settings.token_threshold)
        checked = self.profile.add(AcceptanceProfile.REDRAFT, scored_mask, counts)
        return torch.cat([counts, eos_offsets(tokens, counts, self.eos), checked])

    def _rechecked(self, phase: Phase, values: list[int]) -> Phase:
        state, size = phase.state, self.settings.slot_size
        slots = len(state.slots)
        state.tokens, state.counts, eos = phase.read["tokens"], values[:slots], values[slots:]
        ended = next((row for row in range(slots) if eos[row] < state.counts[row]), None)
        if ended is not None:  # the first slot with an accepted EOS completes; the slots after it are dropped
            state.counts[ended] = size
            self._stop_at(state.slots[ended] * size + eos[ended] + 1)
            state, eos = state.select(list(range(ended + 1))), eos[: ended + 1]
        return self._infilling(state, eos)

    # ---- results -----------------------------------------------------------------------------------------------
    def frontier(self) -> int:
        """Length of the answer prefix that is final in reading order (what can be streamed)."""
        undecided = next((slot for slot, status in enumerate(self.status) if status != self.DONE), self.num_slots)
        return min(undecided * self.settings.slot_size, self.answer_length())

    def answer_length(self) -> int:
        return min(self.end, self.settings.max_new_tokens)

    def result(self) -> torch.LongTensor:
        """The answer, `max_new_tokens` long, with `pad_token_id` after its end."""
        answer = self.answer[: self.settings.max_new_tokens]
        after_end = torch.arange(answer.shape[0], device=self.device) >= self.answer_length()
        return answer.masked_fill(after_end, self.settings.pad_token_id)

    # ---- scoring -----------------------------------------------------------------------------------------------
    def _processed(self, rows: torch.Tensor) -> torch.Tensor:
        """Logit `rows` after processors that read no context but the prompt (in float32, or wider)."""
        if not self.processors:
            return rows
        rows = rows.to(torch.promote_types(rows.dtype, torch.float32))
        return self.processors(self.prompt[None].expand(rows.shape[0], -1), rows)

    def _probabilities(self, rows, targets, slot_tokens=None, at=None):
        """Token distributions of logit `rows` after the processors. `targets`: the answer index each row scores. A
        processor that reads the tokens before a position sees the prompt, the committed answer and, with
        `slot_tokens` (`[slots, size]`) and `at` (the flat positions in it that the rows score), the slot's tokens
        (such processors read the targets to the host)."""
        if self.context_free:
            rows = self._processed(rows)
        else:
            rows = rows.to(torch.promote_types(rows.dtype, torch.float32))
            context = self.answer.expand(rows.shape[0], -1).clone()
            if slot_tokens is not None:
                size = self.settings.slot_size
                columns = (targets - targets % size)[:, None] + self.offsets
                before = self.offsets < (targets % size)[:, None]
                known = slot_tokens[at // size]
                context.scatter_(1, columns, torch.where(before, known, context.gather(1, columns)))
            scores = torch.empty_like(rows)
            for target in targets.unique().tolist():
                chosen = (targets == target).nonzero()[:, 0]
                ids = torch.cat([self.prompt.expand(chosen.shape[0], -1), context[chosen, :target]], dim=1)
                scores[chosen] = self.processors(ids, rows[chosen])
            rows = scores
        return rows.to(torch.promote_types(rows.dtype, torch.float32)).softmax(dim=-1)

    def _scored(self, logits, rows, targets, slot_tokens=None, at=None):
        """The distributions of the logit `rows` (indices into this forward's `logits`) and the token picked from
        each: `(probabilities, where, tokens)`, row `i`'s distribution being `probabilities[where[i]]`. The
        arguments after `rows` are `_probabilities`'."""
        if self.forward_scores is not None:  # every row of the forward is scored already
            probabilities, tokens = self.forward_scores
            return probabilities, rows, tokens[rows]
        probabilities = self._probabilities(logits[rows], targets, slot_tokens, at)
        tokens, _ = pick_tokens(probabilities, self.settings.mask_token_id, self.settings.do_sample)
        return probabilities, torch.arange(rows.shape[0], device=self.device), tokens

    def _pick(self, logits, rows, targets, slot_tokens=None, at=None):
        """A draft token for each of the logit `rows` (indices into `logits`), and its probability."""
        probabilities, where, tokens = self._scored(logits, rows, targets, slot_tokens, at)
        return tokens, probabilities[where, tokens]

    def _ar_check(self, logits, rows, tokens, index, at):
        """`logits[rows[j]]`: the logits scoring the slots' `tokens` at flat position `at[j]`. Returns the model's own
        token at each position and the probability of `tokens` there (1 elsewhere)."""
        probabilities, where, own = self._scored(logits, rows, index.flatten()[at], tokens, at)
        ar_tokens = tokens.clone()
        ar_tokens.view(-1)[at] = own
        ar_probability = torch.ones(tokens.shape, dtype=probabilities.dtype, device=self.device)
        drafts = tokens.flatten()[at]
        drafted = probabilities[where, drafts]
        ar_probability.view(-1)[at] = drafted.masked_fill(drafts == self.settings.mask_token_id, -1)  # not drafted
        return ar_tokens, ar_probability

    # ---- bookkeeping -------------------------------------------------------------------------------------------
    def _settle(self, state: Infilling, eos: list[int]) -> Infilling | None:
        """Apply accepted EOS tokens (at offsets `eos`, `slot_size` where none; the answer ends at the first, later
        slots are dropped) and commit the slots that are complete; return the rest (None when none is left)."""
        size = self.settings.slot_size
        for slot, offset in zip(state.slots, eos):
            if offset < size:
                self._stop_at(slot * size + offset + 1)
        rest = []
        for row, slot in enumerate(state.slots):
            if self.status[slot] == self.DONE:
                continue
            count, stored = state.counts[row], state.stored[row]
            if count < size and eos[row] >= count:
                self.status[slot] = self.INFILLING
                rest.append(row)
                continue
            length = min(eos[row] + 1, size)
            index = slot * size + self.offsets[:length]
            tokens = state.tokens[row, :length]
            self.answer[index] = tokens
            self.status[slot] = self.DONE
            self.committed_slots += 1
            if length > stored:  # the tokens not yet stored join the sequence in the slot's group
                self.record.append(self._in_group(tokens[stored:], index[stored:], state.prefix, state.groups[row]))
        self._watch()
        return state.select(rest) if rest else None

    def _commit_run(self, slots: list[int], tokens: torch.Tensor, eos: list[int], computed: bool) -> None:
        """Commit the slots as one causal run (the verify run's leading slots), each up to its EOS (at offset
        `eos[i]`, `slot_size` when none; only the last slot of a run can hold one, as an EOS ends the answer), with
        the K/V of the forward just run when `computed`."""
        if not slots:
            return
        size = self.settings.slot_size
        length = size * (len(slots) - 1) + min(eos[-1] + 1, size)
        index = self._slot_index(slots).flatten()[:length]
        run = tokens.flatten()[:length]
        self.answer[index] = run
        self.committed_slots += len(slots)
        for slot, offset in zip(slots, eos):
            self.status[slot] = self.DONE
            if offset < size:
                self._stop_at(slot * size + offset + 1)
        run = self._causal(run, index)
        self.record.keep(run) if computed else self.record.append(run)
        self._watch()

    def _stop_at(self, length: int) -> None:
        """End the answer after `length` tokens; the slots after it are dropped."""
        self.end = min(self.end, length)
        for slot in range(self.num_slots):
            if slot * self.settings.slot_size >= self.end:
                self.status[slot] = self.DONE

    def _watch(self) -> None:
        if self.watcher is not None and (stop := self.watcher.advance(self.answer, self.frontier())) is not None:
            self._stop_at(stop)

    def _verify_width(self, slots: int, found: list[int] | None = None) -> int:
        """Leading tokens of each of `slots` chosen slots in the verify forward: `draft_window` (whole slots when
        None), or under `draft_schedule="price"` the number up to it that earns most per price (the first token is
        free: it always passes; each one in the forward scores the next). With `lookup_drafts`, the first token and
        up to `lookup_drafts` (or the priced number) of the drafts copied after it, as many as every slot has
        (`found`)."""
        size, settings = self.settings.slot_size, self.settings
        cap = min(settings.draft_window or size, size)
        if settings.lookup_drafts:
            cap = min(settings.lookup_drafts, size - 1, *(found or [0])) + 1
        if self.prices is None:
            return cap
        rate = self.profile.rate(AcceptanceProfile.PLAN)
        return 1 + best_window(self.prices, rate, [slots * (drafts + 1) for drafts in range(cap)], free=1.0)

    def _infill_windows(self, state: Infilling) -> list[int]:
        """Drafts of each slot queried in the next infill round: `draft_window` (whole slots when None), or under
        `draft_schedule="price"` the number up to it that earns most per price. With `lookup_drafts`, the drafts
        copied from earlier text only: up to `lookup_drafts` (or the priced number up to it) of those found."""
        slots, settings = len(state.slots), self.settings
        if settings.lookup_drafts:
            window = settings.lookup_drafts
            if self.prices is not None:
                fresh, drafting = state.fresh, sum(1 for found in state.found if found)
                widths = [fresh + drafting * drafts for drafts in range(window + 1)]
                window = best_window(self.prices, self.profile.rate(AcceptanceProfile.REDRAFT), widths)
            return [min(window, found) for found in state.found]
        if self.prices is None:
            return [settings.draft_window or settings.slot_size] * slots
        return [self._priced_window(slots, state.fresh)] * slots

    def _priced_window(self, slots: int, fresh: int) -> int:
        """The drafts per slot that earn most per price in an infill round of `slots` slots bringing `fresh` tokens;
        with `fused_redraft` k drafts bring k + 1 `[MASK]` queries (none when k is 0)."""
        size, masks = self.settings.slot_size, self.settings.fused_redraft
        cap = min(self.settings.draft_window or size, size - 1)
        widths = [fresh + slots * (k + (k + 1 if masks and k else 0)) for k in range(cap + 1)]
        return best_window(self.prices, self.profile.rate(AcceptanceProfile.REDRAFT), widths)

    def _drafts_pay(self, slots: int) -> bool:
        """Whether `slots` chosen slots would take drafts into their verify forward or their first infill round."""
        return self._verify_width(slots) > 1 or self._priced_window(slots, slots) > 0

    def _infill_layout(self, state: Infilling, windows: list[int], spans: list[tuple]) -> dict:
        """Where the tokens of an infill round go, as flat positions in `[slots, slot_size]`: `fresh` accepted tokens
        not yet stored, drafts `queried` in the forward, and the positions `checked` by it (below `until`): the first
        draft by the last fresh token, each later one by the draft before it. At most `windows[i]` drafts of slot i
        are queried; the last position of a slot scores nothing in it, so its draft is never queried. The host finds
        them from its counts (lists), and the forward's queries from them: `spans` of (positions, each slot's group,
        each slot's parent group or None), in order; it uploads in one call what the device needs (the stored and
        accepted counts and the ends, from which the device finds the positions again, `infill_masks`; the slots'
        answer indices, the queries' fields but their ids, as `Queries` rows 1-5, and `at`, where in the slots' tokens
        each query's id is)."""
        size, slots, start = self.settings.slot_size, len(state.slots), self.prompt.shape[0]
        until = [min(count + window + 1, size) for count, window in zip(state.counts, windows)]  # > count: open
        layout = dict(fresh=[], checked=[], queried=[])
        for row, (count, stored, end) in enumerate(zip(state.counts, state.stored, until)):
            first = row * size
            layout["fresh"] += range(first + stored, first + count)
            layout["checked"] += range(first + count, first + end)
            layout["queried"] += range(first + count, first + end - 1)
        index = [slot * size + offset for slot in state.slots for offset in range(size)]
        at, rope, groups, parents = [], [], [], []
        for name, slot_groups, slot_parents in spans:
            for position in layout[name]:
                row = position // size
                at.append(position)
                rope.append(start + index[position])
                groups.append(slot_groups[row])
                parents.append(NO_GROUP if slot_parents is None else slot_parents[row])
        n = len(at)
        values = upload([*state.stored, *state.counts, *until, *index,
                         *rope, *at, *[state.prefix] * n, *groups, *parents, *at], self.device)  # fmt: skip
        stored, counts, ends, index_tensor, fields, at_tensor = values.split([slots, slots, slots, slots * size, 5 * n,
                                                                              n])  # fmt: skip
        return dict(
            layout,
            index=index_tensor.view(slots, size),
            stored=stored,
            counts=counts,
            until=ends,
            fields=fields.view(5, n),  # positions, ranks (a placeholder: set when requested), prefixes, groups, parents
            at=at_tensor,
        )

    def _look_up(self, index, tokens, counts) -> tuple[torch.Tensor, torch.Tensor]:
        """Write into the slots' `tokens` (answer indices `index`), after each one's `counts` accepted tokens, the
        drafts copied from earlier text (`lookup_drafts`): the prompt, the answer and the slots' accepted tokens.
        Returns the tokens and how many drafts each slot holds now."""
        at = index + self.prompt.shape[0]
        return self.steps.copy_drafts(self.text, at, tokens, counts, self.settings.lookup_drafts,
                                      self.settings.mask_token_id)  # fmt: skip

    def _grouped(self, state, index, at, tokens, groups, parents=None) -> Queries:
        """The tokens at flat positions `at` of the infilling slots' `tokens` (`[slots, slot_size]`, answer indices
        `index`), each seeing the sequence before `state.prefix` and its slot's group (`groups`, one per slot)."""
        rows = at // self.settings.slot_size
        ids = tokens.flatten()[at]
        parent_of = torch.full_like(ids, NO_GROUP) if parents is None else parents[rows]
        rope_positions = index.flatten()[at] + self.prompt.shape[0]
        return Queries.of(ids, rope_positions, torch.full_like(ids, state.prefix), groups[rows], parent_of)

    def _in_group(self, ids, index, prefix: int, group: int) -> Queries:
        return Queries.of(ids, index + self.prompt.shape[0], torch.full_like(ids, prefix), torch.full_like(ids, group),
                          torch.full_like(ids, NO_GROUP))  # fmt: skip

    def _causal(self, ids: torch.Tensor, index: torch.Tensor) -> Queries:
        return Queries.causal(ids, index + self.prompt.shape[0], len(self.record), self._new_group())

    def _slot_index(self, slots: list[int]) -> torch.Tensor:
        """Answer indices of the tokens of `slots`, shape `[len(slots), slot_size]`."""
        return upload(slots, self.device)[:, None] * self.settings.slot_size + self.offsets

    def _new_group(self) -> int:
        self.next_group += 1
        return self.next_group - 1

    def _new_groups(self, count: int) -> list[int]:
        self.next_group += count
        return list(range(self.next_group - count, self.next_group))


# ---- many rows: one batched forward per step -----------------------------------------------------------------------
def attention_mask(key_ranks, key_groups, ranks, prefixes, groups, parents, columns, dtype) -> torch.Tensor:
    """Additive mask `[batch, 1, new, keys]`: a token sees the keys of its row ranked below its prefix, and the keys
    of its own group and of its parent group ranked up to itself, and always itself (so that padding rows stay
    finite): the new tokens sit at cache `columns` (`[batch, new]`, or an int `past`: columns past, past + 1, ...)."""
    below = key_ranks[:, None, :] <= ranks[:, :, None]
    sees = key_ranks[:, None, :] < prefixes[:, :, None]
    sees |= (key_groups[:, None, :] == groups[:, :, None]) & below
    sees |= (key_groups[:, None, :] == parents[:, :, None]) & below
    if isinstance(columns, int):
        columns = columns + torch.arange(ranks.shape[1], device=ranks.device).expand_as(ranks)
    sees.scatter_(2, columns[:, :, None], True)
    mask = torch.zeros(sees.shape, dtype=dtype, device=sees.device)
    return mask.masked_fill(~sees, torch.finfo(dtype).min)[:, None]


def static_mask(pointers, lengths, key_columns, key_groups, ranks, prefixes, groups, parents, dtype):
    """Where a padded forward's new tokens go in a `SlotCache` and their attention mask: row r brings `lengths[r]` new
    tokens (its last ones; the left padding before them) and has `pointers[r]` stored at columns 0 .. pointers[r] -
    1; the new tokens are written from its pointer on, the padding after them, where the next forward overwrites it.
    `key_columns` is `arange(cache length)`, `key_groups` (`[batch, cache length]`) the group of each column's token.
    Returns the write columns (`[batch, width]`), the key groups with the new tokens' and the mask (`attention_mask`);
    a column not yet written hides behind rank `NEVER`."""
    width = ranks.shape[1]
    columns = pointers[:, None] + (torch.arange(width, device=ranks.device) + lengths[:, None]) % width
    key_groups = key_groups.scatter(1, columns, groups)
    key_ranks = torch.where(key_columns < (pointers + lengths)[:, None], key_columns, NEVER)
    return columns, key_groups, attention_mask(key_ranks, key_groups, ranks, prefixes, groups, parents, columns, dtype)


@dataclass(frozen=True)
class StepFunctions:
    """The decoder's tensor work between forwards that decodes through compiled forwards run compiled too: each
    function's dozens of small operations become one call of generated code (on a GPU a kernel or a few, where each
    operation was a launch). `EAGER_STEPS` holds the functions themselves, `compiled_steps()` them compiled, and
    beside saved forwards on a CPU `SavedForwards.steps` all but `judge_infill` compiled ahead of time
    (`SavedStep`: there a call skips the Python layers of a `torch.compile` call)."""

    copy_drafts: Callable  # drafts copied from earlier text (`lookup_drafts`), written into the slots
    static_mask: Callable  # where a forward's tokens go in a `SlotCache`, and their attention mask
    greedy_distributions: Callable  # a forward's token distributions and greedy tokens, for greedy decoding
    judge_infill: Callable  # the decision of a fast-rule infill round
    score_infill: Callable  # a greedy fast-rule infill round, from its logits to its decision
    score_verify: Callable  # a greedy fast-rule verify forward, from its logits to its decision
    score_plan: Callable  # a greedy plan forward, from its logits to the slots chosen


EAGER_STEPS = StepFunctions(
    copy_drafts, static_mask, greedy_distributions, judge_infill, score_infill, score_verify, score_plan
)


@functools.cache
def compiled_steps() -> StepFunctions:
    """`StepFunctions` under torch.compile with dynamic shapes, made once a process: a function's graphs serve every
    text length, cache length, width and vocabulary, save that dynamo gives sizes of one graphs of their own (one slot
    or several, one row or several, one new token or several; `warm_up_steps`), and so do dtypes and devices. A
    compiled call replaces dozens of small eager operations, which pays most for the functions of many operations on
    small tensors (copying drafts, the mask) and least for scoring many rows, whose work is the exponentials; right
    after a forward each compiled call also pays for a cold cache (see `SavedStep`)."""
    return StepFunctions(*(compile_step(getattr(EAGER_STEPS, field)) for field in StepFunctions.__dataclass_fields__))


def compile_step(function: Callable) -> Callable:
    """`function` under torch.compile with dynamic shapes and room for `RECOMPILE_LIMIT` graphs (dtypes, devices and
    sizes of one multiply them past dynamo's default of 8; torch before 2.13 keeps that default, past which the calls
    run eagerly: the same results, uncompiled)."""
    try:
        return torch.compile(function, dynamic=True, recompile_limit=RECOMPILE_LIMIT)
    except TypeError:  # a torch.compile without `recompile_limit`
        return torch.compile(function, dynamic=True)


def step_functions(compiled) -> StepFunctions:
    """The decoder's step functions for a decode through the `compiled` backbone (`compiled_backbone`; None: eager
    forwards): on a CPU beside saved forwards, all but a fused-redraft round's decision compiled ahead of time too
    (`SavedForwards.steps`), else `compiled_steps()`."""
    if isinstance(compiled, SavedForwards) and compiled.model.device.type == "cpu":
        return compiled.steps
    return compiled_steps() if compiled is not None else EAGER_STEPS


@torch.no_grad()  # (as decodes run: grad mode is among a graph's guards)
def warm_up_steps(model, lookup_drafts: int = 0, steps: StepFunctions | None = None) -> None:
    """Compile `compiled_steps()`'s scoring of `model`'s logits (one row and several), its infill decisions (one
    slot and several) and its greedy plan, verify and infill forwards scored whole (with `lookup_drafts` drafts
    copied) now, and with `lookup_drafts` the copying of that many drafts (one slot and several). The masks compile
    with the forwards (`compile_forwards`)."""
    device, vocab = model.device, model.get_output_embeddings().weight.shape[0]
    steps, eos = steps or compiled_steps(), torch.tensor([2, -1, -1], device=device)  # (as `SlotDecoder.eos`)
    threshold = torch.tensor(0.5, dtype=torch.float64, device=device)  # (as `SlotDecoder.token_threshold`)
    for rows in (1, 2):
        logits = torch.zeros(rows, vocab, dtype=model.dtype, device=device)
        probabilities, _ = steps.greedy_distributions(logits, model.config.mask_token_id)
        tokens = torch.zeros(rows, 4, dtype=torch.long, device=device)
        counts = torch.ones(rows, dtype=torch.long, device=device)  # (`ones_like` of a column keeps its stride)
        probability = probabilities[:, :4].clone()
        for redrafts in (None, tokens + 1):  # the model's own tokens, or `[MASK]` queries' (`fused_redraft`)
            steps.judge_infill(tokens, counts, counts + 2, tokens == 0, probability, tokens + 2, redrafts, eos, 0.5)
    # a whole infill round (`score_infill`): one slot with one row or several, several slots with several rows
    text = torch.zeros(16, dtype=torch.long, device=device)
    for slots, rows in ((1, 1), (1, 2), (2, 2)):
        logits = torch.zeros(rows, vocab, dtype=model.dtype, device=device)
        at = 4 + torch.arange(slots * 4, device=device).view(slots, 4)
        # each slot's first token fresh, the first slot's next rows - slots drafts queried
        stored = torch.zeros(slots, dtype=torch.long, device=device)
        counts, until = stored + 1, stored + 2
        until[0] += rows - slots
        steps.score_infill(logits, at - 4, stored, counts, until, eos, model.config.mask_token_id, threshold, text, at,
                           lookup_drafts)  # fmt: skip
    # a whole verify forward (`score_verify`): one slot or several, one token each or several
    keep_drafts = torch.tensor(False, device=device)
    for slots, width in ((1, 1), (1, 2), (2, 1), (2, 2)):
        logits = torch.zeros(slots, width, vocab, dtype=model.dtype, device=device)
        at = 4 + torch.arange(slots * 4, device=device).view(slots, 4)
        steps.score_verify(logits, at - 4, eos, model.config.mask_token_id, threshold, keep_drafts, text, at,
                           lookup_drafts)  # fmt: skip
        # a whole plan forward (`score_plan`): the slots' first tokens, or all of them
        steps.score_plan(logits, at - 4, model.config.mask_token_id, threshold, text, at, lookup_drafts)
    if lookup_drafts:
        warm_up_copies(device, lookup_drafts, model.config.mask_token_id, steps)


@torch.no_grad()  # (as decodes run: grad mode is among a graph's guards)
def warm_up_copies(device, count: int, unknown: int, steps: StepFunctions | None = None) -> None:
    """Compile `compiled_steps().copy_drafts` (or `steps.copy_drafts`) for `count` drafts on `device` now, for one slot
    and for several."""
    slot_size = 4  # (any size above one: sizes are dynamic)
    text = torch.zeros(4 * slot_size, dtype=torch.long, device=device)
    for slots in (1, 2):
        at = slot_size + torch.arange(slots * slot_size, device=device).view(slots, slot_size)
        counts = torch.ones(slots, dtype=torch.long, device=device)
        (steps or compiled_steps()).copy_drafts(text, at, torch.zeros_like(at), counts, count, unknown)


class SlotCache(Cache):
    """Static K/V storage for slot decoding: `[batch, kv heads, max_cache_len, head dim]` per layer, allocated once
    (transformers' `StaticLayer`), which `torch.compile` can capture. Each row keeps its stored tokens in storage
    order at columns 0, 1, ... (a token's column is its rank); a forward writes its new tokens at the `columns`
    (`[batch, width]`) the executor sets, and keeping only the accepted queries is moving the row's write pointer
    back: the next forward overwrites the rest, and the mask hides every column not yet written or dropped. A forward
    attends over the first `window` columns (`key_window`; the executor sets it with the mask, whose columns match)."""

    def __init__(self, model, batch_size: int, max_cache_len: int):
        text_config = model.config.get_text_config(decoder=True)
        super().__init__(layers=[StaticLayer(max_cache_len) for _ in range(text_config.num_hidden_layers)])
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        self.early_initialization(batch_size, text_config.num_key_value_heads, head_dim, model.dtype, model.device)
        self.max_cache_len = self.window = max_cache_len  # window: the columns a forward attends over (`key_window`)
        self.columns = torch.zeros(batch_size, 1, dtype=torch.long, device=model.device)
        self.rows = torch.arange(batch_size, device=model.device)[:, None]  # each row's index, against its columns
        self.lock = threading.Lock()  # held by the decode using the cache (`claimed`)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        # An indexed assignment, which inductor writes in place into the cache tensors; `scatter_` there became a copy
        # of each layer's keys and values, written back after attention.
        layer, rows = self.layers[layer_idx], self.rows[: key_states.shape[0]]
        layer.keys[rows, :, self.columns] = key_states.transpose(1, 2)
        layer.values[rows, :, self.columns] = value_states.transpose(1, 2)
        if self.window < self.max_cache_len:
            return layer.keys[:, :, : self.window], layer.values[:, :, : self.window]
        return layer.keys, layer.values

    def __getstate__(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if key != "lock"}  # (a copy gets a lock of its own)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, lock=threading.Lock())

    @contextlib.contextmanager
    def claimed(self):
        """Hold the cache for one decode: a model keeps its compiled decodes' cache, and two threads decoding with it
        at once would overwrite each other's keys and values."""
        if not self.lock.acquire(blocking=False):
            raise RuntimeError(
                "This model is already decoding over its static cache in another thread: decode from one thread at a "
                "time, give each thread a model of its own, or use cache_implementation='dynamic'."
            )
        try:
            yield self
        finally:
            self.lock.release()

    def fits(self, model, batch_size: int, max_cache_len: int) -> bool:
        """Whether this cache serves a decode of `batch_size` rows needing `max_cache_len` columns on `model`."""
        keys = self.layers[0].keys
        return (keys.shape[0], keys.dtype, keys.device) == (batch_size, model.dtype, model.device) and (
            max_cache_len <= self.max_cache_len
        )


def cache_length(needed: int) -> int:
    """`needed` columns rounded up to a multiple of `CACHE_LENGTH_MULTIPLE`."""
    return -(-needed // CACHE_LENGTH_MULTIPLE) * CACHE_LENGTH_MULTIPLE


def key_windows(max_cache_len: int) -> list[int]:
    """The key windows of a static cache of `max_cache_len` columns: `CACHE_LENGTH_MULTIPLE` doubled while shorter,
    then the whole cache."""
    windows = [min(CACHE_LENGTH_MULTIPLE, max_cache_len)]
    while windows[-1] < max_cache_len:
        windows.append(min(2 * windows[-1], max_cache_len))
    return windows


def key_window(needed: int, width: int, max_cache_len: int) -> int:
    """The columns a forward of `width` new tokens a row attends over, its rows needing the first `needed` (stored
    and new tokens): the fewest of `key_windows` that hold them where `width` is at most `WINDOW_WIDTH`, else all."""
    if width > WINDOW_WIDTH:
        return max_cache_len
    return next(window for window in key_windows(max_cache_len) if window >= min(needed, max_cache_len))


def slot_cache(model, batch_size: int, needed: int, keep: bool = True) -> SlotCache:
    """A static cache of at least `needed` columns (rounded up to `CACHE_LENGTH_MULTIPLE`). With `keep`, the model's
    kept one when it fits, else a new one kept in its place (`model._refusion_slot_cache`): compiled forwards then see
    the same cache tensors from one `generate()` call to the next. The kept cache is the size of the longest decode
    since; `del model._refusion_slot_cache` frees it. Without `keep`, a new cache for the caller alone."""
    length = cache_length(needed)
    if not keep:
        return SlotCache(model, batch_size, length)
    cache = getattr(model, "_refusion_slot_cache", None)
    if cache is None or not cache.fits(model, batch_size, length):
        cache = SlotCache(model, batch_size, length)
        model._refusion_slot_cache = cache
    return cache


class CacheLayout:
    """Where the rows' tokens are in a `DynamicCache` (or, with no cache, in a forward that recomputes them): one
    column per token of the batch, appended forward after forward; rows of different lengths leave holes, hidden by
    giving them rank `NEVER`. Rows that finish leave the batch."""

    def __init__(self, cache: DynamicCache | None, batch_size: int, device):
        self.cache, self.rows = cache, list(range(batch_size))
        self.ranks = torch.zeros((batch_size, 0), dtype=torch.long, device=device)  # per row and cache column
        self.groups = torch.zeros_like(self.ranks)

    def batch_rows(self, live: list[int]) -> list[int]:
        """The rows of the next forward's batch: the `live` ones (the cache drops the others)."""
        if live != self.rows and self.cache is not None:
            # one upload for all three (a tensor indexed with a list copies it to the device and waits there)
            keep = upload([self.rows.index(row) for row in live], self.ranks.device)
            self.cache.batch_select_indices(keep)
            self.ranks, self.groups = self.ranks[keep], self.groups[keep]
        self.rows = live
        return live

    def mask(self, batch: dict, sizes: list[int], dtype) -> torch.Tensor:
        """The attention mask of the batch's new tokens (`sizes` per row, before left padding), appended after the
        cache's columns."""
        key_ranks = torch.cat([self.ranks, batch["ranks"]], dim=1)
        key_groups = torch.cat([self.groups, batch["groups"]], dim=1)
        return attention_mask(key_ranks, key_groups, batch["ranks"], batch["prefixes"], batch["groups"],
                              batch["parents"], self.ranks.shape[1], dtype)  # fmt: skip

    def keep(self, batch: dict, sizes: list[int], kept: list[int]) -> None:
        """After a forward: each row keeps its first `kept` new tokens (pending and accepted queries), the rest goes."""
        if self.cache is None:
            return
        width = batch["ids"].shape[1]
        kept_ends = [width - size + count for size, count in zip(sizes, kept)]
        end = max(kept_ends)
        keep = torch.arange(end, device=self.ranks.device) < upload(kept_ends, self.ranks.device)[:, None]
        self.ranks = torch.cat([self.ranks, batch["ranks"][:, :end].masked_fill(~keep, NEVER)], dim=1)
        self.groups = torch.cat([self.groups, batch["groups"][:, :end]], dim=1)
        self.cache.crop(end - width)


class StaticLayout:
    """Where the rows' tokens are in a `SlotCache`: row r's stored tokens at columns 0 .. pointer[r] - 1; a forward's
    new tokens at pointer[r] onwards, its left padding after them. The batch keeps its rows (finished rows run as
    padding), so shapes stay static."""

    def __init__(self, cache: SlotCache, batch_size: int, device, steps: StepFunctions | None = None):
        self.cache, self.pointers, self.steps = cache, [0] * batch_size, steps or EAGER_STEPS
        self.columns = torch.arange(cache.max_cache_len, device=device)
        self.groups = torch.full((batch_size, cache.max_cache_len), PADDING["groups"], device=device)

    def batch_rows(self, live: list[int]) -> list[int]:
        return list(range(len(self.pointers)))

    def mask(self, batch: dict, sizes: list[int], dtype) -> torch.Tensor:
        """The attention mask of the batch's new tokens (`sizes` per row, before left padding), which go to the cache
        at its rows' pointers (`static_mask`), over the cache's key window for the forward (`key_window`), which this
        sets."""
        width, needed = batch["ids"].shape[1], max(self.pointers) + batch["ids"].shape[1]
        if needed > self.cache.max_cache_len:
            raise RuntimeError(
                f"The static cache ({self.cache.max_cache_len} columns) is too short for this forward: a row has "
                f"{max(self.pointers)} stored tokens and {width} new ones. This is a bug in sizing the cache."
            )
        pointers, lengths = upload([*self.pointers, *sizes], self.columns.device).view(2, -1)
        self.cache.columns, self.groups, mask = self.steps.static_mask(
            pointers, lengths, self.columns, self.groups, batch["ranks"], batch["prefixes"], batch["groups"],
            batch["parents"], dtype,
        )  # fmt: skip
        self.cache.window = key_window(needed, width, self.cache.max_cache_len)
        return mask[..., : self.cache.window]  # (the columns past it: not written yet, hidden)

    def keep(self, batch: dict, sizes: list[int], kept: list[int]) -> None:
        self.pointers = [pointer + count for pointer, count in zip(self.pointers, kept)]


def compiled_backbone(model, compile_config: CompileConfig, saved_in: str | os.PathLike | None = None):
    """The model's backbone (`get_decoder()`) under `torch.compile` with `compile_config`, compiled once per model and
    config, called as the backbone is and returning the last hidden states of its new tokens, or their logits where the
    new tokens number no more than its `logits_width` (see below; `run_model` reads it). Its graphs (one per width
    bucket, cache length and batch size) are reused by later `generate()` calls. They may number more than dynamo's
    default limit of graphs per function (8; past it a `fullgraph` compile fails), so the calls raise that limit to
    `RECOMPILE_LIMIT` while they run. The function compiled is this file's own (dynamo counts graphs per function:
    compiling `module.__call__` would share the count with every other compiled module, such as a compiled AR's).

    With inductor's weight freezing (`"freezing": True` among `compile_config.options`, which here may go with a
    `mode`, or `torch._inductor.config.freezing = True`), the weights become constants of the graphs, packed for the
    machine's GEMM kernels. Dynamo reads that switch while it traces, where torch.compile's options do not reach, so
    the calls set it themselves. Graphs then hold the weights of the moment they were compiled: when a weight has
    changed since (in place or replaced), a fresh backbone compiles again, so a decode never runs old weights. Then
    the graphs of up to `LOGITS_IN_GRAPH_WIDTH` new tokens also run the output layer (its `logits_width`; 0 without
    freezing, where a graph would multiply by the same unpacked weight as an eager call, over a whole bucket).

    With `saved_in` (a folder: `generate(compile_cache_dir=...)`) the forwards are compiled ahead of time instead and
    kept there (`SavedForwards`), so that a later process loads them rather than compiling; they hold the weights
    (frozen or not), so a weight change also means a fresh backbone."""
    saved = Path(saved_in) if saved_in is not None else None
    weights = frozen_weights(model, compile_config, held=saved is not None)
    compiled = getattr(model, "_refusion_compiled", None)
    # The backbone's id too: a deep copy of the model carries this record, whose functions run the original's layers.
    # The attention implementation too: the graphs are traced through it.
    record = (compile_config, weights, saved, id(model.get_decoder()), attention_implementation(model))
    if compiled is None or compiled[:5] != record:
        if saved is not None:
            backbone = SavedForwards(model, compile_config, saved)
        else:
            arguments = compile_config.to_dict()
            options = {key: value for key, value in (arguments.pop("options") or {}).items() if key != "freezing"}
            freezing, logits_width = weights is not None, graph_logits_width(compile_config)
            compiled_function = torch.compile(
                decoder_function(model, logits_width), **arguments, options=options or None
            )

            kernels = cpu_kernel_configs(model.device, {"freezing": freezing})

            def backbone(**inputs):
                limit = max(RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)
                with torch._dynamo.config.patch(recompile_limit=limit), torch._inductor.config.patch(kernels):
                    return compiled_function(inputs)

            backbone.logits_width = logits_width

        compiled = (copy.deepcopy(compile_config), *record[1:], backbone)
        model._refusion_compiled = compiled
    return compiled[5]


class SavedForwards:
    """The backbone's forwards compiled ahead of time (`torch.export`, then AOTInductor with the compile config's mode
    and options), one package per input shape (batch size, width, cache length), kept in `folder` as `<key>.pt2`: a
    later process loads a package where `torch.compile` traces and compiles again (each width, even with inductor's disk
    cache warm, and longest with frozen weights). The key (`saved_forward_key`) covers what a package depends on: the
    weights' contents (a package holds them, frozen or not), the model's class, config, dtype and device, the compile
    config, this file's source and the versions of torch and transformers. A package is checked against the digest kept
    beside it before it loads, and one that fails (damaged, another key's, or without a digest) or does not load (built
    elsewhere) is compiled again, with a warning (`load_or_build_package`). Packages are written whole (to a partial
    file, then renamed), so processes may share a folder. Called as the compiled backbone is (`run_model`); CUDA graphs
    (`mode="reduce-overhead"`) do not apply to packages.

    On a CPU without oneDNN's bfloat16 kernels (AVX2), autotuned forwards with frozen weights take their matrix
    products from inductor's C++ template alone (`max_autotune_gemm_backends="CPP"`, unless the compile config names
    the backends): AOTInductor free to choose took ATen's unpacked product for some linear layers of a narrow
    package, which then cost well above its one-query package, where `torch.compile`, free or not, takes the template
    throughout (the like on CUDA: pytorch/pytorch#180811). Where the template has no kernel for some product (a dtype
    it does not cover), the package is compiled with the backends the config gives. Where oneDNN has bfloat16 kernels
    (AVX512-BF16, AMX) autotuning chooses freely: without AMX the template multiplies bfloat16 in float32, and
    autotuning takes oneDNN's packed product for the wider forwards, which the template alone would make dearer.

    On a CPU with AMX (`amx_bfloat16`), autotuned forwards with frozen weights of up to `WINDOW_WIDTH` new tokens take
    their products from inductor's C++ template alone (there autotuning takes it for each width anyway; left to
    choose for a width it does not know, it took oneDNN's, the slower) and keep their weights outside their code
    (`WEIGHTS_APART`), where the template's packed layout does not depend on the width: the packages run from one copy
    of the weights (`SharedWeights`), so that a decode alternating widths does not evict one package's weights from
    the processor's caches with another's. Run in turn as a decode runs them, the narrow forwards so cost less than
    from one package of dynamic width (one query padded to two) or from packages each with a copy of its own, with
    the same logits.

    On a CPU with oneDNN's bfloat16 kernels but no AMX (AVX512-BF16 alone), autotuned forwards with frozen weights of up
    to `WINDOW_WIDTH` new tokens are compiled twice, as configured and with oneDNN's packed products alone
    (`max_autotune_gemm_backends="ATEN"`), and the package whose forward runs faster on the forward's own inputs is the
    one kept (`race_packages`). Autotuning times each product alone with its weights in the caches, where the template
    wins at narrow widths; a forward streams all the weights, where oneDNN's kernels (AVX512-BF16) can do better, and
    which does depends on the processor. The race costs a second compile of the narrow widths."""

    def __init__(self, model, compile_config: CompileConfig, folder: Path):
        if compile_config.backend != "inductor":
            raise ValueError(
                f"compile_cache_dir keeps forwards compiled by inductor (AOTInductor); the compile config asks for "
                f"backend={compile_config.backend!r}."
            )
        mode_options = torch._inductor.list_mode_options(compile_config.mode or "default")
        mode_options.pop("triton.cudagraphs", None)
        configs = cpu_kernel_configs(model.device, {**mode_options, **(compile_config.options or {})})
        self.attempts = [configs]  # the inductor configs to compile a package with, in turn until one compiles
        autotuned = configs.get("max_autotune") or configs.get("max_autotune_gemm")
        # autotuned CPU packages with frozen weights whose GEMM backends this class picks (the config names none)
        picks_backends = model.device.type == "cpu" and autotuned and freezes_weights(compile_config) \
            and "max_autotune_gemm_backends" not in configs  # fmt: skip
        if picks_backends and not onednn_bfloat16():
            self.attempts = template_first(configs)
        self.model, self.folder, self.runners = model, folder, {}
        self.fingerprint = saved_forward_key(model, compile_config)
        self.logits_width = graph_logits_width(compile_config)
        # the inductor configs of the narrow widths' packages, whose weights are shared, in turn; None: compiled as
        # the others are, each with weights of its own
        self.narrow_attempts = None
        if amx_bfloat16(model.device) and autotuned and self.logits_width >= WINDOW_WIDTH \
                and configs.get("max_autotune_gemm_backends", "CPP") == "CPP":  # fmt: skip
            self.narrow_attempts = [{**attempt, **WEIGHTS_APART} for attempt in template_first(configs)]
        self.weights = SharedWeights()
        # the inductor configs a narrow width's package races against, in turn; None: compiled as configured alone
        self.rival_attempts = None
        if picks_backends and onednn_bfloat16() and not amx_bfloat16(model.device):
            self.rival_attempts = [{**configs, "max_autotune_gemm_backends": "ATEN"}]
        # the decoder's attention masks, scoring, whole infill rounds and copied drafts, compiled ahead of time beside
        # the forwards (a fused-redraft round's decision stays compiled)
        self.steps = dataclasses.replace(
            compiled_steps(),
            greedy_distributions=SavedStep(greedy_distributions, folder, ({0: "rows"}, None)),
            copy_drafts=SavedStep(copy_drafts, folder, ({0: "text"}, *[{0: "slots"}] * 3, None, None)),
            static_mask=SavedStep(static_mask, folder, (
                {0: "rows"}, {0: "rows"}, {0: "columns"}, {0: "rows", 1: "columns"}, *[{0: "rows", 1: "width"}] * 4,
                None,
            )),
            score_infill=SavedStep(score_infill, folder, (
                {0: "logits"}, *[{0: "slots"}] * 4, {0: "eos"}, None, {}, {0: "text"}, {0: "slots"}, None,
            )),
            score_verify=SavedStep(score_verify, folder, (
                {0: "slots", 1: "width"}, {0: "slots"}, {0: "eos"}, None, {}, {}, {0: "text"}, {0: "slots"}, None,
            )),
            score_plan=SavedStep(score_plan, folder, (
                {0: "slots", 1: "width"}, {0: "slots"}, None, {}, {0: "text"}, {0: "slots"}, None,
            )),
        )  # fmt: skip

    def __call__(self, input_ids, position_ids, attention_mask, cache: "SlotCache", use_cache: bool = True):
        shape = (*input_ids.shape, cache.max_cache_len, cache.window)
        attention_mask = attention_mask.contiguous()  # (a key window's columns of the mask)
        if shape not in self.runners:
            inputs = (
                input_ids, position_ids, attention_mask, cache.columns,
                [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers],
            )  # fmt: skip
            self.runners[shape] = self.load_or_compile(shape, inputs, cache)
        # the package's inputs as its pytree flattens them, run boxed: its own call reads its specs from JSON and
        # flattens the inputs every time
        flat = [input_ids, position_ids, attention_mask, cache.columns]
        flat += [layer.keys for layer in cache.layers] + [layer.values for layer in cache.layers]
        return self.runners[shape].boxed_run(flat)[0]

    def __deepcopy__(self, memo):
        return self  # a deep copy of the model compiles its own (`compiled_backbone` checks whose layers these are)

    def key(self, shape: tuple[int, int, int, int]) -> str:
        """What the package of forwards of `shape` (batch size, width, cache length, key window) is built for."""
        return f"{self.fingerprint} | batch {shape[0]}, width {shape[1]}, cache {shape[2]}, window {shape[3]}"

    def path(self, shape: tuple[int, int, int, int]) -> Path:
        """Where the package of forwards of `shape` (batch size, width, cache length, key window) is kept."""
        return self.folder / f"{hashlib.sha256(self.key(shape).encode()).hexdigest()[:32]}.pt2"

    @property
    def shares_weights(self) -> bool:
        """Whether the forwards of up to `WINDOW_WIDTH` new tokens run from one copy of the weights."""
        return self.narrow_attempts is not None

    @property
    def kind(self) -> str:
        """The forwards' path as a price table's key names it (`price_key`)."""
        shared = f", widths up to {WINDOW_WIDTH} sharing their weights" if self.shares_weights else ""
        return f"saved (AOTInductor){shared}"

    def load_or_compile(self, shape: tuple[int, int, int, int], inputs: tuple, cache: "SlotCache"):
        """The runner of the package of forwards of `shape`, loaded, or compiled first (from `inputs`, over `cache`)."""
        shared = self.shares_weights and shape[1] <= WINDOW_WIDTH

        def build(package_path: str):
            head = self.model.get_output_embeddings() if shape[1] <= self.logits_width else None
            backbone = ExportedBackbone(self.model.get_decoder(), cache, shape[3], head)
            exported = torch.export.export(backbone, inputs, strict=False)
            compile_package(exported, shape, self.narrow_attempts if shared else self.attempts, package_path)
            if self.rival_attempts and shape[1] <= WINDOW_WIDTH:
                self.keep_faster(exported, shape, inputs, package_path)

        flat = [*inputs[:4], *inputs[4], *inputs[5]]
        load = functools.partial(self.weights.load, inputs=flat) if shared else load_forward
        return load_or_build_package(self.path(shape), self.key(shape), build, "forward", load)

    def keep_faster(self, exported, shape: tuple, inputs: tuple, package_path: str) -> None:
        """Compile the forward `exported` again with `rival_attempts` beside the package at `package_path` and leave
        there whichever runs faster on `inputs` (the forward's own: they write the same keys and values at the same
        columns as the forward will). A rival that does not compile leaves the package as it is, with a warning."""
        rival = Path(package_path).with_name(f"{Path(package_path).stem}.rival.pt2")
        try:
            try:
                compile_package(exported, shape, self.rival_attempts, str(rival))
            except Exception as error:
                logger.warning(f"Compiling the forward of {shape} with oneDNN's products alone failed "
                               f"({type(error).__name__}: {str(error)[:300]}); keeping it as configured.")  # fmt: skip
                return
            flat = [*inputs[:4], *inputs[4], *inputs[5]]
            configured, alone = race_packages([package_path, str(rival)], flat)
            kept = "oneDNN's" if alone < configured else "as configured"
            logger.info(f"The forward of {shape}: {1e3 * configured:.2f} ms as configured, {1e3 * alone:.2f} ms with "
                        f"oneDNN's products alone; keeping the package {kept}.")  # fmt: skip
            if alone < configured:
                os.replace(rival, package_path)
        finally:
            rival.unlink(missing_ok=True)


def compile_package(exported, shape: tuple, attempts: list[dict], package_path: str) -> None:
    """Compile the forward of `shape` `exported` into an AOTInductor package at `package_path` with the first of the
    inductor configs `attempts` that compiles it (the earlier ones: inductor's C++ GEMM template alone)."""
    for attempt, configs in enumerate(attempts, 1):
        try:
            torch._inductor.aoti_compile_and_package(exported, package_path=package_path, inductor_configs=configs)
            return
        except Exception as error:
            if attempt == len(attempts):
                raise
            logger.warning(f"Compiling the forward of {shape} with inductor's C++ GEMM template alone failed "
                           f"({type(error).__name__}: {str(error)[:300]}); compiling it with the compile config's "
                           "GEMM backends.")  # fmt: skip


def race_packages(paths: list[str], inputs: list[torch.Tensor], rounds: int = PACKAGE_RACE_ROUNDS) -> list[float]:
    """Seconds the fastest run of each saved forward's package at `paths` took on the flat `inputs` (CPU), the packages
    run in turn `rounds` times (so that a busy moment of the machine falls on each alike), the first round untimed."""
    runners = [load_forward(Path(path)) for path in paths]
    seconds = [[] for _ in paths]
    for _ in range(rounds):
        for runner, times in zip(runners, seconds):
            start = time.perf_counter()
            runner.boxed_run(list(inputs))
            times.append(time.perf_counter() - start)
    return [min(times[1:]) for times in seconds]


class SavedStep:
    """A step function compiled ahead of time (`torch.export` with dynamic sizes, then AOTInductor), kept in `folder`
    beside the saved forwards, and called through its package's boxed run. On a CPU the decoder's step functions run
    right after a forward, whose weights have flushed the caches: there a `torch.compile` call pays for the Python
    layers of dynamo and AOTAutograd, cold, whatever it computes, and a package's boxed run for little but the
    computing.

    `dims` gives, for each argument, the axes whose size varies (named; axes of one name have one size), `{}` for a
    tensor whose sizes are fixed and None for an argument that is not a tensor. The other arguments and the fixed
    sizes and dtypes are constants of a package: each set of them has a package of its own (`key`). A call with a
    tensor of size 0 runs the function itself."""

    def __init__(self, function: Callable, folder: Path, dims: tuple[dict[int, str] | None, ...]):
        self.function, self.folder, self.dims, self.runners, self.by_shapes = function, folder, dims, {}, {}
        self.tensors = [index for index, axes in enumerate(dims) if axes is not None]
        self.axes = [dims[index] for index in self.tensors]

    def __call__(self, *arguments):
        if len(arguments) != len(self.dims):
            raise TypeError(f"{self.function.__name__} takes {len(self.dims)} arguments here, not {len(arguments)}.")
        tensors = [arguments[index].contiguous() for index in self.tensors]
        if any(0 in tensor.shape for tensor in tensors):  # (a package serves sizes from 1 up)
            return self.function(*arguments)
        constants = tuple(argument for argument, axes in zip(arguments, self.dims) if axes is None)
        # (the runner by the exact shapes first: the signature's per-axis loop would run for every tensor of a call)
        shapes = (constants, *((tensor.dtype, tensor.device, tensor.shape) for tensor in tensors))
        runner = self.by_shapes.get(shapes)
        if runner is None:
            signature = tuple(
                (tensor.dtype, tensor.device, *(-1 if axis in axes else size for axis, size in enumerate(tensor.shape)))
                for tensor, axes in zip(tensors, self.axes)
            )
            runner = self.runners.get((signature, constants))
            if runner is None:
                runner = self.runners[signature, constants] = self.load_or_compile(arguments, signature, constants)
            if len(self.by_shapes) >= SHAPES_REMEMBERED:
                self.by_shapes.clear()
            self.by_shapes[shapes] = runner
        return tuple(runner.boxed_run(tensors))

    def key(self, signature: tuple, constants: tuple) -> str:
        """What a package depends on: the function, its constants and fixed sizes, this file's source, the versions
        of torch and transformers and the processor."""
        return " | ".join([
            self.function.__name__, repr(signature), repr(constants), repr(self.dims),
            hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16],
            f"torch {torch.__version__}, transformers {transformers_version}, {cpu_name()}",
        ])  # fmt: skip

    def load_or_compile(self, arguments: tuple, signature: tuple, constants: tuple):
        def build(package_path: str):
            # Traced on zeros in which every varying size is at least 2 (a size of 1 would be taken as fixed); the
            # package serves sizes from 1 up.
            named = {}
            for argument, axes in zip(arguments, self.dims):
                for axis, name in (axes or {}).items():
                    named[name] = max(named.get(name, 2), argument.shape[axis])
            dimensions = {name: torch.export.Dim(name.replace(" ", "_"), min=1) for name in named}
            examples, shapes = [], []
            for index in self.tensors:
                tensor, axes = arguments[index], self.dims[index]
                size = [named[axes[axis]] if axis in axes else length for axis, length in enumerate(tensor.shape)]
                examples.append(torch.zeros(size, dtype=tensor.dtype, device=tensor.device))
                shapes.append({axis: dimensions[name] for axis, name in axes.items()} or None)
            module = StepModule(self.function, arguments, self.tensors)
            exported = torch.export.export(module, tuple(examples), dynamic_shapes=(tuple(shapes),), strict=False)
            configs = cpu_kernel_configs(examples[0].device, {})
            torch._inductor.aoti_compile_and_package(exported, package_path=package_path, inductor_configs=configs)

        key = self.key(signature, constants)
        path = self.folder / f"step-{hashlib.sha256(key.encode()).hexdigest()[:32]}.pt2"
        return load_or_build_package(path, key, build, "step")


def load_package(path: Path, arguments: Callable[[list], tuple] = tuple):
    """The runner of the AOTInductor package at `path`: its `boxed_run` takes the flat inputs and gives the flat
    outputs (`PackageRunner.of`; `arguments` makes the flat inputs the package's arguments where that needs them)."""
    return PackageRunner.of(torch._inductor.aoti_load_package(str(path)), arguments)


class PackageRunner:
    """The one place that runs saved AOTInductor packages through a private hook, and the fallback where it is gone.

    `torch._inductor.aoti_load_package(path)` gives an `AOTICompiledModel`, whose public call takes the arguments
    the package was exported with and on every call reads the package's input and output specs (JSON) and flattens
    and unflattens by them. Its `loader` (a `torch._C._aoti.AOTIModelPackageLoader`) has `boxed_run(flat)`, private:
    the package run on its flat input tensors with nothing else done, which the decode's many small calls take. `of`
    decides once, at load: where the loader has a `boxed_run` it is the runner itself (calls cost what they did);
    where not (renamed or gone in another torch), the runner is this adapter, whose `boxed_run` makes the flat inputs
    the package's arguments (`arguments`: a step's tensors as they are, a forward's `forward_arguments`), makes the
    public call and flattens its outputs: decoding as before, slower, with one warning a process."""

    warned = False  # whether this process has warned that packages run through their public call

    def __init__(self, compiled, arguments: Callable[[list], tuple]):
        self.compiled, self.arguments = compiled, arguments

    @classmethod
    def of(cls, compiled, arguments: Callable[[list], tuple] = tuple):
        """The runner of the loaded package `compiled`: its loader where it has `boxed_run`, else an adapter."""
        loader = getattr(compiled, "loader", None)
        if callable(getattr(loader, "boxed_run", None)):
            return loader
        if not cls.warned:
            cls.warned = True
            logger.warning(f"This torch ({torch.__version__}) loads AOTInductor packages without the loader's "
                           "`boxed_run`; saved forwards and steps run through the packages' public call instead, "
                           "which costs more a call.")  # fmt: skip
        return cls(compiled, arguments)

    def boxed_run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return flat_tensors(self.compiled(*self.arguments(inputs)))


def flat_tensors(outputs) -> list:
    """`outputs` (a tensor, or tuples and lists of them, nested) as a flat list in order."""
    if isinstance(outputs, (tuple, list)):
        return [leaf for output in outputs for leaf in flat_tensors(output)]
    return [outputs]


def forward_arguments(inputs: list[torch.Tensor]) -> tuple:
    """A saved forward's flat inputs (the ids, positions, mask and write columns, every layer's keys, then every
    layer's values) as `ExportedBackbone.forward` takes them: the keys and the values each a list."""
    layers = (len(inputs) - 4) // 2
    return (*inputs[:4], list(inputs[4 : 4 + layers]), list(inputs[4 + layers :]))


def load_forward(path: Path):
    """The runner of the saved forward's package at `path` (`load_package`, its arguments `forward_arguments`)."""
    return load_package(path, forward_arguments)


def load_or_build_package(
    path: Path, key: str, build: Callable[[str], None], what: str, load: Callable = load_package
):
    """The runner of the AOTInductor package kept at `path` for `key`, loaded by `load`. Before it loads, a package
    is checked against the digest kept beside it (`package_problem`): loaded unchecked, one with damaged bytes decoded
    wrong tokens without a word or crashed the process inside torch, and another key's package under its name failed
    inside its C++ runner. Where there is no package, or it fails the check or does not load (built elsewhere; these
    two with a warning naming the saved `what`), `build(package_path)` compiles it into a partial file that is then
    renamed to `path`, and its digest is written beside it (`write_package_digest`): a package is seen whole or not at
    all, so processes may share a folder. A build killed on the way leaves the folder as it was but for a partial
    file that nothing loads, removed once `PARTIAL_STALE` old (`remove_stale_partials`: on a process's first package
    in the folder, and before each build). It is built without autograd whatever the caller's grad mode: exported with
    grad enabled, the weights stay the graph's parameters and inductor's freezing leaves them out (a slower package,
    then kept under the same key for every later process)."""
    if path.parent not in SWEPT_FOLDERS:
        SWEPT_FOLDERS.add(path.parent)
        remove_stale_partials(path.parent)
    if path.exists():
        problem = package_problem(path, key)
        if problem is not None:
            logger.warning(f"The saved {what} {path} {problem}; compiling it again.")
        else:
            try:
                return load(path)
            except Exception as error:  # any failure to load means: compile it again
                logger.warning(f"The saved {what} {path} did not load ({type(error).__name__}: {error}); compiling "
                               "it again.")  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(path.parent)
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.pt2")
    try:
        with torch.no_grad():
            build(str(partial))
        digest = file_digest(partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    write_package_digest(path, key, digest)
    return load(path)


SWEPT_FOLDERS: set[Path] = set()  # the folders of packages whose stale partial files this process has removed
# the partial files of a package, of the rival compiled beside it (`SavedForwards.keep_faster`) and of a digest
PARTIAL_NAME = re.compile(r".+\.\d+\.partial(\.rival)?\.pt2|.+\.pt2\.digest\.\d+\.partial")


def remove_stale_partials(folder: Path) -> None:
    """Remove the partial files of packages and digests in `folder` (`PARTIAL_NAME`) at least `PARTIAL_STALE` old:
    left by builds that were killed. Younger ones may be a live build's, in this process or another."""
    try:
        names = os.listdir(folder)
    except OSError:  # (no folder yet)
        return
    now = time.time()
    for name in filter(PARTIAL_NAME.fullmatch, names):
        try:
            if now - (folder / name).stat().st_mtime >= PARTIAL_STALE:
                (folder / name).unlink()
        except OSError:  # (removed meanwhile by another process)
            continue


def digest_path(path: Path) -> Path:
    """Where the digest of the package at `path` is kept: beside it, as `<name>.digest`."""
    return path.with_name(f"{path.name}.digest")


def file_digest(path: Path) -> str:
    """The sha256 of the bytes of the file at `path` (hex)."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def package_problem(path: Path, key: str) -> str | None:
    """What is wrong with the package at `path` as the one built for `key`, or None where nothing is: the digest kept
    beside it (`digest_path`, JSON: the key and the sha256 of its bytes) is missing or unreadable, names another key
    (another package put under this name: files swapped or copied), or another sha256 than the file's (damaged since).
    Checked once, as the package loads (a loaded runner is kept), by hashing the whole file. The digest is read after
    the file, so that a package another process has just built again here is judged with its own."""
    record_path = digest_path(path)
    try:
        digest = file_digest(path)
    except OSError as error:
        return f"could not be read ({error})"
    try:
        record = json.loads(record_path.read_text())
    except FileNotFoundError:
        return f"has no digest beside it ({record_path.name})"
    except (OSError, ValueError) as error:
        return f"has an unreadable digest {record_path.name} ({type(error).__name__})"
    if not isinstance(record, dict) or not isinstance(record.get("key"), str):
        return f"has an unreadable digest {record_path.name} (no key)"
    if record["key"] != key:
        return f"was built for another key than its name's (per {record_path.name}: another package put in its place)"
    if record.get("sha256") != digest:
        return f"does not match its digest {record_path.name} (its bytes changed since it was written)"
    return None


def write_package_digest(path: Path, key: str, digest: str) -> None:
    """Keep beside the package at `path` (`digest_path`) the `key` it was built for and the sha256 of its bytes
    (`digest`), written whole (a partial file, then renamed). Where it cannot be, a warning: the next process to load
    the package compiles it again."""
    record = digest_path(path)
    partial = record.with_name(f"{record.name}.{os.getpid()}.partial")
    try:
        partial.write_text(json.dumps({"key": key, "sha256": digest}))
        os.replace(partial, record)
    except OSError as error:
        logger.warning(f"The digest of the saved package {path} could not be written to {record} ({error}); the "
                       "next process will compile the package again.")  # fmt: skip
    finally:
        partial.unlink(missing_ok=True)


class SharedWeights:
    """One copy in memory of the weights of AOTInductor packages compiled with their weights outside their code
    (`WEIGHTS_APART`: a `.blob` of every constant, laid out as the package's C++ wrapper lists them). `load` runs a
    package from the copies of constants that earlier packages loaded where they are the same byte for byte (by name,
    dtype, shape and strides), and keeps its others for later ones. Packages of one frozen model that differ in the
    width of their forwards hold the same folded weights (inductor's C++ GEMM template packs them alike whatever the
    row count): they then run from one copy. The first package loaded so runs once on a forward's inputs both ways,
    from the constants read here and with its own loader's, and must give the same outputs bit for bit (the reading
    rests on AOTInductor's layout of the blob, which no API states); where it does not, it and every later package
    load with weights of their own, with a warning, as does a package whose constants cannot be read so."""

    dtypes = {
        "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
        "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
        "bool": torch.bool,
    }  # fmt: skip

    def __init__(self):
        self.kept = {}  # (name, dtype, shape, strides) -> (the constant's bytes, the constant)
        self.checked = False  # whether a package ran from constants read here as from its loader's own
        self.refused = False  # whether one ran otherwise: then none shares

    def load(self, path: Path, inputs: list[torch.Tensor]):
        """The runner of the package at `path` (its `boxed_run` takes the flat inputs), over shared constants;
        `inputs` are a forward's own flat inputs (they write what it will write), for the first package's check."""
        if self.refused:
            return load_forward(path)
        try:  # (a package that does not load at all fails again below, and is compiled again)
            with tempfile.TemporaryDirectory() as folder:
                with zipfile.ZipFile(path) as archive:
                    archive.extractall(folder)
                (code,), (blob,), (wrapper,) = (list(Path(folder).rglob(f"*.{end}")) for end in
                                                ("wrapper.so", "wrapper_weights.blob", "wrapper.cpp"))  # fmt: skip
                runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(code), 1)  # (loaded: the files may go)
                data = torch.empty(blob.stat().st_size, dtype=torch.uint8)
                with blob.open("rb") as file:
                    if file.readinto(data.numpy()) != data.numel():
                        raise ValueError(f"{blob.name} was read short")
                constants = package_constants(wrapper.read_text(), data)
            if set(constants) != set(runner.get_constant_names_to_dtypes()):
                raise ValueError("the constants listed by the wrapper are not the package's")
            shared = {}
            for name, (raw, tensor) in constants.items():
                key = (name, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
                kept = self.kept.get(key)
                if kept is None or not torch.equal(kept[0], raw):
                    kept = self.kept[key] = (raw, tensor)
                shared[name] = kept[1]
            runner.update_constant_buffer(shared, False, True, True)  # active buffer, every constant, user-managed
            if not self.checked:
                self.check(runner, path, inputs)
        except Exception as error:
            logger.warning(f"The saved forward {path} does not run from weights shared with other widths' "
                           f"({type(error).__name__}: {str(error)[:300]}); it loads with its own.")  # fmt: skip
            return load_forward(path)
        return SharedWeightsRunner(runner, shared)

    def check(self, runner, path: Path, inputs: list[torch.Tensor]) -> None:
        """Run `runner` (the package at `path` over constants read here) and the package with its own loader's on
        `inputs`; where their outputs differ, share no weights from now on (a ValueError)."""
        own = load_forward(path).boxed_run(list(inputs))
        if not all(torch.equal(mine, theirs) for mine, theirs in zip(runner.run(list(inputs)), own)):
            self.refused, self.kept = True, {}
            raise ValueError("its outputs from the weights as read here differ from its own loader's; no package will "
                             "share weights")  # fmt: skip
        self.checked = True


class SharedWeightsRunner:
    """An AOTInductor package's runner over constants it does not own (`SharedWeights`): holds them while it runs."""

    def __init__(self, runner, constants: dict[str, torch.Tensor]):
        self.runner, self.constants = runner, constants

    def boxed_run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.runner.run(inputs)


def package_constants(wrapper: str, blob: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The constants of an AOTInductor package kept apart from its code (`WEIGHTS_APART`), by name: each its bytes in
    `blob` (the package's weights file, read as bytes) and the tensor over them, as `wrapper` (the package's C++
    wrapper source, whose `constants_info_` lists each constant's dtype, byte size, shape, strides and offset, in the
    blob's order, each padded to 64 bytes) describes them. A ValueError where they do not fill the blob."""
    fields = {}
    for index, name, value in re.findall(r"constants_info_\[(\d+)\]\.(\w+) = (.*);", wrapper):
        fields.setdefault(int(index), {})[name] = value.strip('"')
    constants, start = {}, 0
    for index in sorted(fields):
        info = fields[index]
        if info["from_folded"] != "false" or info["device_type"] != "cached_torch_device_type_cpu":
            raise ValueError(f"constant {info['name']} is not a CPU weight of the blob")
        size = int(info["data_size"])
        raw = blob[start : start + size]
        if raw.numel() != size:
            raise ValueError(f"the weights file ends before constant {info['name']}")
        dtype = SharedWeights.dtypes[info["dtype"].removeprefix("cached_torch_dtype_")]
        shape, strides = ([int(value) for value in re.findall(r"-?\d+", info[what])] for what in ("shape", "stride"))
        typed = raw.view(dtype)
        constants[info["name"]] = raw, typed.as_strided(shape, strides, typed.storage_offset() + int(info["offset"]))
        start += -(-size // 64) * 64
    if not constants or start < blob.numel():
        raise ValueError(f"the wrapper lists {start} bytes of constants for a weights file of {blob.numel()}")
    return constants


class StepModule(torch.nn.Module):
    """A step function as `torch.export` takes it: its tensor arguments (at `tensors`) are the inputs, the others
    the `arguments` given here."""

    def __init__(self, function: Callable, arguments: tuple, tensors: list[int]):
        super().__init__()
        self.function, self.tensors = function, tensors
        self.arguments = [None if index in tensors else argument for index, argument in enumerate(arguments)]

    def forward(self, *tensors):
        arguments = list(self.arguments)
        for index, tensor in zip(self.tensors, tensors):
            arguments[index] = tensor
        return self.function(*arguments)


class ExportedBackbone(torch.nn.Module):
    """The backbone as `torch.export` takes it: the cache's key/value tensors and write columns are inputs (written in
    place), so a package serves any cache of the same shape; attention is over its first `window` columns. Returns the
    last hidden states, or with a `head` (the output layer) the logits."""

    def __init__(self, decoder, cache: "SlotCache", window: int, head=None):
        super().__init__()
        self.decoder, self.cache, self.window, self.head = decoder, cache, window, head

    def forward(self, input_ids, position_ids, attention_mask, columns, keys, values):
        cache = copy.copy(self.cache)  # the same cache over the inputs' tensors
        cache.layers = [copy.copy(layer) for layer in self.cache.layers]
        for layer, layer_keys, layer_values in zip(cache.layers, keys, values):
            layer.keys, layer.values = layer_keys, layer_values
        cache.columns, cache.window = columns, self.window
        output = self.decoder(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, cache=cache, use_cache=True
        )
        return output.last_hidden_state if self.head is None else self.head(output.last_hidden_state)


def template_first(configs: dict) -> list[dict]:
    """Inductor `configs` as attempts in turn: with inductor's C++ GEMM template as the only backend first, then as
    given where that differs (for products the template has no kernel for)."""
    template = {**configs, "max_autotune_gemm_backends": "CPP"}
    return [template] if template == configs else [template, configs]


def cpu_kernel_configs(device, configs: dict) -> dict:
    """Inductor `configs` for compiling forwards or steps on `device`, with `cpp.min_chunk_size` at `CPU_MIN_CHUNK`
    on a CPU where they do not name it."""
    if torch.device(device).type == "cpu":
        return {"cpp.min_chunk_size": CPU_MIN_CHUNK, **configs}
    return configs


def amx_bfloat16(device) -> bool:
    """Whether `device` is a CPU with AMX's bfloat16 tiles (Intel Sapphire Rapids and later)."""
    return torch.device(device).type == "cpu" and bool(torch.cpu.get_capabilities().get("amx_bf16"))


def onednn_bfloat16() -> bool:
    """Whether oneDNN has bfloat16 kernels for this CPU (AVX512-BF16 or AMX)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def saved_forward_key(model, compile_config: CompileConfig) -> str:
    """What a saved forward depends on besides its input shape, as one string (see `SavedForwards`)."""
    weights = hashlib.blake2b(digest_size=16)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        weights.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
        data = tensor.detach().contiguous().cpu()
        weights.update(data.reshape(-1).view(torch.uint8).numpy() if data.numel() else b"")
    return " | ".join([
        type(model).__name__,
        hashlib.sha256(model.config.to_json_string(use_diff=False).encode()).hexdigest()[:16],
        weights.hexdigest(),
        f"{device_name(model)} {model.dtype}, attention {attention_fingerprint(model)}",
        json.dumps(compile_config.to_dict(), sort_keys=True, default=str),
        hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16],
        f"torch {torch.__version__}, transformers {transformers_version}",
    ])  # fmt: skip


def decoder_function(model, logits_width: int):
    """The model's backbone as a function of its inputs with a code object of its own (dynamo keeps compiled graphs
    per code object, so a new one starts with none: graphs with frozen weights of an earlier compile are not reused),
    returning the last hidden states, or the logits where the new tokens number at most `logits_width`."""
    decoder, head = model.get_decoder(), model.get_output_embeddings()

    def backbone(inputs: dict):
        hidden = decoder(**inputs).last_hidden_state
        return head(hidden) if hidden.shape[1] <= logits_width else hidden

    code = backbone.__code__.replace(co_name=f"refusion_backbone_{id(decoder):x}")
    return type(backbone)(code, backbone.__globals__, code.co_name, None, backbone.__closure__)


def frozen_weights(model, compile_config: CompileConfig, held: bool = False) -> tuple | None:
    """None unless `compile_config` freezes weights into the graphs (its `options`' "freezing", by default inductor's
    global `torch._inductor.config.freezing`) or the compiled forwards hold them anyway (`held`: saved forwards); then
    what identifies the model's current weights: each parameter's and buffer's memory, dtype and version (any
    in-place change moves the version)."""
    if not (held or freezes_weights(compile_config)):
        return None
    return tuple((tensor.data_ptr(), tensor.dtype, tensor._version if not tensor.is_inference() else -1)
                 for tensor in module_tensors(model))  # fmt: skip


def module_tensors(model) -> list[torch.Tensor]:
    """Every parameter and buffer of `model` and its submodules, in a fixed order (a shared one as often as it is
    registered). (A walk of the modules' own dicts: `parameters()` and `buffers()` build every submodule's dotted name
    on the way, which `generate()` paid once a call.)"""
    tensors, modules = [], [model]
    while modules:
        module = modules.pop()
        own = (*module._parameters.values(), *module._buffers.values())
        tensors += [tensor for tensor in own if tensor is not None]
        modules += module._modules.values()
    return tensors


def freezes_weights(compile_config: CompileConfig) -> bool:
    """Whether inductor compiles under `compile_config` with the weights frozen into the graphs."""
    return bool((compile_config.options or {}).get("freezing", torch._inductor.config.freezing))


def graph_logits_width(compile_config: CompileConfig) -> int:
    """Up to how many new tokens a compiled forward under `compile_config` ends with the output layer: with frozen
    weights `LOGITS_IN_GRAPH_WIDTH` (inductor packs the output layer's weight there), else 0 (see `run_model`)."""
    return LOGITS_IN_GRAPH_WIDTH if freezes_weights(compile_config) else 0


def width_buckets(draft_schedule: str) -> tuple[int, ...]:
    """The widths compiled forwards run at under `draft_schedule`: `WIDTH_BUCKETS`, and for priced drafts the
    `NARROW_BUCKETS` too."""
    return NARROW_BUCKETS + WIDTH_BUCKETS if draft_schedule == "price" else WIDTH_BUCKETS


def packed_for(model, width: int) -> bool:
    """Whether every linear layer of `model` computes a forward of `width` new tokens through prepacked kernels
    (`kernels_refusion.prepack_linears`: layers with a `packed_from(dtype)`, the fewest rows packed in that dtype)."""

    def packs(layer) -> bool:
        rows = layer.packed_from(layer.weight.dtype) if hasattr(layer, "packed_from") else None
        return rows is not None and rows <= width

    # (lazily: a model whose first linear layer is not packed, as one never prepacked, is answered there)
    layers = (module for module in model.modules() if isinstance(module, torch.nn.Linear))
    first = next(layers, None)
    return first is not None and packs(first) and all(map(packs, layers))


def pad_width(width: int, buckets: tuple[int, ...] | None) -> int:
    """The width a forward of `width` new tokens runs at: the nearest of the compiled forwards' `buckets` (None:
    eager); wider than the widest, as it is (it runs eagerly)."""
    if buckets is None or width > buckets[-1]:
        return width
    return next(bucket for bucket in buckets if bucket >= width)


def padded_batch(requests: list["Request | None"], width: int, padding: torch.Tensor) -> dict[str, torch.Tensor]:
    """A forward's `FIELDS`, `[rows, width]` each: each row's request left-padded with the `padding` column (the
    `PADDING` values, `[len(FIELDS), 1]`; a row without a request is padding only). One concatenation a row and one
    stack: padding each field apart took six calls a row, which decoding paid every forward."""
    if len(requests) == 1 and requests[0] is not None and len(requests[0]) == width:  # one row, no padding: views
        return dict(zip(FIELDS, requests[0].fields[:, None].unbind()))
    rows = [padding.expand(-1, width - len(request or ())) for request in requests]
    rows = [torch.cat([row, request.fields], dim=1) if request else row for row, request in zip(rows, requests)]
    return dict(zip(FIELDS, torch.stack(rows, dim=1).unbind()))


def run_model(model, compiled, batch: dict, mask: torch.Tensor, cache, num_logits: int) -> torch.Tensor:
    """The logits of each row's last `num_logits` tokens: when the batch's width is a bucket, through the `compiled`
    backbone, whose graphs up to its `logits_width` end with the output layer (frozen weights), and otherwise the
    output layer over those tokens only, eagerly (prepacked weights serve it there; inside a graph of a wide bucket
    it would run over every padded token, a large share of a prompt's forward, and graphs that do not freeze the
    weights get no packed kernel for it); else through the model eagerly."""
    inputs = dict(input_ids=batch["ids"], position_ids=batch["positions"], attention_mask=mask, cache=cache)
    width = batch["ids"].shape[1]
    if compiled is not None and width <= WIDTH_BUCKETS[-1]:  # a bucket (`pad_width`)
        output = compiled(**inputs, use_cache=True)
        if width <= compiled.logits_width:
            return output[:, -num_logits:]
        return model.get_output_embeddings()(output[:, -num_logits:])
    return model(**inputs, use_cache=cache is not None, logits_to_keep=num_logits).logits


def execute(
    model, decoders: list[SlotDecoder], cache: DynamicCache | SlotCache | None, compiled=None, buckets=None
) -> int:
    """Run the decoders' requests as batched forwards over one `cache` (without a cache every request carries its
    whole sequence), through the `compiled` backbone where given, padded to its width `buckets`. After each forward
    every row scores its logits on the device, and the scores of all rows come to the host in one read. Returns the
    number of forwards."""
    device = decoders[0].device
    requests = [decoder.request() for decoder in decoders]
    if isinstance(cache, SlotCache):
        layout = StaticLayout(cache, len(decoders), device, decoders[0].steps)
    else:
        layout = CacheLayout(cache, len(decoders), device)
    # A forward runs at the width bucket priced cheapest for it (`ForwardPrices.run_width`); a measured price table
    # (not the caller's) learns what forwards over the kind of cache it was measured on took.
    pricing = decoders[0].prices if compiled is not None else None
    prices = decoders[0].prices if isinstance(cache, SlotCache) else None
    prices = prices if prices is not None and prices.key is not None else None
    padding = upload(list(PADDING.values()), device)[:, None]
    dtype = model.dtype  # (read once: transformers finds it by walking the parameters, each time)
    forwards = 0
    while live := [row for row, request in enumerate(requests) if request is not None]:
        rows = layout.batch_rows(live)
        batch_requests = [requests[row] for row in rows]
        sizes = [len(request) if request else 0 for request in batch_requests]
        # The first forward, the prompts', runs eagerly at its own width where prepacked kernels serve it cheaper
        eager_prompt = not forwards and prompt_runs_eagerly(model, compiled, cache, max(sizes), buckets)
        graph, graph_buckets = (None, None) if eager_prompt else (compiled, buckets)
        width = pad_width(max(sizes), graph_buckets)
        if graph_buckets is not None and pricing is not None:
            width = pricing.run_width(width)
        # Left-pad the new tokens so that every row's queries end the batch: logits are computed for those only.
        batch = padded_batch(batch_requests, width, padding)
        mask = layout.mask(batch, sizes, dtype)
        num_logits = max(request.num_queries for request in batch_requests if request)
        started = time.perf_counter()
        logits = run_model(model, graph, batch, mask, cache, num_logits)
        forwards += 1
        scores = [
            decoders[row].score(logits[position, num_logits - request.num_queries :]) if request else None
            for position, (row, request) in enumerate(zip(rows, batch_requests))
        ]
        read = [score for score in scores if score is not None and score.shape[0]]
        values = (read[0] if len(read) == 1 else torch.cat(read)).tolist() if read else []  # the one wait a step
        if prices is not None and read and num_logits == width:  # as measured: every new token scored
            prices.observe(width, time.perf_counter() - started)
        kept, start = [], 0
        for row, request, score in zip(rows, batch_requests, scores):
            if request is None:
                kept.append(0)
                continue
            decoder, end = decoders[row], start + score.shape[0]
            queries_kept = decoder.advance(values[start:end])
            start = end
            requests[row] = decoder.request()
            kept.append(len(request) - request.num_queries + queries_kept)
        layout.keep(batch, sizes, kept)
    return forwards


# ---- generate() ----------------------------------------------------------------------------------------------------
def stopping_criteria_for(config: GenerationConfig, stopping_criteria, tokenizer) -> StoppingCriteriaList:
    """The caller's criteria plus those the config's `stop_strings` and `max_time` ask for."""
    criteria = StoppingCriteriaList(stopping_criteria or [])
    if stop_strings := config.stop_strings:
        if tokenizer is None:
            raise ValueError("stop_strings needs the tokenizer: pass tokenizer=... to generate().")
        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    if config.max_time is not None:
        criteria.append(MaxTimeCriteria(max_time=config.max_time))
    return criteria


def checked_input_ids(input_ids, vocabulary: int) -> torch.LongTensor:
    """`input_ids` as a long tensor, refused with a `ValueError` naming it unless it is a non-empty `(batch, length)`
    tensor of integer token ids in `[0, vocabulary)` (else the embedding lookup fails inside torch)."""
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"input_ids must be a tensor of token ids, (batch, length), got {type(input_ids).__name__}.")
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be non-empty and 2D, (batch, length), got shape {tuple(input_ids.shape)}.")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}.")
    low, high = torch.aminmax(input_ids)
    if low < 0 or high >= vocabulary:
        wrong = int(low) if low < 0 else int(high)
        raise ValueError(f"input_ids holds the token id {wrong}, outside the model's vocabulary [0, {vocabulary}).")
    return input_ids.long()


def inferred_attention_mask(input_ids: torch.Tensor, pad_token_id: int | None, eos_token_ids: tuple) -> torch.Tensor:
    """The attention mask of a call that passes none, by transformers' rule: the pad token's positions are padding
    when the prompts hold it and it is not an EOS token; otherwise every position is prompt (with a warning for a
    batch, whose padding cannot then be told apart)."""
    if pad_token_id is not None and pad_token_id not in eos_token_ids and (input_ids == pad_token_id).any():
        return input_ids.ne(pad_token_id).long()
    if input_ids.shape[0] > 1 and pad_token_id in eos_token_ids:
        logger.warning_once(
            "A batch was passed without attention_mask, and its padding cannot be inferred: the pad token is an EOS "
            "token. Every position is read as prompt; pass attention_mask for left-padded prompts."
        )
    return torch.ones_like(input_ids)


def static_cache_columns(prompt_length: int, max_new_tokens: int, slot_size: int, block_length: int) -> int:
    """Columns a static cache needs for prompts of up to `prompt_length` tokens: each row stores its prompt and
    answer (whole slots) once, and a forward's new tokens (the prompt and a block's plan at first, then at most a
    block's fresh tokens, `[MASK]` queries and drafts plus the tokens committed since the last forward) go after
    them, padded up to a width bucket."""
    answer = -(-max_new_tokens // slot_size) * slot_size
    widest = max(4 * block_length, WIDTH_BUCKETS[-1])
    return max(prompt_length + block_length, prompt_length + answer + widest)


def compile_forwards(
    model,
    compile_config: CompileConfig,
    batch_size: int,
    max_cache_len: int,
    draft_schedule: str = "fixed",
    compile_cache_dir: str | os.PathLike | None = None,
    lookup_drafts: int = 0,
) -> None:
    """Compile the forward of every width bucket of `draft_schedule` now, over the static cache for `batch_size`
    rows and `max_cache_len` columns (`static_cache_columns`), so that later `generate(cache_implementation="static",
    compile_config=compile_config)` calls of that batch size and draft schedule whose cache fits compile nothing
    (with `compile_cache_dir`, the same as theirs: load or compile and keep the saved forwards), and their step
    functions (`compiled_steps()`): the attention masks, the scoring of logits, and with `lookup_drafts` the copying
    of that many drafts. A width of up to `WINDOW_WIDTH` compiles a forward for each key window of the cache. The
    forwards run on padding: what they write, the mask of a decode hides."""
    cache = slot_cache(model, batch_size, max_cache_len)
    compiled = compiled_backbone(model, compile_config, compile_cache_dir)
    steps = step_functions(compiled)
    layout = StaticLayout(cache, batch_size, model.device, steps)
    with torch.no_grad():
        for width in width_buckets(draft_schedule):
            batch = {
                name: torch.full((batch_size, width), value, dtype=torch.long, device=model.device)
                for name, value in PADDING.items()
            }
            for window in key_windows(cache.max_cache_len) if width <= WINDOW_WIDTH else [cache.max_cache_len]:
                layout.pointers = [max(window - width, 0)] * batch_size  # stored tokens that need the window
                run_model(model, compiled, batch, layout.mask(batch, [0] * batch_size, model.dtype), cache, 1)
        warm_up_steps(model, lookup_drafts, steps)


def timed_forward(model, compiled, cache: SlotCache, width: int, num_logits: int) -> float:
    """Seconds one forward of `width` new tokens a row takes over `cache` through the `compiled` backbone (None:
    eagerly), waiting for the device. The tokens are padding: what they write, the mask of a decode hides."""
    batch_size, device = cache.layers[0].keys.shape[0], model.device
    batch = {name: torch.full((batch_size, width), value, dtype=torch.long, device=device)
             for name, value in PADDING.items()}  # fmt: skip
    mask = StaticLayout(cache, batch_size, device).mask(batch, [0] * batch_size, model.dtype)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    run_model(model, compiled, batch, mask, cache, num_logits).sum().item()  # waits for the device
    return time.perf_counter() - start


def prompt_runs_eagerly(model, compiled, cache, width: int, buckets: tuple[int, ...] | None) -> bool:
    """Whether a decode's first forward (its prompts', `width` new tokens a row) through the `compiled` backbone runs
    eagerly at its own width rather than padded to its bucket in a graph: where the model's linear layers are
    prepacked for it (`packed_for`) and cost no more so, by the prices `prompt_prices` measured once per backbone,
    batch size, cache length and bucket (kept on the model). Past the widest bucket a forward runs eagerly anyway.
    Which is cheaper depends on the CPU (the eager packed kernels against the graph's, and the graph's padding), so
    it is measured rather than assumed."""
    if compiled is None or not isinstance(cache, SlotCache):
        return False
    bucket = pad_width(width, buckets)
    in_graph = buckets is not None and bucket <= buckets[-1]
    known = getattr(model, "_refusion_prompt_prices", None)
    if known is None:
        known = model._refusion_prompt_prices = {}
    key = (id(compiled), cache.layers[0].keys.shape[0], cache.max_cache_len, bucket)
    if in_graph and key in known and known[key][0] * width > known[key][1]:
        return False  # the graph is cheaper, as measured (asked first: `packed_for` walks every layer)
    if not packed_for(model, width):
        return False
    if not in_graph:
        return True
    if key not in known:
        known[key] = prompt_prices(model, compiled, cache, width, bucket)
    eager_per_token, graph = known[key]
    return eager_per_token * width <= graph


def prompt_prices(model, compiled, cache: SlotCache, width: int, bucket: int, repeats: int = 2) -> tuple[float, float]:
    """What a first forward costs eagerly, per new token (measured at `width`: a narrower one is prorated, which
    prices it low, so that a prompt goes eagerly, as it did before prices were measured, wherever in doubt), and
    through `compiled` padded to `bucket`: each the fastest of `repeats`, after a warm-up, the two timed in turn."""
    num_logits = min(width, LOGITS_IN_GRAPH_WIDTH)
    eager, graph = [], []
    for _ in range(repeats + 1):
        eager.append(timed_forward(model, None, cache, width, num_logits))
        graph.append(timed_forward(model, compiled, cache, bucket, num_logits))
    return min(eager[1:]) / width, min(graph[1:])


def measure_forward_prices(
    model,
    cache: SlotCache,
    compiled=None,
    widths=PRICE_WIDTHS,
    repeats=3,
    buckets=None,
    seconds=PRICE_SECONDS,
    prompt_width: int | None = None,
) -> dict[int, float]:
    """Seconds a forward of each of `widths` new tokens per row takes over `cache` (through the `compiled` backbone
    where given, at the width it pads to among its `buckets`), the fastest of `repeats` timed forwards after a warm-up.
    Widths go narrowest first, a warm-up and a timed forward each, and stop at the first that costs `PRICE_LINEAR` times
    as many one-query forwards as it has queries (timed again, with the one-query forward, before believing it: a busy
    moment does not end the measuring): wider forwards then cost in proportion (`ForwardPrices` prorates past the widest
    measured width) and measuring them would take longest. The other repeats go round the measured widths a forward
    each, so that a busy spell of the machine falls on every width alike and the prices keep their ratios, by which the
    schedule decides (on a busy machine, repeats back to back priced some forwards below narrower ones). Once the timed
    forwards have taken `seconds`, a width gets its warm-up and one timed forward only. Warm-ups do not count towards
    `seconds`, and no width is priced from its warm-up: where a width's forward is compiled on its first call (saved
    forwards not compiled yet), the warm-up takes the compiling (seconds to minutes), which would otherwise spend the
    time and be taken for the width's price.

    First, a forward of `prompt_width` (a decode's first forward, its prompt's) where given: the decode's forwards
    run after it, and so are measured. What a forward costs depends on what ran before: glibc's allocator serves
    large tensors from fresh pages until larger ones have been freed, so that a narrow forward measured first costs
    more than the same forward after a wide one, as in a decode. The forwards run on padding:
    what they write, the mask of a decode hides."""
    if prompt_width:  # run as a decode's (`execute`); its logits as many as the widest measured forward's
        eager = prompt_runs_eagerly(model, compiled, cache, prompt_width, buckets)
        first = prompt_width if eager else pad_width(prompt_width, buckets)
        timed_forward(model, None if eager else compiled, cache, first, min(prompt_width, max(widths)))
    runs = {}  # per padded width, its warm-up and then its timed forwards

    def timed(width: int) -> None:
        """One more timed forward of `width` (padded): its first whatever the time, others while time is left."""
        if len(runs[width]) < 2 or sum(sum(times[1:]) for times in runs.values()) < seconds:
            runs[width].append(timed_forward(model, compiled, cache, width, width))

    def fastest(width: int) -> float:
        return min(runs[pad_width(width, buckets)][1:])

    def linear(width: int) -> bool:
        return width > widths[0] and fastest(width) >= PRICE_LINEAR * width * fastest(widths[0]) / widths[0]

    measured = []
    for width in widths:
        padded = pad_width(width, buckets)
        if padded not in runs:
            runs[padded] = [timed_forward(model, compiled, cache, padded, padded)]
            timed(padded)
        measured.append(width)
        if linear(width):  # once more each before ending there: a busy moment is not the end of width's economy
            timed(padded)
            timed(pad_width(widths[0], buckets))
            if linear(width):
                break
    for _ in range(repeats):  # the repeats, a round at a time
        for padded, times in runs.items():
            if len(times) <= repeats:
                timed(padded)
    return {width: fastest(width) for width in measured}


def price_key(model, cache: SlotCache, compile_config: CompileConfig | None, buckets=None, saved: str = "") -> str:
    """What a price table holds for: the model (name, config, kinds of linear layer, attention implementation), the
    device and threads, the dtype, the forward path (eager, or the compile config, width `buckets` and for saved
    forwards their `saved` kind, `SavedForwards.kind`), the batch size and cache length, and torch's version."""
    config = model.config.to_json_string(use_diff=False)
    linears = sorted({type(module).__name__ for module in model.modules() if isinstance(module, torch.nn.Linear)})
    keys = cache.layers[0].keys
    return " | ".join([
        model.config._name_or_path or model.config.model_type,
        hashlib.sha256(config.encode()).hexdigest()[:16],
        "+".join(linears) + f", attention {attention_fingerprint(model)}",
        f"{device_name(model)} {torch.get_num_threads()} threads",
        str(model.dtype),
        "eager" if compile_config is None else f"compiled {compile_config.to_dict()}, widths {buckets}"
        + (", frozen weights" if freezes_weights(compile_config) else "")
        + (f", {saved}" if saved else ""),
        f"batch {keys.shape[0]}, cache {keys.shape[2]}, key windows {key_windows(keys.shape[2])} up to {WINDOW_WIDTH}",
        f"torch {torch.__version__}",
    ])  # fmt: skip


def device_name(model) -> str:
    """The model's device as compiled code and prices depend on it: the GPU's name, or the processor's with its
    instruction set."""
    if model.device.type == "cuda":
        return torch.cuda.get_device_name(model.device)
    return f"{cpu_name()} {torch.backends.cpu.get_cpu_capability()}"


@functools.cache
def cpu_name() -> str:
    """This machine's `processor_name` (Linux; elsewhere the machine type), read once a process."""
    try:
        return processor_name(Path("/proc/cpuinfo").read_text())
    except OSError:
        return platform.machine()


def processor_name(cpuinfo: str) -> str:
    """The first processor's model name in `cpuinfo` (the text of Linux's /proc/cpuinfo) with its family and model
    numbers, and "AMX" when it has AMX tiles. Prices and compiled code differ between processors that a virtual machine
    may name alike: "AMD EPYC" is both a Zen 4 (family 25) and a Zen 5 (family 26), which the family and model
    numbers tell apart."""
    fields = {}
    for line in cpuinfo.splitlines():
        if not line.strip():  # (the first processor's fields end here)
            break
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return f"{name}{' AMX' if 'amx_tile' in fields.get('flags', '').split() else ''}"


def price_file() -> Path | None:
    """Where measured prices are kept between processes: the file `REFUSION_PRICE_CACHE` names (none when it is
    empty), by default `forward_prices.json` in the user's cache folder."""
    named = os.environ.get(PRICE_CACHE_VARIABLE)
    if named is not None:
        return Path(named).expanduser() if named else None
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "refusion" / "forward_prices.json"


PRICE_FILE_WARNED: set[tuple[str, str]] = set()  # (price file, kind of problem) warned of in this process


def warn_price_file(path: Path, kind: str, message: str) -> None:
    """Log `message` (one line naming the price file `path`), once a process for each `kind` of problem with it."""
    if (str(path), kind) not in PRICE_FILE_WARNED:
        PRICE_FILE_WARNED.add((str(path), kind))
        logger.warning(message)


def read_price_file(path: Path | None) -> dict | None:
    """The tables kept in `path` that pass `check_forward_prices`, by key; none where there is no file. Problems warn
    once a process, naming the file: a table that fails the check is left out alone (the others stay, and the file
    keeps them when it is next written); a file that is not a JSON object (damaged) is moved aside first, never
    overwritten (`move_aside_price_file`), so that its tables are measured again and kept in a new one. None where the
    file cannot be read (a folder, no permission) or moved aside: it is left as it is (`keep_prices` writes nothing
    over it), and prices are measured in each process."""
    if path is None:
        return {}
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):  # (no such file)
        return {}
    except OSError as error:
        warn_price_file(path, "unreadable", f"The forward price file {path} could not be read ({error}); prices are "
                        "measured again in each process and kept nowhere.")  # fmt: skip
        return None
    try:
        stored = json.loads(data)
        if not isinstance(stored, dict):
            raise ValueError(f"a JSON {type(stored).__name__}, not an object of tables")
    except ValueError as error:  # (bytes that are not UTF-8 too)
        return move_aside_price_file(path, f"{type(error).__name__}: {error}")
    tables, damaged = {}, []
    for key, table in stored.items():
        try:
            tables[key] = check_forward_prices(table)
        except ValueError:
            damaged.append(key)
    if damaged:
        warn_price_file(path, "tables", f"The forward price file {path} holds {len(damaged)} damaged table(s) (not "
                        f"positive finite prices by width; the first for {damaged[0][:60]!r}...): they are dropped, "
                        f"the {len(tables)} others kept.")  # fmt: skip
    return tables


def move_aside_price_file(path: Path, problem: str) -> dict | None:
    """Move the price file `path` that does not parse (`problem`: why) aside, with a warning: its target (through a
    symbolic link) renamed to `<name>.corrupt`, or `<name>.corrupt.<n>` where that is taken, so that nothing a user
    may want to read is overwritten. No tables: {} where it was moved (a new file is written in its place), None where
    it could not be (it stays, and nothing is written over it)."""
    target = path.resolve()
    aside, number = target.with_name(f"{target.name}.corrupt"), 0
    while aside.exists() or aside.is_symlink():
        number += 1
        aside = target.with_name(f"{target.name}.corrupt.{number}")
    try:
        os.rename(target, aside)
    except OSError as error:
        warn_price_file(path, "corrupt", f"The forward price file {path} is damaged ({problem}) and could not be "
                        f"moved aside ({error}); it is left as it is, and prices are kept nowhere.")  # fmt: skip
        return None
    warn_price_file(path, f"moved to {aside}", f"The forward price file {path} is damaged ({problem}): moved to "
                    f"{aside}; its prices are measured again and kept in a new file.")  # fmt: skip
    return {}


def measured_prices(
    model, compile_config: CompileConfig | None, cache: SlotCache, compiled=None, buckets=None, prompt_width=None
) -> ForwardPrices:
    """The price table of a decode's forwards over `cache` (through `compiled`, built from `compile_config`, padded
    to its width `buckets`): the one measured before for the same `price_key` (kept on the model and in
    `price_file()`), else one measured now, after a forward of the decode's `prompt_width` (once: a few seconds)."""
    saved = compiled.kind if isinstance(compiled, SavedForwards) else ""
    key = price_key(model, cache, compile_config, buckets, saved)
    known = getattr(model, "_refusion_prices", None)
    if known is None:
        known = model._refusion_prices = {}
    if key not in known:
        measured_here = model.__dict__.setdefault("_refusion_prices_measured", set())  # the keys measured now
        try:
            known[key] = check_forward_prices((read_price_file(price_file()) or {}).get(key))
            measured_here.discard(key)
        except ValueError:  # not kept, or damaged
            known[key] = measure_forward_prices(model, cache, compiled, buckets=buckets, prompt_width=prompt_width)
            keep_prices(key, known[key])
            measured_here.add(key)
    return ForwardPrices(known[key], buckets, key)


def keep_prices(key: str, table: dict[int, float] | None) -> None:
    """Write `table` as the one kept for `key` in `price_file()` (None: drop it), beside the file's other valid
    tables (`read_price_file`; nothing where it cannot be read). Written whole, a partial file renamed over the file
    (removed on any failure, so none is left behind), through a symbolic link to its target, with the file's
    permissions. A file that cannot be written warns once a process."""
    path = price_file()
    if path is None:
        return
    tables = read_price_file(path)
    if tables is None:  # (warned: a file that cannot be read is not written over)
        return
    tables.pop(key, None)
    if table is not None:
        tables[key] = table
    partial = None
    try:
        target = path.resolve()  # (through a symbolic link, to the file it names)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(tables, indent=1, allow_nan=False))
        if target.exists():
            shutil.copymode(target, partial)
        os.replace(partial, target)
    except (OSError, RuntimeError, ValueError) as error:  # (RuntimeError: a loop of links; ValueError: not finite)
        warn_price_file(path, "unwritable", f"Measured forward prices could not be kept in {path} ({error}); set "
                        f"{PRICE_CACHE_VARIABLE} to a writable file, or to '' to keep none.")  # fmt: skip
    finally:
        if partial is not None:
            partial.unlink(missing_ok=True)


def forget_stale_prices(model, prices: ForwardPrices | None) -> None:
    """Deal with a measured table that the decode found stale (`ForwardPrices.stale`). One kept from an earlier
    process is dropped from the model and the price file, so that the next decode measures it again (the machine was
    busy then). One measured in this process, where measuring again would as likely give the same prices (some
    forwards measure dearer on their own than amid a decode), takes the decode's times for the widths it beat. Where
    the narrowest width is among them, the machine was busy while measuring: every width's price first scales by as
    much as the narrowest's fell, so that the ratios, by which the schedule decides, hold. (The one-query forward runs
    most, so a decode sees its fastest: lowered alone, it would leave the wider widths priced dear against it, and
    the schedule choosing narrower drafts, fewer tokens a forward, pass by pass.)"""
    stale = prices.stale() if prices is not None else None
    if stale is None:
        return
    width, seconds = stale
    if prices.key in getattr(model, "_refusion_prices_measured", ()):
        table, seen, narrowest = model._refusion_prices[prices.key], prices.seen, prices.widths[0]
        beaten = {each for each, fastest in seen.items() if fastest < PRICE_STALE * prices.measured[each]}
        scale = seen[narrowest] / prices.measured[narrowest] if narrowest in beaten else 1.0
        for each, price in prices.measured.items():
            table[each] = min(price * scale, seen[each] if each in beaten else math.inf)
        keep_prices(prices.key, table)
        return
    logger.warning(
        f"Forward prices will be measured again: forwards of {width} new tokens took {seconds:.4g} s in this decode, "
        f"against {prices.measured[width]:.4g} s when measured (the machine was busy then, or in another state)."
    )
    model._refusion_prices.pop(prices.key, None)
    keep_prices(prices.key, None)


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
                compiled = compiled_backbone(model, settings.compile_config, settings.compile_cache_dir)
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
    )


def attention_implementation(model) -> str:
    """The backbone's attention implementation (`attn_implementation`): its compiled forwards are traced through it,
    and a model config's JSON does not record it."""
    return model.config.get_text_config(decoder=True)._attn_implementation or "sdpa"


def attention_fingerprint(model) -> str:
    """The attention implementation as compiled forwards depend on it: its name and, for a function registered with
    transformers under a name of its own (as "refusion_grouped"), a hash of the file that defines it, so that saved
    forwards and price tables of an earlier version of it are not taken for its own."""
    name = attention_implementation(model)
    function = ALL_ATTENTION_FUNCTIONS.get(name) if name not in ("sdpa", "eager") else None
    source = inspect.getsourcefile(function) if function is not None else None
    if source is None:
        return name
    return f"{name} {hashlib.sha256(Path(source).read_bytes()).hexdigest()[:16]}"


def check_model(model) -> None:
    """Raise a `ValueError` unless `model` is a backbone and attention implementation slot decoding is exact on."""
    text_config = model.config.get_text_config(decoder=True)
    if text_config.model_type not in SUPPORTED_BACKBONES:
        raise ValueError(
            f"ReFusion decoding needs a RoPE causal decoder that honours caller-given position ids; model_type "
            f"{text_config.model_type!r} is not one of {SUPPORTED_BACKBONES}."
        )
    implementation = attention_implementation(model)
    if implementation not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"attn_implementation={implementation!r} is not supported by ReFusion: it must keep attention in storage "
            f"order with out-of-order position ids. Load the model with attn_implementation in {SUPPORTED_ATTENTION}."
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
    """Write this file as `folder/custom_generate/generate.py`: transformers then runs its `generate` in place of the
    model's own, for `custom_generate="<folder or repo>"` and for a model loaded from the folder with
    `trust_remote_code=True`."""
    target = Path(folder) / "custom_generate" / "generate.py"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(__file__, target)
    return target
