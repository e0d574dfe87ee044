"""The drafter architecture: a Llama-family checkpoint whose mask tokens sit one position further on."""

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.llama import LlamaForCausalLM


class RefusionDrafterForCausalLM(LlamaForCausalLM):
    """`LlamaForCausalLM` that gives every `[MASK]` input the position after its own, so ReFusion's prediction of
    the token at a mask's position lands where vLLM's parallel drafting reads the next token. Only the rotary
    positions change; the KV-cache slots vLLM chose stay as they are (the masks' entries are overwritten when the
    real tokens arrive)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        mask_token_id = getattr(vllm_config.model_config.hf_config, "mask_token_id", None)
        if mask_token_id is None:
            raise ValueError("A ReFusion drafter needs `mask_token_id` in its config.json.")
        self.mask_token_id = int(mask_token_id)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
    ):
        if input_ids is not None:
            positions = positions + (input_ids == self.mask_token_id).to(positions.dtype)
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)
