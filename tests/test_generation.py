"""ReFusion decoding: well-formed output, cached == recomputed, exact cache contents, forward counts, errors."""

import concurrent.futures
import copy
import dataclasses
import itertools

import pytest
import torch
from tiny import tiny_backbone, tiny_tokenizer
from transformers import DynamicCache

import compiling_refusion
import decisions_refusion
import decoder_refusion
import executor_refusion
import generation_refusion
from decisions_refusion import attention_mask
from decoder_refusion import SlotDecoder
from executor_refusion import execute
from finetune.convert import convert_to_refusion
from settings_refusion import DECODING_DEFAULTS, resolve_settings

PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10]])


def sharpened_model(architecture: str, scale: float) -> torch.nn.Module:
    """A tiny converted model in float64 with large random weights and a scaled final norm, so that outputs vary and
    top-token probabilities spread over (0, 1) (small random models repeat one token with probability ~0.01)."""
    tokenizer = tiny_tokenizer()
    backbone = tiny_backbone(architecture, vocab_size=len(tokenizer), initializer_range=0.2)
    model, _ = convert_to_refusion(backbone, tokenizer)
    with torch.no_grad():
        model.model.norm.weight.mul_(scale)
    return model.double().eval()


@pytest.fixture(scope="module")
def model():
    return sharpened_model("qwen3", scale=4.0)


def frequent_token_of(model, skip: int = 0) -> int:
    """A token the model produces often (after the first `skip` answer tokens), used as EOS so that answers end
    early."""
    answer = model.generate(PROMPT, max_new_tokens=24, slot_size=4, eos_token_id=[])[0, PROMPT.shape[1] :]
    return int(answer[skip:].mode().values)


@pytest.fixture(scope="module")
def frequent_token(model):
    return frequent_token_of(model, skip=4)


def check_well_formed(sequences, prompt, max_new_tokens, eos, pad, mask):
    assert torch.equal(sequences[:, : prompt.shape[1]], prompt)
    answer = sequences[0, prompt.shape[1] :]
    assert 1 <= answer.shape[0] <= max_new_tokens
    assert not (answer == mask).any()
    is_eos = torch.isin(answer, torch.tensor(eos, dtype=torch.long))
    if is_eos.any():
        first = int(is_eos.long().argmax())
        assert (answer[first + 1 :] == pad).all()
    else:
        assert answer.shape[0] == max_new_tokens


GRID = list(itertools.product((1, 4, 8), (0.0, 0.5, 1.0), (0.0, 0.5, 1.0), (7, 21)))


@pytest.mark.parametrize(("slot_size", "slot_threshold", "token_threshold", "max_new_tokens"), GRID)
def test_cached_decoding_equals_recomputation_and_is_well_formed(
    model, frequent_token, slot_size, slot_threshold, token_threshold, max_new_tokens
):
    for eos in ([], [frequent_token]):
        settings = dict(
            max_new_tokens=max_new_tokens,
            slot_size=slot_size,
            slot_threshold=slot_threshold,
            token_threshold=token_threshold,
            block_length=2 * slot_size if slot_size > 1 else 8,
            eos_token_id=eos,
            pad_token_id=0,
            return_dict_in_generate=True,
        )
        cached = model.generate(PROMPT, **settings)
        recomputed = model.generate(PROMPT, use_cache=False, **settings)
        assert torch.equal(cached.sequences, recomputed.sequences)
        assert cached.num_forward_passes == recomputed.num_forward_passes
        check_well_formed(cached.sequences, PROMPT, max_new_tokens, eos, 0, model.config.mask_token_id)


@pytest.mark.parametrize("architecture", ["llama", "mistral", "qwen2"])
def test_cached_equals_recomputation_on_every_backbone(architecture):
    model = sharpened_model(architecture, scale=4.0)
    for slot_size, threshold in ((4, 0.5), (8, 0.3)):
        settings = dict(max_new_tokens=24, slot_size=slot_size, slot_threshold=threshold, token_threshold=threshold)
        assert torch.equal(model.generate(PROMPT, **settings), model.generate(PROMPT, use_cache=False, **settings))


def run_decoder(model, **overrides):
    settings, _ = resolve_settings(model, None, PROMPT.shape[1], {"eos_token_id": [], **overrides})
    decoder, cache = SlotDecoder(PROMPT[0], settings), DynamicCache()
    with torch.no_grad():
        execute(model, [decoder], cache)
    return decoder, decoder.result(), cache


