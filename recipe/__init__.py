"""The SmolLM2-135M-Instruct ReFusion recipe: in-repo prompts, self-distillation, LoRA fine-tuning."""
