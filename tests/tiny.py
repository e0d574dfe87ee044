"""Tiny random backbones of every supported architecture and a real (trained-in-process) BPE tokenizer."""

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, True),
    "mistral": (MistralConfig, MistralForCausalLM, False),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, False),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, True),
}

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Two plus two is four. Three times three is nine.",
    "def add(a, b):\n    return a + b",
    "Water boils at one hundred degrees. Ice melts at zero degrees.",
    "List three colours: red, green and blue.",
    "Rewrite the sentence in the past tense: I walk to school.",
    "A cat sat on the mat and looked at the dog.",
]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(extra_special_tokens: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (about 300 tokens) with ChatML special tokens and a chat template."""
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_special_tokens]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token="<|im_start|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_backbone(architecture: str, vocab_size: int, seed: int = 0, **overrides) -> torch.nn.Module:
    """A 2-layer random causal LM of `architecture` with grouped-query attention."""
    config_class, model_class, tied = ARCHITECTURES[architecture]
    settings = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    return model_class(config_class(**settings)).eval()
