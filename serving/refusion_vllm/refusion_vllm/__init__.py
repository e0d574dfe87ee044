"""vLLM plugin: lets a ReFusion checkpoint draft for vLLM's parallel-draft speculative decoding.

vLLM's parallel drafter reads `[..., last token, MASK x (K-1)]` and takes the output at each mask as the token
*after* it (PARD's convention); ReFusion predicts the token *at* a mask's own position. The drafter architecture
registered here moves each mask one position forward before the rotary embedding, so that the mask at input index
j asks ReFusion for the token at position n + j + 1: exactly the draft vLLM expects there. The target model is
untouched and verifies every draft, so answers equal vLLM's autoregressive ones.
"""

DRAFTER_ARCHITECTURE = "RefusionDrafterForCausalLM"


def register() -> None:
    """Entry point (`vllm.general_plugins`): make the drafter architecture known to vLLM's model registry."""
    from vllm import ModelRegistry

    if DRAFTER_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(DRAFTER_ARCHITECTURE, "refusion_vllm.model:RefusionDrafterForCausalLM")
