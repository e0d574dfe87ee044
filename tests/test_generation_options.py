"""Every generation option is honoured through transformers' logits processors, or refused by name; an unset
`use_cache` uses the cache."""

import pytest
import torch
from test_generation import PROMPT, sharpened_model
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

import settings_refusion

SETTINGS = dict(max_new_tokens=16, slot_size=4, block_length=8, slot_threshold=0.5, token_threshold=0.3, pad_token_id=0)
LENGTH = PROMPT.shape[1]


@pytest.fixture(scope="module")
def model():
    return sharpened_model("qwen3", scale=4.0)


@pytest.fixture(scope="module")
def free(model):
    """The greedy answer without options (and without EOS)."""
    return model.generate(PROMPT, eos_token_id=[], **SETTINGS)[0, LENGTH:]


def answer(model, **options):
    return model.generate(PROMPT, **{"eos_token_id": [], **SETTINGS, **options})[0, LENGTH:]


def test_repetition_penalty_keeps_the_prompts_tokens_out_of_the_answer_or_draws_them_in(model, free):
    assert torch.isin(answer(model, repetition_penalty=1e-9), PROMPT[0]).all()  # below 1 a seen token is favoured
    assert not torch.isin(answer(model, repetition_penalty=1e9), PROMPT[0]).any()


def test_no_repeat_ngram_size_one_bans_every_token_seen_before(model, free):
    assert not torch.isin(answer(model, no_repeat_ngram_size=1), PROMPT[0]).any()


@pytest.mark.parametrize("option", ["suppress_tokens", "bad_words_ids", "sequence_bias", "logits_processor"])
def test_a_banned_token_never_appears(model, free, option):
    banned = int(free.mode().values)
    assert banned in free.tolist()

    class Ban(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores.index_fill(-1, torch.tensor([banned]), -float("inf"))

    options = {
        "suppress_tokens": {"suppress_tokens": [banned]},
        "bad_words_ids": {"bad_words_ids": [[banned]]},
        "sequence_bias": {"sequence_bias": {(banned,): -1e9}},
        "logits_processor": {"logits_processor": LogitsProcessorList([Ban()])},
    }[option]
    result = answer(model, **options)
    assert banned not in result.tolist() and result.shape == free.shape


def test_begin_suppress_tokens_changes_only_what_may_start_the_answer(model, free):
    first = int(free[0])
    result = answer(model, begin_suppress_tokens=[first])
    assert result[0] != first


@pytest.mark.parametrize("option", ["min_new_tokens", "min_length"])
def test_min_new_tokens_and_min_length_keep_eos_away_until_reached(model, free, option):
    eos = int(free[2])
    early = answer(model, eos_token_id=eos)
    assert early.shape[0] <= 3
    value = 10 if option == "min_new_tokens" else LENGTH + 10
    late = answer(model, eos_token_id=eos, **{option: value})
    assert late.shape[0] >= 10 and not (late[:9] == eos).any()


def test_forced_eos_token_ends_the_answer_at_max_new_tokens(model, free):
    forced = int(free[0])
    result = answer(model, forced_eos_token_id=forced)
    assert result[-1] == forced and result.shape == free.shape


def test_exponential_decay_length_penalty_ends_answers_early(model, free):
    eos = int(free[-1])
    plain = answer(model, eos_token_id=eos)
    hurried = answer(model, eos_token_id=eos, exponential_decay_length_penalty=(2, 1e6))
    assert hurried.shape[0] < plain.shape[0] and hurried.shape[0] <= 4


def test_sampling_warpers_apply_top_k_one_makes_sampling_deterministic(model):
    samples = []
    for seed, options in [(0, dict(top_k=1)), (1, dict(top_k=1)), (0, dict(top_p=1e-9)), (0, {}), (1, {})]:
        torch.manual_seed(seed)
        samples.append(answer(model, do_sample=True, temperature=50.0, **options))
    assert torch.equal(samples[0], samples[1]) and torch.equal(samples[0], samples[2])  # one token left to draw
    assert not torch.equal(samples[3], samples[4])  # hot sampling without them varies with the seed
    # the one token left is the greedy one: with every slot's first token certain, the first plan chooses them all,
    # and the answer's first token is what the model ranks first after the prompt (a `[MASK]` never is drawn)
    mask = model.config.mask_token_id
    logits = model(torch.cat([PROMPT, torch.tensor([[mask]])], dim=1)).logits[0, -1]
    assert samples[0][0] == logits.index_fill(0, torch.tensor([mask]), -torch.inf).argmax()


@pytest.mark.parametrize("option", [{"remove_invalid_values": True}, {"renormalize_logits": True}])
def test_options_that_only_guard_the_scores_leave_a_finite_model_unchanged(model, free, option):
    assert torch.equal(answer(model, **option), free)


def test_context_dependent_processors_equal_between_cache_recomputation_and_batch(model):
    options = dict(repetition_penalty=1.5, min_new_tokens=5, eos_token_id=3)
    cached = answer(model, **options)
    assert torch.equal(cached, answer(model, use_cache=False, **options))
    batch = torch.tensor([[0, 0, 0, 11, 12, 13], PROMPT[0].tolist()])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1] * 6])
    together = model.generate(batch, attention_mask=mask, **{**SETTINGS, **options})
    assert torch.equal(together[1, 6 : 6 + cached.shape[0]], cached)


