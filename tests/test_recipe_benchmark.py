"""The benchmark's pieces: quality metrics, timed decoding (AR and ReFusion counted alike), tables and plot."""

import copy
import math
from pathlib import Path

import pytest
import torch
from tiny import tiny_backbone, tiny_tokenizer
from transformers import AutoModelForCausalLM

import compiling_refusion
import executor_refusion
import generation_refusion
import kernels_refusion
from benchmarks import decode as decode_benchmark
from benchmarks import draft_sources, quality_speed
from finetune.chat import prompt_token_ids
from finetune.convert import convert_to_refusion, save_refusion
from recipe.decoding import (
    DecodeRun,
    compile_refusion,
    compiled_graphs,
    compiled_refusion,
    cut_answer,
    decode,
    decode_compiled_ar,
    decode_static_ar,
    decoder_module,
    paired_runs,
    paired_speedup,
    static_cache_length,
    stop_token_ids,
    with_fixed_prices,
)
from recipe.evaluate import Evaluation
from recipe.metrics import (
    answer_nll,
    contains_reference,
    exact_match,
    perplexity,
    repeated_ngrams,
    repetition,
    token_f1,
    words,
)
from settings_refusion import DECODING_FIELDS, check_decoding

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["What is the capital of France?", "List three colours.", "Two plus two is", "Explain rain to me."]


def test_agreement_metrics():
    assert words("The Capital, of France!") == ["capital", "of", "france"]
    assert exact_match("Paris.", "paris") and not exact_match("Paris is big", "Paris")
    assert token_f1("the cat sat", "a cat sat") == 1.0  # articles and case do not count
    assert token_f1("cat sat on mat", "cat sat") == pytest.approx(2 * (2 / 4) * 1.0 / (2 / 4 + 1.0))
    assert token_f1("cat cat", "cat") == pytest.approx(2 * 0.5 * 1 / 1.5)  # counts are clipped
    assert token_f1("", "") == 1.0 and token_f1("", "cat") == 0.0 and token_f1("dog", "cat") == 0.0


def test_repetition_counts_the_4_grams_an_answer_already_said():
    loop = "It's like a machine that makes food, but instead of machines, it's a machine that makes food."
    # Normalised words: its like machine that makes food but instead of machines its machine that makes food
    # (15 words, 12 4-grams); "machine that makes food" comes back once.
    assert repeated_ngrams(loop) == (1, 12)
    assert repeated_ngrams("one two three four one two three four one two three four") == (5, 9)
    assert repeated_ngrams("Plants use sunlight, water and air to make sugar.") == (0, 6)
    assert repeated_ngrams("too short") == (0, 0) and repeated_ngrams("b c d e b c", n=2) == (1, 5)
    # Pooled over answers, not averaged per answer; no 4-gram at all is no repetition.
    assert repetition([loop, "one two three four one two three four"]) == pytest.approx((1 + 1) / (12 + 5))
    assert repetition(["yes", ""]) == 0.0


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
    prompts = prompt_token_ids(tokenizer, PROMPTS)
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


def test_paired_runs_decode_each_prompt_with_every_decoder_back_to_back_rotating_the_first():
    calls = []

    def decoder(name):
        def run(prompts):
            calls.append((name, prompts[0][0]))
            return DecodeRun([[prompts[0][0]]], 1.0, 1)

        return run

    prompts = [[10], [11], [12], [13]]
    runs = paired_runs({"a": decoder("a"), "b": decoder("b"), "c": decoder("c")}, prompts, rounds=2)
    firsts = [calls[i][0] for i in range(0, len(calls), 3)]
    assert firsts == ["a", "b", "c", "a", "b", "c", "a", "b"]  # the rotation continues across rounds
    for start in range(0, len(calls), 3):  # one prompt's decodes back to back, every decoder once
        assert len({prompt for _, prompt in calls[start : start + 3]}) == 1
        assert sorted(name for name, _ in calls[start : start + 3]) == ["a", "b", "c"]
    for name in "abc":  # each decoder's runs follow the prompts, round after round
        assert [run.answers[0][0] for run in runs[name]] == [10, 11, 12, 13] * 2


