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
import sys
from pathlib import Path

from huggingface_hub import HfApi
from transformers import PreTrainedTokenizerBase
from trl import ModelConfig, ScriptArguments, TrlParser, get_quantization_config

from finetune.data import PreparedData, load_rows, prepare_dataset
from finetune.export import push_to_hub, save_outputs
from finetune.hybrid import HybridObjectiveCollator
from finetune.trainer import (
    RefusionArguments,
    RefusionSFTConfig,
    RefusionSFTTrainer,
    UsageError,
    continued_adapter,
    load_model,
    lora_config,
)

logger = logging.getLogger("finetune.sft")


class OneLineParser(TrlParser):
    """`TrlParser` that reports a command-line mistake in one line instead of the full usage text."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def make_parser() -> TrlParser:
    """The parser over TRL's `ScriptArguments`, `SFTConfig`, `ModelConfig` and ReFusion's own options."""
    dataclass_types = (ScriptArguments, RefusionSFTConfig, ModelConfig, RefusionArguments)
    return OneLineParser(dataclass_types, prog="refusion-sft", description=__doc__.split("\n\n")[0])


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


def check_arguments(
    training_args: RefusionSFTConfig, model_args: ModelConfig, refusion_args: RefusionArguments
) -> None:
    """Reject option combinations the hybrid objective cannot honour, before anything is loaded."""
    if model_args.model_name_or_path is None:
        raise UsageError("--model_name_or_path is required.")
    if refusion_args.init_adapter is not None and not model_args.use_peft:
        raise UsageError("--init_adapter continues a LoRA adapter: add --use_peft.")
    if training_args.packing or training_args.padding_free:
        raise UsageError("--packing and --padding_free are not supported: each row is laid out as its own slots.")
    if refusion_args.soft_target_weight and not model_args.use_peft:
        raise UsageError(
            "--soft_target_weight takes its targets from the model with its adapter disabled: add --use_peft."
        )
    if refusion_args.soft_target_weight < 0:
        raise UsageError(f"--soft_target_weight must be >= 0, got {refusion_args.soft_target_weight}.")
    if refusion_args.acceptance_decay is not None and not 0.0 < refusion_args.acceptance_decay <= 1.0:
        raise UsageError(f"--acceptance_decay must lie in (0, 1], got {refusion_args.acceptance_decay}.")
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


def build_trainer(
    script_args: ScriptArguments,
    training_args: RefusionSFTConfig,
    model_args: ModelConfig,
    refusion_args: RefusionArguments,
) -> tuple[RefusionSFTTrainer, PreparedData]:
    """Model, data, collator and LoRA config assembled into a `RefusionSFTTrainer`."""
    check_arguments(training_args, model_args, refusion_args)
    quantization_config = get_quantization_config(model_args)
    model, tokenizer = load_model(model_args, refusion_args, training_args, quantization_config)
    if training_args.eos_token is not None:
        if training_args.eos_token not in tokenizer.get_vocab():
            raise UsageError(f"--eos_token {training_args.eos_token!r} is not in the tokenizer's vocabulary.")
        tokenizer.eos_token = training_args.eos_token
    train_data, eval_data = prepare_data(script_args, training_args, refusion_args, tokenizer)
    collator = HybridObjectiveCollator.from_config(
        model.config,
        tokenizer.pad_token_id,
        seed=training_args.seed + training_args.process_index,
        slot_masking=refusion_args.slot_masking,
        acceptance_decay=refusion_args.acceptance_decay,
    )
    # `model_init_kwargs` were used by `load_model` (and are again if the base is reloaded to merge the adapter);
    # hidden while the trainer is built, which would otherwise warn that they are ignored for a loaded model.
    model_init_kwargs, training_args.model_init_kwargs = training_args.model_init_kwargs, None
    peft_config = lora_config(model_args, model.config.mask_token_id)
    if refusion_args.init_adapter is not None:
        model, peft_config = continued_adapter(model, refusion_args.init_adapter), None
        logger.info("Continuing the LoRA adapter %s (its own rank and targets apply).", refusion_args.init_adapter)
    trainer = RefusionSFTTrainer(
        model=model,
        args=training_args,
        data_collator=collator,
        train_dataset=train_data.dataset,
        eval_dataset=eval_data.dataset if eval_data is not None else None,
        processing_class=tokenizer,
        peft_config=peft_config,
        soft_target_weight=refusion_args.soft_target_weight,
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
