"""`draft_schedule="price"`: each verify or infill forward takes the number of drafts per slot (0 up to
`draft_window`) that earns most expected tokens per price, from a table of what a forward of each width costs
(`forward_prices`, the caller's or measured once and kept) and the acceptance the decode has seen. The decisions
are exact: the same tokens cached, static, recomputed, batched and alone, for a given table."""

import json
import math
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from test_batching import PROMPTS, assert_exact_everywhere, left_padded
from test_generation import PROMPT, sharpened_model
from transformers import CompileConfig

import compiling_refusion
import executor_refusion
import prices_refusion
from acceptance_refusion import AcceptanceProfile
from decisions_refusion import best_window, expected_tokens, passes
from executor_refusion import SlotCache
from prices_refusion import ForwardPrices, price_key
from settings_refusion import check_decoding

ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3"]
FLAT = {1: 1.0, 64: 1.0}  # width is free: the widest window pays best
LINEAR = {1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0, 16: 16.0, 32: 32.0}  # every query costs as much as the first
STEEP = {1: 1.0, 2: 50.0, 64: 5000.0}  # a second query costs 50: no draft pays
SETTINGS = dict(
    max_new_tokens=24, slot_size=4, block_length=8, slot_threshold=0.5, token_threshold=0.3, eos_token_id=[],
    pad_token_id=0, return_dict_in_generate=True,
)  # fmt: skip
MEASURED = dict(
    SETTINGS, token_threshold=0.5
)  # a measured table prices greedy decodes only where it cannot change them


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model(request):
    return sharpened_model(request.param, scale=4.0)


def forward_queries(model, call) -> list[int]:
    """The queries (the tokens whose logits are kept) of every forward `call()` runs, eagerly over a dynamic cache."""
    queries = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: queries.append(kwargs["logits_to_keep"]), with_kwargs=True
    )
    try:
        call()
    finally:
        handle.remove()
    return queries


# ---- the pure decision -----------------------------------------------------------------------------------------
def test_expected_tokens_count_the_first_check_and_each_passing_run():
    assert expected_tokens(0.5, 0) == 1
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(0.0, 5) == 1 and expected_tokens(1.0, 3) == 4


def test_free_width_takes_every_draft_and_dear_width_takes_none():
    widths = [2 + 2 * k for k in range(8)]  # two fresh tokens, two slots taking k drafts each
    assert best_window(ForwardPrices(FLAT), 0.4, widths) == 7
    assert best_window(ForwardPrices(STEEP), 0.9, widths) == 0
    assert best_window(ForwardPrices(LINEAR), 0.4, widths) == 0  # a draft earns 0.4 tokens, costs one query


def test_the_window_grows_with_the_acceptance_rate_and_ties_take_the_fewest():
    prices = ForwardPrices({1: 1.0, 2: 1.2, 4: 1.6, 8: 2.6, 16: 5.0})
    widths = [1 + k for k in range(8)]
    chosen = [best_window(prices, rate, widths) for rate in (0.0, 0.3, 0.6, 0.9, 0.99)]
    assert chosen == sorted(chosen) and chosen[0] == 0 and chosen[-1] > chosen[1]
    assert best_window(ForwardPrices(FLAT), 0.0, widths) == 0  # nothing passes: more drafts earn nothing
    # the verify forward's first token is free: it shifts the value of every window alike
    assert best_window(prices, 0.6, widths, free=1.0) <= best_window(prices, 0.6, widths)


def test_prices_interpolate_prorate_and_pad_to_the_compiled_buckets():
    prices = ForwardPrices({"2": 2.0, 4: 6.0, 8: 8.0})  # a JSON file's keys are strings
    assert [prices(width) for width in (1, 2, 3, 4, 6, 8, 16)] == [2.0, 2.0, 4.0, 6.0, 7.0, 8.0, 16.0]
    compiled = ForwardPrices({8: 5.0, 16: 6.0, 32: 9.0, 64: 12.0}, buckets=(8, 16, 32, 64))
    assert [compiled(width) for width in (1, 8, 9, 16, 17, 64, 128)] == [5.0, 5.0, 6.0, 6.0, 9.0, 12.0, 24.0]
    narrow = ForwardPrices({1: 1.0, 2: 2.0, 4: 3.0, 8: 4.0}, buckets=(1, 2, 4, 8))
    assert [narrow(width) for width in (1, 2, 3, 5, 8)] == [1.0, 2.0, 3.0, 4.0, 4.0]
    noisy = ForwardPrices({1: 6.8, 8: 6.8, 16: 6.6, 32: 6.5, 64: 9.8})  # a width measured dearer than a wider one
    assert [noisy(width) for width in (1, 8, 16, 32, 64)] == [6.5, 6.5, 6.5, 6.5, 9.8]


def test_a_measured_table_takes_widths_within_a_few_percent_of_the_narrowest_as_free():
    table = {1: 10.0, 2: 10.3, 4: 10.7, 8: 11.5, 16: 15.0}  # 4 is within PRICE_FREE (8%) of 1, 8 is not
    measured, given = ForwardPrices(table, key="measured"), ForwardPrices(table)
    assert [measured(width) for width in (1, 2, 3, 4, 8, 16)] == [10.0, 10.0, 10.0, 10.0, 11.5, 15.0]
    assert [given(width) for width in (2, 4)] == [10.3, 10.7]  # the caller's table is taken as given
    # where drafts earn little, the measured table still takes every draft a free width holds; the caller's does not
    widths = [1, 2, 3, 4, 5]
    assert best_window(measured, 0.05, widths) == 3 and best_window(given, 0.05, widths) == 1
    measured.observe(4, 0.7 * 10.7)  # its staleness is still judged against what was measured
    assert measured.stale() == (4, pytest.approx(7.49))


