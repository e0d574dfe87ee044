"""Quality metrics of the ReFusion-vs-AR benchmark, each comparing a decoded answer with the AR teacher's.

- generative perplexity: how likely the base autoregressive model finds an answer, exp(mean token NLL) over all
  answers' tokens given their prompts (lower is more fluent by the base model's own standard);
- agreement with the teacher: exact match and word-level F1 (SQuAD-style: lowercased, punctuation and articles
  dropped, bag of words) between an answer and the base model's greedy answer to the same prompt;
- verifiable accuracy: whether an answer contains the prompt's reference string as a whole word or number;
- repetition: the share of an answer's word 4-grams that already occurred earlier in the same answer, pooled over
  answers (the loops a decoder falls into: "a machine that makes food, ... a machine that makes food").
"""

import math
import re
import string
from collections import Counter
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def words(text: str) -> list[str]:
    """The normalised words of `text`: lowercased, punctuation and English articles removed."""
    return _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split()


def exact_match(answer: str, reference: str) -> bool:
    return words(answer) == words(reference)


def token_f1(answer: str, reference: str) -> float:
    """Word-level F1 between two texts; 1.0 when both are empty, 0.0 when only one is."""
    predicted, expected = words(answer), words(reference)
    if not predicted or not expected:
        return float(predicted == expected)
    common = sum((Counter(predicted) & Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def contains_reference(answer: str, reference: str) -> bool:
    """Whether `reference` occurs in `answer` as whole words ("12" is not found in "112" or "1.25")."""
    pattern = rf"(?<![\w.]){re.escape(reference.lower())}(?![\w]|\.\d)"
    return re.search(pattern, answer.lower()) is not None


def repeated_ngrams(text: str, n: int = 4) -> tuple[int, int]:
    """`(repeated, total)` n-grams of `text`'s normalised words; an n-gram is repeated when it occurred earlier in
    the same text (so a loop of k copies counts k - 1 times each of its n-grams)."""
    tokens = words(text)
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(grams) - len(set(grams)), len(grams)


def repetition(texts: Sequence[str], n: int = 4) -> float:
    """Share of repeated word n-grams over all `texts` together (`repeated_ngrams` pooled); 0.0 without n-grams."""
    counts = [repeated_ngrams(text, n) for text in texts]
    total = sum(count for _, count in counts)
    return sum(repeated for repeated, _ in counts) / total if total else 0.0


@torch.no_grad()
def answer_nll(
    model: PreTrainedModel, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], batch_size: int = 8
) -> list[tuple[float, int]]:
    """`(summed negative log-likelihood, token count)` of each answer given its prompt under the causal LM `model`,
    scored in right-padded batches. An empty answer scores `(0.0, 0)`."""
    if len(prompts) != len(answers):
        raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers.")
    device = model.device
    scores = []
    for start in range(0, len(prompts), batch_size):
        batch_prompts, batch_answers = prompts[start : start + batch_size], answers[start : start + batch_size]
        rows = [list(prompt) + list(answer) for prompt, answer in zip(batch_prompts, batch_answers)]
        width = max(len(row) for row in rows)
        input_ids = torch.zeros(len(rows), width, dtype=torch.long)
        attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
        scored = torch.zeros(len(rows), width, dtype=torch.bool)  # positions whose token is an answer token
        for i, (row, prompt) in enumerate(zip(rows, batch_prompts)):
            input_ids[i, : len(row)] = torch.tensor(row)
            attention_mask[i, : len(row)] = 1
            scored[i, len(prompt) : len(row)] = True
        logits = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits
        log_probs = torch.log_softmax(logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        token_log_probs = log_probs.gather(-1, input_ids[:, 1:, None].to(device))[..., 0]
        mask = scored[:, 1:].to(device)
        nll = -(token_log_probs * mask).sum(dim=1)
        scores += [(value, count) for value, count in zip(nll.tolist(), mask.sum(dim=1).tolist())]
    return scores


def perplexity(scores: Sequence[tuple[float, int]]) -> float:
    """exp(total NLL / total tokens) over `answer_nll` scores; NaN when there are no tokens."""
    tokens = sum(count for _, count in scores)
    return math.exp(sum(nll for nll, _ in scores) / tokens) if tokens else math.nan
