"""Compiled forwards kept on disk (`generate(compile_cache_dir=...)`): AOTInductor packages that give the eager tokens,
that a later decode loads instead of compiling, keyed by everything they hold, and that are compiled again when one
does not load."""

import copy
from pathlib import Path

import pytest
import torch
from test_batching import PROMPTS, left_padded
from test_draft_adapter import with_adapter
from test_generation import PROMPT, sharpened_model
from test_static_cache import causal_forward
from transformers import CompileConfig

import compiling_refusion
import decisions_refusion
import executor_refusion
import packages_refusion
from compiling_refusion import compiled_backbone
from packages_refusion import SavedForwards, digest_path

SETTINGS = dict(
    max_new_tokens=12, slot_size=4, block_length=8, slot_threshold=0.5, token_threshold=0.3, fused_redraft=True,
    eos_token_id=[], pad_token_id=0, cache_implementation="static",
)  # fmt: skip


def compile_config(**options) -> CompileConfig:
    return CompileConfig(fullgraph=True, dynamic=False, options=options or None)


@pytest.fixture
def compiles(monkeypatch):
    """The packages compiled from here on (their paths), counted as AOTInductor is called."""
    paths, compile_package = [], torch._inductor.aoti_compile_and_package

    def counted(exported, package_path, **kwargs):
        paths.append(package_path)
        return compile_package(exported, package_path=package_path, **kwargs)

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", counted)
    return paths


def test_saved_forwards_give_the_eager_tokens_and_a_later_decode_loads_them(tmp_path, monkeypatch, caplog):
    """Packages give the eager tokens, a later decode loads them, a damaged one is compiled again; and on a CPU every
    package, forward or step, compiles with inductor's `cpp.min_chunk_size` at `CPU_MIN_CHUNK` (a decoding forward's
    element-wise loops are too small to pay for a second thread), or for forwards at the compile config's own value."""
    compiles, chunks, compile_package = [], [], torch._inductor.aoti_compile_and_package

    def recorded(exported, package_path, inductor_configs=None):
        compiles.append(package_path)
        step = Path(package_path).name.startswith("step-")
        chunks.append(("step" if step else "forward", (inductor_configs or {}).get("cpp.min_chunk_size")))
        return compile_package(exported, package_path=package_path, inductor_configs=inductor_configs)

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", recorded)
    model = with_adapter(sharpened_model("llama", scale=4.0))  # a draft adapter's deltas go into the packages too
    config = compile_config(freezing=True)
    ids, mask = left_padded(PROMPTS)
    eager = model.generate(ids, attention_mask=mask, **SETTINGS)
    saved = dict(SETTINGS, compile_config=config, compile_cache_dir=str(tmp_path))
    assert torch.equal(model.generate(ids, attention_mask=mask, **saved), eager)
    packages = sorted(tmp_path.glob("*.pt2"))
    assert len(packages) == len(compiles) >= 2
    assert {kind for kind, _ in chunks} == {"forward", "step"}
    assert {chunk for _, chunk in chunks} == {compiling_refusion.CPU_MIN_CHUNK}
    own = compile_config(**{"cpp.min_chunk_size": 64})
    assert [configs["cpp.min_chunk_size"] for configs in SavedForwards(model, own, tmp_path).attempts] == [64]
    files = sorted([*packages, *map(digest_path, packages)])
    assert sorted(tmp_path.iterdir()) == files  # each package with its digest, no partial file

    del model._refusion_compiled  # as a new process would: nothing in memory, the packages on disk
    count = len(compiles)
    assert torch.equal(model.generate(ids, attention_mask=mask, **saved), eager)
    assert len(compiles) == count  # loaded, not compiled
    del model._refusion_slot_cache  # a new cache of the same shape: its tensors are the packages' inputs
    assert torch.equal(model.generate(ids, attention_mask=mask, **saved), eager)
    assert len(compiles) == count

    packages[0].write_bytes(b"not a package")  # damaged: compiled again, with a warning, and decodes as before
    del model._refusion_compiled
    assert torch.equal(model.generate(ids, attention_mask=mask, **saved), eager)
    assert len(compiles) == count + 1 and f"{packages[0]} does not match its digest" in caplog.text
    assert sorted(tmp_path.iterdir()) == files


