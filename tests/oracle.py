"""An oracle model whose drafts we control, to count the forwards a decoding rule spends.

The oracle wraps a converted tiny model's `forward` (which still runs, so the KV cache behaves as usual) and replaces
its logits: a real token at answer index i confidently predicts the true token at i + 1 (every autoregressive
prediction is right), and a `[MASK]` at answer index i confidently predicts the true token at i only when
`i % slot_size < right_drafts`, otherwise a wrong token. With every draft right, a block takes one plan and one
verify forward: the floor.
"""

import torch
from tiny import tiny_backbone, tiny_tokenizer

from finetune.convert import convert_to_refusion

CONFIDENT = 30.0  # logit of the predicted token; every other token has 0


def oracle_model(truth: torch.Tensor, prompt_length: int, slot_size: int, right_drafts: int):
    """A converted tiny model that answers `truth` (answer tokens, one more than will be generated)."""
    tokenizer = tiny_tokenizer()
    model, _ = convert_to_refusion(tiny_backbone("llama", vocab_size=len(tokenizer)), tokenizer)
    model.eval()
    mask_id, vocab = model.config.mask_token_id, model.config.text_config.vocab_size
    wrong = (truth + 1) % (mask_id - 3) + 3  # a token that differs from the truth, never special or the mask
    original = model.forward

    def forward(*args, **kwargs):
        output = original(*args, **kwargs)
        queries = output.logits.shape[1]
        ids, positions = kwargs["input_ids"][:, -queries:], kwargs["position_ids"][:, -queries:]
        index = (positions - prompt_length).clamp(min=0)
        is_mask = ids == mask_id
        drafted = torch.where(index % slot_size < right_drafts, truth[index], wrong[index])
        following = truth[(index + 1).clamp(max=truth.shape[0] - 1)]
        target = torch.where(is_mask, drafted, following)
        logits = torch.zeros(*ids.shape, vocab, dtype=output.logits.dtype)
        output.logits = logits.scatter(-1, target[..., None], CONFIDENT)
        return output

    model.forward = forward
    return model


def oracle_run(slot_size: int, right_drafts: int, max_new_tokens: int = 64, **settings):
    """Decode with the oracle; return the generate() output and the truth it should reproduce."""
    generator = torch.Generator().manual_seed(0)
    truth = torch.randint(10, 250, (max_new_tokens + 1,), generator=generator)
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
    model = oracle_model(truth, prompt.shape[1], slot_size, right_drafts)
    output = model.generate(
        prompt, max_new_tokens=max_new_tokens, slot_size=slot_size, eos_token_id=[], pad_token_id=0,
        return_dict_in_generate=True, **settings,
    )  # fmt: skip
    return output, truth[:max_new_tokens]