def test_paired_speedup_pools_tokens_and_seconds_and_reads_per_prompt_ratios():
    reference = [DecodeRun([[0] * 10], 1.0, 10), DecodeRun([[0] * 10], 2.0, 10), DecodeRun([[0] * 20], 1.0, 20)]
    runs = [DecodeRun([[0] * 10], 0.5, 5), DecodeRun([[0] * 10], 2.0, 8), DecodeRun([[0] * 20], 0.5, 10)]
    speedup = paired_speedup(runs, reference)
    assert speedup.ratio == pytest.approx((40 / 3.0) / (40 / 4.0))  # pooled, not the mean of ratios
    assert speedup.median == pytest.approx(2.0)  # per prompt: 2, 1, 2
    assert speedup.low <= 1.0 + 1e-9 and speedup.high == pytest.approx(2.0)
    assert speedup.tokens_per_forward == pytest.approx(40 / 23)
    with pytest.raises(ValueError):  # runs of other prompts than the reference's
        paired_speedup(runs[:2], reference)
    silent = DecodeRun([[]], 0.5, 1)  # a prompt answered with its stop token: no speed, left out of the ratios
    speedup = paired_speedup([runs[0], silent], [reference[0], reference[1]])
    assert speedup.median == speedup.low == speedup.high == pytest.approx(2.0)
    assert speedup.ratio == pytest.approx((10 / 1.0) / (20 / 3.0))
    with pytest.raises(ValueError, match="no tokens"):
        paired_speedup([runs[0]], [silent])


def test_ar_decode_counts_one_forward_per_generated_token():
    tokenizer = tiny_tokenizer()
    model = tiny_backbone("llama", vocab_size=len(tokenizer), initializer_range=0.2).double().eval()
    prompts = prompt_token_ids(tokenizer, PROMPTS)
    stop = stop_token_ids(model, tokenizer)
    for prompt in prompts:
        run = decode(model, tokenizer, [prompt], max_new_tokens=6)
        generated = model.generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )[0, len(prompt) :].tolist()
        assert run.answers == [cut_answer(generated, stop)]
        assert run.forwards == len(generated)  # a forward for every token, the stop token included
        assert run.seconds > 0 and run.tokens == len(run.answers[0])


def test_compiled_ar_decode_answers_as_eager_ar_and_compiles_once_for_prompts_of_every_length():
    """transformers' compiled static-cache generate() (mode "default" here: max-autotune takes longer to compile):
    the same greedy answers as eager AR, one forward per generated position, the compile paid in the warm-up, and
    prompts of different lengths served by that one graph: no recompilation, in the timed decode nor in a later call
    with shorter prompts (the model keeps its longest static cache). The benchmark tabulates it."""
    tokenizer = tiny_tokenizer()
    model = tiny_backbone("llama", vocab_size=len(tokenizer), initializer_range=0.2).eval()
    evaluation = Evaluation(model, tokenizer, prompt_count=4, max_new_tokens=6)  # the eager AR teacher
    prompts = evaluation.prompt_ids
    assert len({len(prompt) for prompt in prompts}) > 1
    compiled = decode_compiled_ar(model, tokenizer, prompts, max_new_tokens=6, mode="default")
    assert compiled.answers == evaluation.teacher.answers and compiled.forwards == evaluation.teacher.forwards
    assert compiled.compile_seconds > 0 and compiled.recompiles == 0
    assert compiled.forward_seconds is None and compiled.orchestration is None  # no hooks in a compiled forward
    assert static_cache_length(prompts, 6) % 128 == 0 and static_cache_length(prompts, 6) >= max(map(len, prompts)) + 6
    again = decode_compiled_ar(model, tokenizer, prompts[1:2], max_new_tokens=4, mode="default", max_cache_len=32)
    assert again.recompiles == 0 and again.answers == [compiled.answers[1][:4]]

    name = f"{quality_speed.AR}, float32, compiled"
    row = evaluation.row(name, "ar", compiled) | {"compile_seconds": compiled.compile_seconds, "recompiles": 0}
    rows = [evaluation.ar_row, row]
    results = dict(machine=evaluation.machine, dtype="float32", prompts=4, max_new_tokens=6, ar_correct=0,
                   chosen=name, chosen_reason="test", rows=rows, progress=[], ar_compile_mode="default",
                   fastest_ar=quality_speed.against_fastest_ar(rows))  # fmt: skip
    table = quality_speed.markdown(results)
    assert f"| {name} | 1 |" in table and "| - |" in table  # its forwards are not timed apart
    assert 'CompileConfig(mode="default")), compiled on every device; one-off compile' in table