@pytest.mark.parametrize(("slot_size", "threshold"), [(4, 0.5), (8, 0.2), (4, 1.0)])
def test_cache_holds_exactly_the_committed_tokens_with_their_original_kv(model, slot_size, threshold):
    decoder, answer, cache = run_decoder(
        model, max_new_tokens=24, slot_size=slot_size, slot_threshold=threshold, token_threshold=threshold
    )
    record = decoder.record
    assert cache.get_seq_length() == record.computed
    ids, positions, _, prefixes, groups, _ = record.fields  # (`FIELDS`)
    # every prompt and answer position exactly once, each holding the token returned at that position
    assert torch.equal(positions.sort().values, torch.arange(PROMPT.shape[1] + answer.shape[0]))
    assert torch.equal(ids[positions.argsort()], torch.cat([PROMPT[0], answer]))
    # the cached K/V equal a from-scratch pass over the stored sequence with the recorded attention structure
    ranks = torch.arange(ids.shape[0])[None]
    prefixes, groups = prefixes[None], groups[None]
    mask = attention_mask(ranks, groups, ranks, prefixes, groups, torch.full_like(groups, -3), 0, model.dtype)
    reference = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids[None], position_ids=positions[None], attention_mask=mask, cache=reference, use_cache=True)
    cached_length = cache.get_seq_length()
    for layer, expected in zip(cache.layers, reference.layers):
        torch.testing.assert_close(layer.keys, expected.keys[:, :, :cached_length], rtol=0, atol=1e-10)
        torch.testing.assert_close(layer.values, expected.values[:, :, :cached_length], rtol=0, atol=1e-10)


def test_thresholds_zero_commit_each_block_with_one_plan_and_one_verify(model):
    output = model.generate(
        PROMPT, max_new_tokens=32, slot_size=4, block_length=16, slot_threshold=0.0, token_threshold=0.0,
        eos_token_id=[], return_dict_in_generate=True,
    )  # fmt: skip
    assert output.num_forward_passes == 2 * 2
    assert output.tokens_per_forward == 32 / 4


@pytest.mark.parametrize("slot_size", [1, 4, 8])
def test_thresholds_one_decode_one_token_per_forward_and_never_less(model, slot_size):
    output = model.generate(
        PROMPT, max_new_tokens=16, slot_size=slot_size, block_length=8, slot_threshold=1.0, token_threshold=1.0,
        eos_token_id=[], return_dict_in_generate=True,
    )  # fmt: skip
    # plan + verify give a slot's first token and the model's own second one; each infill round adds one more: no
    # forward is spent without a token, so the serial worst case is exactly autoregressive, one token per forward
    assert output.num_forward_passes == 16


def test_max_new_tokens_need_not_be_a_multiple_of_the_slot_size(model):
    sequences = model.generate(PROMPT, max_new_tokens=10, slot_size=4, eos_token_id=[])
    assert sequences.shape == (1, PROMPT.shape[1] + 10)


def test_default_block_length_adapts_to_a_new_slot_size(model):
    assert model.generation_config.block_length % 5 != 0
    sequences = model.generate(PROMPT, max_new_tokens=12, slot_size=5, eos_token_id=[])
    assert sequences.shape == (1, PROMPT.shape[1] + 12)
    with pytest.raises(ValueError, match="block_length"):
        model.generate(PROMPT, max_new_tokens=12, slot_size=5, block_length=32)


def test_generation_config_supplies_the_defaults_and_kwargs_override_them(model):
    model.generation_config.slot_size = 4
    try:
        default = model.generate(PROMPT, max_new_tokens=16, eos_token_id=[], return_dict_in_generate=True)
        explicit = model.generate(PROMPT, max_new_tokens=16, slot_size=4, eos_token_id=[], return_dict_in_generate=True)
        other = model.generate(PROMPT, max_new_tokens=16, slot_size=1, eos_token_id=[], return_dict_in_generate=True)
    finally:
        model.generation_config.slot_size = DECODING_DEFAULTS["slot_size"]
    assert torch.equal(default.sequences, explicit.sequences)
    assert default.num_forward_passes == explicit.num_forward_passes
    assert not torch.equal(default.sequences, other.sequences)


