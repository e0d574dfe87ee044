"""The benchmark's pieces: quality metrics, timed decoding (AR and ReFusion counted alike), tables and plot."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from tiny import tiny_backbone, tiny_tokenizer

from finetune.convert import convert_to_refusion
from recipe.decoding import chat_prompt_ids, cut_answer, decode, stop_token_ids
from recipe.metrics import answer_nll, contains_reference, exact_match, perplexity, token_f1, words

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["What is the capital of France?", "List three colours.", "Two plus two is", "Explain rain to me."]


def load_benchmark():
    spec = importlib.util.spec_from_file_location("quality_speed", ROOT / "benchmarks" / "quality_speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_agreement_metrics():
    assert words("The Capital, of France!") == ["capital", "of", "france"]
    assert exact_match("Paris.", "paris") and not exact_match("Paris is big", "Paris")
    assert token_f1("the cat sat", "a cat sat") == 1.0  # articles and case do not count
    assert token_f1("cat sat on mat", "cat sat") == pytest.approx(2 * (2 / 4) * 1.0 / (2 / 4 + 1.0))
    assert token_f1("cat cat", "cat") == pytest.approx(2 * 0.5 * 1 / 1.5)  # counts are clipped
    assert token_f1("", "") == 1.0 and token_f1("", "cat") == 0.0 and token_f1("dog", "cat") == 0.0


def test_reference_must_be_a_whole_word_or_number():
    assert contains_reference("The answer is 12.", "12")
    assert contains_reference("So 12 apples in all", "12")
    assert not contains_reference("That makes 112 apples", "12")
    assert not contains_reference("It is 1.25 metres", "1")
    assert not contains_reference("about 12.5", "12")
    assert contains_reference("The capital of France is Paris.", "paris")
    assert not contains_reference("Parisian food", "Paris")


def test_answer_nll_equals_a_one_by_one_computation_and_perplexity_pools_tokens():
    tokenizer = tiny_tokenizer()
    model = tiny_backbone("llama", vocab_size=len(tokenizer), initializer_range=0.2).double().eval()
    prompts = chat_prompt_ids(tokenizer, PROMPTS)
    answers = [tokenizer.encode(text) for text in ["Paris.", "red, green and blue", "four", ""]]
    scores = answer_nll(model, prompts, answers, batch_size=3)  # batches of 3 and 1, right padding
    for (nll, count), prompt, answer in zip(scores, prompts, answers):
        assert count == len(answer)
        if not answer:
            assert nll == 0.0
            continue
        sequence = torch.tensor([prompt + answer])
        log_probs = torch.log_softmax(model(sequence).logits[0, :-1], dim=-1)
        positions = torch.arange(len(prompt) - 1, len(prompt) + len(answer) - 1)
        expected = -log_probs[positions, torch.tensor(answer)].sum().item()
        assert nll == pytest.approx(expected, rel=1e-9)
    total_nll, total_tokens = sum(s[0] for s in scores), sum(s[1] for s in scores)
    assert perplexity(scores) == pytest.approx(math.exp(total_nll / total_tokens))
    assert math.isnan(perplexity([(0.0, 0)]))
    with pytest.raises(ValueError, match="3 prompts but 4 answers"):
        answer_nll(model, prompts[:3], answers)


def test_cut_answer_stops_at_the_first_stop_token():
    assert cut_answer([5, 6, 2, 7], {2}) == [5, 6]
    assert cut_answer([5, 6], {2}) == [5, 6]
    assert cut_answer([2, 5], {2, 0}) == []


def test_ar_decode_counts_one_forward_per_generated_token():
    tokenizer = tiny_tokenizer()
    model = tiny_backbone("llama", vocab_size=len(tokenizer), initializer_range=0.2).double().eval()
    prompts = chat_prompt_ids(tokenizer, PROMPTS)
    stop = stop_token_ids(model, tokenizer)
    for prompt in prompts:
        run = decode(model, tokenizer, [prompt], max_new_tokens=6)
        generated = model.generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )[0, len(prompt) :].tolist()
        assert run.answers == [cut_answer(generated, stop)]
        assert run.forwards == len(generated)  # a forward for every token, the stop token included
        assert run.seconds > 0 and run.tokens == len(run.answers[0])


def test_refusion_decode_matches_generate_and_batches_equal_single_prompts():
    tokenizer = tiny_tokenizer()
    backbone = tiny_backbone("qwen3", vocab_size=len(tokenizer), initializer_range=0.2)
    model, tokenizer = convert_to_refusion(backbone, tokenizer)
    with torch.no_grad():
        model.model.norm.weight.mul_(4.0)  # spread-out probabilities, so thresholds matter
    model = model.double().eval()
    settings = dict(slot_size=4, block_length=8, slot_threshold=0.5, token_threshold=0.3)
    prompts = chat_prompt_ids(tokenizer, PROMPTS)
    one_by_one = decode(model, tokenizer, prompts, max_new_tokens=12, **settings)
    batched = decode(model, tokenizer, prompts, max_new_tokens=12, batch_size=3, **settings)
    assert batched.answers == one_by_one.answers
    forwards = 0
    for prompt, answer in zip(prompts, one_by_one.answers):
        output = model.generate(torch.tensor([prompt]), max_new_tokens=12, return_dict_in_generate=True, **settings)
        assert cut_answer(output.sequences[0, len(prompt) :].tolist(), stop_token_ids(model, tokenizer)) == answer
        forwards += output.num_forward_passes
    assert one_by_one.forwards == forwards


def test_benchmark_prompts_quality_rows_table_and_plot(tmp_path):
    benchmark = load_benchmark()
    prompts = benchmark.benchmark_prompts(10)
    assert len(prompts) == 10 and sum(p.reference is not None for p in prompts) == 5
    assert len({p.kind for p in prompts}) >= 5

    tokenizer = tiny_tokenizer()
    encode = tokenizer.encode
    teacher = benchmark.DecodeRun([encode(p.reference or "some words here") for p in prompts], seconds=2.0, forwards=50)
    student_texts = ["nothing" if i == 0 else (p.reference or "some words") for i, p in enumerate(prompts)]
    student = benchmark.DecodeRun([encode(t) for t in student_texts], seconds=0.5, forwards=10)
    correct = [i for i, p in enumerate(prompts) if p.reference]
    scores = [(1.0, 2)] * len(prompts)
    row = benchmark.quality(student, teacher, prompts, tokenizer, scores, correct)
    assert row["generative_perplexity"] == pytest.approx(math.exp(0.5))
    assert row["accuracy_where_ar_correct"] == pytest.approx(4 / 5)  # the first verifiable answer is wrong
    assert row["exact_match"] == pytest.approx(4 / 10)  # open-ended: "some words" vs "some words here"
    expected_f1 = (0 + 4 * 1 + 5 * (2 * 1 * (2 / 3) / (1 + 2 / 3))) / 10
    assert row["token_f1"] == pytest.approx(expected_f1)
    speed = benchmark.speed(student, ar_tokens_per_second=teacher.tokens_per_second)
    assert speed["speedup"] == pytest.approx(student.tokens_per_second / teacher.tokens_per_second)
    assert speed["tokens_per_forward"] == pytest.approx(student.tokens / 10)

    ar_row = {"name": benchmark.AR, "kind": "ar", "batch_size": 1} | benchmark.speed(teacher, teacher.tokens_per_second)
    ar_row |= benchmark.quality(teacher, teacher, prompts, tokenizer, scores, correct)
    results = {
        "machine": "test",
        "dtype": "float64",
        "prompts": 10,
        "max_new_tokens": 8,
        "ar_correct": 5,
        "chosen": "slot 8",
        "chosen_reason": "test",
        "rows": [ar_row, {"name": "slot 8", "kind": "slots", "batch_size": 1} | speed | row],
        "progress": [{"name": "checkpoint-2", "step": 2, **speed, **row}],
    }
    table = benchmark.markdown(results)
    assert "| slot 8 | 1 |" in table and "| checkpoint-2 | 2 |" in table and f"{speed['speedup']:.2f}x" in table
    benchmark.plot(results, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_chosen_setting_is_the_fastest_close_to_ar_else_the_best_at_one_token_per_forward():
    benchmark = load_benchmark()
    reference = {"token_f1": 0.8, "generative_perplexity": 2.0}

    def row(name, speedup, f1, ppl, per_forward):
        return dict(name=name, kind="slots", batch_size=1, speedup=speedup, token_f1=f1,
                    generative_perplexity=ppl, tokens_per_forward=per_forward)  # fmt: skip

    rows = [row("slow close", 0.8, 0.79, 2.05, 1.2), row("fast close", 1.4, 0.77, 2.1, 2.1), row("far", 3, 0.2, 9, 4)]
    assert benchmark.choose_setting(rows, reference)[0] == "fast close"
    rows = [row("best below one", 0.5, 0.7, 3, 0.9), row("good", 0.6, 0.6, 3, 1.1), row("worse", 2, 0.3, 8, 3)]
    assert benchmark.choose_setting(rows, reference)[0] == "good"
