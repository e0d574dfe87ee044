"""Saved forwards' choices by kind of CPU (`packages_refusion.SavedForwards`): GEMM templates where they have kernels,
a package raced against oneDNN's where AMX is missing, the narrow widths run from one copy of the weights where AMX is
there, and the weights read from each package checked. The CPU kinds are simulated on any CPU."""

import tempfile
import zipfile
from pathlib import Path

import pytest
import torch
from test_generation import PROMPT, sharpened_model
from test_saved_forwards import SETTINGS, compile_config
from test_static_cache import causal_forward

import executor_refusion
import packages_refusion
import prices_refusion
from compiling_refusion import compiled_backbone
from packages_refusion import SavedForwards, digest_path


def test_autotuned_frozen_packages_on_a_cpu_take_the_gemm_template_alone_where_it_has_kernels(
    tmp_path, monkeypatch, caplog
):
    """On a CPU without oneDNN's bfloat16 kernels, autotuned packages with frozen weights compile with inductor's C++
    GEMM template as the only backend (AOTInductor free to choose took ATen's unpacked products for narrow forwards);
    where the template has no kernel (float64) they compile again, with a warning, with the config's backends. Either
    way: the eager logits. Named backends, no autotuning, or a CPU with oneDNN's bfloat16 kernels (whose packed
    products autotuning picks where they win): one attempt as configured."""
    monkeypatch.setattr(packages_refusion, "onednn_bfloat16", lambda: False)
    monkeypatch.setattr(packages_refusion, "amx_bfloat16", lambda device: False)  # a package a width
    backends, compile_package = [], torch._inductor.aoti_compile_and_package

    def recorded(exported, package_path, inductor_configs):
        backends.append(inductor_configs.get("max_autotune_gemm_backends"))
        return compile_package(exported, package_path=package_path, inductor_configs=inductor_configs)

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", recorded)
    autotuned = compile_config(freezing=True, max_autotune=True)
    for dtype, attempts in ((torch.float32, ["CPP"]), (torch.float64, ["CPP", None])):
        model = sharpened_model("qwen2", scale=4.0).to(dtype)
        backends.clear()
        output, logits = causal_forward(model, SavedForwards(model, autotuned, tmp_path / str(dtype)), 2)
        eager = model(input_ids=torch.arange(3, 3 + 6 + 2)[None]).logits[:, -2:]
        torch.testing.assert_close(logits, eager, rtol=1e-4, atol=1e-4)
        assert backends == attempts
    assert caplog.text.count("C++ GEMM template alone failed") == 1

    model = sharpened_model("qwen2", scale=4.0).float()
    for config in (compile_config(freezing=True, max_autotune=True, max_autotune_gemm_backends="ATEN,CPP"),
                   compile_config(freezing=True), compile_config(max_autotune=True)):  # fmt: skip
        attempts = SavedForwards(model, config, tmp_path).attempts
        assert [configs.get("max_autotune_gemm_backends") for configs in attempts] == [
            config.options.get("max_autotune_gemm_backends")
        ]
    monkeypatch.setattr(packages_refusion, "onednn_bfloat16", lambda: True)
    attempts = SavedForwards(model, autotuned, tmp_path).attempts
    assert [configs.get("max_autotune_gemm_backends") for configs in attempts] == [None]


