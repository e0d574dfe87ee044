"""What a ReFusion decode is asked to do, checked before it starts.

The decoding settings (`DECODING_SETTINGS`: name, default, check and meaning of each, the table `generate`'s docstring
and the README print), how passed options combine with a generation config (`resolve_settings` into one
`DecodingSettings`), the generation options slot decoding refuses, the logits processors and stopping criteria a
config asks for, the checks on inputs, and `check_model`: the backbones and attention implementations slot decoding
is exact on. Nothing here runs the model.
"""

import copy
import hashlib
import inspect
import math
import os
import textwrap
from dataclasses import dataclass, make_dataclass
from pathlib import Path

import torch
from transformers import (
    CompileConfig,
    GenerationConfig,
    MaxTimeCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)
from transformers.generation import logits_process as lp
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging

logger = logging.get_logger(__name__)

# Backbones whose attention follows storage order, whose RoPE follows caller-given position ids and whose mask
# builder passes a prepared 4D mask through untouched; attention implementations that keep storage order with
# out-of-order position ids (flash-attention reads a position jump as a new packed sequence). "refusion_grouped" is
# SDPA over the shared key/value heads, uncopied (`kernels_refusion.use_grouped_attention` registers it).
SUPPORTED_BACKBONES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ATTENTION = ("sdpa", "eager", "refusion_grouped")
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
        "the price of a forward of each width (`forward_prices`; measured on this machine when not given, at a "
        "`token_threshold` of 0.5 or more only) and the acceptance seen so far.",
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
        ("compile_cache_max_gb", float | None),  # the bound on that folder's packages (`bound_folder`); None: none
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
    compile_cache_max_gb = kwargs.pop("compile_cache_max_gb", getattr(config, "compile_cache_max_gb", None))
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
                "pass cache_implementation='static' and a compile_config, without disable_compile."
            )
        compile_cache_dir = str(compile_cache_dir)
    if compile_cache_max_gb is not None:
        if isinstance(compile_cache_max_gb, bool) or not isinstance(compile_cache_max_gb, (int, float)) \
                or not 0 < compile_cache_max_gb < math.inf:  # fmt: skip
            raise ValueError(
                f"compile_cache_max_gb must be a finite number of gigabytes > 0, got {compile_cache_max_gb!r}."
            )
        if compile_cache_dir is None:
            raise ValueError("compile_cache_max_gb bounds the packages in compile_cache_dir; pass that folder too.")
        compile_cache_max_gb = float(compile_cache_max_gb)

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
    if decoding["draft_schedule"] == "price" and forward_prices is None and not do_sample:
        check_measured_prices_apply(decoding["token_threshold"])
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
        compile_cache_max_gb=compile_cache_max_gb,
        max_cache_len=max_cache_len,
    )
    return settings, config


def check_measured_prices_apply(token_threshold: float) -> None:
    """A greedy decode prices its forwards with a table measured on this machine (a clock) only where the drafts
    offered cannot change the answer: at a `token_threshold` of 0.5 or more, where only the model's own token passes
    (each chosen slot being checked against the sequence its plan step saw). Below it, the caller's table decides."""
    if token_threshold < 0.5:
        raise ValueError(
            f"draft_schedule='price' with token_threshold={token_threshold} would let a timing change a greedy "
            "answer: below 0.5 the drafts a forward offers decide what passes, and with no forward_prices the "
            "schedule prices forwards by measuring them. Pass forward_prices={width: price} (your table then "
            "decides the drafts; a priced decode returns the table it used as forward_prices, with "
            "return_dict_in_generate=True), or token_threshold >= 0.5 (only the model's own token passes: the "
            "measured table changes the speed, never the answer)."
        )


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
    """How the forwards are compiled: over a static cache, unless `disable_compile`, with the config's
    `compile_config` on any device where one is given (the argument or the generation config's), and on CUDA (or
    XPU) with transformers' default where none is. None: eager. (transformers' own `generate()` compiles off CUDA only
    when a private flag of the compile config is set; asking with a compile config is enough here.)"""
    if cache_implementation != "static" or config.disable_compile or config.use_cache is False:
        return None
    if config.compile_config is not None:
        return config.compile_config
    if model.device.type in ("cuda", "xpu"):
        return CompileConfig(fullgraph=True, dynamic=False)
    return None


def fastest_settings(device, compile_cache_dir: str | os.PathLike | None = None, frozen: bool = True) -> dict:
    """The decoding options of the fastest decode measured on `device`'s kind (`benchmarks/results/README.md`), as
    `generate` takes them. On a CPU: forwards compiled over a static cache with inductor's autotuning and the weights
    frozen into the graphs, kept as AOTInductor packages in `compile_cache_dir` (None: compiled again in each process),
    drafts priced by a forward-price table measured here once (`draft_schedule="price"`), up to 4 drafts a slot copied
    from the text (`lookup_drafts`), and `token_threshold` 0.5, at which the answer is the model's own greedy one
    whatever the table. `frozen=False` leaves the weights out of the graphs: slower forwards, but packages without
    weights that run on the model's own (one copy in memory, where frozen packages hold one each). On CUDA (or XPU):
    CUDA graphs over unfrozen weights (`mode="reduce-overhead"`), no packages."""
    device = torch.device(device)
    accelerated = device.type in ("cuda", "xpu")
    if accelerated and compile_cache_dir is not None:
        raise ValueError(
            f"compile_cache_dir keeps AOTInductor packages for CPU decoding; on {device.type} the fastest path "
            "compiles CUDA graphs in the process instead: leave it None."
        )
    if accelerated:
        compile_config = CompileConfig(fullgraph=True, dynamic=False, mode="reduce-overhead")
    else:
        compile_config = CompileConfig(
            fullgraph=True, dynamic=False, mode="max-autotune-no-cudagraphs", options={"freezing": frozen}
        )
    settings = dict(cache_implementation="static", compile_config=compile_config, draft_schedule="price",
                    lookup_drafts=4, token_threshold=0.5)  # fmt: skip
    if compile_cache_dir is not None:
        settings["compile_cache_dir"] = str(compile_cache_dir)
    return settings


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