def test_a_weight_change_means_a_fresh_backbone_and_other_packages_only_where_frozen(tmp_path):
    """A changed weight gives a fresh backbone. Frozen packages hold the weights: the changed model's have another
    key, an equal copy's (a later process loading the same checkpoint) the same. Unfrozen packages run on the model's
    tensors, so their key names the weights' layout alone."""
    model = sharpened_model("qwen2", scale=4.0)
    frozen, unfrozen = compile_config(freezing=True), compile_config()
    shape = (1, 8, 128)
    first = compiled_backbone(model, frozen, tmp_path)
    assert isinstance(first, SavedForwards) and compiled_backbone(model, frozen, tmp_path) is first
    assert SavedForwards(copy.deepcopy(model), frozen, tmp_path).path(shape) == first.path(shape)
    shared = SavedForwards(model, unfrozen, tmp_path).path(shape)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] += 1.0  # one element, in place
    second = compiled_backbone(model, frozen, tmp_path)
    assert second is not first and second.path(shape) != first.path(shape)
    assert SavedForwards(model, unfrozen, tmp_path).path(shape) == shared
    keys = {
        second.path(shape),
        second.path((2, 8, 128)),
        second.path((1, 16, 128)),
        second.path((1, 8, 256)),
        shared,
        SavedForwards(model.to(torch.float32), frozen, tmp_path).path(shape),
    }
    assert len(keys) == 6


def test_unfrozen_packages_run_on_the_models_own_weights(tmp_path, monkeypatch):
    """Unfrozen, a package is built without the weights and runs on the model's own tensors: another model of the same
    layout with other weights loads the packages rather than compiling and decodes its own eager tokens, an in-place
    change to a weight reaches the next decode, and the packages hold no copy of the weights."""
    compiles, compile_package = [], torch._inductor.aoti_compile_and_package

    def recorded(exported, package_path, inductor_configs=None):
        compiles.append((Path(package_path).name, dict(inductor_configs or {})))
        return compile_package(exported, package_path=package_path, inductor_configs=inductor_configs)

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", recorded)
    model = sharpened_model("llama", scale=4.0)
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in other.parameters():
            weight.add_(0.2 * torch.randn(weight.shape, generator=generator, dtype=weight.dtype))
    saved = dict(SETTINGS, compile_config=compile_config(), compile_cache_dir=str(tmp_path))
    ids, mask = left_padded(PROMPTS)
    eager = model.generate(ids, attention_mask=mask, **SETTINGS)
    assert torch.equal(model.generate(ids, attention_mask=mask, **saved), eager)
    forwards = [path for path in tmp_path.glob("*.pt2") if not path.name.startswith("step-")]
    count = len(compiles)
    assert forwards and count >= len(forwards)

    other_eager = other.generate(ids, attention_mask=mask, **SETTINGS)
    assert not torch.equal(other_eager, eager)
    assert torch.equal(other.generate(ids, attention_mask=mask, **saved), other_eager)
    assert len(compiles) == count  # the same packages, loaded

    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(-1.0)
    changed = model.generate(ids, attention_mask=mask, **SETTINGS)
    assert not torch.equal(changed, eager)
    assert torch.equal(model.generate(ids, attention_mask=mask, **saved), changed)
    assert len(compiles) == count

    forward_configs = [configs for name, configs in compiles if not name.startswith("step-")]
    assert forward_configs
    assert all(configs["aot_inductor.package_constants_in_so"] is False for configs in forward_configs)


