"""ReFusion decoding over a static KV cache (`cache_implementation="static"`), eager and compiled: the same tokens as
the dynamic cache and as recomputing from scratch, the cache holding exactly the committed tokens, compiled forwards
that compile a bounded set of graphs once."""

import pytest
import torch
from test_batching import PROMPTS, left_padded
from test_generation import PROMPT, sharpened_model
from transformers import CompileConfig, DynamicCache, GenerationConfig

import compiling_refusion
import decisions_refusion
import decoder_refusion
import executor_refusion
import kernels_refusion
import prices_refusion
from acceptance_refusion import AcceptanceProfile
from compiling_refusion import compile_forwards, compiled_steps, warm_up_steps
from decisions_refusion import (
    NO_GROUP,
    accept_and_correct,
    attention_mask,
    check_counts,
    choose_slots,
    eos_offsets,
    first_rejected,
    infill_masks,
    judge_infill,
    judge_verify,
    static_mask,
)
from decoder_refusion import Infilling, Phase, SlotDecoder
from executor_refusion import (
    CACHE_LENGTH_MULTIPLE,
    LOGITS_IN_GRAPH_WIDTH,
    NARROW_BUCKETS,
    WIDTH_BUCKETS,
    SlotCache,
    StaticLayout,
    execute,
    pad_width,
    run_model,
    slot_cache,
    static_cache_columns,
    width_buckets,
)
from settings_refusion import compile_config_for, resolve_settings

ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3"]
SETTINGS = {  # each row of a batch ends at its own time with an EOS (set per test) or runs to max_new_tokens
    "plain": dict(max_new_tokens=20, slot_size=4, slot_threshold=0.5, token_threshold=0.4),
    "fused window": dict(
        max_new_tokens=20, slot_size=8, block_length=16, slot_threshold=0.5, token_threshold=0.3,
        fused_redraft=True, draft_window=2,
    ),
    "reference": dict(max_new_tokens=20, slot_size=4, slot_threshold=0.5, token_threshold=0.4, infill_mode="reference"),
    "one-token slots": dict(max_new_tokens=9, slot_size=1, slot_threshold=0.5, token_threshold=0.4),
}  # fmt: skip


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model(request):
    return sharpened_model(request.param, scale=4.0)


def answer_token(model, settings, offset: int) -> int:
    """A token the first prompt's answer has at `offset`: as EOS it ends that row early (and others elsewhere)."""
    free = model.generate(torch.tensor([PROMPTS[0]]), eos_token_id=[], pad_token_id=0, **settings)
    return int(free[0, len(PROMPTS[0]) + offset])


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("with_eos", [False, True])
def test_static_equals_dynamic_equals_recomputed_batched_and_alone(model, name, with_eos):
    settings = dict(SETTINGS[name], pad_token_id=0, return_dict_in_generate=True)
    settings["eos_token_id"] = answer_token(model, SETTINGS[name], 5) if with_eos else []
    ids, mask = left_padded(PROMPTS)
    static = model.generate(ids, attention_mask=mask, cache_implementation="static", **settings)
    dynamic = model.generate(ids, attention_mask=mask, **settings)
    recomputed = model.generate(ids, attention_mask=mask, use_cache=False, **settings)
    assert torch.equal(static.sequences, dynamic.sequences)
    assert torch.equal(static.sequences, recomputed.sequences)
    assert static.num_forward_passes == dynamic.num_forward_passes
    lengths = []
    for row, prompt in enumerate(PROMPTS):
        alone = model.generate(torch.tensor([prompt]), cache_implementation="static", **settings).sequences
        answer = alone[0, len(prompt) :]
        lengths.append(answer.shape[0])
        assert torch.equal(static.sequences[row, ids.shape[1] : ids.shape[1] + answer.shape[0]], answer)
    if with_eos:  # rows finished at different times and ran on as padding rows of the static batch
        assert min(lengths) < max(lengths) or max(lengths) < settings["max_new_tokens"]


def test_the_static_cache_holds_exactly_the_committed_tokens_with_their_original_kv():
    model = sharpened_model("qwen3", scale=4.0)
    settings, _ = resolve_settings(model, None, PROMPT.shape[1], {"eos_token_id": [], "max_new_tokens": 24})
    decoder = SlotDecoder(PROMPT[0], settings)
    cache = SlotCache(model, 1, static_cache_columns(PROMPT.shape[1], 24, settings.slot_size, settings.block_length))
    with torch.no_grad():
        execute(model, [decoder], cache)
    record = decoder.record
    (ids, positions, _, prefixes, groups, _), stored = record.fields, record.computed  # (`FIELDS`)
    ranks = torch.arange(ids.shape[0])[None]
    mask = attention_mask(ranks, groups[None], ranks, prefixes[None], groups[None], torch.full_like(ranks, -3), 0,
                          model.dtype)  # fmt: skip
    reference = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids[None], position_ids=positions[None], attention_mask=mask, cache=reference, use_cache=True)
    for layer, expected in zip(cache.layers, reference.layers):  # columns 0 .. stored - 1: the stored tokens, in order
        torch.testing.assert_close(layer.keys[:, :, :stored], expected.keys[:, :, :stored], rtol=0, atol=1e-10)
        torch.testing.assert_close(layer.values[:, :, :stored], expected.values[:, :, :stored], rtol=0, atol=1e-10)


