"""Fine-tune a Qwen/Llama/Mistral checkpoint into ReFusion with TRL's `SFTTrainer` and the hybrid objective.

# LoRA on one GPU
```bash
python -m finetune.sft \
    --model_name_or_path Qwen/Qwen3-1.7B \
    --dataset_name data/train.jsonl \
    --output_dir refusion-qwen3-1.7b \
    --use_peft --lora_r 16 --lora_alpha 32 \
    --learning_rate 2e-4 --num_train_epochs 1 \
    --per_device_train_batch_size 8 --gradient_accumulation_steps 4
```

# Full fine-tuning on 8 GPUs per node with DeepSpeed ZeRO-2 (the paper's setup)
```bash
accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml -m finetune.sft \
    --model_name_or_path Qwen/Qwen3-8B --dataset_name data/ --output_dir refusion-qwen3-8b \
    --learning_rate 2e-5 --lr_scheduler_type cosine --num_train_epochs 4 --dtype bfloat16
```

Every TRL flag works unchanged (`--use_peft --load_in_4bit` for QLoRA, `--push_to_hub`, `--resume_from_checkpoint`,
...). The model may be an autoregressive checkpoint, converted on the fly, or a ReFusion one; `output_dir` ends up
holding the merged ReFusion model (loadable with `trust_remote_code=True`), its card and `trainer_state.json`, plus
`adapter/` with LoRA.
"""

import logging
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from huggingface_hub import HfApi
from peft import LoraConfig, PeftModel
from transformers import AutoTokenizer, BitsAndBytesConfig, PretrainedConfig, PreTrainedTokenizerBase
from transformers.integrations.deepspeed import unset_hf_deepspeed_config
from trl import ModelConfig, ScriptArguments, SFTConfig, SFTTrainer, TrlParser, get_peft_config, get_quantization_config

from finetune.convert import FORMATS, convert_to_refusion, load_causal_lm, save_model
from finetune.data import OVERLONG_POLICIES, PreparedData, load_rows, prepare_dataset
from finetune.hybrid import HybridObjectiveCollator
from finetune.model_card import TrainingSummary, render_model_card
from modeling_refusion import RefusionForCausalLM

logger = logging.getLogger("finetune.sft")

STAGING = ".refusion-final"  # inside output_dir; hidden, so never mistaken for the model
QUANTIZATION_ATTRIBUTES = (
    "hf_quantizer",
    "is_quantized",
    "quantization_method",
    "is_loaded_in_4bit",
    "is_loaded_in_8bit",
)


class UsageError(ValueError):
    """A mistake in the command line, reported in one line."""


@dataclass
class RefusionArguments:
    """ReFusion's own options, next to TRL's `ScriptArguments`, `SFTConfig` and `ModelConfig`."""

    slot_sizes: list[int] | None = field(
        default=None,
        metadata={"help": "Slot sizes the hybrid objective draws from, one per example (default: 4 8 16 32)."},
    )
    mask_token: str | None = field(
        default=None,
        metadata={"help": "The [MASK] token: added when missing (default: the tokenizer's own, else <|mask|>)."},
    )
    mask_eps: float | None = field(
        default=None, metadata={"help": "Smallest masking probability of the MDM loss (default: 1e-3)."}
    )
    gguf_file: str | None = field(
        default=None, metadata={"help": "GGUF file inside --model_name_or_path to load (dequantized) as the base."}
    )
    overlong: str = field(
        default="truncate",
        metadata={
            "help": "Rows longer than --max_length: 'truncate' cuts the response, 'drop' skips the row.",
            "choices": list(OVERLONG_POLICIES),
        },
    )
    format: str = field(
        default="refusion",
        metadata={
            "help": "Saved model: 'refusion' (our class; trains further with the hybrid loss) or 'native' (the "
            "backbone's own class and config, which serving engines load; ReFusion decoding with trust_remote_code).",
            "choices": list(FORMATS),
        },
    )


