"""The one prompt format of training and inference: a prompt as the model sees it right before its answer.

Kept apart from `finetune.data` (which needs `datasets`) so that decoding (the demo, the benchmarks) imports only
torch and transformers.
"""

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

Message = dict[str, str]


def prompt_token_ids(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str | list[Message]]) -> list[list[int]]:
    """Token ids of each prompt as the model sees it right before its answer, in training and at inference alike:
    through the tokenizer's chat template with the generation prompt (a string is one user turn), else the plain
    text with the tokenizer's own special tokens."""
    if tokenizer.chat_template is None:
        return tokenizer(list(prompts), add_special_tokens=True)["input_ids"]
    conversations = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
    texts = tokenizer.apply_chat_template(conversations, add_generation_prompt=True, tokenize=False)
    return tokenizer(texts, add_special_tokens=False)["input_ids"]