def test_an_attention_change_means_another_backbone_and_other_packages(tmp_path, compiles):
    """The graphs are traced through the model's attention implementation, which its config's JSON does not record:
    switching it gives a fresh backbone whose packages have other keys, and each decodes the eager tokens of its own
    implementation (eager attention is the decoding policy's for compiled forwards on a CPU)."""
    model = sharpened_model("llama", scale=4.0)
    config, shape = compile_config(), (1, 8, 128)
    short = dict(SETTINGS, max_new_tokens=4, block_length=4)  # a plan and a verify: few packages
    saved = dict(short, compile_config=config, compile_cache_dir=str(tmp_path))
    paths = {}
    for implementation in ("sdpa", "eager"):
        model.set_attn_implementation(implementation)
        backbone = compiled_backbone(model, config, tmp_path)
        paths[implementation] = backbone.path(shape)
        eager = model.generate(PROMPT, **{**short, "cache_implementation": None})
        count = len(compiles)
        assert torch.equal(model.generate(PROMPT, **saved), eager)
        assert len(compiles) > count  # its own packages, none of the other implementation's loaded
        assert compiled_backbone(model, config, tmp_path) is backbone
    assert paths["sdpa"] != paths["eager"]
    model.set_attn_implementation("sdpa")
    assert compiled_backbone(model, config, tmp_path).path(shape) == paths["sdpa"]


def test_compile_cache_dir_needs_compiled_forwards_by_inductor(tmp_path):
    model = sharpened_model("mistral", scale=4.0)
    settings = dict(SETTINGS, compile_cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="compile_cache_dir=.*compiles none"):
        model.generate(PROMPT, **settings)  # static cache, but no compile config
    with pytest.raises(ValueError, match="compile_cache_dir=.*compiles none"):
        model.generate(PROMPT, **dict(settings, cache_implementation=None, compile_config=compile_config()))
    with pytest.raises(ValueError, match="compile_cache_dir must name a folder"):
        model.generate(PROMPT, **dict(settings, compile_config=compile_config(), compile_cache_dir=""))
    eager_backend = compile_config()
    eager_backend.backend = "eager"
    with pytest.raises(ValueError, match="backend='eager'"):
        model.generate(PROMPT, **dict(settings, compile_config=eager_backend))
    model.generation_config.compile_cache_dir = str(tmp_path)  # read from the model's generation config too
    with pytest.raises(ValueError, match="compile_cache_dir=.*compiles none"):
        model.generate(PROMPT, **{key: value for key, value in settings.items() if key != "compile_cache_dir"})
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("saved", [False, True])
def test_a_deep_copy_of_the_model_gets_a_backbone_of_its_own(tmp_path, saved):
    """The record of the compiled backbone travels with a deep copy of the model; its functions would run the
    original's layers (and weights), so the copy builds its own."""
    model = sharpened_model("qwen3", scale=4.0)
    folder = tmp_path if saved else None
    original = compiled_backbone(model, compile_config(), folder)
    twin = copy.deepcopy(model)
    backbone = compiled_backbone(twin, compile_config(), folder)
    assert backbone is not original and compiled_backbone(model, compile_config(), folder) is original
    if saved:
        assert backbone.model is twin


def test_forwards_compiled_by_torch_compile_on_a_cpu_keep_small_loops_on_one_thread(monkeypatch):
    """As packages do (`CPU_MIN_CHUNK`, in the test above), forwards compiled by `torch.compile` run under it."""
    seen, compile_function = [], torch.compile

    def watched(function, **kwargs):
        compiled = compile_function(function, **kwargs)

        def run(*args):
            seen.append(torch._inductor.config.cpp.min_chunk_size)
            return compiled(*args)

        return run

    monkeypatch.setattr(torch, "compile", watched)
    model = sharpened_model("qwen2", scale=4.0)
    output, logits = causal_forward(model, compiled_backbone(model, compile_config()), 2)
    eager_logits = model(input_ids=torch.arange(3, 3 + 6 + 2)[None]).logits[:, -2:]
    torch.testing.assert_close(logits, eager_logits, rtol=1e-4, atol=1e-4)
    assert seen and set(seen) == {compiling_refusion.CPU_MIN_CHUNK}