def test_without_amx_a_narrow_forward_keeps_the_faster_of_its_package_as_configured_and_with_onednn_alone(
    tmp_path, monkeypatch, caplog
):
    """On a CPU with oneDNN's bfloat16 kernels but no AMX, an autotuned frozen forward of up to `WINDOW_WIDTH` new
    tokens is compiled as configured and with oneDNN's products alone, and the package that ran faster on the
    forward's inputs is the one kept (no other file left), which gives the eager logits and a later process loads;
    wider forwards compile once. Named backends, no autotuning, unfrozen, AMX or no oneDNN bfloat16: no rival."""
    monkeypatch.setattr(packages_refusion, "onednn_bfloat16", lambda: True)
    monkeypatch.setattr(packages_refusion, "amx_bfloat16", lambda device: False)
    backends, race, compile_package = [], [], torch._inductor.aoti_compile_and_package
    race_packages = packages_refusion.race_packages

    def recorded(exported, package_path, inductor_configs):
        if not Path(package_path).name.startswith("step-"):
            backends.append(inductor_configs.get("max_autotune_gemm_backends"))
        return compile_package(exported, package_path=package_path, inductor_configs=inductor_configs)

    def watched(paths, inputs, rounds=packages_refusion.PACKAGE_RACE_ROUNDS):
        seconds = race_packages(paths, inputs, rounds)
        race.append((seconds, [Path(path).read_bytes() for path in paths]))
        return seconds

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", recorded)
    monkeypatch.setattr(packages_refusion, "race_packages", watched)
    model = sharpened_model("qwen2", scale=4.0).float()
    autotuned = compile_config(freezing=True, max_autotune=True)
    eager = model(input_ids=torch.arange(3, 3 + 6 + 16)[None]).logits
    caplog.set_level("INFO", logger=packages_refusion.logger.name)
    saved = SavedForwards(model, autotuned, tmp_path)
    output, logits = causal_forward(model, saved, 2)
    torch.testing.assert_close(logits, eager[:, 6:8], rtol=1e-4, atol=1e-4)
    assert backends == [None, "ATEN"] and len(race) == 1
    (configured, alone), contents = race[0]
    assert configured > 0 and alone > 0
    package = saved.path((1, 2, 128, 128))
    assert sorted(tmp_path.iterdir()) == [package, digest_path(package)]  # the rival gone, the digest of the kept one
    assert package.read_bytes() == contents[1 if alone < configured else 0]
    assert f"keeping the package {'oneDNN' if alone < configured else 'as configured'}" in caplog.text

    later = SavedForwards(model, autotuned, tmp_path)  # as a later process would: loads the kept package
    output, logits = causal_forward(model, later, 2)
    torch.testing.assert_close(logits, eager[:, 6:8], rtol=1e-4, atol=1e-4)
    output, logits = causal_forward(model, later, 16)
    torch.testing.assert_close(logits, eager[:, 6:22], rtol=1e-4, atol=1e-4)
    assert backends == [None, "ATEN", None] and len(race) == 1

    for config in (compile_config(freezing=True, max_autotune=True, max_autotune_gemm_backends="ATEN,CPP"),
                   compile_config(freezing=True), compile_config(max_autotune=True)):  # fmt: skip
        assert SavedForwards(model, config, tmp_path).rival_attempts is None
    assert SavedForwards(model, autotuned, tmp_path).rival_attempts[0]["max_autotune_gemm_backends"] == "ATEN"
    monkeypatch.setattr(packages_refusion, "amx_bfloat16", lambda device: True)
    assert SavedForwards(model, autotuned, tmp_path).rival_attempts is None
    monkeypatch.setattr(packages_refusion, "amx_bfloat16", lambda device: False)
    monkeypatch.setattr(packages_refusion, "onednn_bfloat16", lambda: False)
    assert SavedForwards(model, autotuned, tmp_path).rival_attempts is None


