"""The end of a `finetune.sft` run: the trained weights gathered and merged into one ReFusion model, written into
`output_dir` with its card without ever leaving a half-written folder (`finetune.files.publish`: staged first, moved
in file by file, `config.json` last, other files kept), and optionally pushed to the Hub."""

import logging
import shutil
from pathlib import Path

from huggingface_hub import HfApi
from peft import PeftModel
from transformers import PreTrainedTokenizerBase
from transformers.integrations.deepspeed import unset_hf_deepspeed_config
from trl import ModelConfig, ScriptArguments, SFTTrainer

from finetune.convert import save_model
from finetune.files import STAGING, discard_staging, publish
from finetune.model_card import TrainingSummary, render_model_card
from finetune.trainer import RefusionArguments, RefusionSFTConfig, RefusionSFTTrainer, load_model
from modeling_refusion import RefusionForCausalLM

logger = logging.getLogger("finetune.sft")


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
        discard_staging(output_dir)  # what a run stopped while writing its final files left
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