@pytest.mark.parametrize(
    "option",
    [
        {"num_beams": 2},
        {"num_beam_groups": 2},
        {"diversity_penalty": 0.5},
        {"length_penalty": 2.0},
        {"early_stopping": True},
        {"penalty_alpha": 0.6},
        {"guidance_scale": 1.5},
        {"force_words_ids": [[5]]},
        {"dola_layers": "low"},
        {"output_scores": True},
        {"output_logits": True},
        {"output_attentions": True},
        {"output_hidden_states": True},
        {"cache_implementation": "offloaded"},
        {"prompt_lookup_num_tokens": 3},
        {"token_healing": True},
        {"encoder_repetition_penalty": 1.2},
        {"prefix_allowed_tokens_fn": lambda batch, ids: [5]},
        {"assistant_model": "draft"},
    ],
    ids=lambda option: next(iter(option)),
)
def test_options_slot_decoding_cannot_apply_are_refused_by_name(model, option):
    with pytest.raises(ValueError, match=next(iter(option))):
        model.generate(PROMPT, **{**SETTINGS, **option})


def test_prompt_lookup_is_refused_naming_slot_decodings_own_copied_drafts(model):
    with pytest.raises(ValueError, match=r"prompt_lookup_num_tokens=3 \(its own drafts copied from the text are"):
        model.generate(PROMPT, **SETTINGS, prompt_lookup_num_tokens=3)


def test_a_generation_config_without_use_cache_decodes_with_the_cache(model):
    seen = []
    original = model.forward

    def counting(*args, **kwargs):
        seen.append(kwargs["input_ids"].numel())
        return original(*args, **kwargs)

    model.forward = counting
    try:
        results = {}
        for use_cache in (None, True, False):
            config = GenerationConfig(**{**model.generation_config.to_dict(), "use_cache": use_cache})
            seen.clear()
            results[use_cache] = (model.generate(PROMPT, generation_config=config, **SETTINGS), sum(seen))
    finally:
        del model.forward
    assert torch.equal(results[None][0], results[False][0])
    assert results[None][1] == results[True][1] < results[False][1] / 2


# Every option of transformers' GenerationConfig, by what slot decoding does with it; an option transformers adds
# fails the test below until it is placed here (and honoured, refused or shown inert).
HONOURED = {
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "max_time", "stop_strings", "do_sample",
    "num_return_sequences", "temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
    "top_h", "repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "sequence_bias", "suppress_tokens",
    "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "renormalize_logits", "eos_token_id", "pad_token_id", "use_cache",
    "cache_implementation", "compile_config", "disable_compile", "max_cache_len", "cache_config",
    "return_dict_in_generate",
}  # fmt: skip
INERT = {  # read only by decoding modes slot decoding refuses (assisted decoding, prompt lookup), or not by generate()
    "assistant_confidence_threshold", "assistant_early_exit", "assistant_ensemble_weight", "assistant_lookbehind",
    "target_lookbehind", "num_assistant_tokens", "num_assistant_tokens_schedule", "is_assistant",
    "max_matching_ngram_size", "speculation_type", "continuous_batching_config", "bos_token_id",
    "decoder_start_token_id", "_from_model_config", "transformers_version",
}  # fmt: skip


def test_every_option_transformers_knows_is_honoured_refused_or_inert():
    options = set(GenerationConfig().to_dict())
    placed = HONOURED | INERT | set(settings_refusion.REFUSED_OPTIONS)
    assert options <= placed, f"options slot decoding has not placed: {sorted(options - placed)}"
    assert not (HONOURED | INERT) & set(settings_refusion.REFUSED_OPTIONS)


def test_every_logits_processor_transformers_builds_is_built_here_too(model):
    """transformers' own builder (`_get_logits_processor`) and this decoder's, for a config that sets every option
    that makes a processor: the same processors, so none is skipped without a word."""
    options = dict(
        sequence_bias={(7,): 1.0}, repetition_penalty=1.2, no_repeat_ngram_size=3, bad_words_ids=[[9]], min_length=3,
        min_new_tokens=2, forced_bos_token_id=5, forced_eos_token_id=6, remove_invalid_values=True,
        exponential_decay_length_penalty=(4, 1.1), suppress_tokens=[8], begin_suppress_tokens=[10],
        renormalize_logits=True, do_sample=True, temperature=0.7, top_h=0.9, top_k=5, top_p=0.9, min_p=0.05,
        typical_p=0.9, epsilon_cutoff=0.01, eta_cutoff=0.01, eos_token_id=[2], pad_token_id=0, max_new_tokens=8,
    )  # fmt: skip
    config = GenerationConfig(**options)
    model._prepare_special_tokens(config, device="cpu")
    theirs = model._get_logits_processor(config, input_ids_seq_length=LENGTH, device="cpu")
    settings, merged = settings_refusion.resolve_settings(model, None, LENGTH, dict(options))
    ours = settings_refusion.build_logits_processors(merged, settings, LENGTH, "cpu")
    assert sorted(type(each).__name__ for each in theirs) == sorted(type(each).__name__ for each in ours)


def test_prefilling_in_chunks_is_refused(model):
    with pytest.raises(ValueError, match="prefill_chunk_size=16 .the prompt is one forward"):
        model.generate(PROMPT, **SETTINGS, prefill_chunk_size=16)