def test_a_forward_runs_at_the_cheapest_bucket_as_wide_as_it():
    table, buckets = {1: 17.2, 2: 14.5, 4: 14.4, 8: 47.5, 16: 74.6}, (1, 2, 4, 8, 16, 32)
    widths = (1, 2, 3, 4, 5, 16, 32, 40)
    dip = ForwardPrices(table, buckets)  # the caller's table
    assert [dip.run_width(width) for width in widths] == [4, 4, 4, 4, 8, 16, 32, 40]
    assert [dip(width) for width in (1, 2, 4)] == [14.4, 14.4, 14.4]  # priced as run
    tie = ForwardPrices({1: 2.0, 2: 1.0, 4: 1.0}, buckets=(1, 2, 4))
    assert tie.run_width(1) == 2  # the narrower of equal prices
    assert ForwardPrices({1: 2.0, 2: 1.0}).run_width(1) == 1  # eager (no buckets): forwards run as they are
    assert ForwardPrices({1: 2.0, 64: 1.0}, buckets=(1, 2, 4, 64)).run_width(2) == 2  # 2 not measured: its bucket
    # a measured table's bucket runs once at its own width before it is padded, and unpadded once seen cheaper
    measured = ForwardPrices(table, buckets, key="measured")
    assert [measured.run_width(width) for width in widths] == [1, 2, 4, 4, 8, 16, 32, 40]
    assert [measured.run_width(width) for width in widths] == [4, 4, 4, 4, 8, 16, 32, 40]
    measured.observe(1, 19.0)  # as dear as measured: still padded
    assert measured.run_width(1) == 4
    measured.observe(1, 12.0)  # a decode saw it cheaper than the bucket it was padded to
    assert measured.run_width(1) == 1 and measured.run_width(2) == 4


def test_the_acceptance_rate_starts_at_one_half_and_follows_the_checks_the_host_read():
    profile = AcceptanceProfile(4, "cpu")
    assert profile.rate(AcceptanceProfile.PLAN) == 0.5
    checked = torch.tensor([[False, True, True, True]])
    counts = profile.add(AcceptanceProfile.PLAN, checked, torch.tensor([3]))  # offsets 1, 2 pass, 3 fails
    assert counts.tolist() == [3, 2]
    assert profile.rate(AcceptanceProfile.PLAN) == 0.5  # the host has not read the check yet
    profile.read(AcceptanceProfile.PLAN, counts.tolist())
    assert profile.known == [3, 2, 0, 0]
    assert profile.rate(AcceptanceProfile.PLAN) == pytest.approx((2 + 1) / (3 + 2))
    assert profile.rate(AcceptanceProfile.REDRAFT) == 0.5


def test_the_prior_is_the_rate_before_any_check_and_weighs_as_two_drafts():
    profile = AcceptanceProfile(4, "cpu", prior=0.1)
    assert profile.rate(AcceptanceProfile.PLAN) == pytest.approx(0.1)
    counts = profile.add(AcceptanceProfile.PLAN, torch.tensor([[False, True, True, True]]), torch.tensor([3]))
    profile.read(AcceptanceProfile.PLAN, counts.tolist())
    assert profile.rate(AcceptanceProfile.PLAN) == pytest.approx((2 + 0.2) / (3 + 2))
    assert profile.rate(AcceptanceProfile.REDRAFT) == pytest.approx(0.1)


def test_the_prior_is_a_fast_rule_setting_between_zero_and_one():
    assert check_decoding({})["draft_prior"] == 0.5
    assert check_decoding({"draft_prior": 0})["draft_prior"] == 0
    assert check_decoding({}, {"infill_mode": "reference", "draft_prior": 0.1})["draft_prior"] == 0.5
    with pytest.raises(ValueError, match=r"draft_prior must be a number in \[0, 1\], got 1.5"):
        check_decoding({"draft_prior": 1.5})
    with pytest.raises(ValueError, match="draft_prior=0.1 and infill_mode='reference' were both passed"):
        check_decoding({"draft_prior": 0.1, "infill_mode": "reference"})


@pytest.mark.parametrize(
    ("prices", "message"),
    [
        ({}, "got {}"),
        ([1.0, 2.0], "got [1.0, 2.0]"),
        ({0: 1.0}, "width 0 is not a positive integer"),
        ({"eight": 1.0}, "width 'eight' is not a positive integer"),
        ({True: 1.0}, "width True is not a positive integer"),
        ({1: -0.5}, "the price of width 1 (-0.5) is not a positive finite number"),
        ({1: math.inf}, "the price of width 1 (inf) is not a positive finite number"),
        ({1: "fast"}, "the price of width 1 ('fast') is not a positive finite number"),
        ({1: math.nan}, "the price of width 1 (nan) is not a positive finite number"),
        ({1: 10**400}, "is not a positive finite number"),
        ({"\u00b2": 1.0}, "width '\u00b2' is not a positive integer"),  # a digit to `str.isdigit`, not to `int`
    ],
)
def test_bad_prices_are_refused_naming_the_option(prices, message):
    model = sharpened_model("llama", scale=4.0)
    with pytest.raises(ValueError, match="forward_prices must map forward widths") as error:
        model.generate(PROMPT, draft_schedule="price", forward_prices=prices, **SETTINGS)
    assert message in str(error.value)


def test_the_schedule_is_a_fast_rule_setting_with_two_values():
    assert check_decoding({})["draft_schedule"] == "fixed"
    assert check_decoding({}, {"infill_mode": "reference", "draft_schedule": "price"})["draft_schedule"] == "fixed"
    assert check_decoding({"draft_schedule": None})["draft_schedule"] == "fixed"
    with pytest.raises(ValueError, match="draft_schedule must be 'fixed' or 'price', got 'auto'"):
        check_decoding({"draft_schedule": "auto"})
    with pytest.raises(ValueError, match="draft_schedule='price' and infill_mode='reference' were both passed"):
        check_decoding({"draft_schedule": "price", "infill_mode": "reference"})


