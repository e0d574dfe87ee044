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
import sys
from pathlib import Path

from huggingface_hub import HfApi
from trl import ModelConfig, ScriptArguments, TrlParser, get_quantization_config

from finetune.data import prepare_training_data
from finetune.export import push_to_hub, save_outputs
from finetune.hybrid import HybridObjectiveCollator
from finetune.trainer import (
    RefusionArguments,
    RefusionSFTConfig,
    RefusionSFTTrainer,
    check_arguments,
    load_model,
    lora_config,
    resolve_resume,
)

logger = logging.getLogger("finetune.sft")


class OneLineParser(TrlParser):
    """`TrlParser` that reports a command-line mistake in one line instead of the full usage text."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_args_and_config(self, args=None, **kwargs):
        """TRL's parsing, where a value the argument classes reject (their `ValueError`) is a mistake too."""
        try:
            return super().parse_args_and_config(args, **kwargs)
        except ValueError as error:
            self.error(" ".join(str(error).split()))


def make_parser() -> TrlParser:
    """The parser over TRL's `ScriptArguments`, `SFTConfig`, `ModelConfig` and ReFusion's own options."""
    dataclass_types = (ScriptArguments, RefusionSFTConfig, ModelConfig, RefusionArguments)
    return OneLineParser(dataclass_types, prog="refusion-sft", description=__doc__.split("\n\n")[0])


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, train, write `output_dir` and optionally push it; return the exit status."""
    script_args, training_args, model_args, refusion_args = make_parser().parse_args_and_config(argv)
    if not logger.handlers:
        logger.addHandler(logging.StreamHandler())
    logger.setLevel(logging.INFO if training_args.process_index == 0 else logging.WARNING)
    # The merged model is pushed at the end; the Trainer would push adapter checkpoints.
    push, training_args.push_to_hub = training_args.push_to_hub, False
    try:
        resume = resolve_resume(training_args.resume_from_checkpoint, training_args.output_dir)
        check_arguments(training_args, model_args, refusion_args)

        # Model: an autoregressive checkpoint converted to ReFusion on the fly, or a ReFusion one
        model, tokenizer = load_model(model_args, refusion_args, training_args, get_quantization_config(model_args))

        # Dataset
        train_data, eval_data = prepare_training_data(
            script_args, training_args, tokenizer, overlong=refusion_args.overlong
        )

        # Trainer, fed by the hybrid objective's collator
        collator = HybridObjectiveCollator.from_config(
            model.config,
            tokenizer.pad_token_id,
            seed=training_args.seed + training_args.process_index,
            slot_masking=refusion_args.slot_masking,
            masked_slots=refusion_args.masked_slots,
            acceptance_decay=refusion_args.acceptance_decay,
        )
        trainer = RefusionSFTTrainer(
            model=model,
            args=training_args,
            data_collator=collator,
            train_dataset=train_data.dataset,
            eval_dataset=eval_data.dataset if eval_data is not None else None,
            processing_class=tokenizer,
            peft_config=lora_config(model_args, model.config.mask_token_id),
            init_adapter=refusion_args.init_adapter,
            soft_target_weight=refusion_args.soft_target_weight,
        )
    except (ValueError, OSError, ImportError) as error:  # UsageError and DataFormatError are ValueErrors
        print(f"refusion-sft: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 1

    trainer.train(resume_from_checkpoint=resume)

    # Save the merged model, its card and the adapter, and push them to the Hub
    save_outputs(trainer, trainer.processing_class, script_args, model_args, refusion_args, len(train_data.dataset))
    if push and trainer.accelerator.is_main_process:
        repo_id = push_to_hub(Path(training_args.output_dir), training_args)
        logger.info("Pushed to %s/%s", HfApi().endpoint, repo_id)
    trainer.end()
    return 0


if __name__ == "__main__":
    sys.exit(main())
