"""The model card (README.md) written next to a fine-tuned ReFusion model and pushed to the Hub with it."""

from dataclasses import dataclass, field
from pathlib import Path

from settings_refusion import settings_table

PAPER = "https://arxiv.org/abs/2512.13586"
CITATION = """@inproceedings{li2026refusion,
  title     = {ReFusion: A Diffusion Large Language Model with Parallel Autoregressive Decoding},
  author    = {Li and Guan and Wu and Li},
  booktitle = {International Conference on Learning Representations},
  year      = {2026},
  url       = {https://arxiv.org/abs/2512.13586}
}"""


@dataclass
class TrainingSummary:
    """What the card reports about a fine-tuning run."""

    base_model: str
    dataset: str
    method: str
    rows: int
    max_length: int | None
    slot_sizes: list[int]
    mask_eps: float
    steps: int
    epochs: float
    learning_rate: float
    batch_size: int
    final_losses: dict[str, float] = field(default_factory=dict)
    format: str = "refusion"


FORMATS = {
    "refusion": """**Format: `refusion`.** The weights are the backbone's, under `RefusionForCausalLM` (code in this
repository, `auto_map` in `config.json`), which also computes the hybrid training loss for further fine-tuning.
`custom_generate/generate.py` holds the same decoder for any plain checkpoint of the backbone's class:
`model.generate(ids, custom_generate="<this repo>", trust_remote_code=True)`.""",
    "native": """**Format: `native`.** `config.json` is the backbone's own (its `model_type` and `architectures`, with
`mask_token_id` recorded), so every engine that serves the backbone (vLLM, SGLang, TGI, llama.cpp after conversion)
serves this model, autoregressively; without `trust_remote_code` it is an ordinary causal LM. Loaded with
`trust_remote_code=True`, transformers runs `custom_generate/generate.py` as its `generate()`: ReFusion decoding.""",
}


def _public_name(name: str) -> str:
    """A Hub id as it is; a local path by its folder or file name only (no path of the training machine)."""
    return Path(name).name if Path(name).exists() or Path(name).is_absolute() else name


def _metadata(summary: TrainingSummary) -> str:
    lines = ["---", "library_name: transformers", "pipeline_tag: text-generation"]
    if not Path(summary.base_model).exists():
        lines.append(f"base_model: {summary.base_model}")
    if not Path(summary.dataset).exists():
        lines.append(f"datasets:\n- {summary.dataset}")
    tags = ["refusion", "masked-diffusion", "parallel-decoding", "trl", "sft"]
    if summary.method != "full fine-tuning":
        tags.append("lora")
    lines.append("tags:\n" + "\n".join(f"- {tag}" for tag in tags))
    return "\n".join([*lines, "---"])


def render_model_card(repo_id: str, summary: TrainingSummary) -> str:
    """Markdown with Hub metadata: what the model is, how to load and run it, how it was trained."""
    losses = ", ".join(f"{name} {value:.4f}" for name, value in summary.final_losses.items()) or "not logged"
    base_model, dataset = _public_name(summary.base_model), _public_name(summary.dataset)
    rows = [
        ("Base model", f"`{base_model}`"),
        ("Dataset", f"`{dataset}` ({summary.rows} examples)"),
        ("Method", summary.method),
        ("Slot sizes / mask eps", f"{summary.slot_sizes} / {summary.mask_eps:g}"),
        ("Max length", str(summary.max_length)),
        ("Steps / epochs", f"{summary.steps} / {summary.epochs:g}"),
        ("Learning rate / global batch", f"{summary.learning_rate:g} / {summary.batch_size}"),
        ("Last logged losses", losses),
    ]
    table = "\n".join(["| | |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)])
    return f"""{_metadata(summary)}

# {repo_id.split("/")[-1]}

A [ReFusion]({PAPER}) model: a masked diffusion language model that decodes slots of tokens in parallel and
verifies them autoregressively, reusing the KV cache exactly. It was fine-tuned from `{base_model}` with the
hybrid objective (autoregressive loss on clean slots plus masked-diffusion loss on masked slots) using TRL.

## Use

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{repo_id}", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("{repo_id}", trust_remote_code=True)  # it reads the config
messages = [{{"role": "user", "content": "What is the capital of France?"}}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
output = model.generate(**inputs, max_new_tokens=128)
print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
```

`generate` runs ReFusion's plan-and-infill decoding. It takes the usual `generate()` options and these decoding
parameters; this model's own defaults are in `generation_config.json`, and an option passed to `generate` wins.

{settings_table()}

{FORMATS[summary.format]}

## Training

{table}

An `adapter/` folder, when present, holds the LoRA adapter; it applies to the base model converted to ReFusion
(`finetune.convert.convert_to_refusion`) and loads with `peft.PeftModel.from_pretrained`.

## Citation

```bibtex
{CITATION}
```
"""