# ---- decoding with a schedule ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fused_redraft", [False, True])
@pytest.mark.parametrize("prices", [LINEAR, STEEP], ids=["linear", "steep"])
def test_priced_decoding_is_exact_static_recomputed_batched_and_alone(model, fused_redraft, prices):
    settings = dict(SETTINGS, draft_schedule="price", forward_prices=prices, fused_redraft=fused_redraft)
    assert_exact_everywhere(model, settings)


@pytest.mark.parametrize("fused_redraft", [False, True])
@pytest.mark.parametrize("window", [None, 2])
def test_free_width_decodes_as_the_fixed_window(model, fused_redraft, window):
    settings = dict(SETTINGS, fused_redraft=fused_redraft, draft_window=window)
    fixed = model.generate(PROMPT, **settings)
    priced = model.generate(PROMPT, draft_schedule="price", forward_prices=FLAT, **settings)
    assert torch.equal(priced.sequences, fixed.sequences)
    assert priced.num_forward_passes == fixed.num_forward_passes


@pytest.mark.parametrize("fused_redraft", [False, True])
def test_dear_width_leaves_one_query_per_slot_in_every_forward(model, fused_redraft):
    settings = dict(SETTINGS, fused_redraft=fused_redraft)
    slots_per_block, size = SETTINGS["block_length"] // SETTINGS["slot_size"], SETTINGS["slot_size"]
    fixed = forward_queries(model, lambda: model.generate(PROMPT, **settings))
    priced = forward_queries(
        model, lambda: model.generate(PROMPT, draft_schedule="price", forward_prices=STEEP, **settings)
    )
    # no draft pays: plans draft each masked slot's first token only (which chooses the slots), verify and infill
    # forwards query one token per slot (a first infill round also recomputes the verified token in the slot's own
    # context); the fixed window plans whole slots and checks wider
    assert max(priced) <= 2 * slots_per_block < slots_per_block * size
    assert max(fixed) >= slots_per_block * size
    assert sum(priced) < sum(fixed)


@pytest.mark.parametrize("threshold", [0.0, 0.3])
def test_undrafted_positions_never_pass_even_at_threshold_zero(model, threshold):
    settings = dict(SETTINGS, token_threshold=threshold, draft_schedule="price", forward_prices=STEEP)
    ids, mask = left_padded(PROMPTS)
    answers = model.generate(ids, attention_mask=mask, **settings).sequences[:, ids.shape[1] :]
    assert not (answers == model.config.mask_token_id).any()
    assert not passes(torch.tensor([-1.0]), 0.0).any() and passes(torch.tensor([0.0]), 0.0).all()


# ---- the price table: measured once, kept, overridable ---------------------------------------------------------
def test_measured_prices_are_kept_in_the_file_and_read_back(tmp_path, monkeypatch):
    path = tmp_path / "prices.json"
    monkeypatch.setenv("REFUSION_PRICE_CACHE", str(path))
    model = sharpened_model("qwen2", scale=4.0)
    first = model.generate(PROMPT, draft_schedule="price", **MEASURED)
    (key, table), *others = json.loads(path.read_text()).items()
    assert not others and "torch.float64" in key and "eager" in key
    widths = [int(width) for width in table]  # measuring may stop early: a prefix of the widths, two at least
    assert len(widths) >= 2 and widths == list(prices_refusion.PRICE_WIDTHS[: len(widths)])
    assert all(price > 0 for price in table.values())

    def refuse(*args, **kwargs):
        raise AssertionError("the kept prices should have been used")

    monkeypatch.setattr(prices_refusion, "measure_forward_prices", refuse)
    fresh = sharpened_model("qwen2", scale=4.0)  # a new model object: nothing kept on it
    again = fresh.generate(PROMPT, draft_schedule="price", **MEASURED)
    same = fresh.generate(PROMPT, draft_schedule="price", forward_prices=table, **MEASURED)
    assert torch.equal(again.sequences, same.sequences)
    assert torch.equal(first.sequences, again.sequences)  # the table in force was the measured one


ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu avx2 avx512f avx512_bf16

