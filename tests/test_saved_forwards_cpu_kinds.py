"""Saved forwards' choices by kind of CPU (`packages_refusion.SavedForwards`): GEMM templates where they have kernels,
a package raced against oneDNN's where AMX is missing, the narrow widths with the GEMM template alone where AMX is
there. The CPU kinds are simulated on any CPU."""

from pathlib import Path

import torch
from test_generation import PROMPT, sharpened_model
from test_saved_forwards import SETTINGS, compile_config
from test_static_cache import causal_forward

import packages_refusion
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
    """On a CPU with oneDNN's bfloat16 kernels but no AMX, an autotuned frozen forward of up to `NARROW_WIDTH` new
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
    package = saved.path((1, 2, 128))
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


def test_on_a_cpu_with_amx_the_narrow_widths_take_the_gemm_template_alone(tmp_path, monkeypatch):
    """With AMX, autotuned packages with frozen weights of up to `NARROW_WIDTH` new tokens are a package a width
    compiled with the C++ GEMM template alone (autotuning free to choose took oneDNN's slower product for widths it did
    not know), each holding its weights, as every package does: each width gives the eager logits and a later process
    loads them. Wider forwards take the backends they take elsewhere on this CPU. Without AMX, with named backends,
    unfrozen or not autotuned: no narrow choice."""
    configs, compile_package = [], torch._inductor.aoti_compile_and_package

    def recorded(exported, package_path, inductor_configs):
        if not Path(package_path).name.startswith("step-"):
            configs.append(inductor_configs)
        return compile_package(exported, package_path=package_path, inductor_configs=inductor_configs)

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", recorded)
    monkeypatch.setattr(packages_refusion, "amx_bfloat16", lambda device: True)
    monkeypatch.setattr(packages_refusion, "onednn_bfloat16", lambda: True)
    model = sharpened_model("qwen2", scale=4.0).float()
    autotuned = compile_config(freezing=True, max_autotune=True)
    ids = torch.arange(3, 3 + 6 + 16)[None]
    eager = model(input_ids=ids).logits
    for _ in ("compiles", "loads"):
        saved = SavedForwards(model, autotuned, tmp_path)  # (the second: as a later process would)
        for width in (1, 2, 4, 8, 16):
            output, logits = causal_forward(model, saved, width)
            torch.testing.assert_close(logits, eager[:, 6 : 6 + width], rtol=1e-4, atol=1e-4)
    assert [c.get("max_autotune_gemm_backends") for c in configs] == ["CPP"] * 4 + [None]
    assert not any(key.startswith("aot_inductor.package_constants") for c in configs for key in c)

    for config in (compile_config(freezing=True, max_autotune=True, max_autotune_gemm_backends="ATEN,CPP"),
                   compile_config(freezing=True), compile_config(max_autotune=True)):  # fmt: skip
        assert SavedForwards(model, config, tmp_path).narrow_attempts is None
    monkeypatch.setattr(packages_refusion, "amx_bfloat16", lambda device: False)
    assert SavedForwards(model, autotuned, tmp_path).narrow_attempts is None


def test_a_priced_decode_on_an_amx_cpu_runs_one_query_forwards_from_their_own_package(tmp_path, monkeypatch):
    """On an AMX CPU (the narrow widths' packages compiled apart), a priced decode runs its one-query forwards from a
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
    assert backbone.narrow_attempts is not None and 1 in widths and (1, 1, 128) in backbone.runners