@pytest.mark.parametrize("fused", [False, True])
def test_an_infill_round_queries_fresh_tokens_masks_and_drafts_at_their_slots_positions_and_groups(fused):
    """The host builds an infill round's queries from its counts: fresh accepted tokens (stored from `stored` up to
    `counts`), with `fused_redraft` a `[MASK]` query at each position checked (from the count up to the draft window
    and one more), then the drafts queried (the checked positions but each slot's last); each at its slot's RoPE
    positions, in its slot's group (the `[MASK]` queries in new groups whose parent is the slot's)."""
    model = sharpened_model("llama", scale=4.0)
    options = dict(eos_token_id=[], max_new_tokens=16, slot_size=4, fused_redraft=fused, draft_window=2)
    settings, _ = resolve_settings(model, None, PROMPT.shape[1], options)
    decoder, start, mask_id = SlotDecoder(PROMPT[0], settings), PROMPT.shape[1], settings.mask_token_id
    state = Infilling(slots=[3, 0, 2], tokens=torch.arange(100, 112).view(3, 4), counts=[1, 2, 0], stored=[0, 2, 0],
                      groups=[7, 8, 9], prefix=11)  # fmt: skip
    group = decoder.next_group
    phase = Phase(SlotDecoder.INFILL, state=state)
    ids, rope, _, prefixes, groups, parents = decoder._infill_queries(phase).fields.tolist()
    # fresh: slot 3's first token; checked: slot 3 at 1-3, slot 0 at 2-3, slot 2 at 0-2; queried: those but the last
    expected = dict(ids=[100], rope=[start + 12], groups=[7], parents=[NO_GROUP])
    if fused:
        expected["ids"] += [mask_id] * 8
        expected["rope"] += [start + offset for offset in (13, 14, 15, 2, 3, 8, 9, 10)]
        expected["groups"] += [group] * 3 + [group + 1] * 2 + [group + 2] * 3
        expected["parents"] += [7, 7, 7, 8, 8, 9, 9, 9]
    expected["ids"] += [101, 102, 106, 108, 109]
    expected["rope"] += [start + offset for offset in (13, 14, 2, 8, 9)]
    expected["groups"] += [7, 7, 8, 9, 9]
    expected["parents"] += [NO_GROUP] * 5
    assert dict(ids=ids, rope=rope, groups=groups, parents=parents) == expected
    assert prefixes == [11] * len(ids)
    layout = phase.forward  # an InfillRound
    assert layout.sizes == ([1, 8, 5] if fused else [1, 5]) and layout.fresh_queries.fields[0].tolist() == [100]
    assert layout.stored.tolist() == [0, 2, 0]
    assert layout.counts.tolist() == [1, 2, 0] and layout.until.tolist() == [4, 4, 3]
    fresh, queried, checked = infill_masks(layout.stored, layout.counts, layout.until, 4)
    assert fresh.tolist() == [[True, False, False, False], [False] * 4, [False] * 4]
    assert checked.tolist() == [[False, True, True, True], [False, False, True, True], [True, True, True, False]]
    assert queried.tolist() == [[False, True, True, False], [False, False, True, False], [True, True, False, False]]
    assert layout.index.tolist() == [[12, 13, 14, 15], [0, 1, 2, 3], [8, 9, 10, 11]]


def test_the_static_cache_is_reused_while_it_fits_and_replaced_when_it_does_not():
    model = sharpened_model("llama", scale=4.0)
    first = slot_cache(model, 2, 100)
    assert first.max_cache_len % 128 == 0 and first.max_cache_len >= 100
    assert slot_cache(model, 2, 90) is first  # shorter: same tensors, so compiled graphs see the same shapes
    assert slot_cache(model, 1, 90) is not first  # another batch size
    longer = slot_cache(model, 1, 300)
    assert longer.max_cache_len >= 300 and longer.layers[0].keys.shape[2] == longer.max_cache_len
    # a long prompt and answer: the cache sized for it decodes it exactly
    prompt = torch.arange(5, 205)[None]
    settings = dict(max_new_tokens=40, slot_size=4, block_length=8, eos_token_id=[], pad_token_id=0)
    assert torch.equal(
        model.generate(prompt, cache_implementation="static", **settings), model.generate(prompt, **settings)
    )


def test_a_forward_writes_at_its_rows_pointers_and_attends_over_the_whole_cache():
    model = sharpened_model("llama", scale=4.0)
    cache = SlotCache(model, 1, 256)
    layout = StaticLayout(cache, 1, model.device)
    batch = {name: torch.full((1, 4), value) for name, value in decoder_refusion.PADDING.items()}
    for pointer in (0, 124, 252):
        layout.pointers = [pointer]
        mask = layout.mask(batch, [4], model.dtype)
        assert mask.shape == (1, 1, 4, 256) and torch.equal(cache.columns[0], torch.arange(pointer, pointer + 4))
        new = torch.ones(1, *cache.layers[0].keys.shape[1:2], 4, cache.layers[0].keys.shape[3], dtype=model.dtype)
        keys, values = cache.update(new, 2 * new, 0)  # written at the pointer, attended over every column
        assert keys.shape[2] == values.shape[2] == 256
        assert torch.equal(values[0, :, pointer : pointer + 4], 2 * new[0])


def test_a_decode_past_the_first_cache_multiple_gives_the_dynamic_tokens_and_compiles_nothing_new():
    """Over a cache of 256 columns, an answer whose forwards cross column 128 decodes the dynamic cache's tokens,
    eagerly and compiled, where `compile_forwards` compiled one graph per width up front and the decode compiles
    nothing more."""
    model = sharpened_model("qwen2", scale=4.0)
    prompt = (torch.arange(100, 210) % 97 + 3)[None]  # 110 tokens: the answer's forwards cross column 128
    settings = dict(max_new_tokens=32, slot_size=4, block_length=8, slot_threshold=0.5, token_threshold=0.3,
                    eos_token_id=[], pad_token_id=0)  # fmt: skip
    dynamic = model.generate(prompt, **settings)
    assert CACHE_LENGTH_MULTIPLE < static_cache_columns(prompt.shape[1], 32, 4, 8) <= 2 * CACHE_LENGTH_MULTIPLE
    assert torch.equal(model.generate(prompt, cache_implementation="static", **settings), dynamic)
    config = compile_config()
    compile_masks(model.dtype)
    warm_up_steps(model)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compile_forwards(model, config, 1, static_cache_columns(prompt.shape[1], 32, 4, 8))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == len(WIDTH_BUCKETS)
    compiled = dict(settings, cache_implementation="static", compile_config=config)
    assert torch.equal(model.generate(prompt, **compiled), dynamic)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == len(WIDTH_BUCKETS)  # none since