def test_on_a_cpu_with_amx_the_narrow_widths_run_from_one_copy_of_the_weights(tmp_path, monkeypatch, caplog):
    """With AMX, autotuned packages with frozen weights of up to `WINDOW_WIDTH` new tokens are a package a width
    compiled with the C++ GEMM template alone and their weights outside their code, and run from one copy of them:
    each width gives the eager logits, a later process loads them sharing again, and price tables key on the
    sharing. Wider forwards keep weights of their own. Without AMX, with named backends, unfrozen or not autotuned:
    weights in each package."""
    configs, compile_package = [], torch._inductor.aoti_compile_and_package

    def recorded(exported, package_path, inductor_configs):
        if not Path(package_path).name.startswith("step-"):
            configs.append(inductor_configs)
        return compile_package(exported, package_path=package_path, inductor_configs=inductor_configs)

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", recorded)
    monkeypatch.setattr(packages_refusion, "amx_bfloat16", lambda device: True)
    model = sharpened_model("qwen2", scale=4.0).float()
    autotuned = compile_config(freezing=True, max_autotune=True)
    ids = torch.arange(3, 3 + 6 + 16)[None]
    eager = model(input_ids=ids).logits
    for _ in ("compiles", "loads"):
        saved = SavedForwards(model, autotuned, tmp_path)  # (the second: as a later process would)
        for width in (1, 2, 4, 8, 16):
            output, logits = causal_forward(model, saved, width)
            torch.testing.assert_close(logits, eager[:, 6 : 6 + width], rtol=1e-4, atol=1e-4)
        narrow = [saved.runners[1, width, 128, 128] for width in (1, 2, 4, 8)]
        assert all(isinstance(runner, packages_refusion.SharedWeightsRunner) for runner in narrow)
        assert not isinstance(saved.runners[1, 16, 128, 128], packages_refusion.SharedWeightsRunner)
        # a constant alike in two packages (name, shape, strides, values) is one tensor; which the template packs alike
        # depends on the CPU's blocking (for this model, on an AMX Xeon all but a few of 8 rows', on an AVX2 Zen 2 all
        # but a few of 4 rows'), but most are
        first = narrow[0].constants
        for runner in narrow:
            for name, tensor in runner.constants.items():
                kept = first.get(name)
                alike = kept is not None and kept.shape == tensor.shape and kept.stride() == tensor.stride()
                assert (tensor is kept) == (alike and torch.equal(tensor, kept)), name
        assert all(sum(runner.constants[name] is first.get(name) for name in runner.constants) > len(first) / 2
                   for runner in narrow)  # fmt: skip
        distinct = {id(tensor) for runner in narrow for tensor in runner.constants.values()}
        assert len(saved.weights.kept) == len(distinct) < 2 * len(first)
    # (the wide package takes the backends it takes elsewhere on this CPU: `test_autotuned_frozen_packages_...`)
    assert (
        [(c.get("max_autotune_gemm_backends"), c.get("aot_inductor.package_constants_in_so")) for c in configs[:4]]
        == [("CPP", False)] * 4
        and len(configs) == 5
        and "aot_inductor.package_constants_in_so" not in configs[4]
    )
    assert "does not run from weights shared" not in caplog.text
    cache = executor_refusion.SlotCache(model, 1, 128)
    assert "sharing their weights" in prices_refusion.price_key(model, cache, autotuned, saved=saved.kind)

    for config in (compile_config(freezing=True, max_autotune=True, max_autotune_gemm_backends="ATEN,CPP"),
                   compile_config(freezing=True), compile_config(max_autotune=True)):  # fmt: skip
        assert not SavedForwards(model, config, tmp_path).shares_weights
    named = compile_config(freezing=True, max_autotune=True, max_autotune_gemm_backends="CPP")
    assert SavedForwards(model, named, tmp_path).shares_weights
    monkeypatch.setattr(packages_refusion, "amx_bfloat16", lambda device: False)
    assert not SavedForwards(model, autotuned, tmp_path).shares_weights and saved.kind != SavedForwards(
        model, autotuned, tmp_path).kind  # fmt: skip


def test_shared_weights_are_the_package_s_own_constants_and_a_package_they_do_not_fit_loads_alone(
    tmp_path, monkeypatch, caplog
):
    """The constants read from a package's weights file by its wrapper's listing are the ones its own loader reads
    (each of a unique name), byte for byte; a package whose listing does not fit (another layout) loads with weights
    of its own, with a warning, and gives the same logits."""
    monkeypatch.setattr(packages_refusion, "amx_bfloat16", lambda device: True)
    model = sharpened_model("llama", scale=4.0).float()
    autotuned = compile_config(freezing=True, max_autotune=True)
    saved = SavedForwards(model, autotuned, tmp_path)
    output, shared_logits = causal_forward(model, saved, 2)
    path = saved.path((1, 2, 128, 128))
    with tempfile.TemporaryDirectory() as folder:  # the package's own reading of its weights file
        zipfile.ZipFile(path).extractall(folder)
        (code,), (blob,) = (list(Path(folder).rglob(f"*.{end}")) for end in ("wrapper.so", "wrapper_weights.blob"))
        reference = torch._C._aoti.AOTIModelContainerRunnerCpu(str(code), 1)
        reference.update_constant_buffer_from_blob(str(blob))
        constants = reference.extract_constants_map(False)
    listed = {}
    for name, fqn in reference.get_constant_names_to_original_fqns().items():
        listed.setdefault(fqn, []).append(name)
    # (the template's packed weights may share one original name, by which the runner's map keys them)
    unique = {fqn: names[0] for fqn, names in listed.items() if len(names) == 1}
    runner = saved.runners[1, 2, 128, 128]
    assert unique and set(runner.constants) == set(reference.get_constant_names_to_original_fqns())
    for fqn, name in unique.items():
        assert torch.equal(constants[fqn], runner.constants[name]), name

    other = SavedForwards(model, autotuned, tmp_path)
    monkeypatch.setattr(packages_refusion, "package_constants", lambda wrapper, blob: {})
    output, alone_logits = causal_forward(model, other, 2)
    assert not isinstance(other.runners[1, 2, 128, 128], packages_refusion.SharedWeightsRunner)
    assert "does not run from weights shared" in caplog.text
    assert torch.equal(alone_logits, shared_logits)
    assert not other.weights.refused  # (a package that cannot be read stops only itself)


