"""Self-distillation: the base model answers the training prompts with its own greedy decoding, in batches.

The answers become fine-tuning rows in the ReFusion authors' format, `{"query": prompt, "response": answer}`,
appended to a JSONL file one batch at a time, so an interrupted run resumes where it stopped (a row cut off by the
interruption is cut away and its prompt answered again).
"""

import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from finetune.chat import prompt_token_ids
from finetune.files import drop_torn_line, read_jsonl
from recipe.decoding import decode

# A sentence's last character (not the dot of "3." in a numbered list) or a line break.
SENTENCE_END = re.compile(r"(?<![0-9])[.!?](?=\s|$)|\n")


def answer_batch(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], max_new_tokens: int
) -> list[tuple[str, bool]]:
    """Greedy answers to chat-formatted `prompts`, decoded as one left-padded batch, each with whether it ended
    at EOS (True) or was cut off by `max_new_tokens` (False)."""
    run = decode(model, tokenizer, prompt_token_ids(tokenizer, prompts), max_new_tokens, batch_size=len(prompts))
    return [
        (tokenizer.decode(answer, skip_special_tokens=True).strip(), len(answer) < max_new_tokens)
        for answer in run.answers
    ]


def cut_at_sentence_end(text: str) -> str:
    """An answer cut off by `max_new_tokens`, shortened to its last complete sentence or line ("" if none).

    Training rows end with EOS, so a row ending mid-sentence would teach the model to stop mid-sentence.
    """
    ends = [match.end() for match in SENTENCE_END.finditer(text)]
    end = ends[-1] if ends else 0
    return text[:end].strip() if end >= len(text) // 2 else ""


def batches(items: Sequence[str], size: int) -> Iterator[Sequence[str]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def distill(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    output_file: str | Path,
    batch_size: int = 8,
    max_new_tokens: int = 128,
) -> int:
    """Answer every prompt not yet in `output_file` and append the rows; return how many rows the file holds.

    An answer cut off by `max_new_tokens` keeps its complete sentences only; empty answers are skipped (they would
    be malformed training rows).
    """
    output_file = Path(output_file)
    done = {row.get("query") for row in read_jsonl(output_file)}  # a bad line stops it, naming the file and line
    todo = [prompt for prompt in prompts if prompt not in done]
    output_file.parent.mkdir(parents=True, exist_ok=True)
    drop_torn_line(output_file)  # a row cut off by a stopped run: its prompt is answered again below
    with output_file.open("a", encoding="utf-8") as sink:
        for chunk in batches(todo, batch_size):
            for prompt, (answer, finished) in zip(chunk, answer_batch(model, tokenizer, chunk, max_new_tokens)):
                answer = answer if finished else cut_at_sentence_end(answer)
                if answer:
                    sink.write(json.dumps({"query": prompt, "response": answer}) + "\n")
            sink.flush()
    return len(read_jsonl(output_file))