def test_static_cache_ar_answers_as_generate_eager_compiled_and_frozen_without_recompiling(monkeypatch):
    """AR over ReFusion's static cache: eager (float64), the greedy answers and forwards of transformers' generate();
    compiled with frozen weights (float32), the answers of its own eager run, one graph for the steps of prompts of
    every length that fit the cache and one per prompts' width bucket (as ReFusion's first forward, the prompt runs
    padded to its bucket in a graph, unless prepacked layers price it cheaper eagerly), and decodes stopped at the
    first stop token or at max_new_tokens."""
    tokenizer = tiny_tokenizer()
    base = tiny_backbone("llama", vocab_size=len(tokenizer), initializer_range=0.2).eval()
    prompts = prompt_token_ids(tokenizer, PROMPTS)
    assert len({len(prompt) for prompt in prompts}) > 1
    model = copy.deepcopy(base).double()
    for prompt in prompts:
        expected = decode(model, tokenizer, [prompt], max_new_tokens=8)
        static = decode_static_ar(model, tokenizer, [prompt], max_new_tokens=8)
        assert static.answers == expected.answers and static.forwards == expected.forwards
    endless = decode_static_ar(model, tokenizer, prompts[:1], max_new_tokens=5, eos_token_id=[])
    assert endless.forwards == 5 and len(endless.answers[0]) == 5
    with pytest.raises(ValueError, match="max_cache_len"):
        decode_static_ar(model, tokenizer, prompts[:1], max_new_tokens=8, max_cache_len=4)

    eager = decode_static_ar(base, tokenizer, prompts, max_new_tokens=8, max_cache_len=64)
    frozen = compiled_refusion("cpu", mode="default", freeze=True)["compile_config"]
    graphs = compiled_graphs()
    widths, run_model = [], executor_refusion.run_model
    monkeypatch.setattr(executor_refusion, "run_model", lambda *args: widths.append(args[2]["ids"].shape[1]) or
                        run_model(*args))  # fmt: skip
    compiled = decode_static_ar(base, tokenizer, prompts, max_new_tokens=8, compile_config=frozen, max_cache_len=64)
    assert compiled.answers == eager.answers and compiled.forwards == eager.forwards
    buckets = {executor_refusion.pad_width(len(prompt), executor_refusion.WIDTH_BUCKETS) for prompt in prompts}
    assert set(widths) == {1} | buckets  # the prompts padded to their bucket
    assert compiled_graphs() - graphs == 1 + len(buckets)  # the one-query step and the buckets, for every prompt
    assert base._refusion_compiled[1] is not None  # the weights were frozen into it

    kernels_refusion.prepack_linears(base, {torch.float32: 1})
    for prices, eagerly in (((1.0, 0.001), False), ((0.001, 1.0), True)):  # (a token eagerly, the graph's forward)
        monkeypatch.setattr(executor_refusion, "prompt_prices", lambda *args, prices=prices, **kwargs: prices)
        base.__dict__.pop("_refusion_prompt_prices", None)
        widths.clear()
        prepacked = decode_static_ar(base, tokenizer, prompts, max_new_tokens=8, compile_config=frozen,
                                     max_cache_len=64)  # fmt: skip
        assert prepacked.answers == eager.answers
        assert set(widths) == ({1} if eagerly else {1} | buckets)