def test_widths_pad_to_buckets_only_when_compiled_and_priced_drafts_get_narrow_ones():
    assert pad_width(3, None) == 3
    assert width_buckets("fixed") == WIDTH_BUCKETS and width_buckets("price") == NARROW_BUCKETS + WIDTH_BUCKETS
    assert [pad_width(width, width_buckets("fixed")) for width in (1, 8, 9, 17, 64)] == [8, 8, 16, 32, 64]
    assert [pad_width(width, width_buckets("price")) for width in (1, 2, 3, 5, 9, 64)] == [1, 2, 4, 8, 16, 64]
    assert pad_width(WIDTH_BUCKETS[-1] + 1, WIDTH_BUCKETS) == WIDTH_BUCKETS[-1] + 1  # a prompt: runs eagerly as it is


def compile_config() -> CompileConfig:
    return CompileConfig(fullgraph=True, dynamic=False, mode="default")


def test_forwards_compile_where_a_compile_config_is_given_over_the_static_cache():
    model = sharpened_model("llama", scale=4.0)

    def chosen(**options):
        config = GenerationConfig(**{key: value for key, value in options.items() if key != "compile_config"})
        config.compile_config = options.get("compile_config")
        return compile_config_for(model, config, config.cache_implementation or "dynamic")

    assert chosen(cache_implementation="static") is None  # a CPU compiles only when asked to
    assert chosen(cache_implementation="static", compile_config=compile_config()).mode == "default"
    config = compile_config()
    config._compile_all_devices = False  # transformers' private flag plays no part
    assert chosen(cache_implementation="static", compile_config=config) is config
    assert chosen(cache_implementation="static", compile_config=compile_config(), disable_compile=True) is None
    assert chosen(compile_config=compile_config()) is None  # compiled forwards need the static cache
    with pytest.raises(ValueError, match="cache_implementation.*'offloaded'"):
        model.generate(PROMPT, max_new_tokens=4, cache_implementation="offloaded")


def test_compiled_forwards_give_the_same_tokens_and_compile_once():
    model = sharpened_model("qwen3", scale=4.0)
    settings = dict(
        max_new_tokens=12, slot_size=4, block_length=8, slot_threshold=0.5, token_threshold=0.3, fused_redraft=True,
        eos_token_id=[], pad_token_id=0, cache_implementation="static", compile_config=compile_config(),
    )  # fmt: skip
    prompts = [PROMPT, torch.tensor([[11, 12, 13]]), torch.tensor([[20, 21, 22, 23, 24, 25, 26, 27, 28]])]
    eager = [model.generate(prompt, **{**settings, "compile_config": None}) for prompt in prompts]
    compile_masks(model.dtype)  # the step functions, shared by every model (compiled in whichever test asks first)
    warm_up_steps(model)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compile_forwards(model, settings["compile_config"], 1, static_cache_columns(9, 12, 4, 8))  # the longest prompt
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == len(WIDTH_BUCKETS)  # one per width
    for prompt, expected in zip(prompts, eager):  # prompts of other lengths over that cache: nothing recompiles
        assert torch.equal(model.generate(prompt, **settings), expected)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == len(WIDTH_BUCKETS)


def mask_inputs(generator, rows: int, width: int, columns: int) -> tuple:
    """Random `static_mask` arguments: stored tokens, new tokens (some rows padded), groups and ranks."""
    pointers = torch.randint(0, columns - width + 1, (rows,), generator=generator)
    lengths = torch.randint(0, width + 1, (rows,), generator=generator)
    key_groups = torch.randint(-2, 4, (rows, columns), generator=generator)
    ranks, prefixes = (torch.randint(0, columns, (rows, width), generator=generator) for _ in range(2))
    groups, parents = (torch.randint(-3, 4, (rows, width), generator=generator) for _ in range(2))
    return pointers, lengths, torch.arange(columns), key_groups, ranks, prefixes, groups, parents


