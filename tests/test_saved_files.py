"""Saved packages read back from disk (`generate(compile_cache_dir=...)`): each is checked against the digest kept
beside it (the key it was built for, the sha256 of its bytes) before it loads, so that damaged bytes, another
package put under its name or a missing digest mean a warning and a package compiled again, never wrong logits or a
crash inside torch; and a build killed on the way leaves a folder that later decodes use, its partial file removed
once stale; where torch's package loader has no `boxed_run` (private), packages run through their public call. (The
price file read back is tested in test_price_schedule.py.)"""

import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_generation import sharpened_model
from test_saved_forwards import compile_config
from test_static_cache import causal_forward

import packages_refusion
from compiling_refusion import compiled_backbone
from decisions_refusion import greedy_distributions
from packages_refusion import SavedForwards, SavedStep, digest_path, load_or_build_package

ROOT = Path(__file__).resolve().parents[1]
SHAPE = (1, 2, 128)  # batch size, width, cache length: the forward `causal_forward(..., 2)` runs
STEP_DIMS = ({0: "rows"}, None)  # `greedy_distributions`: any number of rows, the mask token a constant
MASK_TOKEN_ID = 20


def step_scores() -> torch.Tensor:
    return torch.randn(3, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def run_saved(model, folder: Path) -> tuple[torch.Tensor, tuple]:
    """The logits of a two-token forward through the saved forwards in `folder` and what the saved step of
    `greedy_distributions` gives for `step_scores()` there (each loaded, or compiled first)."""
    _, logits = causal_forward(model, SavedForwards(model, compile_config(), folder), 2)
    return logits, SavedStep(greedy_distributions, folder, STEP_DIMS)(step_scores(), MASK_TOKEN_ID)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A folder with the forward package of `SHAPE` and the step package of `greedy_distributions`, each with its
    digest, built once for the module, and what they give."""
    model = sharpened_model("llama", scale=4.0)
    folder = tmp_path_factory.mktemp("saved")
    logits, outputs = run_saved(model, folder)
    (step,) = folder.glob("step-*.pt2")
    forward = SavedForwards(model, compile_config(), folder).path(SHAPE)
    return dict(model=model, folder=folder, logits=logits, outputs=outputs, forward=forward, step=step)


@pytest.fixture
def copied(saved, tmp_path):
    """A copy of the saved folder for a test to damage, and the paths of its two packages."""
    folder = tmp_path / "saved"
    shutil.copytree(saved["folder"], folder)
    return folder, folder / saved["forward"].name, folder / saved["step"].name


@pytest.fixture
def compiles(monkeypatch):
    """The packages compiled from here on (their paths)."""
    paths, compile_package = [], torch._inductor.aoti_compile_and_package

    def counted(exported, package_path, **kwargs):
        paths.append(Path(package_path).name)
        return compile_package(exported, package_path=package_path, **kwargs)

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", counted)
    return paths


def assert_as_saved(saved, logits, outputs) -> None:
    """The forward's logits and the step's results equal those of the undamaged packages, and the eager ones."""
    assert torch.equal(logits, saved["logits"])
    assert all(torch.equal(got, wanted) for got, wanted in zip(outputs, saved["outputs"]))
    eager = saved["model"](input_ids=torch.arange(3, 3 + 6 + 2)[None]).logits[:, 6:]
    torch.testing.assert_close(logits, eager, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outputs[0], greedy_distributions(step_scores(), MASK_TOKEN_ID)[0])


def test_the_saved_folder_holds_each_package_with_its_digest(saved):
    names = sorted(path.name for path in saved["folder"].iterdir())
    assert names == sorted([saved["forward"].name, f"{saved['forward'].name}.digest", saved["step"].name,
                            f"{saved['step'].name}.digest"])  # fmt: skip
    record = json.loads(digest_path(saved["forward"]).read_text())
    assert record["key"] == SavedForwards(saved["model"], compile_config(), saved["folder"]).key(SHAPE)
    assert record["sha256"] == packages_refusion.file_digest(saved["forward"])


def test_a_package_with_damaged_bytes_is_compiled_again_with_a_warning(saved, copied, compiles, caplog):
    """Bytes changed inside a forward package (loaded as it was, one whose weights were damaged decoded other logits
    without a word; unfrozen, as here, a package holds code alone)."""
    folder, forward, step = copied
    data = forward.read_bytes()
    at = len(data) // 2
    damaged = data[:at] + bytes(255 - byte for byte in data[at : at + 64]) + data[at + 64 :]
    forward.write_bytes(damaged)
    logits, outputs = run_saved(saved["model"], folder)
    assert_as_saved(saved, logits, outputs)
    assert caplog.text.count("does not match its digest") == 1 and f"The saved forward {forward} " in caplog.text
    assert compiles == [f"{forward.stem}.{os.getpid()}.partial.pt2"]  # that package alone compiled again
    assert forward.read_bytes() != damaged  # replaced, with a digest of its own
    assert packages_refusion.package_problem(forward, json.loads(digest_path(forward).read_text())["key"]) is None
    run_saved(saved["model"], folder)  # a later process loads it as it is now
    assert len(compiles) == 1 and caplog.text.count("does not match its digest") == 1


def test_another_package_put_under_a_package_s_name_is_caught_by_the_key_in_its_digest(saved, copied, compiles, caplog):
    """The forward and the step package swapped, each with its digest (both whole and valid, their sha256s right):
    loaded as they were, the forward failed inside AOTInductor's runner. The key recorded beside each catches it."""
    folder, forward, step = copied
    for one, other in ((forward, step), (digest_path(forward), digest_path(step))):
        os.replace(one, folder / "swapping")
        os.replace(other, one)
        os.replace(folder / "swapping", other)
    logits, outputs = run_saved(saved["model"], folder)
    assert_as_saved(saved, logits, outputs)
    assert caplog.text.count("was built for another key") == 2
    assert f"The saved forward {forward} " in caplog.text and f"The saved step {step} " in caplog.text
    assert len(compiles) == 2


def test_a_package_without_its_digest_is_compiled_again_with_a_warning(saved, copied, compiles, caplog):
    """A package whose digest is gone (or never written: a package of a version before digests, a build killed
    between its rename and its digest) is not trusted."""
    folder, forward, step = copied
    digest_path(step).unlink()
    logits, outputs = run_saved(saved["model"], folder)
    assert_as_saved(saved, logits, outputs)
    assert caplog.text.count("has no digest beside it") == 1 and f"The saved step {step} " in caplog.text
    assert len(compiles) == 1 and digest_path(step).exists()


def test_without_the_loader_s_private_boxed_run_packages_run_through_their_public_call_with_one_warning(
    saved, compiles, monkeypatch, caplog
):
    """`boxed_run` is a private hook of AOTInductor's package loader (`PackageRunner`): where a torch renames it, the
    saved forward and step run through their packages' public calls (a forward's keys and values as lists), give
    what they gave, and a process says so once. Where the loader has it, the runner is the loader itself."""
    assert isinstance(packages_refusion.load_package(saved["step"]), torch._C._aoti.AOTIModelPackageLoader)
    load = torch._inductor.aoti_load_package

    class Hidden:
        """A loaded package whose loader has no `boxed_run`: its public call only."""

        def __init__(self, path: str):
            self.compiled, self.loader, self.calls = load(path), object(), 0

        def __call__(self, *arguments):
            self.calls += 1
            return self.compiled(*arguments)

        def __getattr__(self, name: str):  # (its other public methods: metadata, constants)
            return getattr(self.compiled, name)

    loaded = []
    monkeypatch.setattr(torch._inductor, "aoti_load_package", lambda path: loaded.append(Hidden(path)) or loaded[-1])
    monkeypatch.setattr(packages_refusion.PackageRunner, "warned", False)
    for _ in range(2):  # (loaded again: one warning a process all the same)
        logits, outputs = run_saved(saved["model"], saved["folder"])
        assert_as_saved(saved, logits, outputs)
    assert sorted(package.calls for package in loaded) == [1, 1, 2, 2]  # each run: the step once, the forward twice
    warnings = [record for record in caplog.records if record.levelname == "WARNING"]
    assert len(warnings) == 1 and "without the loader's `boxed_run`" in warnings[0].getMessage()
    assert not compiles


LOAD_STEP = """
import sys
from pathlib import Path
import torch
from decisions_refusion import greedy_distributions
from packages_refusion import SavedStep
scores = torch.randn(3, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
torch.save(SavedStep(greedy_distributions, Path(sys.argv[1]), ({0: "rows"}, None))(scores, 20), sys.argv[2])
"""


def python_process(script: str, *arguments, **options) -> subprocess.Popen:
    """A Python process running `script` with `arguments`, this repository and its tests importable."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    return subprocess.Popen([sys.executable, "-c", script, *map(str, arguments)], env=environment, **options)


def test_a_package_whose_code_was_damaged_is_compiled_again_and_the_process_lives(saved, copied, tmp_path):
    """Bytes of a step package's compiled code overwritten: loaded as it was, the process died (SIGSEGV or
    SIGILL, inside torch). Here, in a process of its own: a warning naming the package, and the results as before."""
    folder, forward, step = copied
    data = bytearray(step.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 20000] = random.Random(0).randbytes(20000)
    step.write_bytes(bytes(data))
    results = tmp_path / "results.pt"
    process = python_process(LOAD_STEP, folder, results, stderr=subprocess.PIPE, text=True)
    _, errors = process.communicate(timeout=300)
    assert process.returncode == 0, errors[-2000:]
    assert f"The saved step {step} does not match its digest" in errors
    assert all(torch.equal(got, wanted) for got, wanted in zip(torch.load(results), saved["outputs"]))


BUILD_AND_STALL = """
import sys, time
from pathlib import Path
import torch
from test_generation import sharpened_model
from test_saved_forwards import compile_config
from test_static_cache import causal_forward
from packages_refusion import SavedForwards