processor\t: 1
cpu family\t: 25
model\t\t: 17
model name\t: (the first processor's name counts)
flags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile
"""


def test_processors_a_virtual_machine_names_alike_get_names_of_their_own():
    """Price tables and packages are keyed by the processor's name: a Zen 4 and a Zen 5 that a virtual machine both
    calls "AMD EPYC" differ by family and model; AMX tiles are named; the first processor's fields are read."""
    zen5 = ZEN4.replace("cpu family\t: 25", "cpu family\t: 26").replace("model\t\t: 17", "model\t\t: 2")
    amx = "cpu family\t: 6\nmodel\t\t: 143\nmodel name\t: Intel(R) Xeon(R) Platinum\nflags\t\t: avx512f amx_tile\n"
    names = [compiling_refusion.processor_name(info) for info in (ZEN4, zen5, amx)]
    assert names == [
        "AMD EPYC (family 25, model 17)", "AMD EPYC (family 26, model 2)",
        "Intel(R) Xeon(R) Platinum (family 6, model 143) AMX",
    ]  # fmt: skip
    assert compiling_refusion.processor_name("flags\t: avx2 not_amx_tile\n") == compiling_refusion.platform.machine()
    assert compiling_refusion.cpu_name() in compiling_refusion.device_name(sharpened_model("qwen2", scale=4.0))


class FakeForwards:
    """Forwards that take `cost(width)` seconds on a clock of their own (the module's `time.perf_counter`), the
    widths run recorded."""

    def __init__(self, monkeypatch, cost):
        self.now, self.cost, self.widths, self.logits = 0.0, cost, [], []
        monkeypatch.setattr(executor_refusion, "time", type("Clock", (), {"perf_counter": lambda: self.now}))
        monkeypatch.setattr(executor_refusion, "run_model", self)

    def __call__(self, model, compiled, batch, mask, cache, num_logits):
        width = batch["ids"].shape[1]
        self.widths.append(width)
        self.logits.append(num_logits)
        self.now += self.cost(width, len(self.widths))
        return torch.zeros(1)


def measure(model, batch_size=1, **kwargs):
    return prices_refusion.measure_forward_prices(model, SlotCache(model, batch_size, 128), **kwargs)


def test_measuring_stops_where_width_has_no_economy_left_and_prorates_past_it(monkeypatch):
    model = sharpened_model("llama", scale=4.0)
    forwards = FakeForwards(monkeypatch, lambda width, run: 0.01 * width)  # every query costs the first's price
    table = measure(model)
    assert table == pytest.approx({1: 0.01, 2: 0.02})  # 2 costs two one-query forwards: 4 to 64 not run
    assert set(forwards.widths) == {1, 2} and len(forwards.widths) == 8  # a warm-up and 3 timed forwards each
    assert ForwardPrices(table)(64) == pytest.approx(0.64)

    forwards = FakeForwards(monkeypatch, lambda width, run: 0.01 * width)
    assert measure(model, prompt_width=40) == pytest.approx(table)  # after a forward as wide as the decode's first
    assert forwards.widths[:2] == [40, 1] and forwards.logits[0] == 40 and len(forwards.widths) == 9
    forwards = FakeForwards(monkeypatch, lambda width, run: 0.01 * width)
    measure(model, prompt_width=100)
    assert forwards.widths[0] == 100 and forwards.logits[0] == 64  # no more logits than the widest measured forward

    forwards = FakeForwards(monkeypatch, lambda width, run: 0.01 + 0.001 * width)  # width is cheap: all measured
    table = measure(model)
    assert list(table) == list(prices_refusion.PRICE_WIDTHS)
    assert table[64] == pytest.approx(0.074)
    # just below the line (0.9 of the one-query price per query) still measures on
    forwards = FakeForwards(monkeypatch, lambda width, run: 0.01 * (1 if width == 1 else 0.89 * width))
    assert list(measure(model)) == list(prices_refusion.PRICE_WIDTHS)


def test_measuring_takes_the_fastest_repeat_and_fewer_once_its_time_is_spent(monkeypatch):
    model = sharpened_model("llama", scale=4.0)
    forwards = FakeForwards(monkeypatch, lambda width, run: 0.01 + 0.001 * width + (0.5 if run % 4 == 2 else 0))
    table = measure(model)
    assert table[1] == pytest.approx(0.011)  # a slow run among the repeats is not the price
    forwards = FakeForwards(monkeypatch, lambda width, run: 1.0 + 0.01 * width)  # 1 s a forward, 4 s to spend
    table = measure(model, seconds=4.0)
    assert list(table) == list(prices_refusion.PRICE_WIDTHS)
    counts = [forwards.widths.count(width) for width in prices_refusion.PRICE_WIDTHS]
    assert counts == [2] * len(counts)  # a warm-up and a timed forward each: no repeats once the time is spent
    assert table[64] == pytest.approx(1.64)
    forwards = FakeForwards(monkeypatch, lambda width, run: 0.3 + 0.01 * width)  # 2.29 s once each, 2.8 to spend
    measure(model, seconds=2.8)
    assert [forwards.widths.count(width) for width in prices_refusion.PRICE_WIDTHS] == [3, 3, 2, 2, 2]


def test_a_warm_up_that_compiles_neither_spends_the_time_nor_prices_its_width(monkeypatch):
    """Forwards not compiled yet compile on their first call, the warm-up: that time is not a forward's price and
    leaves the measuring its time for the repeats."""
    model = sharpened_model("llama", scale=4.0)
    compiled = set()

    def cost(width: int, run: int) -> float:
        first, _ = width not in compiled, compiled.add(width)
        return 30.0 if first else 0.01 + 0.001 * width

    forwards = FakeForwards(monkeypatch, cost)
    table = measure(model)
    assert table == pytest.approx({width: 0.01 + 0.001 * width for width in prices_refusion.PRICE_WIDTHS})
    assert len(forwards.widths) == 4 * len(prices_refusion.PRICE_WIDTHS)  # a warm-up and 3 timed forwards each
    # the buckets of 16 and 32 new tokens are neither run (nor so compiled) nor measured: priced between 8 and 64
    assert not {16, 32} & set(forwards.widths)
    prices = ForwardPrices(table, buckets=(1, 2, 4, 8, 16, 32, 64))
    assert [prices(width) for width in (9, 16, 32)] == pytest.approx([0.026, 0.026, 0.042])


def test_a_busy_spell_of_the_machine_does_not_price_one_width_above_the_others(monkeypatch):
    model = sharpened_model("llama", scale=4.0)
    # busy from the 5th forward to the 8th: as long as one width's warm-up and repeats, were they back to back
    forwards = FakeForwards(monkeypatch, lambda width, run: 0.01 + 0.001 * width + (0.005 if 5 <= run <= 8 else 0))
    table = measure(model)
    assert table == pytest.approx({width: 0.01 + 0.001 * width for width in prices_refusion.PRICE_WIDTHS})
    assert len(forwards.widths) == 4 * len(prices_refusion.PRICE_WIDTHS)  # a warm-up and 3 timed forwards each

    # a busy moment on the forward that would end the measuring (two queries costing two one-query forwards) does not
    forwards = FakeForwards(monkeypatch, lambda width, run: 0.01 + 0.001 * width + (0.5 if run == 4 else 0))
    table = measure(model)
    assert list(table) == list(prices_refusion.PRICE_WIDTHS) and table[2] == pytest.approx(0.012)


def test_a_decode_measures_its_prices_after_a_forward_as_wide_as_its_prompt(monkeypatch):
    monkeypatch.setenv("REFUSION_PRICE_CACHE", "")
    measured, measure_forward_prices = [], prices_refusion.measure_forward_prices

    def spy(*args, **kwargs):
        measured.append(kwargs["prompt_width"])
        return measure_forward_prices(*args, **kwargs)

    monkeypatch.setattr(prices_refusion, "measure_forward_prices", spy)
    model = sharpened_model("qwen3", scale=4.0)
    ids, mask = left_padded(PROMPTS)
    model.generate(ids, attention_mask=mask, draft_schedule="price", **MEASURED)
    assert measured == [ids.shape[1]]


def test_a_table_learns_its_widths_fastest_forwards_and_finds_itself_stale_below_the_line():
    prices = ForwardPrices({1: 1.0, 4: 2.0}, key="a kept table")
    prices.observe(2, 0.01)  # not a measured width: nothing to compare with
    prices.observe(1, 0.9)
    prices.observe(4, 1.6)
    assert prices.seen == {1: 0.9, 4: 1.6} and prices.stale() is None  # 0.8 of the price: not below 0.75
    prices.observe(4, 1.4)
    assert prices.stale() == (4, 1.4)


def test_a_table_measured_in_this_process_keeps_its_ratios_where_the_one_query_price_was_beaten(monkeypatch):
    """The one-query forward runs most, so a decode sees its fastest: the machine was busy while measuring, and every
    width scales by as much, where a width beaten further takes its own time. Where only a wider width was beaten
    (measured dearer on its own than amid a decode), that width alone takes the decode's time."""
    monkeypatch.setenv("REFUSION_PRICE_CACHE", "")
    measured = {1: 1.0, 2: 1.1, 4: 1.2, 8: 1.6}
    model = SimpleNamespace(_refusion_prices={"key": dict(measured)}, _refusion_prices_measured={"key"})
    prices = ForwardPrices(measured, key="key")
    for width, seconds in ((1, 0.5), (4, 1.0), (8, 0.6)):  # 4: not beaten (0.83 of its price); 8: beaten further
        prices.observe(width, seconds)
    prices_refusion.forget_stale_prices(model, prices)
    assert model._refusion_prices["key"] == pytest.approx({1: 0.5, 2: 0.55, 4: 0.6, 8: 0.6})

    model = SimpleNamespace(_refusion_prices={"key": dict(measured)}, _refusion_prices_measured={"key"})
    prices = ForwardPrices(measured, key="key")
    for width, seconds in ((1, 0.9), (4, 0.7)):  # the one-query forward as measured, four queries beaten
        prices.observe(width, seconds)
    prices_refusion.forget_stale_prices(model, prices)
    assert model._refusion_prices["key"] == pytest.approx({1: 1.0, 2: 1.1, 4: 0.7, 8: 1.6})


CHEAP = {1: 1e-9, 2: 1.5e-9, 64: 8e-9}  # below any forward: a table no decode beats


def kept_table(model, settings: dict, path, monkeypatch, factor: float = 1.0):
    """Decode once with `CHEAP` as the measured table, then keep it in `path` scaled by `factor`; its key, and the
    decode's output. (A real measurement of a tiny model on a busy machine may itself be beaten at once.)"""
    with monkeypatch.context() as patch:
        patch.setattr(prices_refusion, "measure_forward_prices", lambda *args, **kwargs: dict(CHEAP))
        output = model.generate(PROMPT, **settings)
    ((key, table),) = json.loads(path.read_text()).items()
    path.write_text(json.dumps({key: {width: price * factor for width, price in table.items()}}))
    model._refusion_prices.clear()
    return key, output


def test_a_kept_table_that_decodes_beat_is_measured_again(tmp_path, monkeypatch, caplog):
    path = tmp_path / "prices.json"
    monkeypatch.setenv("REFUSION_PRICE_CACHE", str(path))
    settings = dict(MEASURED, draft_schedule="price", cache_implementation="static")
    model = sharpened_model("llama", scale=4.0)
    key, first = kept_table(model, settings, path, monkeypatch, factor=1e12)  # as if measured on a very busy machine
    again = model.generate(PROMPT, **settings)
    assert torch.equal(first.sequences, again.sequences)  # the same decisions: every width dearer alike
    assert "measured again" in caplog.text
    assert key not in json.loads(path.read_text()) and key not in model._refusion_prices
    measured = []
    monkeypatch.setattr(prices_refusion, "measure_forward_prices", lambda *a, **k: measured.append(1) or CHEAP)
    model.generate(PROMPT, **settings)
    assert measured == [1] and json.loads(path.read_text())[key] == {str(width): p for width, p in CHEAP.items()}


def test_a_table_measured_in_this_process_that_decodes_beat_takes_their_times(tmp_path, monkeypatch, caplog):
    """Measuring again would as likely give the same prices: the beaten widths take the decode's fastest forward."""
    path = tmp_path / "prices.json"
    monkeypatch.setenv("REFUSION_PRICE_CACHE", str(path))
    settings = dict(MEASURED, draft_schedule="price", cache_implementation="static")
    model = sharpened_model("llama", scale=4.0)
    dear = {1: 1e3, 2: 1.5e3, 64: 8e3}  # seconds: every decode beats it
    measured = []
    monkeypatch.setattr(prices_refusion, "measure_forward_prices", lambda *a, **k: measured.append(1) or dict(dear))
    model.generate(PROMPT, **settings)
    ((key, table),) = json.loads(path.read_text()).items()
    assert measured == [1] and "measured again" not in caplog.text
    beaten = {int(width) for width, price in table.items() if price < dear[int(width)]}
    assert 1 in beaten and all(table[str(width)] < 1.0 for width in beaten)  # this decode's times
    scale = table["1"] / dear[1]  # and as the one-query price was beaten, every width scaled by as much
    assert all(table[str(width)] <= price * scale * (1 + 1e-12) for width, price in dear.items())
    assert model._refusion_prices[key] == {int(width): price for width, price in table.items()}
    model.generate(PROMPT, **settings)
    assert measured == [1]  # not measured again
    model._refusion_prices.clear()  # a later process reads the kept table, and a decode that beats it measures again
    path.write_text(json.dumps({key: {width: price * 1e6 for width, price in table.items()}}))
    model.generate(PROMPT, **settings)
    assert "measured again" in caplog.text and key not in json.loads(path.read_text())


@pytest.mark.parametrize("case", ["cheaper than measured", "over another kind of cache", "the caller's"])
def test_a_table_stays_where_no_decode_over_its_cache_beat_it(tmp_path, monkeypatch, caplog, case):
    path = tmp_path / "prices.json"
    monkeypatch.setenv("REFUSION_PRICE_CACHE", str(path))
    settings = dict(MEASURED, draft_schedule="price", cache_implementation="static")
    model = sharpened_model("qwen2", scale=4.0)
    kept_table(model, settings, path, monkeypatch, factor=1.0 if case == "cheaper than measured" else 1e12)
    if case == "over another kind of cache":  # the same key: measured over a static cache like the dynamic one
        settings["cache_implementation"] = "dynamic"
    if case == "the caller's":
        settings["forward_prices"] = {1: 1000.0, 64: 1000.0}
    kept = path.read_text()
    model.generate(PROMPT, **settings)
    assert "measured again" not in caplog.text
    assert path.read_text() == kept


def test_a_damaged_file_is_moved_aside_and_measured_again_and_an_empty_name_keeps_nothing(
    tmp_path, monkeypatch, caplog
):
    """A price file that is not JSON (or not an object of tables) is never overwritten: it is moved aside to
    `<name>.corrupt` (`.corrupt.1` where that is taken), with one warning naming it, and a new file keeps the table
    measured in its place."""
    path = tmp_path / "prices.json"
    path.write_text("{not json")
    (tmp_path / "prices.json.corrupt").write_text("an earlier damaged file")
    monkeypatch.setenv("REFUSION_PRICE_CACHE", str(path))
    model = sharpened_model("llama", scale=4.0)
    model.generate(PROMPT, draft_schedule="price", **MEASURED)
    assert len(json.loads(path.read_text())) == 1
    assert (tmp_path / "prices.json.corrupt.1").read_text() == "{not json"
    assert (tmp_path / "prices.json.corrupt").read_text() == "an earlier damaged file"
    assert caplog.text.count(f"The forward price file {path} is damaged") == 1
    path.write_bytes(b"[1, 2]")  # JSON, but no object of tables
    assert prices_refusion.read_price_file(path) == {}
    assert (tmp_path / "prices.json.corrupt.2").read_bytes() == b"[1, 2]" and not path.exists()

    monkeypatch.setenv("REFUSION_PRICE_CACHE", "")
    other = sharpened_model("mistral", scale=4.0)
    other.generate(PROMPT, draft_schedule="price", **MEASURED)
    assert len(other._refusion_prices) == 1 and not path.exists()


def test_damaged_tables_are_dropped_alone_with_one_warning(tmp_path, monkeypatch, caplog):
    """A table that is not positive finite prices by width (NaN, which Python's JSON reads, infinite, negative, a
    string, a number past every float) is dropped with one warning naming the file, the valid ones kept; a decode
    whose own table was damaged measures it again."""
    path = tmp_path / "prices.json"
    monkeypatch.setenv("REFUSION_PRICE_CACHE", str(path))
    model = sharpened_model("llama", scale=4.0)
    settings = dict(MEASURED, draft_schedule="price")
    key, _ = kept_table(model, settings, path, monkeypatch)
    good = {"another model's": {"1": 0.5, "8": 0.75}}
    damaged = {
        key: {"1": math.nan, "8": 1.0}, "infinite": {"1": math.inf}, "negative": {"1": -1.0}, "text": {"1": "fast"},
        "huge": {"1": 10**400}, "no table": [1.0], "no width": {"one": 1.0}, "empty": {},
    }  # fmt: skip
    path.write_text(json.dumps({**good, **damaged}))  # (NaN and Infinity as Python's JSON writes them)
    measured = []
    monkeypatch.setattr(prices_refusion, "measure_forward_prices", lambda *a, **k: measured.append(1) or CHEAP)
    model.generate(PROMPT, **settings)
    assert measured == [1]
    assert json.loads(path.read_text()) == {**good, key: {str(width): price for width, price in CHEAP.items()}}
    assert caplog.text.count(f"The forward price file {path} holds 8 damaged table(s)") == 1
    path.write_text(json.dumps({**good, **damaged}))
    assert prices_refusion.read_price_file(path) == {"another model's": {1: 0.5, 8: 0.75}}
    assert caplog.text.count("damaged table(s)") == 1  # once a process


def test_an_unwritable_file_warns_and_decodes(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv("REFUSION_PRICE_CACHE", str(blocker / "prices.json"))  # its folder is a file
    model = sharpened_model("llama", scale=4.0)
    output = model.generate(PROMPT, draft_schedule="price", **MEASURED)
    assert output.sequences.shape[1] == PROMPT.shape[1] + SETTINGS["max_new_tokens"]
    assert "could not be kept" in caplog.text


def test_a_file_that_cannot_be_written_warns_once_and_leaves_no_partial_file(tmp_path, monkeypatch, caplog):
    """Where the price file cannot be replaced (here its rename fails) or its name is a folder, each decode still
    runs, the warning comes once a process, no partial file is left beside it and the folder is left as it is."""
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"kept": {"1": 1.0}}))
    monkeypatch.setenv("REFUSION_PRICE_CACHE", str(path))
    replace = prices_refusion.os.replace

    def failing(source, target):
        if str(source).endswith(".partial"):
            raise OSError(30, "Read-only file system", str(target))
        return replace(source, target)

    monkeypatch.setattr(prices_refusion.os, "replace", failing)
    for key in ("first", "second"):
        prices_refusion.keep_prices(key, {1: 1.0})
    assert caplog.text.count(f"could not be kept in {path}") == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == ["prices.json"]
    assert json.loads(path.read_text()) == {"kept": {"1": 1.0}}
    monkeypatch.undo()

    folder = tmp_path / "forward_prices.json"
    folder.mkdir()
    monkeypatch.setenv("REFUSION_PRICE_CACHE", str(folder))
    monkeypatch.setattr(prices_refusion, "measure_forward_prices", lambda *a, **k: dict(CHEAP))
    for architecture in ("llama", "qwen2"):  # two models: each measures and would keep its table
        output = sharpened_model(architecture, scale=4.0).generate(PROMPT, draft_schedule="price", **MEASURED)
        assert output.sequences.shape[1] == PROMPT.shape[1] + SETTINGS["max_new_tokens"]
    assert caplog.text.count(f"The forward price file {folder} could not be read") == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == ["forward_prices.json", "prices.json"]
    assert not any(folder.iterdir())


