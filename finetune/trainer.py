"""The pieces `finetune.sft` assembles: ReFusion's options and the checks on them, the `SFTConfig` and `SFTTrainer`
subclasses, the checkpoint a run resumes from, and the model (an autoregressive checkpoint converted on the fly, or a
ReFusion one) with its LoRA config."""

import contextlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel
from transformers import AutoTokenizer, BitsAndBytesConfig, PretrainedConfig, PreTrainedTokenizerBase
from trl import ModelConfig, SFTConfig, SFTTrainer, get_peft_config

from finetune.convert import FORMATS, MASK_INITS, convert_to_refusion, load_causal_lm
from finetune.data import OVERLONG_POLICIES
from finetune.hybrid import MASKED_SLOTS, SLOT_MASKINGS
from modeling_refusion import RefusionForCausalLM, refusion_hybrid_loss, refusion_soft_target_loss

QUANTIZATION_ATTRIBUTES = (
    "hf_quantizer",
    "is_quantized",
    "quantization_method",
    "is_loaded_in_4bit",
    "is_loaded_in_8bit",
)

logger = logging.getLogger("finetune.sft")  # the run's log, which `finetune.sft` shows


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
    mdm_loss_weight: float | None = field(
        default=None, metadata={"help": "Weight of the MDM term: loss = ar_loss + weight * mdm_loss (default: 1)."}
    )
    slot_masking: str = field(
        default="whole",
        metadata={
            "help": "What a masked slot hides: 'whole' (every token, the paper), 'suffix' (a random clean prefix of "
            "0..size-1 of its own tokens stays in front of its masks, as in the decoder's infill) or 'mixed' (either, "
            "drawn per slot).",
            "choices": list(SLOT_MASKINGS),
        },
    )
    masked_slots: str = field(
        default="random",
        metadata={
            "help": "Which slots the MDM term masks: 'random' (each with probability p, the paper) or 'tail' (the "
            "last ceil(p * slots) of the response, so every [MASK] sees only text before it, as in decoding).",
            "choices": list(MASKED_SLOTS),
        },
    )
    acceptance_decay: float | None = field(
        default=None,
        metadata={
            "help": "Weight the MDM term of the k-th [MASK] of a slot by decay**k, rescaled so each slot keeps its "
            "total: favours the first drafts, which start every accepted run (e.g. 0.7; default: off, all weights 1)."
        },
    )
    soft_target_weight: float = field(
        default=0.0,
        metadata={
            "help": "Weight of a KL term pulling each [MASK] toward the converted model's own next-token "
            "distribution there (the adapter disabled, true prefix, same step); needs --use_peft (default: 0, off)."
        },
    )
    mask_init: str = field(
        default="mean",
        metadata={
            "help": "Embedding of a newly added [MASK] token: 'mean' of the vocabulary's rows, or 'random' (normal, "
            "with the rows' spread). An existing mask row is never changed.",
            "choices": list(MASK_INITS),
        },
    )
    init_adapter: str | None = field(
        default=None,
        metadata={
            "help": "Continue training this saved LoRA adapter (a folder with adapter_config.json, e.g. an earlier "
            "run's adapter/) instead of a fresh one; needs --use_peft, and the adapter's own LoRA settings apply."
        },
    )
    draft_adapter_rank: int | None = field(
        default=None,
        metadata={
            "help": "Train a draft-only adapter of this rank instead (adapter_refusion): low-rank deltas that apply at "
            "[MASK] tokens only, with every base weight frozen, so the model's causal predictions (which verify every "
            "draft) stay the base model's bit for bit. A model that has one continues it (default: off)."
        },
    )
    draft_adapter_alpha: float | None = field(
        default=None, metadata={"help": "The draft adapter's deltas are scaled by alpha / rank (default: 2 * rank)."}
    )
    draft_adapter_modules: list[str] | None = field(
        default=None,
        metadata={
            "help": "Linear layers of each decoder layer the draft adapter adapts (default: q_proj k_proj v_proj "
            "o_proj gate_proj up_proj down_proj)."
        },
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
    draft_only = refusion_args.draft_adapter_rank is not None
    if draft_only and (model_args.use_peft or refusion_args.init_adapter is not None):
        raise UsageError("--draft_adapter_rank trains the draft adapter alone: drop --use_peft and --init_adapter.")
    if draft_only and refusion_args.draft_adapter_rank < 1:
        raise UsageError(f"--draft_adapter_rank must be a positive integer, got {refusion_args.draft_adapter_rank}.")
    if draft_only and refusion_args.format == "native":
        raise UsageError("A draft adapter is applied by ReFusion's own class only: drop --format native.")
    if not draft_only and (refusion_args.draft_adapter_alpha, refusion_args.draft_adapter_modules) != (None, None):
        raise UsageError("--draft_adapter_alpha and --draft_adapter_modules go with --draft_adapter_rank.")
    if refusion_args.soft_target_weight and not (model_args.use_peft or draft_only):
        raise UsageError(
            "--soft_target_weight takes its targets from the model with its adapter disabled: add --use_peft "
            "(or train a draft adapter: --draft_adapter_rank)."
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


class RefusionSFTTrainer(SFTTrainer):
    """`SFTTrainer` whose loss is ReFusion's hybrid loss, logged with its parts.

    TRL's `compute_loss` routes around a model's loss (it asks for a fused next-token NLL), so it is replaced. The
    parts of every micro-batch's loss are summed on the device and averaged over steps and processes only when the
    trainer logs, landing next to `loss` in `trainer_state.json`. With `soft_target_weight` the loss gains
    `soft_target_weight * soft_target_loss` (`refusion_soft_target_loss`), its target computed in the same step by
    the same network with the LoRA adapter disabled. With `init_adapter` a saved LoRA adapter continues its training
    (`continued_adapter`) in place of the fresh one `peft_config` describes.
    """

    # The hybrid loss is a per-micro-batch mean: let `Trainer` divide it over the gradient accumulation steps.
    loss_is_scaled_for_ga = False

    def __init__(
        self,
        model,
        args: SFTConfig | None = None,
        *,
        peft_config: LoraConfig | None = None,
        init_adapter: str | os.PathLike | None = None,
        soft_target_weight: float = 0.0,
        **kwargs,
    ):
        if init_adapter is not None:
            model, peft_config = continued_adapter(model, init_adapter), None
            logger.info("Continuing the LoRA adapter %s (its own rank and targets apply).", init_adapter)
        # A loaded model's `model_init_kwargs` were used by `load_model` (and are again if the base is reloaded to
        # merge the adapter); hidden from `SFTTrainer`, which would otherwise warn that they are ignored.
        model_init_kwargs = None if isinstance(model, str) else getattr(args, "model_init_kwargs", None)
        if model_init_kwargs is not None:
            args.model_init_kwargs = None
        try:
            super().__init__(model, args, peft_config=peft_config, **kwargs)
        finally:
            if model_init_kwargs is not None:
                args.model_init_kwargs = model_init_kwargs
        if soft_target_weight and not (isinstance(self.model, PeftModel) or draft_adapter_of(self.model) is not None):
            raise UsageError(
                "--soft_target_weight needs a LoRA model or a draft adapter: its targets come without the adapter."
            )
        self.soft_target_weight = soft_target_weight
        self.loss_part_names = ("ar_loss", "mdm_loss") + (("soft_target_loss",) if soft_target_weight else ())
        self._loss_parts: dict[str, torch.Tensor] = {}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Hybrid loss of a `HybridObjectiveCollator` batch; its parts are kept for the next log.

        Replaced because `SFTTrainer.compute_loss` computes its own next-token loss (and token accuracy) from
        shifted `labels`, which for a hybrid batch is wrong twice over: labels are already aligned with the logits
        (no shift), and `[MASK]` positions carry the masked-diffusion term, weighted by each example's noise level.
        The loss is `ar_loss + mdm_loss_weight * mdm_loss` (`refusion_hybrid_loss`, the batch's `mdm_token_weight`
        applied when present) plus the soft-target term when it is on.
        """
        mode = "train" if model.training else "eval"
        # The targets first: a draft adapter's gate is its backbone's latest call's, which a backward that recomputes
        # activations reads again.
        target = (
            converted_model_log_probs(self.accelerator.unwrap_model(model), inputs) if self.soft_target_weight else None
        )
        outputs = model(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            position_ids=inputs["position_ids"],
            use_cache=False,
        )
        fields = (inputs["is_masked"], inputs["noise_level"], inputs["response_length"])
        token_weight = inputs.get("mdm_token_weight")
        mdm_weight = self.accelerator.unwrap_model(model).config.mdm_loss_weight
        loss, ar_loss, mdm_loss = refusion_hybrid_loss(
            outputs.logits, inputs["labels"], *fields, mdm_weight=mdm_weight, token_weight=token_weight
        )
        parts = [ar_loss, mdm_loss]
        if self.soft_target_weight:
            soft_loss = refusion_soft_target_loss(
                outputs.logits, inputs["is_masked"], target, *fields[1:], token_weight=token_weight
            )
            loss = loss + self.soft_target_weight * soft_loss
            parts.append(soft_loss)
        parts = torch.stack([part.detach() for part in parts] + [torch.ones_like(ar_loss)])
        self._loss_parts[mode] = self._loss_parts.get(mode, 0) + parts.float()
        outputs.loss, outputs.ar_loss, outputs.mdm_loss = loss, ar_loss, mdm_loss
        return (loss, outputs) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluate the hybrid loss only, never gathering full-vocabulary logits."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add `ar_loss`, `mdm_loss` and (when on) `soft_target_loss`, or their `eval_*`, to the logs with a loss."""
        prefix = "eval_" if "eval_loss" in logs else ""
        mode = "eval" if prefix else "train"
        if f"{prefix}loss" in logs and mode in self._loss_parts:
            *sums, count = self.accelerator.reduce(self._loss_parts.pop(mode), reduction="sum").tolist()
            for name, total in zip(self.loss_part_names, sums):
                logs[f"{prefix}{name}"] = total / count
        super().log(logs, start_time)


def draft_adapter_of(model):
    """The draft adapter of a ReFusion model (unwrapped from DDP and the like), or None."""
    return getattr(getattr(model, "module", model), "draft_adapter", None)


@torch.no_grad()
def converted_model_log_probs(model: PeftModel | RefusionForCausalLM, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Log-probabilities (`[masked count, vocab]`, in the order of `is_masked.nonzero()`) that the converted model,
    i.e. `model` with its LoRA adapter disabled, gives to the token at each `[MASK]` position given the true prefix.
    A model with a draft adapter is the converted model already wherever no `[MASK]` is, as here.

    One causal forward over the plain sequence in reading order (each `[MASK]` put back to its label, every token
    at its position id); the distribution for position `q` is read from the output at `q - 1`.
    """
    input_ids, position_ids, is_masked = batch["input_ids"], batch["position_ids"], batch["is_masked"]
    real = batch["attention_mask"].bool()
    storage = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    # Real tokens hold positions 0..n-1 of their row, padding keeps its own (larger) storage index.
    reading_index = torch.where(real, position_ids, storage)
    restored = torch.where(is_masked, batch["labels"], input_ids)
    plain = torch.empty_like(input_ids).scatter_(1, reading_index, restored)
    lora = isinstance(model, PeftModel)
    network = model.get_base_model() if lora else model
    with model.disable_adapter() if lora else contextlib.nullcontext():
        hidden = network.model(
            input_ids=plain, attention_mask=batch["attention_mask"], position_ids=storage, use_cache=False
        ).last_hidden_state
        rows, columns = is_masked.nonzero(as_tuple=True)
        logits = network.lm_head(hidden[rows, position_ids[rows, columns] - 1])
    return logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(dim=-1)


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
    if refusion_args.mdm_loss_weight is not None:
        overrides["mdm_loss_weight"] = refusion_args.mdm_loss_weight
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
        prepare_draft_adapter(model, refusion_args)
        # An explicit trust_remote_code: the config names our code, and without an answer transformers would ask [y/N]
        # on a terminal (or wait 15 s on an open pipe) before loading this ordinary tokenizer.
        tokenizer = AutoTokenizer.from_pretrained(
            path, revision=revision, trust_remote_code=bool(training_args.trust_remote_code)
        )
        if refusion_args.mask_token not in (None, tokenizer.mask_token):
            raise UsageError(
                f"{path} already uses the mask token {tokenizer.mask_token!r}; --mask_token cannot change it."
            )
        for name, value in overrides.items():
            setattr(model.config, name, value)
        model.config.validate_refusion_fields()
        return model, tokenizer

    base, tokenizer = load_causal_lm(path, gguf_file=refusion_args.gguf_file, **load_kwargs)
    model, tokenizer = convert_to_refusion(
        base, tokenizer, refusion_args.mask_token, mask_init=refusion_args.mask_init, **overrides
    )
    prepare_draft_adapter(model, refusion_args)
    if quantization_config is not None:
        # The wrapper shares the quantized modules, so it must be seen as quantized by PEFT and the Trainer. (A GGUF
        # base is fully dequantized: its GGUF marker is not carried over, so the model stays serializable.)
        for name in QUANTIZATION_ATTRIBUTES:
            if hasattr(base, name):
                setattr(model, name, getattr(base, name))
    return model, tokenizer


def prepare_draft_adapter(model: RefusionForCausalLM, refusion_args: RefusionArguments) -> None:
    """With `--draft_adapter_rank`: give the model a draft adapter of those settings (or check that the one it has
    matches them) and leave only the adapter's deltas trainable."""
    rank = refusion_args.draft_adapter_rank
    if rank is None:
        return
    alpha = refusion_args.draft_adapter_alpha if refusion_args.draft_adapter_alpha is not None else 2.0 * rank
    if model.draft_adapter is None:
        model.add_draft_adapter(rank, alpha, refusion_args.draft_adapter_modules)
    else:
        wanted = {"rank": rank, "alpha": float(alpha)}
        if refusion_args.draft_adapter_modules is not None:
            wanted["target_modules"] = list(refusion_args.draft_adapter_modules)
        has = {key: model.config.draft_adapter[key] for key in wanted}
        if has != wanted:
            raise UsageError(f"The model's draft adapter has {has}, not the {wanted} the options ask for.")
    model.requires_grad_(False)
    model.draft_adapter.requires_grad_(True)


def lora_config(model_args: ModelConfig, mask_token_id: int) -> LoraConfig | None:
    """TRL's LoRA config, on every linear layer by default, with the mask token's embedding row trainable."""
    peft_config = get_peft_config(model_args)
    if peft_config is None:
        return None
    if peft_config.target_modules is None:
        peft_config.target_modules = "all-linear"
    peft_config.trainable_token_indices = {"embed_tokens": [mask_token_id]}
    return peft_config


def continued_adapter(model: RefusionForCausalLM, adapter: str | os.PathLike) -> PeftModel:
    """`model` with the saved LoRA `adapter` loaded trainable, to continue its training.

    The adapter must train the model's own `[MASK]` row (its `trainable_token_indices`), which every adapter this
    package saves does; an adapter made for another mask id would silently train the wrong row.
    """
    adapter = Path(adapter)
    if not (adapter / "adapter_config.json").is_file():
        raise UsageError(f"--init_adapter {str(adapter)!r} holds no adapter_config.json.")
    config = LoraConfig.from_pretrained(adapter)
    trained_rows = (config.trainable_token_indices or {}).get("embed_tokens", [])
    if model.config.mask_token_id not in trained_rows:
        raise UsageError(
            f"--init_adapter {str(adapter)!r} does not train the mask token's embedding row "
            f"(id {model.config.mask_token_id}); it was made for another model or mask token."
        )
    return PeftModel.from_pretrained(model, adapter, is_trainable=True)