def test_refusion_decode_matches_generate_and_batches_equal_single_prompts():
    tokenizer = tiny_tokenizer()
    backbone = tiny_backbone("qwen3", vocab_size=len(tokenizer), initializer_range=0.2)
    model, tokenizer = convert_to_refusion(backbone, tokenizer)
    with torch.no_grad():
        model.model.norm.weight.mul_(4.0)  # spread-out probabilities, so thresholds matter
    model = model.double().eval()
    settings = dict(slot_size=4, block_length=8, slot_threshold=0.5, token_threshold=0.3)
    prompts = prompt_token_ids(tokenizer, PROMPTS)
    one_by_one = decode(model, tokenizer, prompts, max_new_tokens=12, **settings)
    batched = decode(model, tokenizer, prompts, max_new_tokens=12, batch_size=3, **settings)
    assert batched.answers == one_by_one.answers
    forwards = 0
    for prompt, answer in zip(prompts, one_by_one.answers):
        output = model.generate(torch.tensor([prompt]), max_new_tokens=12, return_dict_in_generate=True, **settings)
        assert cut_answer(output.sequences[0, len(prompt) :].tolist(), stop_token_ids(model, tokenizer)) == answer
        forwards += output.num_forward_passes
    assert one_by_one.forwards == forwards


@pytest.mark.parametrize("through_config", [False, True])
def test_priced_settings_below_half_get_a_price_table_fixed_for_the_run(through_config):
    """`generate()` refuses a measured price table where drafts decide what passes (`token_threshold` < 0.5); a
    benchmark decodes such settings with the table a decode at 0.5 measures, fixed once, whether the settings come as
    keywords or in a `generation_config`."""
    tokenizer = tiny_tokenizer()
    model, tokenizer = convert_to_refusion(tiny_backbone("llama", vocab_size=len(tokenizer)), tokenizer)
    model.eval()
    settings = dict(slot_size=4, block_length=8, token_threshold=0.3, draft_schedule="price")
    if through_config:
        config = copy.deepcopy(model.generation_config)
        config.update(**settings)
        settings = dict(generation_config=config)
    prompts = prompt_token_ids(tokenizer, PROMPTS[:2])
    with pytest.raises(ValueError, match="would let a timing change a greedy answer"):
        decode(model, tokenizer, prompts, max_new_tokens=8, **{**settings, "forward_prices": None})
    fixed = with_fixed_prices(model, tokenizer, prompts, 8, settings)
    assert set(fixed["forward_prices"]) >= {1, 2, 4} and all(price > 0 for price in fixed["forward_prices"].values())
    assert with_fixed_prices(model, tokenizer, prompts, 8, settings) == fixed  # measured once
    assert decode(model, tokenizer, prompts, max_new_tokens=8, **settings).answers  # decodes, with the fixed table


def test_decode_runs_the_refusion_decoder_a_native_export_carries(tmp_path):
    """A native export is the backbone's own class; its decoder arrives as an instance-level `generate` (transformers'
    custom_generate, loaded with trust_remote_code), which `decode` must call rather than the class's AR one."""
    tokenizer = tiny_tokenizer()
    backbone = tiny_backbone("llama", vocab_size=len(tokenizer), initializer_range=0.2)
    model, tokenizer = convert_to_refusion(backbone, tokenizer)
    settings = dict(slot_size=4, block_length=8, slot_threshold=0.5, token_threshold=0.3)
    folder = save_refusion(model, tokenizer, tmp_path / "native", format="native")
    native = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float64).eval()
    assert type(native).__name__ == "LlamaForCausalLM"
    prompts = prompt_token_ids(tokenizer, PROMPTS[:2])
    exported = decode(native, tokenizer, prompts, max_new_tokens=12, **settings)
    converted = decode(model.double().eval(), tokenizer, prompts, max_new_tokens=12, **settings)
    assert exported.answers == converted.answers
    assert exported.forwards == converted.forwards
    assert exported.acceptance is not None  # the ReFusion decoder's own record: not transformers' AR generate()
    static = decode(native, tokenizer, prompts, max_new_tokens=12, cache_implementation="static", **settings)
    assert static.answers == converted.answers  # the backbone class's decoder and output layer over the static cache


