"""Convert an autoregressive causal LM into a ReFusion model without changing what it computes.

    python -m finetune.convert --model_name_or_path Qwen/Qwen3-0.6B --output_dir refusion-qwen3-0.6b
    python -m finetune.convert --model_name_or_path ./smollm2 --gguf_file SmolLM2-135M-Instruct.Q4_1.gguf \
        --output_dir refusion-smollm2

The converted model keeps the backbone's modules and parameter names; the only additions are a `[MASK]`
token (reused when the tokenizer already has one) and ReFusion's configuration and generation defaults.
"""

import argparse
import copy
import logging
import os
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from configuration_refusion import RefusionConfig
from finetune.files import check_output_dir, staged_output
from generation_refusion import write_custom_generate
from modeling_refusion import RefusionForCausalLM
from settings_refusion import DECODING_FIELDS, DECODING_SETTINGS, SUPPORTED_ATTENTION, DecodingSetting, check_decoding

logger = logging.getLogger(__name__)

DEFAULT_MASK_TOKEN = "<|mask|>"
MASK_INITS = ("mean", "random")  # the row a newly added [MASK] token starts from
FORMATS = ("refusion", "native")


def load_causal_lm(
    name_or_path: str | os.PathLike, gguf_file: str | None = None, **model_kwargs
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a folder, a Hub id or a GGUF file inside a folder."""
    if gguf_file is not None and not (Path(name_or_path) / gguf_file).is_file() and Path(name_or_path).is_dir():
        raise FileNotFoundError(f"GGUF file {gguf_file!r} not found in {str(name_or_path)!r}.")
    model_kwargs.setdefault("dtype", torch.float32 if gguf_file else "auto")
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, gguf_file=gguf_file, **model_kwargs)
    return model, tokenizer


def add_mask_token(
    tokenizer: PreTrainedTokenizerBase, mask_token: str | None = None, mask_token_id: int | None = None
) -> tuple[int, bool]:
    """Set the tokenizer's mask token, adding it to the vocabulary only if absent; return `(id, was_added)`.

    The mask token is `mask_token`, else the token of `mask_token_id` (what a checkpoint's config records), else
    the tokenizer's own mask token, else `<|mask|>` (reused when the vocabulary has it, added when it does not)."""
    if mask_token is None and mask_token_id is not None:
        if not 0 <= mask_token_id < len(tokenizer):
            raise ValueError(f"The config's mask_token_id {mask_token_id} is outside the tokenizer ({len(tokenizer)}).")
        mask_token = tokenizer.convert_ids_to_tokens(mask_token_id)
    mask_token = mask_token or tokenizer.mask_token or DEFAULT_MASK_TOKEN
    size_before = len(tokenizer)
    tokenizer.add_special_tokens({"mask_token": mask_token})
    mask_token_id = tokenizer.convert_tokens_to_ids(mask_token)
    reserved = {
        "eos": tokenizer.eos_token_id,
        "pad": tokenizer.pad_token_id,
        "bos": tokenizer.bos_token_id,
    }
    for name, token_id in reserved.items():
        if token_id is not None and token_id == mask_token_id:
            raise ValueError(f"The mask token {mask_token!r} is the tokenizer's {name} token (id {token_id}).")
    return mask_token_id, len(tokenizer) > size_before


@torch.no_grad()
def _make_room_for_mask(model: PreTrainedModel, mask_token_id: int, init: str = "mean") -> None:
    """Grow the embeddings if the mask id lies past them, and give the mask row the mean embedding (`init="mean"`)
    or a draw from a normal distribution with the rows' mean and spread (`"random"`, seeded: conversion is
    reproducible)."""
    input_embeddings = model.get_input_embeddings()
    if mask_token_id >= input_embeddings.num_embeddings:
        model.resize_token_embeddings(mask_token_id + 1, mean_resizing=False)
    known_rows = min(mask_token_id, input_embeddings.num_embeddings)
    for embedding in {model.get_input_embeddings().weight, model.get_output_embeddings().weight}:
        rows = embedding[:known_rows]
        row = rows.mean(dim=0)
        if init == "random":
            noise = torch.randn(rows.shape[1], generator=torch.Generator().manual_seed(0), dtype=torch.float32)
            row = row + noise.to(rows.device, rows.dtype) * rows.std(dim=0)
        embedding[mask_token_id] = row


def convert_to_refusion(
    model: PreTrainedModel | str | os.PathLike,
    tokenizer: PreTrainedTokenizerBase | None = None,
    mask_token: str | None = None,
    *,
    gguf_file: str | None = None,
    do_sample: bool = False,
    mask_init: str = "mean",
    **kwargs,
) -> tuple[RefusionForCausalLM, PreTrainedTokenizerBase]:
    """Wrap a causal LM (or a path/Hub id to load) as a `RefusionForCausalLM` sharing its modules.

    The mask token is `mask_token`, else the one the model's config records (`mask_token_id`, as the authors'
    released checkpoint has), else the tokenizer's own, else `<|mask|>`; it is added to the vocabulary only when
    missing (its row: `mask_init`, the mean embedding or a random draw), and an existing row is never changed. The
    converted generation config decodes greedily unless `do_sample=True` is passed, since ReFusion's thresholds are
    defined on greedy drafts. `kwargs` set decoding defaults written to the generation config (the parameters of
    `settings_refusion.DECODING_SETTINGS`) and `RefusionConfig`
    fields (`train_slot_sizes`, `mask_eps`, `mdm_loss_weight`). On ordinary left-to-right input the result computes
    the same logits as the base model over the base vocabulary.
    """
    decoding = check_decoding({name: kwargs.pop(name) for name in DECODING_FIELDS if name in kwargs})
    if isinstance(model, (str, os.PathLike)):
        model, loaded_tokenizer = load_causal_lm(model, gguf_file=gguf_file)
        tokenizer = tokenizer or loaded_tokenizer
    if tokenizer is None:
        raise ValueError("convert_to_refusion needs the tokenizer when given a loaded model.")
    if isinstance(model, RefusionForCausalLM):
        raise ValueError("The model is already a RefusionForCausalLM.")

    recorded = getattr(model.config, "mask_token_id", None)
    if recorded is None:
        recorded = getattr(model.generation_config, "mask_token_id", None)
    mask_token_id, added = add_mask_token(tokenizer, mask_token, recorded)
    if mask_init not in MASK_INITS:
        raise ValueError(f"mask_init must be one of {MASK_INITS}, got {mask_init!r}.")
    if added or mask_token_id >= model.get_input_embeddings().num_embeddings:
        _make_room_for_mask(model, mask_token_id, mask_init)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    attention = model.config._attn_implementation  # read before the wrapper's init adjusts the shared config
    clean_backbone_config(model)
    draft_adapter = kwargs.pop("draft_adapter", None)  # made below, over the base's own modules
    config = RefusionConfig(text_config=model.config, mask_token_id=mask_token_id, **kwargs)
    with torch.device("meta"):
        refusion = RefusionForCausalLM(config)
    refusion.model = model.model
    refusion.lm_head = model.lm_head
    if attention not in SUPPORTED_ATTENTION:
        logger.warning("attn_implementation=%r misreads out-of-order position ids; ReFusion uses 'sdpa'.", attention)
        refusion.set_attn_implementation("sdpa")
    if draft_adapter is not None:
        refusion.add_draft_adapter(**draft_adapter)
    refusion.generation_config = refusion_generation_config(
        model.generation_config, mask_token_id, tokenizer, decoding, do_sample
    )
    refusion.eval()
    return refusion, tokenizer


def clean_backbone_config(model: PreTrainedModel) -> None:
    """Drop from the backbone's config what describes the converting machine rather than the saved weights: the
    local path it was loaded from, and a quantization config when the weights are not quantized (a GGUF file is
    de-quantized on loading)."""
    config, quantizer = model.config, getattr(model, "hf_quantizer", None)
    dequantized = quantizer is None or getattr(quantizer.quantization_config, "quant_method", None) == "gguf"
    if getattr(config, "quantization_config", None) is not None and dequantized:
        del config.quantization_config
    if Path(str(getattr(config, "_name_or_path", ""))).is_absolute():
        config._name_or_path = ""


def refusion_generation_config(
    base: GenerationConfig,
    mask_token_id: int,
    tokenizer: PreTrainedTokenizerBase,
    decoding: dict,
    do_sample: bool = False,
) -> GenerationConfig:
    """The base model's generation defaults plus ReFusion's `decoding` parameters (all of them, as `check_decoding`
    returns them), its special tokens, and greedy decoding unless `do_sample` (which keeps the base's sampling
    settings)."""
    generation_config = GenerationConfig.from_dict(base.to_dict())
    generation_config._from_model_config = False  # else loading it back would drop the fields added here
    generation_config.do_sample = do_sample
    if not do_sample:  # the base's sampling settings would only apply when sampling (and fail validation)
        for name in ("temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h"):
            setattr(generation_config, name, None)
    for name, value in decoding.items():
        setattr(generation_config, name, value)
    generation_config.mask_token_id = mask_token_id
    if generation_config.eos_token_id is None:
        generation_config.eos_token_id = tokenizer.eos_token_id
    if generation_config.pad_token_id is None:
        generation_config.pad_token_id = tokenizer.pad_token_id
    return generation_config


def to_native(model: RefusionForCausalLM) -> PreTrainedModel:
    """The backbone's own causal LM class over the same modules (no copy), with the mask token recorded in its
    config and ReFusion's decoding defaults in its generation config. A model with a draft adapter has none: the
    backbone's class has no place for the adapter, and would decode without it."""
    if model.config.draft_adapter is not None:
        raise ValueError(
            "This model has a draft adapter (config.draft_adapter), which only ReFusion's own class applies: save it "
            "in the 'refusion' format."
        )
    text_config = copy.deepcopy(model.config.text_config)
    text_config.mask_token_id = model.config.mask_token_id
    with torch.device("meta"):
        native = AutoModelForCausalLM.from_config(text_config)
    native.model, native.lm_head = model.model, model.lm_head
    native.generation_config = copy.deepcopy(model.generation_config)
    return native.eval()


def save_model(model: RefusionForCausalLM, folder: str | os.PathLike, format: str = "refusion") -> None:
    """`save_pretrained` in `format` ("refusion": our class; "native": the backbone's own); both carry the decoder
    in `custom_generate/` (our class writes it itself)."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}.")
    if format == "native":
        to_native(model).save_pretrained(folder)
        write_custom_generate(folder)
    else:
        model.save_pretrained(folder)


def save_refusion(
    model: RefusionForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    output_dir: str | os.PathLike,
    format: str = "refusion",
    *,
    overwrite_output_dir: bool = False,
) -> Path:
    """Write model (safetensors), configs, tokenizer and `custom_generate/` into `output_dir`, a missing or empty
    folder, or with `overwrite_output_dir=True` any folder: files of the same names are replaced (and the weight
    files of an earlier save), every other file kept. The files are written into a hidden staging folder first and
    moved in only when complete (`finetune.files.staged_output`), so a run stopped while writing leaves the folder
    as it was. `format="refusion"`: our class (its code and `auto_map`; the hybrid loss for further training);
    `"native"`: the backbone's own class and `config.json`, which every engine that serves the backbone loads, and
    which decodes with ReFusion when loaded with `trust_remote_code=True`."""
    if format not in FORMATS:  # before any file is written
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}.")
    with staged_output(output_dir, overwrite_output_dir) as staging:
        save_model(model, staging, format)
        tokenizer.save_pretrained(staging)
    return Path(output_dir)


def flag_type(setting: DecodingSetting):
    """The argparse `type` of a decoding setting's flag: its words (`none`, `true`/`false`), checked by the table."""

    def parse(text: str):
        try:
            return setting.parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse.__name__ = setting.name
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m finetune.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_name_or_path", required=True, help="Folder or Hub id of a causal LM.")
    parser.add_argument("--gguf_file", default=None, help="GGUF file inside --model_name_or_path to load.")
    parser.add_argument("--output_dir", required=True, help="Where to write the ReFusion model.")
    parser.add_argument(
        "--overwrite_output_dir", action="store_true",
        help="Write into --output_dir even when it holds files: those of the model's names are replaced, others kept.",
    )  # fmt: skip
    parser.add_argument(
        "--mask_token", default=None, help=f"Mask token (default: the tokenizer's, else {DEFAULT_MASK_TOKEN})."
    )
    for setting in DECODING_SETTINGS:  # the decoding defaults written to the generation config
        parser.add_argument(
            f"--{setting.name}", type=flag_type(setting), default=argparse.SUPPRESS, metavar=setting.kind.__name__,
            help=f"{setting.doc} Takes {setting.values()}; default {setting.default!r}; {setting.applies_to()}.",
        )  # fmt: skip
    parser.add_argument(
        "--do_sample", action="store_true", help="Sample by default (default: greedy, what the thresholds assume)."
    )
    parser.add_argument(
        "--format", choices=FORMATS, default="refusion",
        help="refusion: our class (trains with the hybrid loss); native: the backbone's own class and config.",
    )  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = {name: getattr(args, name) for name in DECODING_FIELDS if hasattr(args, name)}
    try:
        check_output_dir(args.output_dir, args.overwrite_output_dir)  # before minutes of loading and converting
        model, tokenizer = convert_to_refusion(
            args.model_name_or_path,
            mask_token=args.mask_token,
            gguf_file=args.gguf_file,
            do_sample=args.do_sample,
            **overrides,
        )
        output_dir = save_refusion(
            model, tokenizer, args.output_dir, args.format, overwrite_output_dir=args.overwrite_output_dir
        )
    except (OSError, ValueError) as error:
        message = " ".join(str(error).split())
        print(f"finetune.convert: error: {message}", file=sys.stderr)
        return 1
    print(
        f"Converted {args.model_name_or_path} ({model.config.text_config.model_type}, "
        f"{model.num_parameters() / 1e6:.1f}M parameters) to ReFusion with mask token "
        f"{tokenizer.mask_token!r} (id {model.config.mask_token_id}) -> {output_dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