def test_weights_read_in_the_wrong_places_are_caught_by_the_first_package(tmp_path, monkeypatch, caplog):
    """Where the reading of a package's weights file goes wrong in a way its sizes do not show (two constants of one
    shape swapped), the first package's check against its own loader catches it: that package and every later one
    load with weights of their own, with a warning, and give the eager logits."""
    monkeypatch.setattr(packages_refusion, "amx_bfloat16", lambda device: True)
    read = packages_refusion.package_constants

    def swapped(wrapper, blob):
        constants = read(wrapper, blob)
        tensors = {name: tensor for name, (raw, tensor) in constants.items() if tensor.dtype.is_floating_point}
        names = list(tensors)
        first, second = next(
            (a, b) for i, a in enumerate(names) for b in names[i + 1 :]
            if tensors[a].shape == tensors[b].shape and not torch.equal(tensors[a], tensors[b])
        )  # fmt: skip
        constants[first], constants[second] = constants[second], constants[first]
        return constants

    monkeypatch.setattr(packages_refusion, "package_constants", swapped)
    model = sharpened_model("llama", scale=4.0).float()
    eager = model(input_ids=torch.arange(3, 3 + 6 + 4)[None]).logits
    saved = SavedForwards(model, compile_config(freezing=True, max_autotune=True), tmp_path)
    for width in (2, 4):
        output, logits = causal_forward(model, saved, width)
        torch.testing.assert_close(logits, eager[:, 6 : 6 + width], rtol=1e-4, atol=1e-4)
        assert not isinstance(saved.runners[1, width, 128, 128], packages_refusion.SharedWeightsRunner)
    assert saved.weights.refused and caplog.text.count("differ from its own loader's") == 1


def test_package_constants_refuses_a_listing_that_does_not_fill_the_weights_file():
    wrapper = "\n".join(
        f"    constants_info_[{index}].{field} = {value};"
        for index, (name, size, shape) in enumerate([("a", 8, "{2}"), ("b", 16, "{2, 2}")])
        for field, value in [
            ("name", f'"{name}"'), ("dtype", "cached_torch_dtype_float32"),
            ("device_type", "cached_torch_device_type_cpu"), ("offset", "0"), ("data_size", str(size)),
            ("from_folded", "false"), ("shape", shape),
            ("stride", "{1}" if name == "a" else "{2, 1}"),
        ]
    )  # fmt: skip
    values = torch.arange(6, dtype=torch.float32)
    blob = torch.zeros(64 + 16, dtype=torch.uint8)
    blob[:8] = values[:2].view(torch.uint8)
    blob[64:] = values[2:].view(torch.uint8)
    constants = packages_refusion.package_constants(wrapper, blob)
    assert torch.equal(constants["a"][1], values[:2]) and torch.equal(constants["b"][1], values[2:].view(2, 2))
    with pytest.raises(ValueError, match="ends before"):
        packages_refusion.package_constants(wrapper, blob[:70])
    with pytest.raises(ValueError, match="lists 128 bytes"):
        packages_refusion.package_constants(wrapper, torch.zeros(200, dtype=torch.uint8))


def test_a_priced_decode_on_an_amx_cpu_runs_one_query_forwards_from_their_own_package(tmp_path, monkeypatch):
    """Where the narrow widths' packages share their weights (AMX), a priced decode runs its one-query forwards from a
    one-query package (no padding to two), with the eager tokens."""
    monkeypatch.setattr(packages_refusion, "amx_bfloat16", lambda device: True)
    model = sharpened_model("qwen2", scale=4.0).float()
    widths = []
    monkeypatch.setattr(SavedForwards, "__call__", lambda self, input_ids, *rest, call=SavedForwards.__call__, **kw:
                        widths.append(input_ids.shape[1]) or call(self, input_ids, *rest, **kw))  # fmt: skip
    # prices that make one- and two-query forwards equal, so that the schedule runs narrow forwards
    settings = dict(SETTINGS, draft_schedule="price", forward_prices={1: 1.0, 2: 1.0, 4: 1.5, 8: 2.0, 64: 16.0})
    eager = model.generate(PROMPT, return_dict_in_generate=True, **settings)
    config = compile_config(freezing=True, max_autotune=True)
    saved = model.generate(PROMPT, return_dict_in_generate=True, compile_config=config,
                           compile_cache_dir=str(tmp_path), **settings)  # fmt: skip
    assert torch.equal(saved.sequences, eager.sequences)
    backbone = compiled_backbone(model, config, tmp_path)
    assert backbone.shares_weights and 1 in widths
    assert isinstance(backbone.runners[1, 1, 128, 128], packages_refusion.SharedWeightsRunner)
