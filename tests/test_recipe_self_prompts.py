"""`recipe.self_prompts`: requests the base model writes are cleaned, kept far from both evaluation sets, deduplicated
and appended so that a stopped run resumes."""

import json

import torch
from tiny import tiny_backbone, tiny_tokenizer

from recipe.prompts import build_prompts, everyday_prompts, split_prompts
from recipe.self_prompts import ASKS, Overlap, clean_request, evaluation_texts, sampler, write_requests


def test_a_completion_is_kept_only_where_it_reads_as_a_request():
    assert clean_request('Question: "Why do cats purr when they are happy?"\nAnd more.') == (
        "Why do cats purr when they are happy?"
    )
    assert clean_request("\n\n  Explain how a battery stores energy.  ") == "Explain how a battery stores energy."
    assert clean_request("Sure! Why do cats purr when they are happy?") is None  # the model talking about the task
    assert clean_request("Here is a question about cats: why do they purr?") is None
    assert clean_request("Why cats?") is None  # too short
    assert clean_request("Why do cats purr when they are happy and") is None  # cut off mid-sentence
    assert clean_request("") is None


def test_requests_never_overlap_either_evaluation_set():
    texts = evaluation_texts()
    _, held_out = split_prompts(build_prompts())
    assert len(texts) == len(held_out) + len(everyday_prompts())
    overlaps = Overlap(texts)
    everyday = everyday_prompts()[0].text  # "Why do onions make people cry when they are chopped?"
    assert overlaps(everyday) and overlaps("So, " + everyday.lower() + " Tell me.")
    shortest = min((prompt.text for prompt in held_out), key=lambda text: len(text.split()))
    assert len(shortest.split()) < 6 and overlaps(shortest) and overlaps(f"Please answer: {shortest}")
    assert not overlaps("Why do onions taste sweet after a long slow cooking in butter?")


def test_requests_are_kept_deduplicated_and_a_stopped_run_resumes(tmp_path):
    asked = []
    answers = iter(
        [
            "Why do bees dance in front of their hive?",  # (bees, open_question)
            "Here is one: explain honey.",  # rejected: not a request
            "Why do onions make people cry when they are chopped?",  # rejected: an everyday prompt
            "How do I bake bread without yeast at home?",  # (bread, explanation) is asked; kept
            "Why do bees DANCE in front of their hive!",  # a duplicate (case, punctuation aside): dropped
            "Explain why bread dough rises in a warm kitchen.",
            "What makes a bee choose one flower over another?",
            "Explain how bees turn nectar into honey.",
        ]
    )

    def ask(instructions, seed):
        asked.append(list(instructions))
        return [next(answers) for _ in instructions]

    path = tmp_path / "requests.jsonl"
    kinds = ("open_question", "explanation")
    excluded = [prompt.text for prompt in everyday_prompts()]
    count = write_requests(ask, path, per_pair=1, topics=("bees", "bread"), kinds=kinds, excluded=excluded,
                           batch_size=3, max_rounds=1)  # fmt: skip
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert count == len(rows) == 2
    assert rows[0] == {"kind": "open_question", "topic": "bees", "text": "Why do bees dance in front of their hive?"}
    assert rows[1]["text"] == "How do I bake bread without yeast at home?"
    assert asked[0] == [ASKS[kind].format(topic=topic) for topic in ("bees", "bread") for kind in kinds][:3]

    # Resumed with more rounds: only the pairs still short are asked again, and the file keeps what it had.
    asked.clear()
    count = write_requests(ask, path, per_pair=1, topics=("bees", "bread"), kinds=kinds, excluded=excluded,
                           batch_size=3, max_rounds=3)  # fmt: skip
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert count == 4 and {(row["topic"], row["kind"]) for row in rows} == {
        (topic, kind) for topic in ("bees", "bread") for kind in kinds
    }
    assert asked == [  # the two pairs still short, then the one whose answer was a duplicate
        [ASKS["explanation"].format(topic="bees"), ASKS["open_question"].format(topic="bread")],
        [ASKS["explanation"].format(topic="bees")],
    ]


def test_the_sampler_gives_one_completion_per_instruction_and_is_seeded():
    tokenizer = tiny_tokenizer()
    model = tiny_backbone("llama", vocab_size=len(tokenizer))
    ask = sampler(model, tokenizer, max_new_tokens=6)
    instructions = [ASKS["advice"].format(topic="tea"), ASKS["code"].format(topic="git")]
    first, again = ask(instructions, seed=3), ask(instructions, seed=3)
    assert len(first) == 2 and all(isinstance(text, str) for text in first)
    assert first == again
    assert torch.is_grad_enabled()  # the sampler's no_grad stays inside it
