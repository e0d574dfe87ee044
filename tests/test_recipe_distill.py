"""Self-distillation: batched greedy answers equal one-by-one answers; rows are written and resumed."""

import json

import torch
from tiny import tiny_backbone, tiny_tokenizer

import recipe.distill
from finetune.data import load_rows, prepare_dataset
from recipe.distill import answer_batch, cut_at_sentence_end, distill

PROMPTS = ["What is the capital of France?", "List three colours.", "Two plus two is", "Explain rain."]


def test_batched_answers_equal_one_by_one_answers():
    tokenizer = tiny_tokenizer()
    model = tiny_backbone("llama", vocab_size=len(tokenizer), initializer_range=0.2).double()
    batched = answer_batch(model, tokenizer, PROMPTS, max_new_tokens=6)
    alone = [answer_batch(model, tokenizer, [prompt], max_new_tokens=6)[0] for prompt in PROMPTS]
    assert batched == alone
    assert any(text for text, _ in batched)


def test_cut_off_answers_keep_their_complete_sentences():
    assert cut_at_sentence_end("Paris is big. It has a tower. And") == "Paris is big. It has a tower."
    assert cut_at_sentence_end("1. Apples\n2. Pears\n3. Ban") == "1. Apples\n2. Pears"  # "3." ends no sentence
    assert cut_at_sentence_end("Pi is 3.14 and e is 2.71 roughly so") == ""
    assert cut_at_sentence_end("Short. Then a long unfinished tail that goes on and on") == ""  # most would be lost


def test_distilled_rows_are_training_data_and_a_rerun_resumes(tmp_path, monkeypatch):
    tokenizer = tiny_tokenizer()
    model = tiny_backbone("qwen3", vocab_size=len(tokenizer), initializer_range=0.2)
    real_answer_batch = recipe.distill.answer_batch

    def answers_with_a_cut_off_one(model, tokenizer, prompts, max_new_tokens):
        answers = real_answer_batch(model, tokenizer, prompts, max_new_tokens)
        texts = {"Two plus two is": ("Four. Then", False), "Explain rain.": ("No sentence end", False)}
        return [texts.get(prompt, (f"Answer {len(text)}", True)) for prompt, (text, _) in zip(prompts, answers)]

    monkeypatch.setattr(recipe.distill, "answer_batch", answers_with_a_cut_off_one)
    output = tmp_path / "distilled.jsonl"
    count = distill(model, tokenizer, PROMPTS[:2], output, batch_size=2, max_new_tokens=5)
    assert count == len(output.read_text().splitlines()) <= 2
    count = distill(model, tokenizer, PROMPTS, output, batch_size=3, max_new_tokens=5)
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert count == len(rows) and len({row["query"] for row in rows}) == len(rows)  # nothing answered twice
    assert {row["query"] for row in rows} == set(PROMPTS) - {"Explain rain."}  # no complete sentence: skipped
    assert {row["response"] for row in rows if row["query"] == "Two plus two is"} == {"Four."}
    tokenizer.add_special_tokens({"mask_token": "<|mask|>"})  # as after conversion to ReFusion
    prepared = prepare_dataset(load_rows(output), tokenizer, max_length=64, overlong="truncate")
    assert prepared.row_format == "query_response" and len(prepared.dataset) == len(rows)
    assert torch.tensor(prepared.dataset[0]["response_ids"])[-1] == tokenizer.eos_token_id