@dataclass
class RefusionSFTConfig(SFTConfig):
    """`SFTConfig` with defaults that suit the device and the hybrid-objective data pipeline.

    Without an accelerator the run uses the CPU (gloo across processes), fp32 and no activation checkpointing; on an
    accelerator bf16 (where supported) and activation checkpointing, as in TRL. The collator needs its own columns,
    so TRL's column removal and dataset preparation are always off.
    """

    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={"help": "Deprecated alias of --activation_checkpointing (on with an accelerator, off on CPU)."},
    )
    bf16: bool | None = field(
        default=None,
        metadata={"help": "bf16 mixed precision (default: on with a bf16-capable accelerator, off on CPU)."},
    )

    def __post_init__(self):
        accelerator = None if self.use_cpu else torch.accelerator.current_accelerator()
        self.use_cpu = accelerator is None
        if self.bf16 is None and not self.fp16:
            self.bf16 = accelerator is not None and (accelerator.type != "cuda" or torch.cuda.is_bf16_supported())
        if self.activation_checkpointing is None and self.gradient_checkpointing is None:
            self.activation_checkpointing = accelerator is not None
        self.remove_unused_columns = False
        self.dataset_kwargs = {**(self.dataset_kwargs or {}), "skip_prepare_dataset": True}
        super().__post_init__()


class RefusionSFTTrainer(SFTTrainer):
    """`SFTTrainer` whose loss is the model's own hybrid loss, logged with its AR and MDM parts.

    TRL's `compute_loss` routes around a model's loss (it asks for a fused next-token NLL), so it is replaced. The
    AR and MDM losses of every micro-batch are summed on the device and averaged over steps and processes only when
    the trainer logs, landing next to `loss` in `trainer_state.json`.
    """

    # The hybrid loss is a per-micro-batch mean: let `Trainer` divide it over the gradient accumulation steps.
    loss_is_scaled_for_ga = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._loss_parts: dict[str, torch.Tensor] = {}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Hybrid loss of a `HybridObjectiveCollator` batch; AR and MDM parts are kept for the next log."""
        mode = "train" if model.training else "eval"
        batch = {name: value for name, value in inputs.items() if name != "slot_size"}
        outputs = model(**batch, use_cache=False)
        parts = torch.stack([outputs.ar_loss.detach(), outputs.mdm_loss.detach(), torch.ones_like(outputs.ar_loss)])
        self._loss_parts[mode] = self._loss_parts.get(mode, 0) + parts.float()
        return (outputs.loss, outputs) if return_outputs else outputs.loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluate the hybrid loss only, never gathering full-vocabulary logits."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add `ar_loss` and `mdm_loss` (or `eval_*`) to the logs that carry a loss."""
        prefix = "eval_" if "eval_loss" in logs else ""
        mode = "eval" if prefix else "train"
        if f"{prefix}loss" in logs and mode in self._loss_parts:
            ar_sum, mdm_sum, count = self.accelerator.reduce(self._loss_parts.pop(mode), reduction="sum").tolist()
            logs[f"{prefix}ar_loss"] = ar_sum / count
            logs[f"{prefix}mdm_loss"] = mdm_sum / count
        super().log(logs, start_time)


