"""Training prompts as varied as users' own: the base model writes requests from seed topics, in six kinds.

    python -m recipe.self_prompts --output_dir recipe/artifacts/self-prompts [--per_pair 2] [--answer]

The recipe's prompts come from a few templates; a model trained on them alone sees only their shapes. Here the base
model writes the requests itself: for every seed topic (`TOPICS`) and kind of request (`ASKS`: open questions,
explanations, advice, code, multi-sentence instructions and writing tasks, the kinds of the everyday evaluation set)
it is asked, through its chat template, for one request of that kind about the topic, sampled so that each ask gives
another. A request is kept when it reads as one (`clean_request`), is new, and shares no run of `OVERLAP_WORDS` words
with any prompt of either evaluation set (the recipe's held-out prompts and `benchmarks/data/everyday_prompts.jsonl`),
so neither set is ever trained on, even nearly. Kept requests are appended to `requests.jsonl`
(`{"kind", "topic", "text"}`) batch by batch, so a stopped run resumes; `--answer` then has the base model answer
them greedily into `distilled.jsonl` (`recipe.distill`), the targets a draft adapter learns.
"""

import argparse
import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from finetune.chat import prompt_token_ids
from finetune.files import drop_torn_line, read_jsonl
from recipe.distill import distill
from recipe.model import load_base
from recipe.prompts import build_prompts, everyday_prompts, split_prompts

TOPICS = [
    "sleep", "coffee", "houseplants", "bicycles", "saving money", "job interviews", "rainbows", "volcanoes",
    "the Roman Empire", "bread baking", "learning a language", "running", "email etiquette", "spreadsheets",
    "passwords", "the moon", "recycling", "public speaking", "camping", "board games", "vaccines", "honey bees",
    "electric cars", "budget travel", "photography", "chess", "the printing press", "tides", "composting",
    "time management", "git", "SQL databases", "regular expressions", "web browsers", "batteries", "earthquakes",
    "dinosaurs", "the human heart", "vitamins", "meditation", "renting a flat", "credit cards", "birthdays",
    "pizza", "tea", "winter clothing", "dogs", "cats", "gardening", "music practice", "libraries", "airports",
    "the internet", "solar panels", "clouds", "oceans", "ancient Egypt", "friendship", "moving house", "cooking rice",
]  # fmt: skip
ASKS = {  # what the base model is asked to write, per kind
    "open_question": "Write one question that a curious person might ask about {topic}. Reply with the question only.",
    "explanation": "Write one request asking someone to explain how or why something about {topic} works. "
    "Reply with the request only.",
    "advice": "Write a short message, one or two sentences, in which someone describes a problem with {topic} and "
    "asks for advice. Reply with the message only.",
    "code": "Write one request for a short piece of Python code or a shell command that helps with a task involving "
    "{topic}. Reply with the request only.",
    "instruction": "Write an instruction of two sentences asking an assistant to draft a note, an email, a plan or a "
    "list about {topic}. Reply with the instruction only.",
    "writing": "Write one request for a short poem, story, slogan or description about {topic}. Reply with the "
    "request only.",
}
OVERLAP_WORDS = 6
LEADING_LABEL = re.compile(r"^(question|request|message|instruction|prompt|user)\s*\d*\s*[:\-]\s*", re.IGNORECASE)
META_STARTS = ("here is", "here's", "sure", "certainly", "of course", "as an ai", "i'm sorry", "i can't")


def clean_request(text: str) -> str | None:
    """The request in a sampled completion, or None where it does not read as one: its first non-empty line without
    a label ("Question:") or quotes, of 4 to 60 words, ending as a sentence does, and not the model talking about
    the task ("Here is ...", "Sure, ...")."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return None
    request = LEADING_LABEL.sub("", lines[0]).strip().strip("\"'“”").strip()
    if request.lower().startswith(META_STARTS) or not 4 <= len(request.split()) <= 60:
        return None
    return request if request.endswith(("?", ".", "!")) else None


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


class Overlap:
    """Whether a text shares a run of `size` words (case and punctuation aside) with any of the texts given, or holds
    the whole of one shorter than that."""

    def __init__(self, texts: Iterable[str], size: int = OVERLAP_WORDS):
        self.size = size
        self.runs = set()
        for text in texts:
            tokens = words(text)
            self.runs |= self._runs(tokens, min(size, len(tokens)))
        self.lengths = {len(run) for run in self.runs}

    @staticmethod
    def _runs(tokens: list[str], size: int) -> set[tuple[str, ...]]:
        return {tuple(tokens[start : start + size]) for start in range(len(tokens) - size + 1)} if size else set()

    def __call__(self, text: str) -> bool:
        tokens = words(text)
        return any(not self.runs.isdisjoint(self._runs(tokens, size)) for size in self.lengths)


def evaluation_texts() -> list[str]:
    """Every prompt of both evaluation sets: the recipe's held-out split and the everyday prompts."""
    _, held_out = split_prompts(build_prompts())
    return [prompt.text for prompt in held_out] + [prompt.text for prompt in everyday_prompts()]