def test_greedy_is_deterministic_and_seeded_sampling_reproducible(model):
    settings = dict(max_new_tokens=16, slot_size=4, eos_token_id=[])
    assert torch.equal(model.generate(PROMPT, **settings), model.generate(PROMPT, **settings))
    samples = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        samples.append(model.generate(PROMPT, do_sample=True, temperature=1.5, top_k=0, **settings))
    assert torch.equal(samples[0], samples[1])
    assert not torch.equal(samples[0], samples[2])
    torch.manual_seed(0)
    recomputed = model.generate(PROMPT, do_sample=True, temperature=1.5, top_k=0, use_cache=False, **settings)
    assert torch.equal(samples[0], recomputed)


def test_rows_of_a_left_padded_batch_equal_their_prompts_alone(model):
    short = torch.tensor([[11, 12, 13]])
    batch = torch.tensor([[0, 0, 0, 11, 12, 13], PROMPT[0].tolist()])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1] * 6])
    settings = dict(max_new_tokens=12, slot_size=4, eos_token_id=[], pad_token_id=0)
    together = model.generate(batch, attention_mask=mask, **settings)
    assert torch.equal(together[0, 3:], model.generate(short, **settings)[0])
    assert torch.equal(together[1], model.generate(PROMPT, **settings)[0])


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"input_ids": torch.zeros((1, 0), dtype=torch.long)}, "non-empty"),
        ({"input_ids": torch.tensor([[5, -1]])}, "mask token"),
        ({"slot_size": 0}, "slot_size"),
        ({"slot_threshold": 1.5}, "slot_threshold"),
        ({"token_threshold": -0.5}, "token_threshold"),
        ({"slot_size": 4, "block_length": 10}, "block_length"),
        ({"eos_token_id": -1}, "EOS"),
        ({"pad_token_id": -1}, "pad"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"num_beams": 2}, "beam"),
        ({"do_sample": True, "temperature": 0.0}, "temperature"),
        ({"top_p": 0.0, "do_sample": True}, "top_p"),
        ({"unknown_option": 3}, "unknown_option"),
        ({"attention_mask": torch.tensor([[1, 0, 1, 1, 1, 1]])}, "left-padded"),
        ({"attention_mask": torch.zeros((1, 6), dtype=torch.long)}, "at least one token"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be a whole number"),
        ({"max_new_tokens": None, "max_length": 9.0}, "max_length must be a whole number"),
        ({"input_ids": torch.tensor([[5, 6, 1000]])}, "input_ids holds the token id 1000, outside"),
        ({"input_ids": torch.tensor([[5, -3, 7]])}, "input_ids holds the token id -3, outside"),
        ({"input_ids": torch.tensor([[5.0, 6.0]])}, "input_ids must hold integer token ids"),
        ({"input_ids": [[5, 6, 7]]}, "input_ids must be a tensor"),
        ({"input_ids": torch.tensor([5, 6, 7])}, "input_ids must be non-empty and 2D"),
        ({"attention_mask": [[1] * 6]}, "attention_mask must be a tensor"),
        ({"mask_token_id": 3}, r"passed mask_token_id \(3\) differs from the model config's"),
        ({"cache_implementation": "static", "cache_config": {"max_cache_len": 4}}, "cache_config"),
        ({"max_cache_len": 512}, "max_cache_len=512 sizes the static cache"),
        ({"cache_implementation": "static", "max_cache_len": 0}, "max_cache_len must be a positive"),
        ({"num_return_sequences": 0}, "num_return_sequences must be a positive"),
        ({"num_return_sequences": 2.5, "do_sample": True}, "num_return_sequences must be a positive"),
        ({"eos_token_id": 10**6}, r"eos_token_id must hold token ids in \[0, "),
        ({"eos_token_id": 2.5}, "eos_token_id must hold token ids"),
        ({"pad_token_id": 10**6}, "pad_token_id must hold token ids"),
        ({"forced_eos_token_id": 10**6}, "forced_eos_token_id must hold token ids"),
        ({"suppress_tokens": [10**6]}, "suppress_tokens must hold token ids"),
    ],
)
def test_bad_input_raises_a_value_error_naming_it(model, arguments, message):
    mask_id = model.config.mask_token_id
    arguments = dict(arguments)
    for key in ("eos_token_id", "pad_token_id"):
        if arguments.get(key) == -1:
            arguments[key] = mask_id
    input_ids = arguments.pop("input_ids", PROMPT)
    if isinstance(input_ids, torch.Tensor) and not input_ids.dtype.is_floating_point:
        input_ids = torch.where(input_ids == -1, mask_id, input_ids)
    with pytest.raises(ValueError, match=message):
        model.generate(input_ids, **{"max_new_tokens": 8, **arguments})