class OneLineParser(TrlParser):
    """`TrlParser` that reports a command-line mistake in one line instead of the full usage text."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def make_parser() -> TrlParser:
    """The parser over TRL's `ScriptArguments`, `SFTConfig`, `ModelConfig` and ReFusion's own options."""
    dataclass_types = (ScriptArguments, RefusionSFTConfig, ModelConfig, RefusionArguments)
    return OneLineParser(dataclass_types, prog="refusion-sft", description=__doc__.split("\n\n")[0])


def is_refusion_checkpoint(name_or_path: str, revision: str | None = None) -> bool:
    """Whether a folder or Hub id already holds a ReFusion model (its config's `model_type`)."""
    config, _ = PretrainedConfig.get_config_dict(name_or_path, revision=revision)
    return config.get("model_type") == "refusion"


def load_model(
    model_args: ModelConfig,
    refusion_args: RefusionArguments,
    training_args: RefusionSFTConfig,
    quantization_config: BitsAndBytesConfig | None = None,
) -> tuple[RefusionForCausalLM, PreTrainedTokenizerBase]:
    """Load a ReFusion checkpoint, or an autoregressive one converted on the fly, with ReFusion's overrides.

    `--model_init_kwargs` go to `from_pretrained` as in TRL; a quantized model is loaded straight onto the process's
    own device.
    """
    overrides = {}
    if refusion_args.slot_sizes is not None:
        overrides["train_slot_sizes"] = refusion_args.slot_sizes
    if refusion_args.mask_eps is not None:
        overrides["mask_eps"] = refusion_args.mask_eps
    path, revision = model_args.model_name_or_path, model_args.model_revision
    load_kwargs = {
        "revision": revision,
        "dtype": model_args.dtype,
        "trust_remote_code": training_args.trust_remote_code,
    }
    if model_args.attn_implementation is not None:
        load_kwargs["attn_implementation"] = model_args.attn_implementation
    load_kwargs.update(training_args.model_init_kwargs or {})
    if quantization_config is not None:
        load_kwargs.update(quantization_config=quantization_config, device_map={"": training_args.device})

    if refusion_args.gguf_file is None and is_refusion_checkpoint(path, revision):
        model = RefusionForCausalLM.from_pretrained(path, **load_kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
        if refusion_args.mask_token not in (None, tokenizer.mask_token):
            raise UsageError(
                f"{path} already uses the mask token {tokenizer.mask_token!r}; --mask_token cannot change it."
            )
        for name, value in overrides.items():
            setattr(model.config, name, value)
        model.config.validate_refusion_fields()
        return model, tokenizer

    base, tokenizer = load_causal_lm(path, gguf_file=refusion_args.gguf_file, **load_kwargs)
    model, tokenizer = convert_to_refusion(base, tokenizer, refusion_args.mask_token, **overrides)
    if quantization_config is not None:
        # The wrapper shares the quantized modules, so it must be seen as quantized by PEFT and the Trainer. (A GGUF
        # base is fully dequantized: its GGUF marker is not carried over, so the model stays serializable.)
        for name in QUANTIZATION_ATTRIBUTES:
            if hasattr(base, name):
                setattr(model, name, getattr(base, name))
    return model, tokenizer


def lora_config(model_args: ModelConfig, mask_token_id: int) -> LoraConfig | None:
    """TRL's LoRA config, on every linear layer by default, with the mask token's embedding row trainable."""
    peft_config = get_peft_config(model_args)
    if peft_config is None:
        return None
    if peft_config.target_modules is None:
        peft_config.target_modules = "all-linear"
    peft_config.trainable_token_indices = {"embed_tokens": [mask_token_id]}
    return peft_config


def last_complete_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest `checkpoint-N` that was fully written (the Trainer writes `trainer_state.json` last)."""
    checkpoints = [
        path
        for path in Path(output_dir).glob("checkpoint-*")
        if path.name.removeprefix("checkpoint-").isdigit() and (path / "trainer_state.json").is_file()
    ]
    return max(checkpoints, key=lambda path: int(path.name.removeprefix("checkpoint-")), default=None)


def resolve_resume(resume_from_checkpoint: str | None, output_dir: str) -> str | None:
    """Map `--resume_from_checkpoint` (a path, or `true`/`last` for the newest complete one) to a checkpoint path."""
    if resume_from_checkpoint is None or resume_from_checkpoint.lower() in ("false", "none", ""):
        return None
    if resume_from_checkpoint.lower() in ("true", "last"):
        checkpoint = last_complete_checkpoint(output_dir)
        if checkpoint is None:
            raise UsageError(f"--resume_from_checkpoint: no complete checkpoint in {output_dir!r}.")
        return str(checkpoint)
    if not (Path(resume_from_checkpoint) / "trainer_state.json").is_file():
        raise UsageError(f"--resume_from_checkpoint: {resume_from_checkpoint!r} is not a complete checkpoint.")
    return resume_from_checkpoint


def check_arguments(training_args: RefusionSFTConfig, model_args: ModelConfig) -> None:
    """Reject option combinations the hybrid objective cannot honour, before anything is loaded."""
    if model_args.model_name_or_path is None:
        raise UsageError("--model_name_or_path is required.")
    if training_args.packing or training_args.padding_free:
        raise UsageError("--packing and --padding_free are not supported: each row is laid out as its own slots.")
    if (model_args.load_in_4bit or model_args.load_in_8bit) and not model_args.use_peft:
        raise UsageError("--load_in_4bit/--load_in_8bit train adapters only: add --use_peft.")
    if training_args.chat_template_path is not None and not training_args.chat_template_path.endswith(
        (".jinja", ".j2")
    ):
        raise UsageError("--chat_template_path must be a .jinja file.")


def prepare_data(
    script_args: ScriptArguments,
    training_args: RefusionSFTConfig,
    refusion_args: RefusionArguments,
    tokenizer: PreTrainedTokenizerBase,
) -> tuple[PreparedData, PreparedData | None]:
    """Load and tokenize the train split (and the test split when evaluating); the main process goes first."""
    if script_args.dataset_name is None:
        raise UsageError("--dataset_name is required (a .json/.jsonl/.parquet file, a folder of them, or a Hub id).")
    if script_args.dataset_streaming:
        raise UsageError("--dataset_streaming is not supported: rows are checked before training starts.")
    if training_args.chat_template_path is not None:
        tokenizer.chat_template = Path(training_args.chat_template_path).read_text(encoding="utf-8")
    splits = [script_args.dataset_train_split]
    if training_args.eval_strategy != "no":
        splits.append(script_args.dataset_test_split)
    prepared = []
    with training_args.main_process_first(desc="dataset preparation"):
        for split in splits:
            rows = load_rows(script_args.dataset_name, script_args.dataset_config, split=split)
            prepared.append(
                prepare_dataset(
                    rows,
                    tokenizer,
                    max_length=training_args.max_length,
                    overlong=refusion_args.overlong,
                    num_proc=training_args.dataset_num_proc,
                )
            )
            logger.info("%s split: %s", split, prepared[-1].summary(training_args.max_length))
    return prepared[0], (prepared[1] if len(prepared) > 1 else None)


def is_sharded(trainer: SFTTrainer) -> bool:
    """Whether each process holds only a shard of the weights (FSDP or DeepSpeed ZeRO-3)."""
    plugin = trainer.accelerator.state.deepspeed_plugin
    return trainer.is_fsdp_enabled or (plugin is not None and plugin.zero_stage == 3)


def merged_model(
    trainer: SFTTrainer,
    staging: Path,
    model_args: ModelConfig,
    refusion_args: RefusionArguments,
) -> RefusionForCausalLM | None:
    """Gather the trained weights on the main process as one plain ReFusion model (LoRA merged in).

    With LoRA the adapter is first written to `staging/adapter`. Quantized or sharded weights cannot be merged in
    place, so the base is then reloaded in full precision and the saved adapter merged into it. Every process must
    call this (saving sharded weights is collective); the other processes get None.
    """
    model = trainer.accelerator.unwrap_model(trainer.model)
    reload = is_sharded(trainer) or getattr(model, "hf_quantizer", None) is not None
    if isinstance(model, PeftModel):
        trainer.save_model(str(staging / "adapter"))
    elif reload:
        trainer.save_model(str(staging / "full"))
    if not trainer.accelerator.is_main_process:
        return None
    if not reload:
        return model.merge_and_unload() if isinstance(model, PeftModel) else model
    unset_hf_deepspeed_config()  # training is over: the reload must not be partitioned across processes again
    if isinstance(model, PeftModel):
        base, _ = load_model(model_args, refusion_args, trainer.args)
        return PeftModel.from_pretrained(base, staging / "adapter").merge_and_unload()
    full = RefusionForCausalLM.from_pretrained(staging / "full", dtype=model.dtype)
    shutil.rmtree(staging / "full")
    return full


def publish(staging: Path, output_dir: Path) -> None:
    """Move the staged files into `output_dir`, `config.json` last, so that the folder loads only once complete."""
    (output_dir / "config.json").unlink(missing_ok=True)
    for source in sorted(staging.iterdir(), key=lambda path: path.name == "config.json"):
        target = output_dir / source.name
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(source, target)
    staging.rmdir()


def training_summary(
    trainer: SFTTrainer, script_args: ScriptArguments, model_args: ModelConfig, rows: int
) -> TrainingSummary:
    """The figures the model card reports, read from the finished trainer."""
    args, config = trainer.args, trainer.accelerator.unwrap_model(trainer.model).config
    if not model_args.use_peft:
        method = "full fine-tuning"
    else:
        quantized = " (QLoRA, 4-bit base)" if model_args.load_in_4bit else ""
        method = f"LoRA r={model_args.lora_r}, alpha={model_args.lora_alpha}{quantized}, mask-token embedding trained"
    last_log = next((log for log in reversed(trainer.state.log_history) if "loss" in log), {})
    return TrainingSummary(
        base_model=model_args.model_name_or_path,
        dataset=script_args.dataset_name,
        method=method,
        rows=rows,
        max_length=args.max_length,
        slot_sizes=list(config.train_slot_sizes),
        mask_eps=config.mask_eps,
        steps=trainer.state.global_step,
        epochs=trainer.state.epoch or 0.0,
        learning_rate=args.learning_rate,
        batch_size=args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size,
        final_losses={name: last_log[name] for name in ("loss", "ar_loss", "mdm_loss") if name in last_log},
    )


def hub_repo_id(training_args: RefusionSFTConfig) -> str:
    """`--hub_model_id`, else the output folder's name (as the Trainer does)."""
    return training_args.hub_model_id or Path(training_args.output_dir).absolute().name


def push_to_hub(output_dir: Path, training_args: RefusionSFTConfig) -> str:
    """Upload the merged model, its code, tokenizer, card and `adapter/` (not the checkpoints); return the repo id."""
    api = HfApi(token=training_args.hub_token)
    repo = api.create_repo(hub_repo_id(training_args), private=training_args.hub_private_repo, exist_ok=True)
    api.upload_folder(
        repo_id=repo.repo_id,
        folder_path=output_dir,
        revision=training_args.hub_revision,
        commit_message="ReFusion fine-tuning with TRL",
        ignore_patterns=["checkpoint-*", ".*"],
    )
    return repo.repo_id


def save_outputs(
    trainer: RefusionSFTTrainer,
    tokenizer: PreTrainedTokenizerBase,
    script_args: ScriptArguments,
    model_args: ModelConfig,
    refusion_args: RefusionArguments,
    rows: int,
) -> None:
    """Write `trainer_state.json`, then the merged model, card and adapter into `output_dir` without a torn state."""
    training_args = trainer.args
    output_dir = Path(training_args.output_dir)
    staging = output_dir / STAGING
    if trainer.accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        trainer.save_state()
    trainer.accelerator.wait_for_everyone()
    model = merged_model(trainer, staging, model_args, refusion_args)
    if model is not None:
        model.config.use_cache = True  # the Trainer turned it off for training; the published model generates
        save_model(model, staging, refusion_args.format)
        tokenizer.save_pretrained(staging)
        summary = training_summary(trainer, script_args, model_args, rows)
        summary.format = refusion_args.format
        card = render_model_card(hub_repo_id(training_args), summary)
        (staging / "README.md").write_text(card, encoding="utf-8")
        publish(staging, output_dir)
        logger.info("Merged ReFusion model written to %s", output_dir)
    trainer.accelerator.wait_for_everyone()


def build_trainer(
    script_args: ScriptArguments,
    training_args: RefusionSFTConfig,
    model_args: ModelConfig,
    refusion_args: RefusionArguments,
) -> tuple[RefusionSFTTrainer, PreparedData]:
    """Model, data, collator and LoRA config assembled into a `RefusionSFTTrainer`."""
    check_arguments(training_args, model_args)
    quantization_config = get_quantization_config(model_args)
    model, tokenizer = load_model(model_args, refusion_args, training_args, quantization_config)
    if training_args.eos_token is not None:
        if training_args.eos_token not in tokenizer.get_vocab():
            raise UsageError(f"--eos_token {training_args.eos_token!r} is not in the tokenizer's vocabulary.")
        tokenizer.eos_token = training_args.eos_token
    train_data, eval_data = prepare_data(script_args, training_args, refusion_args, tokenizer)
    collator = HybridObjectiveCollator.from_config(
        model.config, tokenizer.pad_token_id, seed=training_args.seed + training_args.process_index
    )
    # `model_init_kwargs` were used by `load_model` (and are again if the base is reloaded to merge the adapter);
    # hidden while the trainer is built, which would otherwise warn that they are ignored for a loaded model.
    model_init_kwargs, training_args.model_init_kwargs = training_args.model_init_kwargs, None
    trainer = RefusionSFTTrainer(
        model=model,
        args=training_args,
        data_collator=collator,
        train_dataset=train_data.dataset,
        eval_dataset=eval_data.dataset if eval_data is not None else None,
        processing_class=tokenizer,
        peft_config=lora_config(model_args, model.config.mask_token_id),
    )
    training_args.model_init_kwargs = model_init_kwargs
    return trainer, train_data


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, train, write `output_dir` and optionally push it; return the exit status."""
    parser = make_parser()
    try:
        script_args, training_args, model_args, refusion_args = parser.parse_args_and_config(argv)
    except ValueError as error:
        parser.error(" ".join(str(error).split()))
    if not logger.handlers:
        logger.addHandler(logging.StreamHandler())
    logger.setLevel(logging.INFO if training_args.process_index == 0 else logging.WARNING)
    push = training_args.push_to_hub
    training_args.push_to_hub = False  # the Trainer would push adapter checkpoints; the merged model is pushed below
    try:
        resume = resolve_resume(training_args.resume_from_checkpoint, training_args.output_dir)
        trainer, train_data = build_trainer(script_args, training_args, model_args, refusion_args)
    except (ValueError, OSError, ImportError) as error:  # UsageError and DataFormatError included
        print(f"refusion-sft: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 1

    trainer.train(resume_from_checkpoint=resume)
    save_outputs(trainer, trainer.processing_class, script_args, model_args, refusion_args, len(train_data.dataset))
    if push and trainer.accelerator.is_main_process:
        repo_id = push_to_hub(Path(training_args.output_dir), training_args)
        logger.info("Pushed to %s/%s", HfApi().endpoint, repo_id)
    trainer.end()
    return 0


if __name__ == "__main__":
    sys.exit(main())