# ---- step functions compiled ahead of time --------------------------------------------------------------------------
def test_saved_steps_give_the_functions_results_at_every_size_and_later_ones_load_them(tmp_path, compiles, monkeypatch):
    """A step function as a package (`SavedStep`): one package serves every varying size (from 1 up) and every
    threshold (a tensor argument), gives what the function gives, and a later `SavedStep` over the folder loads it;
    other constants (drafts copied) make another package. The runners it remembers by exact shapes stay few (here
    at most 2) and always the right ones."""
    from test_static_cache import infill_round

    monkeypatch.setattr(packages_refusion, "SHAPES_REMEMBERED", 2)

    step = packages_refusion.SavedStep(
        decisions_refusion.score_infill, tmp_path,
        ({0: "logits"}, *[{0: "slots"}] * 4, {0: "eos"}, None, {}, {0: "text"}, {0: "slots"}, None),
    )  # fmt: skip
    generator, eos, mask_token_id = torch.Generator().manual_seed(5), torch.tensor([3, -1, -1]), 20
    for case in range(12):
        drafts = (0, 3)[case // 6]
        round_ = infill_round(generator, 1 + case % 3, 8, 40, mask_token_id)
        threshold = torch.tensor((0.0, 0.3, 0.6)[case % 3], dtype=torch.float64)
        arguments = (
            round_["logits"], round_["tokens"], round_["stored"], round_["counts"], round_["until"], eos, mask_token_id,
            threshold, round_["text"], round_["at"], drafts,
        )  # fmt: skip
        expected = decisions_refusion.score_infill(*arguments)
        assert all(torch.equal(got, wanted) for got, wanted in zip(step(*arguments), expected)), case
        assert len(compiles) == 1 + case // 6  # one package a number of drafts copied
        assert 1 <= len(step.by_shapes) <= 2
    later = packages_refusion.SavedStep(step.function, tmp_path, step.dims)
    assert all(torch.equal(got, wanted) for got, wanted in zip(later(*arguments), expected))
    assert len(compiles) == 2 and len(list(tmp_path.glob("*.pt2"))) == 2
    with pytest.raises(TypeError, match="takes 11 arguments here, not 10"):
        step(*arguments[:-1])
    scoring = packages_refusion.SavedStep(decisions_refusion.greedy_distributions, tmp_path, ({0: "rows"}, None))
    nothing = scoring(torch.zeros(0, 40), mask_token_id)  # no row: the function itself, no package
    assert nothing[0].shape == (0, 40) and nothing[1].shape == (0,) and len(compiles) == 2


def test_a_decode_through_saved_forwards_on_a_cpu_runs_its_masks_and_infill_rounds_from_saved_steps(
    tmp_path, compiles, monkeypatch
):
    """On a CPU a decode through saved forwards takes its attention masks, greedy plan, verify and infill forwards
    scored whole and copied drafts from packages kept beside the forwards (`SavedForwards.steps`),
    compiled while its forwards are, and decodes the eager tokens."""
    model = sharpened_model("qwen3", scale=4.0)
    calls, call = [], packages_refusion.SavedStep.__call__
    monkeypatch.setattr(
        packages_refusion.SavedStep,
        "__call__",
        lambda self, *arguments: calls.append(self.function.__name__) or call(self, *arguments),
    )
    settings = dict(SETTINGS, fused_redraft=False, lookup_drafts=2, max_new_tokens=16)
    eager = model.generate(PROMPT, return_dict_in_generate=True, **settings)
    config = compile_config()
    columns = executor_refusion.static_cache_columns(PROMPT.shape[1], 16, 4, 8)
    compiling_refusion.compile_forwards(model, config, 1, columns, compile_cache_dir=tmp_path, lookup_drafts=2)
    whole = {"score_plan", "score_verify", "score_infill"}
    assert set(calls) == {"static_mask", "copy_drafts", *whole}
    steps = sorted(path.name for path in tmp_path.glob("step-*.pt2"))
    assert len(steps) == 5
    calls.clear()
    count = len(compiles)
    saved = model.generate(PROMPT, return_dict_in_generate=True, **dict(settings, compile_config=config,
                                                                         compile_cache_dir=str(tmp_path)))  # fmt: skip
    assert torch.equal(saved.sequences, eager.sequences) and saved.num_forward_passes == eager.num_forward_passes
    assert calls.count("static_mask") == saved.num_forward_passes
    assert set(calls) <= {"static_mask", "copy_drafts", *whole} and whole <= set(calls)
    assert len(compiles) == count  # compile_forwards compiled it all


def test_a_package_built_with_grad_enabled_has_its_weights_frozen(tmp_path):
    """A first forward outside `torch.no_grad()` (a price probe, a user's own call of the backbone) builds the package
    that every later process loads under the same key: built with autograd on, export would keep the weights as the
    graph's parameters and freezing would leave them out (constants named after the layers, a slower package)."""
    model = sharpened_model("llama", scale=4.0)
    compiled = compiled_backbone(model, compile_config(freezing=True), tmp_path)
    cache = executor_refusion.slot_cache(model, 1, 40)
    with torch.enable_grad():
        executor_refusion.timed_forward(model, compiled, cache, 4, 4)
    (runner,) = compiled.runners.values()
    constants = runner.get_constant_fqns()
    assert any(name.startswith("_frozen_param") for name in constants)
    assert not [name for name in constants if "proj" in name]  # no linear layer's weight left unfrozen


def test_a_package_built_without_its_constants_runs_on_the_tensors_given_and_names_one_missing(tmp_path):
    """`load_forward` binds the tensors given to a package whose metadata says it was built without its constants,
    refuses, naming it, a constant not among them, and leaves a package holding its constants as it is."""
    layer = torch.nn.Linear(8, 8).eval()
    inputs = torch.randn(2, 8)
    with torch.no_grad():
        exported = torch.export.export(layer, (inputs,))
        for name, configs in [
            ("bare", packages_refusion.BARE_PACKAGE),
            ("whole", {}),
        ]:  # fmt: skip
            torch._inductor.aoti_compile_and_package(
                exported, package_path=str(tmp_path / f"{name}.pt2"), inductor_configs=configs
            )
        tensors = dict(layer.named_parameters())
        bare = packages_refusion.load_forward(tmp_path / "bare.pt2", tensors)
        assert torch.equal(bare.boxed_run([inputs])[0], layer(inputs))
        layer.weight.mul_(2.0)  # the package runs on the layer's own weight and bias (a small one too)
        layer.bias.add_(1.0)
        assert torch.equal(bare.boxed_run([inputs])[0], layer(inputs))
        with pytest.raises(ValueError, match=r"takes constants the model does not have: \['bias'\]"):
            packages_refusion.load_forward(tmp_path / "bare.pt2", {"weight": layer.weight})
        whole = packages_refusion.load_forward(tmp_path / "whole.pt2", {})
        assert not torch.equal(whole.boxed_run([inputs])[0], layer(inputs))  # (its own copy, from before the change)


def test_an_unfrozen_package_that_makes_constants_of_its_own_keeps_them(tmp_path, monkeypatch):
    """Where the package built without its constants names one the model does not have (inductor's C++ GEMM template
    packs a copy of each weight), it is compiled again holding its constants, and computes what a bare one does."""
    model = sharpened_model("llama", scale=4.0).float()
    expected = causal_forward(model, SavedForwards(model, compile_config(), tmp_path / "bare"), 2)[1]
    monkeypatch.setattr(packages_refusion, "BARE_PACKAGE", {**packages_refusion.BARE_PACKAGE, "max_autotune": True,
                                                            "max_autotune_gemm_backends": "CPP"})  # fmt: skip
    built, compile_package = [], packages_refusion.compile_package

    def recorded(exported, shape, attempts, path):
        built.append(attempts[0].get("aot_inductor.package_constants_in_so", True))
        return compile_package(exported, shape, attempts, path)

    monkeypatch.setattr(packages_refusion, "compile_package", recorded)
    logits = causal_forward(model, SavedForwards(model, compile_config(), tmp_path / "own"), 2)[1]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)  # (other kernels: float32 rounding)
    assert built == [False, True]  # bare, then with its constants
    (package,) = (tmp_path / "own").glob("*.pt2")
    assert torch._inductor.aoti_load_package(str(package)).get_metadata().get("refusion_constants") is None