def test_compile_refusion_compiles_the_forwards_the_loaded_decoder_then_reuses(tmp_path):
    """The warm-up compiles every width bucket through the decoder module `generate()` runs (here a loaded folder's
    `custom_generate/generate.py`, not this package's `generation_refusion`), so the timed decode compiles nothing."""
    tokenizer = tiny_tokenizer()
    backbone = tiny_backbone("llama", vocab_size=len(tokenizer), initializer_range=0.2)
    model, tokenizer = convert_to_refusion(backbone, tokenizer)
    folder = save_refusion(model, tokenizer, tmp_path / "refusion")
    loaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float64).eval()
    module = decoder_module(loaded)
    assert module is not generation_refusion and module.__name__.endswith("generate")
    assert decoder_module(model) is generation_refusion
    settings = dict(slot_size=4, block_length=8, slot_threshold=0.5, token_threshold=0.3)
    prompts = prompt_token_ids(tokenizer, PROMPTS)
    eager = decode(loaded, tokenizer, prompts, max_new_tokens=10, **settings)
    options = compiled_refusion("cpu", mode="default")
    config = copy.deepcopy(loaded.generation_config)
    config.update(**settings)
    graphs = compiled_graphs()
    assert compile_refusion(loaded, prompts, 10, options["compile_config"], generation_config=config) > 0
    warmed = compiled_graphs()
    # a graph per width bucket, and the loaded module's own step functions' (its functions are not this package's)
    assert warmed - graphs > len(decoder_module(loaded, "executor_refusion").WIDTH_BUCKETS)
    compiled = decode(loaded, tokenizer, prompts, max_new_tokens=10, time_forwards=False, **options, **settings)
    assert compiled.answers == eager.answers
    assert compiled_graphs() == warmed  # nothing compiled in the decode


def test_compiled_refusion_with_freeze_asks_for_freezing_beside_the_mode():
    plain = compiled_refusion("cpu", mode="max-autotune-no-cudagraphs")["compile_config"]
    assert (plain.mode, plain.options) == ("max-autotune-no-cudagraphs", None)
    assert not compiling_refusion.freezes_weights(plain)
    frozen = compiled_refusion("cpu", mode="max-autotune-no-cudagraphs", freeze=True)["compile_config"]
    assert (frozen.mode, frozen.options) == ("max-autotune-no-cudagraphs", {"freezing": True})
    assert compiling_refusion.freezes_weights(frozen)