@pytest.mark.parametrize("slot_size", [1, 4, 8])
def test_eos_ends_the_answer_and_later_slots_are_dropped(model, slot_size):
    settings = dict(max_new_tokens=24, slot_size=slot_size, slot_threshold=0.5, token_threshold=0.5, pad_token_id=0)
    free = model.generate(PROMPT, eos_token_id=[], return_dict_in_generate=True, **settings)
    eos = int(free.sequences[0, PROMPT.shape[1] + 9])
    ended = model.generate(PROMPT, eos_token_id=eos, return_dict_in_generate=True, **settings)
    answer = ended.sequences[0, PROMPT.shape[1] :]
    first = int((answer == eos).long().argmax())
    assert answer[first] == eos and first <= 9  # decisions match the free run until an EOS is committed
    assert answer.shape[0] == first + 1  # nothing returned after the end of the only row
    assert ended.num_forward_passes < free.num_forward_passes
    assert ended.tokens_per_forward == (first + 1) / ended.num_forward_passes


@pytest.mark.parametrize(
    "options",
    [
        dict(slot_size=4),
        dict(slot_size=8, fused_redraft=True),
        dict(slot_size=4, draft_window=2),
        dict(slot_size=1),
        dict(slot_size=4, infill_mode="reference"),
        dict(slot_size=4, draft_schedule="price", forward_prices={1: 1.0, 2: 1.1, 4: 1.2, 8: 1.3}),
    ],
)
def test_greedy_decoding_scores_each_forward_whole_and_decides_as_scoring_each_decision(
    model, frequent_token, monkeypatch, options
):
    """Greedy decoding scores each forward with one step function of its phase, from the logits to what the host
    reads (`score_plan`, `score_verify`, `score_infill` with or without `[MASK]` queries, and the authors' rule's
    `score_redraft` and `score_recheck`); its decisions equal those of the path that scores the rows each decision
    reads (sampling's, and that of processors that read context)."""
    settings = dict(
        max_new_tokens=24, slot_threshold=0.5, token_threshold=0.4, eos_token_id=[frequent_token], pad_token_id=0,
        return_dict_in_generate=True, **options,
    )  # fmt: skip
    calls = []

    def counting(name, function):
        return lambda *args: calls.append(name) or function(*args)

    steps = decisions_refusion.EAGER_STEPS
    counted = dataclasses.replace(
        steps, **{name: counting(name, getattr(steps, name)) for name in ("score_plan", "score_verify", "score_infill")}
    )
    monkeypatch.setattr(compiling_refusion, "EAGER_STEPS", counted)  # (`step_functions` hands it out)
    for name in ("score_redraft", "score_recheck"):
        monkeypatch.setattr(decoder_refusion, name, counting(name, getattr(decoder_refusion, name)))
    at_once = model.generate(PROMPT, **settings)
    assert len(calls) == at_once.num_forward_passes
    reference, whole_slots = options.get("infill_mode") == "reference", options["slot_size"] > 1
    assert ("score_infill" in calls) == (whole_slots and not reference)
    assert ("score_recheck" in calls) == ("score_redraft" in calls) == reference
    assert "score_plan" in calls and ("score_verify" in calls) == whole_slots
    created = SlotDecoder.__init__

    def each_decision(self, *args, **kwargs):
        created(self, *args, **kwargs)
        self.greedy = False

    monkeypatch.setattr(SlotDecoder, "__init__", each_decision)
    calls.clear()
    alone = model.generate(PROMPT, **settings)
    assert not calls
    assert torch.equal(at_once.sequences, alone.sequences)
    assert at_once.num_forward_passes == alone.num_forward_passes