@pytest.mark.parametrize("dangling", [False, True])
def test_a_price_file_that_is_a_symbolic_link_is_written_through_it(tmp_path, monkeypatch, dangling):
    """The link stays a link: its target (made where it is missing, its folder too) holds the tables, with the
    permissions it had."""
    target = tmp_path / "shared" / "prices.json"
    link = tmp_path / "cache" / "forward_prices.json"
    link.parent.mkdir()
    link.symlink_to(target)
    if not dangling:
        target.parent.mkdir()
        target.write_text(json.dumps({"kept": {"1": 1.0}}))
        target.chmod(0o640)
    monkeypatch.setenv("REFUSION_PRICE_CACHE", str(link))
    prices_refusion.keep_prices("new", {1: 2.0, 8: 3.0})
    assert link.is_symlink() and link.resolve() == target.resolve()
    expected = {"new": {"1": 2.0, "8": 3.0}} if dangling else {"kept": {"1": 1.0}, "new": {"1": 2.0, "8": 3.0}}
    assert json.loads(target.read_text()) == expected
    assert sorted(path.name for path in target.parent.iterdir()) == ["prices.json"]  # no partial file left
    if not dangling:
        assert target.stat().st_mode & 0o777 == 0o640


def test_a_table_holds_for_one_model_dtype_attention_batch_path_and_set_of_widths():
    model = sharpened_model("llama", scale=4.0)
    keys = {price_key(model, SlotCache(model, 1, 128), None), price_key(model, SlotCache(model, 2, 128), None)}
    compiled = CompileConfig(mode="max-autotune-no-cudagraphs")
    keys.add(price_key(model, SlotCache(model, 1, 128), compiled, (8, 16)))
    keys.add(price_key(model, SlotCache(model, 1, 128), compiled, (1, 2, 8, 16)))
    model.set_attn_implementation("eager")  # what a forward costs depends on it; the config's JSON does not say it
    keys.add(price_key(model, SlotCache(model, 1, 128), compiled, (1, 2, 8, 16)))
    keys.add(price_key(model.to(torch.float32), SlotCache(model, 1, 128), None))
    assert len(keys) == 6


