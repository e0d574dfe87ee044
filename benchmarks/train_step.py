"""Training-step cost of the hybrid objective against plain TRL SFT, same model, same examples (SmolLM2-135M, LoRA).

    python -m benchmarks.train_step [--batch_size 8] [--prompt_tokens 32] [--response_tokens 96] [--steps 5]

Both sides are `SFTTrainer.training_step` (forward + backward) on the same LoRA-wrapped SmolLM2-135M and the same
prompt/response token ids: plain SFT through TRL's own data preparation, collator and fused next-token loss;
ReFusion through `RefusionSFTTrainer` with `HybridObjectiveCollator`, whose batch has the same shape (the objective
reorders and masks tokens, it adds no FLOPs). Steps alternate between the two so that load on the machine hits both
alike; the median is reported. A second table gives collator throughput in batches/s.
"""

import argparse
import statistics
import tempfile
import time

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import PreTrainedModel
from trl import SFTConfig, SFTTrainer

from finetune.convert import convert_to_refusion
from finetune.hybrid import HybridObjectiveCollator
from finetune.trainer import RefusionSFTTrainer
from recipe.model import load_base


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--prompt_tokens", type=int, default=32)
    parser.add_argument("--response_tokens", type=int, default=96)
    parser.add_argument("--steps", type=int, default=5, help="Timed steps per side, after one warm-up step.")
    parser.add_argument("--collator_seconds", type=float, default=3.0, help="Time spent timing each collator.")
    return parser.parse_args()


def examples(vocab_size: int, count: int, prompt_tokens: int, response_tokens: int) -> list[dict[str, list[int]]]:
    """Fixed random ordinary token ids (the step cost does not depend on which tokens they are)."""
    generator = torch.Generator().manual_seed(0)

    def draw(length: int) -> list[int]:
        return torch.randint(100, vocab_size - 100, (length,), generator=generator).tolist()

    return [{"prompt_ids": draw(prompt_tokens), "response_ids": draw(response_tokens)} for _ in range(count)]


def unmarked_copy(model: PreTrainedModel) -> PreTrainedModel:
    """The same weights in a fresh model: a GGUF load is fully dequantized but marked quantized, which the Trainer
    refuses to train."""
    fresh = type(model)(model.config)
    fresh.load_state_dict(model.state_dict())
    return fresh


def config(output_dir: str, batch_size: int, **overrides) -> SFTConfig:
    return SFTConfig(
        output_dir=output_dir,
        per_device_train_batch_size=batch_size,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        max_length=None,
        **overrides,
    )


def lora(**extra) -> LoraConfig:
    return LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM", **extra)


def time_steps(trainers: dict[str, tuple[SFTTrainer, dict]], steps: int) -> dict[str, list[float]]:
    """Seconds per `training_step`, the trainers taking turns; one untimed warm-up step each."""
    seconds = {name: [] for name in trainers}
    for trainer, _ in trainers.values():
        trainer.current_gradient_accumulation_steps = 1  # normally set by `train()`
    for step in range(steps + 1):
        for name, (trainer, batch) in trainers.items():
            start = time.perf_counter()
            trainer.training_step(trainer.model, dict(batch))
            if step:
                seconds[name].append(time.perf_counter() - start)
            trainer.model.zero_grad(set_to_none=True)
    return seconds


def batches_per_second(collate, features: list[dict], budget: float) -> float:
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget:
        collate(features)
        calls += 1
    return calls / (time.perf_counter() - start)


def main() -> None:
    args = parse_args()
    gguf_model, tokenizer = load_base()
    ar_model = unmarked_copy(gguf_model)
    refusion, tokenizer = convert_to_refusion(unmarked_copy(gguf_model), tokenizer)
    features = examples(len(tokenizer) - 1, args.batch_size, args.prompt_tokens, args.response_tokens)

    plain_rows = Dataset.from_list(
        [
            {
                "input_ids": feature["prompt_ids"] + feature["response_ids"],
                "completion_mask": [0] * args.prompt_tokens + [1] * args.response_tokens,
            }
            for feature in features
        ]
    )
    hybrid_rows = Dataset.from_list(features)
    with tempfile.TemporaryDirectory() as scratch:
        plain = SFTTrainer(
            model=ar_model,
            args=config(scratch, args.batch_size),
            train_dataset=plain_rows,
            processing_class=tokenizer,
            peft_config=lora(),
        )
        collator = HybridObjectiveCollator.from_config(refusion.config, tokenizer.pad_token_id, seed=0)
        hybrid = RefusionSFTTrainer(
            model=refusion,
            args=config(
                scratch, args.batch_size, remove_unused_columns=False, dataset_kwargs={"skip_prepare_dataset": True}
            ),
            data_collator=collator,
            train_dataset=hybrid_rows,
            processing_class=tokenizer,
            peft_config=lora(trainable_token_indices={"embed_tokens": [refusion.config.mask_token_id]}),
        )
        plain_features = list(plain.train_dataset)
        plain_batch = plain.data_collator(plain_features)
        hybrid_batch = collator(features)
        assert plain_batch["input_ids"].shape == hybrid_batch["input_ids"].shape
        seconds = time_steps(
            {"plain TRL SFT": (plain, plain_batch), "ReFusion hybrid": (hybrid, hybrid_batch)}, args.steps
        )
        plain_rate = batches_per_second(plain.data_collator, plain_features, args.collator_seconds)
        hybrid_rate = batches_per_second(collator, features, args.collator_seconds)

    shape = "x".join(map(str, plain_batch["input_ids"].shape))
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    ratio = medians["ReFusion hybrid"] / medians["plain TRL SFT"]
    print(
        f"\nSmolLM2-135M, LoRA r=16 on all linear layers, CPU ({torch.get_num_threads()} threads), "
        f"batch {shape} tokens, median of {args.steps} steps\n"
    )
    print("| training step (forward + backward) | seconds | vs plain |")
    print("|---|---|---|")
    print(f"| plain TRL SFT (fused next-token loss) | {medians['plain TRL SFT']:.3f} | 1.00 |")
    print(f"| ReFusion hybrid objective | {medians['ReFusion hybrid']:.3f} | {ratio:.2f} |")
    print("\n| collator | batches/s |")
    print("|---|---|")
    print(f"| TRL DataCollatorForLanguageModeling | {plain_rate:.0f} |")
    print(f"| HybridObjectiveCollator | {hybrid_rate:.0f} |")


if __name__ == "__main__":
    main()