def sampler(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int = 64, temperature: float = 0.9
) -> Callable[[Sequence[str], int], list[str]]:
    """`ask(instructions, seed)`: one sampled completion of the model per instruction (chat-formatted, as one
    left-padded batch, seeded)."""

    @torch.no_grad()
    def ask(instructions: Sequence[str], seed: int) -> list[str]:
        ids = prompt_token_ids(tokenizer, instructions)
        width = max(map(len, ids))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        batch = torch.tensor([[pad] * (width - len(row)) + row for row in ids], device=model.device)
        mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in ids], device=model.device)
        torch.manual_seed(seed)
        out = model.generate(batch, attention_mask=mask, do_sample=True, temperature=temperature, top_p=0.95,
                             max_new_tokens=max_new_tokens, pad_token_id=pad)  # fmt: skip
        return tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)

    return ask


def write_requests(
    ask: Callable[[Sequence[str], int], list[str]],
    output_file: str | Path,
    per_pair: int = 2,
    topics: Sequence[str] = TOPICS,
    kinds: Sequence[str] = tuple(ASKS),
    excluded: Iterable[str] = (),
    batch_size: int = 16,
    max_rounds: int = 4,
) -> int:
    """Ask for requests until every (topic, kind) pair has `per_pair` kept ones in `output_file` or has been asked
    `max_rounds` times as often; return how many requests the file holds. `excluded`: texts no request may overlap
    (`Overlap`); a request equal to one kept before (case and spaces aside) is dropped too."""
    output_file = Path(output_file)
    output_file.parent.mkdir(parents=True, exist_ok=True)
    drop_torn_line(output_file)
    kept = read_jsonl(output_file, required=("kind", "topic", "text"))
    seen = {" ".join(words(row["text"])) for row in kept}
    counts = Counter((row["topic"], row["kind"]) for row in kept)
    overlaps = Overlap(excluded)
    with output_file.open("a", encoding="utf-8") as sink:
        for round_ in range(max_rounds * per_pair):
            todo = [(topic, kind) for topic in topics for kind in kinds if counts[topic, kind] < per_pair]
            if not todo:
                break
            for start in range(0, len(todo), batch_size):
                pairs = todo[start : start + batch_size]
                completions = ask([ASKS[kind].format(topic=topic) for topic, kind in pairs], round_ * 100_003 + start)
                for (topic, kind), completion in zip(pairs, completions):
                    request = clean_request(completion)
                    key = " ".join(words(request or ""))
                    if request is None or key in seen or overlaps(request):
                        continue
                    seen.add(key)
                    counts[topic, kind] += 1
                    sink.write(json.dumps({"kind": kind, "topic": topic, "text": request}) + "\n")
                sink.flush()
    return len(read_jsonl(output_file))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", required=True, help="requests.jsonl (and distilled.jsonl) go here, appended")
    parser.add_argument("--per_pair", type=int, default=2, help="requests per (topic, kind): 60 x 6 pairs")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--answer", action="store_true", help="also answer them greedily into distilled.jsonl")
    parser.add_argument("--max_new_tokens", type=int, default=96, help="of each answer")
    args = parser.parse_args()
    model, tokenizer = load_base()
    model.eval()
    folder = Path(args.output_dir)
    count = write_requests(sampler(model, tokenizer), folder / "requests.jsonl", args.per_pair,
                           excluded=evaluation_texts(), batch_size=args.batch_size)  # fmt: skip
    print(f"{count} requests in {folder / 'requests.jsonl'}")
    if args.answer:
        requests = [row["text"] for row in read_jsonl(folder / "requests.jsonl")]
        rows = distill(model, tokenizer, requests, folder / "distilled.jsonl", args.batch_size, args.max_new_tokens)
        print(f"{rows} answered rows in {folder / 'distilled.jsonl'}")


if __name__ == "__main__":
    main()