def test_a_generation_config_can_carry_the_schedule_and_its_prices(tmp_path):
    model = sharpened_model("qwen3", scale=4.0)
    model.generation_config.draft_schedule = "price"
    model.generation_config.forward_prices = STEEP
    model.generation_config.save_pretrained(tmp_path)  # JSON: the widths come back as strings
    loaded = type(model.generation_config).from_pretrained(tmp_path)
    assert set(loaded.forward_prices) == {"1", "2", "64"}
    from_config = model.generate(PROMPT, generation_config=loaded, **SETTINGS)
    passed = model.generate(PROMPT, draft_schedule="price", forward_prices=STEEP, **SETTINGS)
    assert torch.equal(from_config.sequences, passed.sequences)


def test_the_benchmark_models_a_decode_by_pricing_each_forward_by_its_width():
    from tiny import tiny_backbone, tiny_tokenizer

    from benchmarks.price_schedule import modelled
    from finetune.chat import prompt_token_ids
    from finetune.convert import convert_to_refusion

    tokenizer = tiny_tokenizer()
    backbone = tiny_backbone("llama", vocab_size=len(tokenizer), initializer_range=0.2)
    model, tokenizer = convert_to_refusion(backbone, tokenizer, slot_size=4, block_length=8, fused_redraft=True)
    prompts = prompt_token_ids(tokenizer, ["Name a colour."])
    unit = {1: 1.0, 1000: 1000.0}  # a forward costs its width
    widths = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        result = modelled(model.eval(), tokenizer, prompts, 12, unit, draft_schedule="fixed")
    finally:
        handle.remove()
    assert result["forwards"] == len(widths) > 1 and result["tokens"] > 0
    assert result["seconds"] == sum(widths[1:])  # the prompt's forward left out
    assert result["ar_seconds"] == result["tokens"]  # one one-query forward per AR token