def test_a_generation_config_whose_mask_token_disagrees_with_the_models_is_refused_naming_both(model):
    config = copy.deepcopy(model.generation_config)
    config.mask_token_id = model.config.mask_token_id - 1
    message = rf"generation config's mask_token_id \({config.mask_token_id}\) differs from the model config's " \
        rf"\({model.config.mask_token_id}\)"  # fmt: skip
    with pytest.raises(ValueError, match=message):
        model.generate(PROMPT, generation_config=config, max_new_tokens=4)


def test_a_left_padded_batch_without_attention_mask_has_its_padding_inferred_from_the_pad_token(model):
    """As transformers infers it: the pad token's positions are padding when it is not an EOS token."""
    batch = torch.tensor([[0, 0, 0, 11, 12, 13], PROMPT[0].tolist()])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1] * 6])
    settings = dict(max_new_tokens=12, slot_size=4, eos_token_id=[2], pad_token_id=0)
    assert torch.equal(model.generate(batch, **settings), model.generate(batch, attention_mask=mask, **settings))
    with pytest.raises(ValueError, match="inferred from the pad token 0"):
        model.generate(torch.tensor([[11, 0, 12]]), **settings)  # a pad token inside a prompt reads as a gap


def test_a_batch_whose_padding_cannot_be_inferred_is_decoded_with_a_warning(model, caplog):
    batch = torch.tensor([[0, 0, 0, 11, 12, 13], PROMPT[0].tolist()])
    settings = dict(max_new_tokens=4, slot_size=4, eos_token_id=[0], pad_token_id=0)
    with caplog.at_level("WARNING"):
        model.generate(batch, **settings)
    assert "padding cannot be inferred" in caplog.text


@pytest.mark.parametrize("slot_size", [64, 100_000])
def test_slots_longer_than_the_answer_are_cut_to_it(model, slot_size):
    """A slot (and block) longer than `max_new_tokens` would plan and check positions past the answer's end: the
    decode is the one with slots of `max_new_tokens` tokens, its work bounded by them."""
    settings = dict(max_new_tokens=4, eos_token_id=[], return_dict_in_generate=True)
    cut = model.generate(PROMPT, slot_size=4, **settings)
    long = model.generate(PROMPT, slot_size=slot_size, **settings)
    assert torch.equal(long.sequences, cut.sequences)
    assert long.num_forward_passes == cut.num_forward_passes <= 4 + 1


def test_a_static_cache_is_sized_by_max_cache_len_and_released_after_an_eager_decode(model, monkeypatch):
    sizes, make = [], executor_refusion.slot_cache

    def recorded(*args, **kwargs):
        cache = make(*args, **kwargs)
        sizes.append(cache.max_cache_len)
        return cache

    monkeypatch.setattr(generation_refusion, "slot_cache", recorded)
    settings = dict(max_new_tokens=8, slot_size=4, eos_token_id=[], cache_implementation="static")
    plain = model.generate(PROMPT, **settings)
    assert torch.equal(model.generate(PROMPT, max_cache_len=1000, **settings), plain)
    assert sizes[0] < 1000 <= sizes[1]
    assert not hasattr(model, "_refusion_slot_cache")  # an eager decode's static cache is its own


def test_threads_decoding_one_model_with_the_static_cache_each_get_their_own_answer(model):
    prompts = [PROMPT, torch.tensor([[11, 12, 13, 14]])]
    settings = dict(max_new_tokens=12, slot_size=4, eos_token_id=[], cache_implementation="static")
    alone = [model.generate(prompt, **settings) for prompt in prompts]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(model.generate, prompt, **settings) for prompt in prompts * 4]
        together = [run.result() for run in runs]
    for index, answer in enumerate(together):
        assert torch.equal(answer, alone[index % 2])


def test_a_kept_static_cache_is_used_by_one_decode_at_a_time(model):
    """A compiled decode keeps its cache on the model for the next; a second decode over it at the same time (another
    thread) is refused rather than overwriting its keys and values."""
    cache = executor_refusion.slot_cache(model, 1, 64)
    with cache.claimed():
        with pytest.raises(RuntimeError, match="already decoding over its static cache in another thread"):
            with cache.claimed():
                pass
    with cache.claimed():  # released
        twin = copy.deepcopy(model)  # a copy of a model holding its cache (and of the cache): a lock of its own
        with twin._refusion_slot_cache.claimed():
            assert torch.equal(twin._refusion_slot_cache.layers[0].keys, cache.layers[0].keys)
    del model._refusion_slot_cache