@torch.no_grad()  # (as in a decode: grad mode is among a graph's guards)
def compile_masks(dtype, batch_sizes=(1,)) -> None:
    """Compile `compiled_steps().static_mask` for masks of `dtype` over `batch_sizes` rows, of one new token and of
    several."""
    generator = torch.Generator().manual_seed(0)
    for rows in batch_sizes:
        for width in (1, 2):
            compiled_steps().static_mask(*mask_inputs(generator, rows, width, 16), dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_compiled_static_mask_is_the_eager_one_and_compiles_up_front(dtype):
    """Decodes through compiled forwards place their tokens and build their masks through `compiled_steps()`: one
    graph for each of one row or several and one new token or several, whatever the width and cache length."""
    compile_masks(dtype, batch_sizes=(1, 2))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for case in range(40):
            rows, width, columns = 1 + case % 3, 1 + case % 9, 16 + 8 * (case % 4)
            inputs = mask_inputs(generator, rows, width, columns)
            compiled, eager = compiled_steps().static_mask(*inputs, dtype), static_mask(*inputs, dtype)
            for got, expected in zip(compiled, eager):
                assert torch.equal(got, expected), (rows, width, columns)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_the_infill_decision_is_its_parts_and_compiled_is_the_eager_one():
    """`judge_infill` decides as `first_rejected`, `accept_and_correct`, `eos_offsets` and `AcceptanceProfile.add`
    do; compiled (`compiled_steps()`, as decodes through compiled forwards run it) it decides the same, from the
    graphs `warm_up_steps` compiled (one slot or several; redrafts of their own or the model's tokens)."""
    model = sharpened_model("llama", scale=4.0)
    warm_up_steps(model)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    generator = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for case in range(40):
            slots, size = 1 + case % 3, (4, 8)[case % 2]
            tokens = torch.randint(0, 6, (slots, size), generator=generator)
            counts = torch.randint(1, size, (slots,), generator=generator)
            until = torch.minimum(counts + torch.randint(1, size, (slots,), generator=generator), torch.tensor(size))
            offsets = torch.arange(size)
            checked = (offsets >= counts[:, None]) & (offsets < until[:, None])
            probability = torch.rand(slots, size, generator=generator, dtype=torch.float64)
            own, redrafts = (torch.randint(0, 6, (slots, size), generator=generator) for _ in range(2))
            redrafts = redrafts if case % 4 < 2 else None
            eos = torch.tensor([3, -1, -1] if case % 3 else [-1, -1])
            eager = judge_infill(tokens, counts, until, checked, probability, own, redrafts, eos, 0.4)
            compiled = compiled_steps().judge_infill(tokens, counts, until, checked, probability, own, redrafts, eos,
                                                     0.4)  # fmt: skip
            assert all(torch.equal(got, expected) for got, expected in zip(compiled, eager)), case
            rejected = first_rejected(counts, probability, 0.4, until)
            expected_tokens, expected_counts = accept_and_correct(
                tokens, counts, probability, own, own if redrafts is None else redrafts, 0.4, until
            )
            assert torch.equal(eager[0], expected_tokens) and torch.equal(eager[1], expected_counts)
            assert torch.equal(eager[2], eos_offsets(expected_tokens, expected_counts, eos))
            added, recorded = (AcceptanceProfile(size, "cpu") for _ in range(2))
            counts = added.add(AcceptanceProfile.REDRAFT, checked, rejected)
            recorded.record(AcceptanceProfile.REDRAFT, eager[3])
            assert torch.equal(counts, check_counts(eager[3]))
            assert counts.tolist() == [int(eager[3][0].sum()), int(eager[3][1].sum())]
            assert all(torch.equal(a, b) for a, b in zip(added.tables(), recorded.tables()))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def infill_round(generator, slots: int, size: int, vocab: int, mask_token_id: int, fused: bool = False) -> dict:
    """A random greedy infill round as `SlotDecoder` lays one out: each slot's accepted tokens (its last one fresh),
    then drafts (some the mask token) of which a window is queried, and the forward's logits: the fresh tokens' rows,
    (`fused`: then a `[MASK]` query's for each checked position,) then the queried drafts' (row-major); the text the
    slots sit in, for copied drafts."""
    counts = torch.randint(1, size, (slots,), generator=generator)
    stored = torch.minimum(counts - 1, torch.randint(0, size, (slots,), generator=generator))
    until = torch.minimum(counts + torch.randint(1, size, (slots,), generator=generator), torch.tensor(size))
    offsets = torch.arange(size)
    fresh = (offsets >= stored[:, None]) & (offsets < counts[:, None])
    checked = (offsets >= counts[:, None]) & (offsets < until[:, None])
    queried = checked & (offsets < until[:, None] - 1)
    tokens = torch.randint(0, 12, (slots, size), generator=generator)
    tokens = tokens.masked_fill(torch.rand(slots, size, generator=generator) < 0.2, mask_token_id)
    rows = int(fresh.sum() + queried.sum() + (checked.sum() if fused else 0))
    logits = 3 * torch.randn(rows, vocab, generator=generator, dtype=torch.float64)
    logits[:, :12] += 4  # the slots' tokens are likely
    text = torch.randint(0, 12, (slots * size + 20,), generator=generator)
    at = 20 + torch.arange(slots * size).view(slots, size)
    return dict(logits=logits, fresh=fresh, queried=queried, tokens=tokens, stored=stored, counts=counts, until=until,
                checked=checked, text=text, at=at)  # fmt: skip


def warmed_up_scoring() -> tuple:
    """A tiny model with `compiled_steps()` warmed up for it (with and without copied drafts): the model, its
    vocabulary size, its mask token and the count of graphs compiled so far."""
    model = sharpened_model("qwen3", scale=4.0)
    warm_up_steps(model, lookup_drafts=3)
    warm_up_steps(model)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return model, model.get_output_embeddings().weight.shape[0], model.config.mask_token_id, graphs


def test_an_infill_round_scored_whole_decides_as_its_parts_and_compiled_as_eager():
    """`score_infill` decides as the decoder's parts do, written out position by position: each checked position is
    scored by the row of the position before it (the fresh tokens' rows, then the queried drafts'); the model's own
    token and the draft's probability from `greedy_distributions` go to `judge_infill`, with, where the round is
    fused, the greedy token of each checked position's own `[MASK]` query (rows between the fresh and the queried
    ones) as its redraft; then `copy_drafts`. Compiled, it decides the same from the graphs `warm_up_steps`
    compiled."""
    model, vocab, mask_token_id, graphs = warmed_up_scoring()
    generator = torch.Generator().manual_seed(11)
    eos = torch.tensor([3, -1, -1])
    threshold = torch.tensor(0.4, dtype=torch.float64)  # as the decoder passes it (`SlotDecoder.token_threshold`)
    with torch.no_grad():
        for case in range(36):
            slots, size, drafts = 1 + case % 3, (4, 8)[case % 2], (0, 3)[case % 4 // 2]
            fused = not drafts and case % 5 < 2  # (`fused_redraft` queries no copied drafts)
            round_ = infill_round(generator, slots, size, vocab, mask_token_id, fused)
            round_["logits"] = round_["logits"].to(model.dtype)
            tokens, logits = round_["tokens"], round_["logits"]
            probabilities, greedy = decisions_refusion.greedy_distributions(logits, mask_token_id)
            checked = round_["checked"].flatten().nonzero()[:, 0] if fused else []
            order = [*round_["fresh"].flatten().nonzero()[:, 0], *checked, *round_["queried"].flatten().nonzero()[:, 0]]
            fresh_rows = int(round_["fresh"].sum())
            row_of = {int(position): row for row, position in enumerate(order) if not fresh_rows <= row < fresh_rows
                      + len(checked)}  # fmt: skip
            mask_row_of = {int(position): fresh_rows + row for row, position in enumerate(checked)}
            ar_tokens, ar_probability = tokens.clone(), torch.ones(tokens.shape, dtype=probabilities.dtype)
            redrafts = tokens.clone() if fused else None
            for slot, offset in round_["checked"].nonzero().tolist():
                row = row_of[slot * size + offset - 1]
                ar_tokens[slot, offset] = greedy[row]
                draft = int(tokens[slot, offset])
                ar_probability[slot, offset] = -1 if draft == mask_token_id else probabilities[row, draft]
                if fused:
                    redrafts[slot, offset] = greedy[mask_row_of[slot * size + offset]]
            expected = judge_infill(tokens, round_["counts"], round_["until"], round_["checked"], ar_probability,
                                    ar_tokens, redrafts, eos, 0.4)  # fmt: skip
            values = [expected[1], expected[2]]
            new_tokens = expected[0]
            if drafts:
                new_tokens, found = decisions_refusion.copy_drafts(round_["text"], round_["at"], new_tokens,
                                                                    expected[1], drafts, mask_token_id)  # fmt: skip
                values.append(found)
            values.append(check_counts(expected[3]))  # the check's drafts offered and accepted, for the host
            arguments = (
                logits, tokens, round_["stored"], round_["counts"], round_["until"], eos, mask_token_id, threshold,
                round_["text"], round_["at"], drafts, fused,
            )  # fmt: skip
            for scored in (decisions_refusion.score_infill(*arguments), compiled_steps().score_infill(*arguments)):
                assert torch.equal(scored[0], torch.cat(values)), case
                assert torch.equal(scored[1], new_tokens) and torch.equal(scored[2], expected[3]), case
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_a_verify_forward_scored_whole_decides_as_its_parts_and_compiled_as_eager():
    """`score_verify` decides as the decoder's parts do, written out position by position: offset i of each slot
    (1 up to the forward's width) is scored by the slot's row of offset i - 1; the model's own token and the draft's
    probability from `greedy_distributions` go to `judge_verify` (the plan's drafts kept after a rejection, or the
    model's tokens), then `copy_drafts`. Compiled, it decides the same from the graphs `warm_up_steps` compiled."""
    model, vocab, mask_token_id, graphs = warmed_up_scoring()
    generator = torch.Generator().manual_seed(12)
    eos = torch.tensor([3, -1, -1])
    threshold = torch.tensor(0.4, dtype=torch.float64)
    with torch.no_grad():
        for case in range(24):
            slots, size, drafts = 1 + case % 3, (4, 8)[case % 2], (0, 3)[case % 4 // 2]
            width = 1 + (case * 5) % size  # the leading tokens of each slot in the forward, 1 .. size
            keep = torch.tensor(case % 3 == 1)
            tokens = torch.randint(0, 12, (slots, size), generator=generator)
            tokens = tokens.masked_fill(torch.rand(slots, size, generator=generator) < 0.2, mask_token_id)
            logits = 3 * torch.randn(slots, width, vocab, generator=generator, dtype=torch.float64)
            logits[..., :12] += 4  # the slots' tokens are likely
            logits = logits.to(model.dtype)
            text = torch.randint(0, 12, (slots * size + 20,), generator=generator)
            at = 20 + torch.arange(slots * size).view(slots, size)
            probabilities, greedy = decisions_refusion.greedy_distributions(logits.flatten(0, 1), mask_token_id)
            ar_tokens, ar_probability = tokens.clone(), torch.ones(tokens.shape, dtype=probabilities.dtype)
            scored = torch.zeros(slots, size, dtype=torch.bool)
            for slot in range(slots):
                for offset in range(1, min(width + 1, size)):
                    row, draft = slot * width + offset - 1, int(tokens[slot, offset])
                    scored[slot, offset] = True
                    ar_tokens[slot, offset] = greedy[row]
                    ar_probability[slot, offset] = -1 if draft == mask_token_id else probabilities[row, draft]
            values, new_tokens, marks = judge_verify(tokens, scored, ar_probability, ar_tokens, eos, 0.4, keep)
            if drafts:
                new_tokens, found = decisions_refusion.copy_drafts(text, at, new_tokens, values[2], drafts,
                                                                    mask_token_id)  # fmt: skip
                values.append(found)
            values.append(check_counts(marks))
            arguments = (logits, tokens, eos, mask_token_id, threshold, keep, text, at, drafts)
            for decided in (decisions_refusion.score_verify(*arguments), compiled_steps().score_verify(*arguments)):
                assert torch.equal(decided[0], torch.cat(values)), case
                assert torch.equal(decided[1], new_tokens) and torch.equal(decided[2], marks), case
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_a_plan_scored_whole_picks_and_chooses_as_its_parts_and_compiled_as_eager():
    """`score_plan` drafts and chooses as the decoder's parts do: each slot's greedy drafts and the probability of its
    first from `greedy_distributions`, `choose_slots` (and for one-token slots which drafts are EOS), then
    `copy_drafts` after the first token. Compiled, it decides the same from the graphs `warm_up_steps` compiled."""
    model, vocab, mask_token_id, graphs = warmed_up_scoring()
    generator = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for case in range(20):
            slots, size = 1 + case % 3, 1 if case >= 16 else (4, 8)[case % 2]  # (one-token slots last)
            copies = (0, 3)[case % 4 // 2] if size > 1 else 0
            width, threshold = (1, size)[case % 8 // 4], (0.9, 0.3)[case % 3 == 0]
            drafts = torch.randint(0, 12, (slots, size), generator=generator)
            logits = 3 * torch.randn(slots, width, vocab, generator=generator, dtype=torch.float64)
            logits[..., :12] += 4
            logits = logits.to(model.dtype)
            text = torch.randint(0, 12, (slots * size + 20,), generator=generator)
            at = 20 + torch.arange(slots * size).view(slots, size)
            probabilities, greedy = decisions_refusion.greedy_distributions(logits.flatten(0, 1), mask_token_id)
            expected = drafts.clone()
            expected[:, :width] = greedy.view(slots, width)
            first = probabilities.gather(1, greedy[:, None])[:, 0].view(slots, width)[:, 0]
            eos = torch.tensor([int(greedy[0]), -1, -1])  # (the first slot's draft is an EOS)
            values = [choose_slots(first, threshold).long()]
            if size == 1:  # one-token slots: which drafts are EOS
                values.append(torch.isin(expected[:, 0], eos).long())
            if copies:
                ones = torch.ones(slots, dtype=torch.long)
                expected, found = decisions_refusion.copy_drafts(text, at, expected, ones, copies, mask_token_id)
                values.append(found)
            arguments = (logits, drafts, eos, mask_token_id, torch.tensor(threshold, dtype=torch.float64), text, at,
                         copies)  # fmt: skip
            for decided in (decisions_refusion.score_plan(*arguments), compiled_steps().score_plan(*arguments)):
                assert torch.equal(decided[0], torch.cat(values)) and torch.equal(decided[1], expected), case
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_the_verify_decision_accepts_the_leading_passing_drafts_and_corrects_the_first_rejected_one():
    tokens = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8]])
    scored = torch.tensor([[False, True, True, False]] * 2)  # a forward of two tokens a slot: offsets 1 and 2
    ar_probability = torch.tensor([[1.0, 0.9, 0.2, 1.0], [1.0, 0.9, 0.8, 1.0]])
    ar_tokens = torch.tensor([[5, 6, 17, 8], [5, 6, 7, 8]])
    eos = torch.tensor([7, -1, -1])
    values, new_tokens, marks = judge_verify(tokens, scored, ar_probability, ar_tokens, eos, 0.5)
    assert [value.tolist() for value in values] == [[2, 3], [4, 2]] and torch.equal(new_tokens, tokens)
    # offered: the scored drafts up to the first rejected one (2 + 2); accepted: those before it (1 + 2)
    assert marks.sum(dim=(1, 2)).tolist() == [4, 3]
    values, new_tokens, _ = judge_verify(tokens, scored, ar_probability, ar_tokens, eos, 0.5, torch.tensor(False))
    # the fast rule: slot 0 takes the model's 17 at offset 2 and stops there (3 counted); slot 1 passed its whole window
    assert values[2].tolist() == [3, 3] and new_tokens.tolist() == [[5, 6, 17, 8], [5, 6, 7, 8]]
    assert values[3].tolist() == [4, 2]  # slot 1's accepted 7 is an EOS


@pytest.mark.parametrize("options", [dict(repetition_penalty=1.5), dict(do_sample=True, top_k=5)])
def test_compiled_decodes_with_logits_processors_or_sampling_give_the_eager_tokens(options):
    model = sharpened_model("qwen2", scale=4.0)
    settings = dict(
        max_new_tokens=12, slot_size=4, block_length=8, slot_threshold=0.5, token_threshold=0.3, eos_token_id=[],
        pad_token_id=0, cache_implementation="static", compile_config=compile_config(), **options,
    )  # fmt: skip
    torch.manual_seed(0)
    eager = model.generate(PROMPT, **{**settings, "compile_config": None})
    columns = static_cache_columns(PROMPT.shape[1], 12, 4, 8)
    compile_forwards(model, settings["compile_config"], 1, columns)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch.manual_seed(0)
    assert torch.equal(model.generate(PROMPT, **settings), eager)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # the decode compiled nothing


def test_a_compiled_backbone_holds_more_graphs_than_dynamos_default_limit():
    """Width buckets x cache lengths pass dynamo's default of 8 graphs per function, past which a `fullgraph` compile
    fails; a decode after them still gives the eager tokens."""
    model = sharpened_model("mistral", scale=4.0)
    config = compile_config()
    for columns in (128, 256, 384):  # 12 graphs
        compile_forwards(model, config, 1, columns)
        del model._refusion_slot_cache  # the next compiles over a cache of its own length
    settings = dict(max_new_tokens=12, slot_size=4, block_length=8, eos_token_id=[], pad_token_id=0)
    eager = model.generate(PROMPT, cache_implementation="static", **settings)
    assert torch.equal(model.generate(PROMPT, cache_implementation="static", compile_config=config, **settings), eager)


def test_priced_compiled_decodes_run_narrow_forwards_in_narrow_buckets_and_give_the_eager_tokens(monkeypatch):
    model = sharpened_model("llama", scale=4.0)
    steep = {1: 1.0, 2: 1.9, 4: 3.8, 8: 7.5, 16: 15.0, 32: 30.0, 64: 60.0}  # width is dear: one query per slot
    settings = dict(
        max_new_tokens=12, slot_size=4, block_length=8, slot_threshold=0.5, token_threshold=0.5, fused_redraft=True,
        eos_token_id=[], pad_token_id=0, draft_schedule="price", forward_prices=steep, cache_implementation="static",
        compile_config=compile_config(),
    )  # fmt: skip
    eager = model.generate(PROMPT, **{**settings, "compile_config": None})
    columns = static_cache_columns(PROMPT.shape[1], 12, 4, 8)
    compile_forwards(model, settings["compile_config"], 1, columns, draft_schedule="price")
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    widths, run_model = [], executor_refusion.run_model

    def recorded(model, compiled, batch, *args):
        widths.append(batch["ids"].shape[1] if compiled is not None else None)
        return run_model(model, compiled, batch, *args)

    monkeypatch.setattr(executor_refusion, "run_model", recorded)
    assert torch.equal(model.generate(PROMPT, **settings), eager)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # every bucket was compiled before
    assert set(widths) - {None} <= set(NARROW_BUCKETS + WIDTH_BUCKETS)
    assert min(width for width in widths if width is not None) < WIDTH_BUCKETS[0]  # narrow forwards ran narrow
    assert 1 in widths
    # where two queries are priced cheaper than one, one-query forwards run padded to two: the same tokens
    dip = {**steep, 1: 2.5}
    eager = model.generate(PROMPT, **{**settings, "compile_config": None, "forward_prices": dip})
    widths.clear()
    assert torch.equal(model.generate(PROMPT, **{**settings, "forward_prices": dip}), eager)
    assert 1 not in widths and 2 in widths
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    # a measured table that prices one query above two (measured on a busy machine, say): the decode runs a one-query
    # forward at its own width once, to see what it costs (which forwards follow depends on the times seen:
    # test_price_schedule); the same tokens
    monkeypatch.setattr(prices_refusion, "measure_forward_prices", lambda *args, **kwargs: dict(dip))
    widths.clear()
    measured = {name: value for name, value in settings.items() if name != "forward_prices"}
    assert torch.equal(model.generate(PROMPT, **measured), eager)
    assert 1 in widths and 2 in widths
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@pytest.mark.skipif(not kernels_refusion.onednn_available(), reason="this PyTorch has no oneDNN on this CPU")
def test_the_prompt_runs_eagerly_at_its_own_width_where_prepacked_kernels_serve_it_cheaper(monkeypatch):
    model = sharpened_model("qwen3", scale=4.0).float()  # oneDNN packs float32, not float64
    graph_dearer = lambda *args, **kwargs: (0.001, 1.0)  # noqa: E731 (seconds a token eagerly, the graph's forward)
    monkeypatch.setattr(executor_refusion, "prompt_prices", graph_dearer)
    settings = dict(
        max_new_tokens=12, slot_size=4, block_length=8, slot_threshold=0.5, token_threshold=0.3, eos_token_id=[],
        pad_token_id=0, cache_implementation="static", compile_config=compile_config(),
    )  # fmt: skip
    eager = model.generate(PROMPT, **{**settings, "compile_config": None})
    forwards, run_model = [], executor_refusion.run_model

    def recorded(model, compiled, batch, *args):
        forwards.append((batch["ids"].shape[1], compiled is not None))
        return run_model(model, compiled, batch, *args)

    monkeypatch.setattr(executor_refusion, "run_model", recorded)
    first = PROMPT.shape[1] + 8  # the prompt and the plan of the first block's two slots
    assert torch.equal(model.generate(PROMPT, **settings), eager)
    assert forwards[0] == (pad_width(first, WIDTH_BUCKETS), True)  # plain layers: padded to a compiled bucket
    kernels_refusion.prepack_linears(model, {torch.float32: first})  # packed from the prompt's width on
    forwards.clear()
    assert torch.equal(model.generate(PROMPT, **settings), eager)
    assert forwards[0] == (first, False) and all(compiled for _, compiled in forwards[1:])
    monkeypatch.setattr(executor_refusion, "prompt_prices", lambda *args, **kwargs: (1.0, 0.001))
    model._refusion_prompt_prices.clear()  # measured again: the graph is cheaper now
    forwards.clear()
    assert torch.equal(model.generate(PROMPT, **settings), eager)
    assert forwards[0] == (pad_width(first, WIDTH_BUCKETS), True)
    monkeypatch.setattr(executor_refusion, "prompt_prices", graph_dearer)
    model._refusion_prompt_prices.clear()
    kernels_refusion.prepack_linears(model, {torch.float32: first + 1})  # narrower than the packs' rows: compiled
    forwards.clear()
    assert torch.equal(model.generate(PROMPT, **settings), eager)
    assert forwards[0] == (pad_width(first, WIDTH_BUCKETS), True)


@pytest.mark.skipif(not kernels_refusion.onednn_available(), reason="this PyTorch has no oneDNN on this CPU")
def test_the_prompts_path_is_measured_once_per_bucket_and_prorated_by_width(monkeypatch):
    model = sharpened_model("qwen3", scale=4.0).float()
    kernels_refusion.prepack_linears(model, {torch.float32: 1})
    timed = []

    def fake(model, compiled, cache, width, num_logits):  # eagerly 1 ms a token, 30 ms a graph forward
        timed.append((width, compiled is not None))
        return 0.03 if compiled is not None else 0.001 * width

    monkeypatch.setattr(executor_refusion, "timed_forward", fake)
    cache, backbone = SlotCache(model, 1, 128), object()
    runs_eagerly = executor_refusion.prompt_runs_eagerly
    assert runs_eagerly(model, backbone, cache, 20, WIDTH_BUCKETS)  # 20 ms eagerly, 30 in the graph of 32
    assert timed == [(20, False), (32, True)] * 3  # a warm-up and two timed forwards each, in turn
    assert runs_eagerly(model, backbone, cache, 29, WIDTH_BUCKETS)
    assert not runs_eagerly(model, backbone, cache, 31, WIDTH_BUCKETS)  # 31 ms, prorated from 20 tokens' price
    assert len(timed) == 6  # measured once for the bucket
    assert not runs_eagerly(model, backbone, cache, 40, WIDTH_BUCKETS) and len(timed) == 12  # the bucket of 64
    walks, packed_for = [], executor_refusion.packed_for
    monkeypatch.setattr(executor_refusion, "packed_for", lambda *args: walks.append(args[1]) or packed_for(*args))
    assert not runs_eagerly(model, backbone, cache, 40, WIDTH_BUCKETS) and not walks  # known: the graph, no walk
    assert runs_eagerly(model, backbone, cache, 20, WIDTH_BUCKETS) and walks == [20]  # eager only if packed for it
    assert runs_eagerly(model, backbone, cache, 100, WIDTH_BUCKETS) and len(timed) == 12  # past the buckets: eager
    assert not runs_eagerly(model, None, cache, 20, WIDTH_BUCKETS)  # not compiled: nothing to choose
    kernels_refusion.prepack_linears(model, {torch.float32: 50})
    assert not runs_eagerly(model, backbone, cache, 20, WIDTH_BUCKETS)  # not prepacked for 20 rows: the graph


def test_compiled_decodes_with_frozen_weights_give_the_eager_tokens_and_follow_a_weight_change():
    """Inductor's weight freezing (asked for in the compile options, beside a mode) makes the weights constants of
    the graphs: a decode gives the eager tokens, also over a new cache of the same shape; after a weight is replaced,
    the graphs compiled before would decode with the old weight, and the next decode compiles afresh instead."""
    model = sharpened_model("llama", scale=4.0)
    frozen = CompileConfig(fullgraph=True, dynamic=False, mode="default", options={"freezing": True})
    settings = dict(
        max_new_tokens=12, slot_size=4, block_length=8, slot_threshold=0.5, token_threshold=0.3, eos_token_id=[],
        pad_token_id=0, cache_implementation="static", compile_config=frozen,
    )  # fmt: skip
    eager = model.generate(PROMPT, **{**settings, "compile_config": None})
    assert torch.equal(model.generate(PROMPT, **settings), eager)
    del model._refusion_slot_cache  # a new cache of the same shape: the graphs take it as an input, not a constant
    assert torch.equal(model.generate(PROMPT, **settings), eager)
    layer = model.model.layers[0].mlp.down_proj
    layer.weight.data = layer.weight.data * -3.0  # the same parameter, new memory
    changed = model.generate(PROMPT, **{**settings, "compile_config": None})
    assert not torch.equal(changed, eager)  # the change matters to the answer
    config, _, saved, owner, attention, old_graphs = model._refusion_compiled
    model._refusion_compiled = (
        config, compiling_refusion.frozen_weights(model, frozen), saved, owner, attention, old_graphs
    )  # fmt: skip
    assert torch.equal(model.generate(PROMPT, **settings), eager)  # the weights were frozen: the old graphs are stale
    del model._refusion_compiled
    model.generate(PROMPT, **settings)  # a first backbone over these weights, then a weight change again:
    layer.weight.data = layer.weight.data * -1.0
    restored = model.generate(PROMPT, **{**settings, "compile_config": None})
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert torch.equal(model.generate(PROMPT, **settings), restored)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs  # compiled again with the new weights
    assert compiling_refusion.frozen_weights(model, frozen) == model._refusion_compiled[1]


def causal_forward(model, compiled, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What `compiled` returns for `width` new causal tokens after a 6-token past over a fresh static cache, and the
    logits `run_model` makes of them."""
    cache = SlotCache(model, 1, 128)
    layout = StaticLayout(cache, 1, model.device)
    ids = torch.arange(3, 3 + 6 + width)[None] % model.config.get_text_config(decoder=True).vocab_size
    outputs = []
    for run_with, span in ((None, slice(0, 6)), (compiled, slice(6, 6 + width))):
        ranks = torch.arange(span.start, span.stop)[None]
        batch = dict(ids=ids[:, span], positions=ranks, ranks=ranks, prefixes=ranks, groups=torch.zeros_like(ranks),
                     parents=torch.full_like(ranks, NO_GROUP))  # fmt: skip
        mask = layout.mask(batch, [ranks.shape[1]], model.dtype)
        outputs.append(run_model(model, run_with, batch, mask, cache, ranks.shape[1]))
        layout.keep(batch, [ranks.shape[1]], [ranks.shape[1]])
    inputs = dict(input_ids=batch["ids"], position_ids=batch["positions"], attention_mask=mask, cache=cache)
    layout.pointers = [6]  # the same forward again, straight through the compiled backbone
    mask = layout.mask(batch, [width], model.dtype)
    return compiled(**{**inputs, "attention_mask": mask}, use_cache=True), outputs[1]


def test_frozen_graphs_of_narrow_widths_end_with_the_output_layer():
    """With frozen weights a compiled forward of up to `LOGITS_IN_GRAPH_WIDTH` new tokens returns their logits (the
    output layer inside the graph, where inductor packs its weight), a wider one hidden states for the eager output
    layer; unfrozen graphs always return hidden states. `run_model` gives the eager logits either way."""
    model = sharpened_model("qwen2", scale=4.0)
    frozen = CompileConfig(fullgraph=True, dynamic=False, mode="default", options={"freezing": True})
    text = model.config.get_text_config(decoder=True)
    vocab, hidden = text.vocab_size, text.hidden_size
    assert vocab != hidden
    for config, logits_width in ((frozen, LOGITS_IN_GRAPH_WIDTH), (compile_config(), 0)):
        model.__dict__.pop("_refusion_compiled", None)
        compiled = compiling_refusion.compiled_backbone(model, config)
        assert compiled.logits_width == logits_width
        for width in (NARROW_BUCKETS[-1], WIDTH_BUCKETS[1]):
            output, logits = causal_forward(model, compiled, width)
            assert output.shape[-1] == (vocab if width <= logits_width else hidden)
            eager = model(input_ids=(torch.arange(3, 3 + 6 + width)[None] % vocab)).logits[:, -width:]
            torch.testing.assert_close(logits, eager, rtol=1e-4, atol=1e-4)


def test_without_freezing_a_weight_change_reuses_the_compiled_graphs():
    """Unfrozen graphs read the weights at every call: a changed weight needs no new compile (and gets none)."""
    assert not compiling_refusion.freezes_weights(compile_config())
    model = sharpened_model("qwen3", scale=4.0)
    settings = dict(
        max_new_tokens=12, slot_size=4, block_length=8, eos_token_id=[], pad_token_id=0, cache_implementation="static",
        compile_config=compile_config(),
    )  # fmt: skip
    model.generate(PROMPT, **settings)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(-3.0)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    expected = model.generate(PROMPT, **{**settings, "compile_config": None})
    assert torch.equal(model.generate(PROMPT, **settings), expected)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_module_tensors_are_the_models_parameters_and_buffers_in_a_fixed_order():
    model = sharpened_model("llama", scale=4.0)
    model.register_buffer("nothing", None)  # registered as None: not a tensor
    tensors = compiling_refusion.module_tensors(model)
    assert {id(tensor) for tensor in tensors} == {id(tensor) for tensor in [*model.parameters(), *model.buffers()]}
    assert [id(tensor) for tensor in compiling_refusion.module_tensors(model)] == [id(tensor) for tensor in tensors]