@pytest.mark.parametrize("fused_redraft", [False, True])
def test_a_pessimistic_prior_starts_narrow_where_width_is_free_and_stays_exact(fused_redraft):
    """Free width and the default prior: the first plan drafts whole slots. A prior of 0: no draft is expected to
    pass, so it drafts each slot's first token only, until checks say otherwise; cached, static, recomputed, batched
    and alone give the same tokens."""
    model = sharpened_model("llama", scale=4.0)
    slots_per_block, size = SETTINGS["block_length"] // SETTINGS["slot_size"], SETTINGS["slot_size"]
    settings = dict(SETTINGS, draft_schedule="price", forward_prices=FLAT, fused_redraft=fused_redraft)
    optimistic = forward_queries(model, lambda: model.generate(PROMPT, **settings))
    pessimistic = forward_queries(model, lambda: model.generate(PROMPT, draft_prior=0.0, **settings))
    assert optimistic[0] == slots_per_block * size and pessimistic[0] == slots_per_block
    settings["draft_prior"] = 0.0
    assert_exact_everywhere(model, settings)


# ---- greedy answers do not depend on timing ------------------------------------------------------------------------
SCHEDULES = {
    "whole slots": {},
    "window 1": dict(draft_window=1),
    "window 2": dict(draft_window=2),
    "free width": dict(draft_schedule="price", forward_prices=FLAT),
    "linear prices": dict(draft_schedule="price", forward_prices=LINEAR),
    "dear width": dict(draft_schedule="price", forward_prices=STEEP),
    "copied drafts": dict(lookup_drafts=2),
    "priced copied drafts": dict(lookup_drafts=2, draft_schedule="price", forward_prices=LINEAR),
}