compile_package = torch._inductor.aoti_compile_and_package

def stalled(exported, package_path, **kwargs):
    compile_package(exported, package_path=package_path, **kwargs)
    print("written", package_path, flush=True)
    time.sleep(600)  # (killed here: the partial file written whole, not yet renamed)

torch._inductor.aoti_compile_and_package = stalled
model = sharpened_model("llama", scale=4.0)
causal_forward(model, SavedForwards(model, compile_config(), Path(sys.argv[1])), 2)
"""


def test_a_build_killed_before_its_package_was_renamed_leaves_a_folder_later_decodes_use(
    saved, tmp_path, compiles, monkeypatch
):
    """A process killed (SIGKILL) while it builds a package leaves its partial file and no package: a later process
    compiles the package and gets the logits of an undisturbed build, never reading the partial file; the first
    process to use the folder once the partial file is `PARTIAL_STALE` old removes it."""
    folder = tmp_path / "saved"
    process = python_process(BUILD_AND_STALL, folder, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines, deadline = [""], time.monotonic() + 300
    try:  # (until the line that says the partial file is written; the libraries print others, and an end is "")
        while select.select([process.stdout], [], [], max(deadline - time.monotonic(), 0))[0]:
            lines.append(process.stdout.readline())
            if not lines[-1] or lines[-1].startswith("written"):
                break
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert lines[-1].startswith("written"), lines
    (partial,) = folder.iterdir()
    assert partial.name == f"{saved['forward'].stem}.{process.pid}.partial.pt2" and partial.stat().st_size > 0

    model = saved["model"]
    _, logits = causal_forward(model, SavedForwards(model, compile_config(), folder), 2)
    assert torch.equal(logits, saved["logits"]) and len(compiles) == 1
    assert partial.exists()  # young: it may be a live build's

    stale = time.time() - packages_refusion.PARTIAL_STALE - 60
    os.utime(partial, (stale, stale))
    monkeypatch.setattr(packages_refusion, "SWEPT_FOLDERS", set())  # as a new process
    _, logits = causal_forward(model, SavedForwards(model, compile_config(), folder), 2)
    assert torch.equal(logits, saved["logits"]) and len(compiles) == 1
    assert sorted(path.name for path in folder.iterdir()) == [saved["forward"].name, f"{saved['forward'].name}.digest"]


# ---- load_or_build_package with stand-in packages (bytes naming their key) ----------------------------------------
def package_of(key: str):
    """The `build` and `load` of a stand-in package of `key`, and the keys built."""
    built = []

    def build(package_path: str) -> None:
        built.append(key)
        Path(package_path).write_text(f"a package for {key}")

    return build, Path.read_text, built


def test_a_package_is_loaded_only_with_a_digest_of_its_own_key_and_bytes(tmp_path, caplog):
    first, second = tmp_path / "first.pt2", tmp_path / "second.pt2"
    for path, key in ((first, "one"), (second, "two")):
        build, load, built = package_of(key)
        assert load_or_build_package(path, key, build, "forward", load) == f"a package for {key}" and built == [key]
        assert load_or_build_package(path, key, build, "forward", load) == f"a package for {key}" and len(built) == 1
    assert not caplog.text

    cases = {
        "does not match its digest": lambda: (first.write_text("a package for two"), second.write_text("damaged")),
        "was built for another key": lambda: (os.replace(digest_path(first), tmp_path / "digest"),
                                              os.replace(digest_path(second), digest_path(first)),
                                              os.replace(tmp_path / "digest", digest_path(second))),
        "has an unreadable digest": lambda: (digest_path(first).write_text("{not json"),
                                             digest_path(second).write_text('["a list"]')),
        "has no digest beside it": lambda: (digest_path(first).unlink(), digest_path(second).unlink()),
    }  # fmt: skip
    for problem, damage in cases.items():
        caplog.clear()
        damage()
        for path, key in ((first, "one"), (second, "two")):
            build, load, built = package_of(key)
            assert load_or_build_package(path, key, build, "step", load) == f"a package for {key}" and built == [key]
            assert f"The saved step {path} {problem}" in caplog.text
        assert caplog.text.count(problem) == 2 and len(caplog.records) == 2
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "first.pt2", "first.pt2.digest", "second.pt2", "second.pt2.digest"
    ]  # fmt: skip


def test_a_package_that_passes_its_digest_but_does_not_load_is_compiled_again(tmp_path, caplog):
    """(Built elsewhere, say: a machine whose code it cannot run.)"""
    path = tmp_path / "package.pt2"
    build, load, built = package_of("key")
    load_or_build_package(path, "key", build, "forward", load)
    loads = []

    def refusing_once(package: Path) -> str:
        loads.append(package)
        if len(loads) == 1:
            raise RuntimeError("cannot run it here")
        return load(package)

    assert load_or_build_package(path, "key", build, "forward", refusing_once) == "a package for key"
    assert built == ["key", "key"] and f"The saved forward {path} did not load (RuntimeError" in caplog.text


def test_a_failed_build_leaves_no_partial_file_and_the_folder_as_it_was(tmp_path):
    path = tmp_path / "package.pt2"

    def failing(package_path: str) -> None:
        Path(package_path).write_text("half a package")
        raise RuntimeError("the compiler failed")

    with pytest.raises(RuntimeError, match="the compiler failed"):
        load_or_build_package(path, "key", failing, "forward", Path.read_text)
    assert not any(tmp_path.iterdir())


def test_partial_files_left_by_killed_builds_are_removed_once_stale(tmp_path):
    """The partial files of packages, of rival packages and of digests that are `PARTIAL_STALE` old are removed on
    a process's first package in the folder; younger ones (a live build's) and other files stay."""
    stale = time.time() - packages_refusion.PARTIAL_STALE - 60
    names = {
        "a.123.partial.pt2": False, "a.123.partial.rival.pt2": False, "a.pt2.digest.123.partial": False,
        "b.456.partial.pt2": True, "notes.partial": True, "c.pt2": True,
    }  # fmt: skip
    for name in names:
        (tmp_path / name).write_text(name)
        if name != "b.456.partial.pt2":  # (young)
            os.utime(tmp_path / name, (stale, stale))
    build, load, built = package_of("key")
    load_or_build_package(tmp_path / "d.pt2", "key", build, "forward", load)
    kept = {name for name, kept in names.items() if kept} | {"d.pt2", "d.pt2.digest"}
    assert {path.name for path in tmp_path.iterdir()} == kept


def test_a_bounded_folder_evicts_the_least_recently_used_packages_and_nothing_else(tmp_path, monkeypatch, caplog):
    """With a bound (`compile_cache_max_gb`), a build is followed by evicting the least recently used whole packages
    (each with its digest) until the folder's packages fit: a load marks a package used, and a package this process
    has loaded stays; partial files and a user's own files are never touched. Where the packages in use alone exceed
    the bound, one warning."""
    monkeypatch.setattr(packages_refusion, "IN_USE", set())
    monkeypatch.setattr(packages_refusion, "BOUND_WARNED", set())
    names = [f"{index:032x}.pt2" for index in range(4)]  # as `SavedForwards.path` names packages
    old = time.time() - 1000
    for age, name in enumerate(names[:3]):  # three packages of 100 bytes, other processes', the first the oldest
        (tmp_path / name).write_bytes(bytes(100))
        packages_refusion.write_package_digest(tmp_path / name, name, packages_refusion.file_digest(tmp_path / name))
        os.utime(tmp_path / name, (old + age, old + age))
    for name in ("mine.pt2", f"{names[0]}.123.partial.pt2"):  # a user's file, a live build's partial file
        (tmp_path / name).write_bytes(bytes(500))
        os.utime(tmp_path / name, (old - 10, old - 10))
    unbuilt = pytest.fail  # (the packages already there load, unbuilt)
    assert load_or_build_package(tmp_path / names[1], names[1], unbuilt, "step", Path.read_bytes) == bytes(100)
    monkeypatch.setitem(packages_refusion.FOLDER_BOUNDS, tmp_path, 200)
    load_or_build_package(tmp_path / names[3], names[3], lambda path: Path(path).write_bytes(bytes(50)), "step",
                          Path.read_bytes)  # fmt: skip
    # 350 bytes of packages: the least recently used (the first, then the third) go until 200 fit; the second (loaded
    # by this process: used now) and the new one stay
    left = {path.name for path in tmp_path.iterdir()}
    assert left == {names[1], f"{names[1]}.digest", names[3], f"{names[3]}.digest", "mine.pt2",
                    f"{names[0]}.123.partial.pt2"}  # fmt: skip
    assert not caplog.text

    packages_refusion.bound_folder(tmp_path, 100)  # both left are in use: kept, with one warning
    packages_refusion.bound_folder(tmp_path, 100)
    assert {path.name for path in tmp_path.iterdir()} == left
    assert caplog.text.count("over its bound of 0.00 GB (compile_cache_max_gb); none of them is evicted") == 1


def test_compile_cache_max_gb_needs_a_folder_and_a_positive_size(tmp_path):
    model = sharpened_model("llama", scale=4.0)
    saved = dict(cache_implementation="static", compile_config=compile_config(), compile_cache_dir=str(tmp_path))
    for bad in (0, -1.0, float("inf"), float("nan"), "4GB", True):
        with pytest.raises(ValueError, match="compile_cache_max_gb must be a finite number of gigabytes > 0"):
            model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=4, compile_cache_max_gb=bad, **saved)
    with pytest.raises(ValueError, match="compile_cache_max_gb bounds the packages in compile_cache_dir"):
        model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=4, compile_cache_max_gb=1.0)
    compiled_backbone(model, compile_config(), tmp_path, 2.5)  # (what `generate` passes on; nothing compiles yet)
    assert packages_refusion.FOLDER_BOUNDS[tmp_path] == 2_500_000_000
    compiled_backbone(model, compile_config(), tmp_path)
    assert tmp_path not in packages_refusion.FOLDER_BOUNDS
