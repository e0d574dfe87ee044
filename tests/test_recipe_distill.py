"""Self-distillation: batched greedy answers equal one-by-one answers; rows are written and resumed."""

import json

import torch
from tiny import tiny_backbone, tiny_tokenizer

from finetune.data import load_rows, prepare_dataset
from recipe.distill import answer_batch, distill

PROMPTS = ["What is the capital of France?", "List three colours.", "Two plus two is", "Explain rain."]


def test_batched_answers_equal_one_by_one_answers():
    tokenizer = tiny_tokenizer()
    model = tiny_backbone("llama", vocab_size=len(tokenizer), initializer_range=0.2).double()
    batched = answer_batch(model, tokenizer, PROMPTS, max_new_tokens=6)
    alone = [answer_batch(model, tokenizer, [prompt], max_new_tokens=6)[0] for prompt in PROMPTS]
    assert batched == alone
    assert any(batched)


def test_distilled_rows_are_training_data_and_a_rerun_resumes(tmp_path):
    tokenizer = tiny_tokenizer()
    model = tiny_backbone("qwen3", vocab_size=len(tokenizer), initializer_range=0.2)
    output = tmp_path / "distilled.jsonl"
    count = distill(model, tokenizer, PROMPTS[:2], output, batch_size=2, max_new_tokens=5)
    assert count == len(output.read_text().splitlines()) <= 2
    count = distill(model, tokenizer, PROMPTS, output, batch_size=3, max_new_tokens=5)
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert count == len(rows) and len({row["query"] for row in rows}) == len(rows)  # nothing answered twice
    assert {row["query"] for row in rows} <= set(PROMPTS)
    tokenizer.add_special_tokens({"mask_token": "<|mask|>"})  # as after conversion to ReFusion
    prepared = prepare_dataset(load_rows(output), tokenizer, max_length=64, overlong="truncate")
    assert prepared.row_format == "query_response" and len(prepared.dataset) == len(rows)
    assert torch.tensor(prepared.dataset[0]["response_ids"])[-1] == tokenizer.eos_token_id