@pytest.mark.parametrize("fused_redraft", [False, True])
@pytest.mark.parametrize("threshold", [0.5, 0.8])
def test_where_only_the_model_s_own_token_passes_neither_prices_nor_window_change_the_answer(
    model, threshold, fused_redraft
):
    # Each chosen slot is checked against the sequence as its plan step found it, whatever its siblings committed
    # since: so the forwards' widths (and the drafts they check) change how many forwards a decode takes, never its
    # tokens.
    ids, mask = left_padded(PROMPTS)
    settings = dict(SETTINGS, token_threshold=threshold, fused_redraft=fused_redraft)
    answers, queries = {}, {}
    for name, schedule in SCHEDULES.items():
        call = partial(model.generate, ids, attention_mask=mask, **settings, **schedule)
        queries[name] = sum(forward_queries(model, lambda call=call, name=name: answers.setdefault(name, call())))
    expected = answers["whole slots"].sequences
    assert {name for name, answer in answers.items() if not torch.equal(answer.sequences, expected)} == set()
    assert len(set(queries.values())) >= 4  # (the schedules ran forwards of other widths)


@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.49])
def test_a_greedy_decode_below_one_half_takes_priced_drafts_only_from_a_table_passed_in(threshold):
    model = sharpened_model("qwen3", scale=4.0)
    settings = dict(SETTINGS, token_threshold=threshold, draft_schedule="price")
    with pytest.raises(ValueError, match=rf"token_threshold={threshold} would let a timing change a greedy answer"):
        model.generate(PROMPT, **settings)
    model.generate(PROMPT, forward_prices=LINEAR, **settings)  # the caller's table decides
    model.generation_config.forward_prices = LINEAR
    model.generate(PROMPT, **settings)  # so does one the generation config carries
    model.generation_config.forward_prices = None
    torch.manual_seed(0)
    model.generate(PROMPT, do_sample=True, **settings)  # a sampled answer is not a repeatable one anyway


def test_a_priced_decode_returns_the_table_it_used_and_passing_it_back_decides_alike(monkeypatch):
    monkeypatch.setenv("REFUSION_PRICE_CACHE", "")
    monkeypatch.setattr(prices_refusion, "measure_forward_prices", lambda *args, **kwargs: dict(CHEAP))
    model = sharpened_model("llama", scale=4.0)
    ids, mask = left_padded(PROMPTS)
    measured = model.generate(ids, attention_mask=mask, draft_schedule="price", **MEASURED)
    assert measured.forward_prices and all(isinstance(width, int) for width in measured.forward_prices)
    for threshold in (0.3, 0.5):  # below one half too, where only a table passed in may price the drafts
        settings = dict(MEASURED, token_threshold=threshold, draft_schedule="price")
        first = model.generate(ids, attention_mask=mask, forward_prices=measured.forward_prices, **settings)
        again = model.generate(ids, attention_mask=mask, forward_prices=first.forward_prices, **settings)
        assert torch.equal(first.sequences, again.sequences)
        assert first.num_forward_passes == again.num_forward_passes
    unpriced = model.generate(ids, attention_mask=mask, **MEASURED)
    assert unpriced.forward_prices is None


def test_the_recipe_fixes_a_table_before_timing_priced_drafts_below_one_half(monkeypatch):
    from tiny import tiny_tokenizer

    from recipe.decoding import decode

    monkeypatch.setenv("REFUSION_PRICE_CACHE", "")
    measured = []
    monkeypatch.setattr(prices_refusion, "measure_forward_prices",
                        lambda *args, **kwargs: measured.append(1) or dict(CHEAP))  # fmt: skip
    model = sharpened_model("qwen2", scale=4.0)
    tokenizer = tiny_tokenizer()
    prompts = [PROMPT[0].tolist(), PROMPT[0, :5].tolist()]
    settings = dict(slot_size=4, block_length=8, token_threshold=0.3, draft_schedule="price", eos_token_id=[])
    runs = [decode(model, tokenizer, prompts, 12, batch_size=2, **settings) for _ in range(2)]
    fixed = decode(
        model,
        tokenizer,
        prompts,
        12,
        batch_size=2,
        forward_prices=ForwardPrices(CHEAP, key="measured").table,
        **settings,
    )
    assert runs[0].answers == runs[1].answers == fixed.answers
    assert len(measured) == 1  # measured once, by a decode at one half, outside the timed ones