def test_evaluation_scores_runs_against_the_teacher_and_the_benchmark_tabulates_them(tmp_path):
    tokenizer = tiny_tokenizer()
    model = tiny_backbone("llama", vocab_size=len(tokenizer), initializer_range=0.2).double().eval()
    evaluation = Evaluation(model, tokenizer, prompt_count=10, max_new_tokens=6)
    prompts = evaluation.prompts
    assert len(prompts) == 10 and sum(p.reference is not None for p in prompts) == 5
    assert len({p.kind for p in prompts}) >= 5
    assert evaluation.teacher.answers == decode(model, tokenizer, evaluation.prompt_ids, 6).answers
    assert evaluation.ar_row["token_f1"] == 1.0 and evaluation.ar_row["speedup"] == 1.0

    # A student that answers every verifiable prompt with its reference and the first open one with nothing.
    texts = [p.reference or ("" if i == 5 else evaluation.teacher_texts[i]) for i, p in enumerate(prompts)]
    student = DecodeRun([tokenizer.encode(text) for text in texts], seconds=0.5, forwards=10)
    row = evaluation.row("student", "slots", student)
    references = evaluation.teacher_texts
    assert row["accuracy_verifiable"] == 1.0
    assert row["token_f1"] == pytest.approx(sum(token_f1(t, r) for t, r in zip(texts, references)) / 10)
    assert row["exact_match"] == pytest.approx(sum(exact_match(t, r) for t, r in zip(texts, references)) / 10)
    nll = answer_nll(model, evaluation.prompt_ids, student.answers)
    assert row["generative_perplexity"] == pytest.approx(perplexity(nll))
    assert row["speedup"] == pytest.approx(student.tokens_per_second / evaluation.teacher.tokens_per_second)
    assert row["tokens_per_forward"] == pytest.approx(student.tokens / 10)
    assert row["repetition"] == pytest.approx(repetition(texts))
    looping = DecodeRun([tokenizer.encode("cat sat on mat " * 4)] * 10, seconds=0.5, forwards=10)
    assert evaluation.row("looping", "slots", looping)["repetition"] == pytest.approx(9 / 13)  # 13 4-grams, 4 distinct
    with pytest.raises(RuntimeError, match="outside the base vocabulary"):
        evaluation.row("mask", "slots", DecodeRun([[len(tokenizer)]] * 10, seconds=1.0, forwards=1))

    results = {
        "machine": evaluation.machine,
        "dtype": "float64",
        "prompts": 10,
        "max_new_tokens": 6,
        "ar_correct": len(evaluation.correct),
        "chosen": "student",
        "chosen_reason": "test",
        "rows": [evaluation.ar_row, row],
        "progress": [{**row, "name": "checkpoint-2", "step": 2}],
        "settings": {"student": quality_speed.GRID["whole slots"]},
    }
    table = quality_speed.markdown(results)
    assert "| student | 16 | 0.8 | 0.3 | 32 | fast | False | None |" in table  # its whole setting, field by field
    assert "| student | 1 |" in table and "| checkpoint-2 | 2 |" in table and f"{row['speedup']:.2f}x" in table
    assert "| repeated 4-grams |" in table and f"| {row['repetition']:.2f} |" in table
    quality_speed.plot(results, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_teacher_at_another_batch_size_is_decoded_once_and_is_its_own_speed_reference():
    tokenizer = tiny_tokenizer()
    model = tiny_backbone("llama", vocab_size=len(tokenizer), initializer_range=0.2).double().eval()
    evaluation = Evaluation(model, tokenizer, prompt_count=4, max_new_tokens=4)
    batched = evaluation.ar_row_at(2)
    assert batched["batch_size"] == 2 and batched["speedup"] == 1.0 and batched["token_f1"] == 1.0
    assert evaluation.ar_row_at(2) is batched  # cached, not decoded again
    run = evaluation.timed(model, tokenizer, batch_size=2)
    row = evaluation.row("again", "ar", run, 2)
    assert row["speedup"] == pytest.approx(run.tokens_per_second / batched["tokens_per_second"])


def test_adapter_rows_score_the_untrained_conversion_and_its_own_ar_decoding():
    tokenizer = tiny_tokenizer()
    model = tiny_backbone("llama", vocab_size=len(tokenizer), initializer_range=0.2).double().eval()
    evaluation = Evaluation(model, tokenizer, prompt_count=2, max_new_tokens=4)
    rows = evaluation.adapter_rows("untrained", None)
    # Converting does not change the function: decoded token by token, it answers exactly as the teacher.
    assert rows["converted_ar"]["exact_match"] == 1.0 and rows["converted_ar"]["token_f1"] == 1.0
    assert rows["refusion"]["forwards"] > 0 and rows["refusion"]["kind"] == "slots"


def test_the_chosen_setting_is_the_fastest_close_to_ar_else_the_best_at_one_token_per_forward():
    reference = {"token_f1": 0.8, "generative_perplexity": 2.0}

    def row(name, speedup, f1, ppl, per_forward):
        return dict(name=name, kind="slots", batch_size=1, speedup=speedup, token_f1=f1,
                    generative_perplexity=ppl, tokens_per_forward=per_forward)  # fmt: skip

    rows = [row("slow close", 0.8, 0.79, 2.05, 1.2), row("fast close", 1.4, 0.77, 2.1, 2.1), row("far", 3, 0.2, 9, 4)]
    assert quality_speed.choose_setting(rows, reference)[0] == "fast close"
    rows = [row("best below one", 0.5, 0.7, 3, 0.9), row("good", 0.6, 0.6, 3, 1.1), row("worse", 2, 0.3, 8, 3)]
    assert quality_speed.choose_setting(rows, reference)[0] == "good"


def test_the_fastest_ar_row_may_be_a_compiled_one_timed_in_interleaved_rounds():
    order = []

    def decoder(name, seconds, warm_ups=None):
        """Runs of `seconds` each; compiled when given the seconds of their `warm_ups` (the first compiles)."""

        def run():
            order.append(name)
            if warm_ups is None:
                return DecodeRun([[5, 6]], seconds.pop(0), 2, forward_seconds=0.1)
            return DecodeRun([[5, 6]], seconds.pop(0), 2, None, compile_seconds=warm_ups.pop(0), recompiles=0)

        return run

    decoders = {
        "eager": decoder("eager", [2.0, 1.0, 3.0]),
        "compiled": decoder("compiled", [0.5, 0.9, 0.4], [90, 1, 1]),
    }
    runs = quality_speed.interleaved(decoders, repeats=3)
    assert order == ["eager", "compiled"] * 3  # rounds, not one decoder's repeats back to back
    assert runs["eager"].seconds == 1.0 and runs["eager"].compile_seconds is None
    assert runs["compiled"].seconds == 0.4 and runs["compiled"].compile_seconds == 90  # the one-off cost
    assert runs["compiled"].recompiles == 0

    ar = quality_speed.AR
    rows = [
        {"name": ar, "kind": "ar", "batch_size": 1, "tokens_per_second": 13.0, "speedup": 1.0},
        {"name": f"{ar}, bfloat16", "kind": "ar", "batch_size": 1, "tokens_per_second": 16.0},
        {"name": f"{ar}, bfloat16, compiled", "kind": "ar", "batch_size": 1, "tokens_per_second": 25.0,
         "compile_seconds": 90.0, "recompiles": 0},
        {"name": "shipped default", "kind": "slots", "batch_size": 1, "tokens_per_second": 10.0, "speedup": 0.77},
    ]  # fmt: skip
    assert quality_speed.against_fastest_ar(rows) == f"{ar}, bfloat16, compiled"
    assert [row["speedup"] for row in rows] == [0.52, 0.64, 1.0, 0.4]
    note = quality_speed.compiled_note({"rows": rows, "ar_compile_mode": "max-autotune-no-cudagraphs"})
    assert f"{ar}, bfloat16, compiled 90 s" in note and "graphs compiled after the warm-ups: 0" in note


GRIDS = {"quality_speed": quality_speed.GRID, "decode": decode_benchmark.SETTINGS}


@pytest.mark.parametrize(("grid", "name"), [(grid, name) for grid, rows in GRIDS.items() for name in rows])
def test_every_benchmark_row_is_a_whole_valid_decoding_setting(grid, name):
    """A row states every decoding setting, so it means the same thing whatever the shipped defaults are, and the
    decoder accepts it (with the shipped fused redraft and draft window, the rows that change one thing of the
    shipped setting stopped the default grid at "reference")."""
    decoding = GRIDS[grid][name]
    assert sorted(decoding) == sorted(DECODING_FIELDS)
    assert check_decoding(decoding) == decoding  # valid, and nothing left to a default


def test_draft_checks_in_one_forward_equal_a_forward_per_draft():
    """benchmarks.draft_sources puts every [MASK] draft query after the answer in one forward; each must see what a
    plan forward's [MASK] at its slot offset sees: the prompt, the answer tokens before its point, and the slot's
    [MASK]s up to itself, each at its own position (a slot drafted after its first `a` tokens)."""
    tokenizer = tiny_tokenizer()
    backbone = tiny_backbone("llama", vocab_size=len(tokenizer), initializer_range=0.2)
    model, tokenizer = convert_to_refusion(backbone, tokenizer)
    model = model.double().eval()
    prompt, answer = prompt_token_ids(tokenizer, PROMPTS[:1])[0], [17, 42, 99, 5, 63]
    settings = dict(token_threshold=0.01, slot_threshold=0.02)
    checks = draft_sources.check_drafts(model, prompt, answer, max_distance=3, settings=settings)
    seen, distance, target = draft_sources.draft_queries(len(prompt), len(answer), 3)
    assert distance.tolist() == checks["distance"].tolist() and len(distance) == 5 + 4 + 3
    mask_id = model.generation_config.mask_token_id
    with torch.no_grad():
        ar = model(torch.tensor([prompt + answer])).logits[0].softmax(-1)
        for query, (a, d, j) in enumerate(zip(seen.tolist(), distance.tolist(), target.tolist())):
            ids = torch.tensor([prompt + answer[:a] + [mask_id] * d])
            positions = torch.tensor([list(range(len(prompt) + a + d))])
            probabilities = model(ids, position_ids=positions).logits[0, -1].softmax(-1)
            probabilities[mask_id] = -1
            draft = int(probabilities.argmax())
            assert a + d - 1 == j
            assert bool(checks["ar_token"][query]) == (draft == answer[j])
            assert bool(checks["accepted"][query]) == (ar[len(prompt) + j - 1, draft].item() > 0.01)
            assert bool(checks["confident"][query]) == (probabilities.max().item() > 0.02)
