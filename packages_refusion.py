"""Saved forwards: a static-cache decode's forwards compiled ahead of time and kept on disk (`compile_cache_dir=`).

`SavedForwards` exports the backbone once per input shape (batch size, width, cache length), compiles it
with AOTInductor into a package in the folder and loads it in later processes instead of compiling. Packages are built
under partial names and renamed when whole, checked against a digest when loaded and rebuilt when damaged
(`load_or_build_package`). `SavedStep` does the same for the decode's step functions. This module reaches into
torch's AOTInductor runtime in one place, where no public API does the job (`PackageRunner`), with a fallback that
keeps decoding, slower, with one warning. Only `compiling_refusion.compiled_backbone` imports it, and
only for a decode that asked for saved forwards.
"""

import copy
import dataclasses
import hashlib
import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import CompileConfig
from transformers import __version__ as transformers_version
from transformers.utils import logging

try:
    from .compiling_refusion import (
        compiled_steps,
        cpu_kernel_configs,
        cpu_name,
        device_name,
        freezes_weights,
        graph_logits_width,
        source_digest,
    )
    from .decisions_refusion import (
        copy_drafts,
        score_infill,
        score_plan,
        score_verify,
        static_mask,
    )
    from .executor_refusion import SlotCache
    from .settings_refusion import attention_fingerprint
except ImportError:  # installed as top-level modules rather than loaded as Hub remote code
    from compiling_refusion import (
        compiled_steps,
        cpu_kernel_configs,
        cpu_name,
        device_name,
        freezes_weights,
        graph_logits_width,
        source_digest,
    )
    from decisions_refusion import (
        copy_drafts,
        score_infill,
        score_plan,
        score_verify,
        static_mask,
    )
    from executor_refusion import SlotCache
    from settings_refusion import attention_fingerprint

logger = logging.get_logger(__name__)

SHAPES_REMEMBERED = 1024  # a `SavedStep`'s runners by exact input shapes (the text's length varies by prompt)
# Where a saved forward is compiled two ways and the faster kept (`SavedForwards`), each runs this many times in turn
# on the forward's own inputs, the first of each untimed.
PACKAGE_RACE_ROUNDS = 6
# Forwards of up to this many new tokens are narrow: where a CPU's GEMM backends are picked for them apart from the
# wider forwards' (`SavedForwards`: AMX, AVX512-BF16 without AMX).
NARROW_WIDTH = 8
# A package's partial file (`load_or_build_package`) this many seconds old was left by a build that was killed: a live
# build renames its partial within minutes (the longest wait: a rival compiled beside it, `SavedForwards.keep_faster`).
PARTIAL_STALE = 3600.0
# The metadata of a saved forward built without its constants, which runs on the model's own tensors (`load_forward`).
MODEL_CONSTANTS = {"refusion_constants": "the model's own tensors"}
# The inductor configs of such a package: no constants in it, small ones kept as tensors too (inductor writes them
# into the code otherwise), and matrix products from ATen, which takes the weights as they are (inductor's C++ GEMM
# template makes a packed copy of each, a constant of the package's own).
BARE_PACKAGE = {
    "aot_inductor.package_constants_in_so": False,
    "always_keep_tensor_constants": True,
    "max_autotune_gemm_backends": "ATEN",
    "aot_inductor.metadata": MODEL_CONSTANTS,
}


class SavedForwards:
    """The backbone's forwards compiled ahead of time (`torch.export`, then AOTInductor with the compile config's mode
    and options), one package per input shape (batch size, width, cache length), kept in `folder` as `<key>.pt2`: a
    later process loads a package where `torch.compile` traces and compiles again (each width, even with inductor's disk
    cache warm, and longest with frozen weights). With frozen weights a package holds them, packed: each package its
    own copy, in memory too. Unfrozen, a package is built without them and runs on the model's own tensors, bound when
    it loads (`load_forward`): one copy of the weights whatever the number of packages, and a package serves any
    weights of the same names, dtypes and shapes. The key (`saved_forward_key`) covers what a package depends on: the
    weights (their contents where frozen), the model's class, config, dtype and device, the compile config, this
    file's source and the versions of torch and transformers. A package is checked against the digest kept
    beside it before it loads, and one that fails (damaged, another key's, or without a digest) or does not load (built
    elsewhere) is compiled again, with a warning (`load_or_build_package`). Packages are written whole (to a partial
    file, then renamed), so processes may share a folder. Called as the compiled backbone is (`run_model`); CUDA graphs
    (`mode="reduce-overhead"`) do not apply to packages.

    On a CPU without oneDNN's bfloat16 kernels (AVX2), autotuned forwards with frozen weights take their matrix
    products from inductor's C++ template alone (`max_autotune_gemm_backends="CPP"`, unless the compile config names
    the backends): AOTInductor free to choose took ATen's unpacked product for some linear layers of a narrow
    package, which then cost well above its one-query package, where `torch.compile`, free or not, takes the template
    throughout (the like on CUDA: pytorch/pytorch#180811). Where the template has no kernel for some product (a dtype
    it does not cover), the package is compiled with the backends the config gives. Where oneDNN has bfloat16 kernels
    (AVX512-BF16, AMX) autotuning chooses freely: without AMX the template multiplies bfloat16 in float32, and
    autotuning takes oneDNN's packed product for the wider forwards, which the template alone would make dearer.

    On a CPU with AMX (`amx_bfloat16`), autotuned forwards with frozen weights of up to `NARROW_WIDTH` new tokens take
    their products from inductor's C++ template alone: there autotuning takes it for each width anyway, but left to
    choose for a width it does not know it took oneDNN's, the slower. Each package holds its own copy of the (packed)
    weights, as everywhere.

    On a CPU with oneDNN's bfloat16 kernels but no AMX (AVX512-BF16 alone), autotuned forwards with frozen weights of up
    to `NARROW_WIDTH` new tokens are compiled twice, as configured and with oneDNN's packed products alone
    (`max_autotune_gemm_backends="ATEN"`), and the package whose forward runs faster on the forward's own inputs is the
    one kept (`race_packages`). Autotuning times each product alone with its weights in the caches, where the template
    wins at narrow widths; a forward streams all the weights, where oneDNN's kernels (AVX512-BF16) can do better, and
    which does depends on the processor. The race costs a second compile of the narrow widths."""

    def __init__(self, model, compile_config: CompileConfig, folder: Path):
        if compile_config.backend != "inductor":
            raise ValueError(
                f"compile_cache_dir keeps forwards compiled by inductor (AOTInductor); the compile config asks for "
                f"backend={compile_config.backend!r}."
            )
        mode_options = torch._inductor.list_mode_options(compile_config.mode or "default")
        mode_options.pop("triton.cudagraphs", None)
        configs = cpu_kernel_configs(model.device, {**mode_options, **(compile_config.options or {})})
        self.attempts = [configs]  # the inductor configs to compile a package with, in turn until one compiles
        autotuned = configs.get("max_autotune") or configs.get("max_autotune_gemm")
        # autotuned CPU packages with frozen weights whose GEMM backends this class picks (the config names none)
        picks_backends = model.device.type == "cpu" and autotuned and freezes_weights(compile_config) \
            and "max_autotune_gemm_backends" not in configs  # fmt: skip
        if picks_backends and not onednn_bfloat16():
            self.attempts = template_first(configs)
        # Unfrozen, a package's constants are the weights as they are: it is built without them and runs on the
        # model's own tensors, given it when it loads (`load_forward`). Frozen, they are packed copies it must hold.
        self.shares_weights = not freezes_weights(compile_config)
        self.model, self.folder, self.runners = model, folder, {}
        self.bound = {}  # by shape, the tensors a package built without its constants runs on: kept alive with it
        self.fingerprint = saved_forward_key(model, compile_config)
        self.logits_width = graph_logits_width(compile_config)
        # the inductor configs of the packages of up to `NARROW_WIDTH` new tokens, in turn; None: as the others'
        self.narrow_attempts = template_first(configs) if picks_backends and amx_bfloat16(model.device) else None
        # the inductor configs a narrow width's package races against, in turn; None: compiled as configured alone
        self.rival_attempts = None
        if picks_backends and onednn_bfloat16() and not amx_bfloat16(model.device):
            self.rival_attempts = [{**configs, "max_autotune_gemm_backends": "ATEN"}]
        # the decoder's attention masks, scoring, whole infill rounds and copied drafts, compiled ahead of time beside
        # the forwards (sampling's infill decision stays compiled)
        self.steps = dataclasses.replace(
            compiled_steps(),
            copy_drafts=SavedStep(copy_drafts, folder, ({0: "text"}, *[{0: "slots"}] * 3, None, None)),
            static_mask=SavedStep(static_mask, folder, (
                {0: "rows"}, {0: "rows"}, {0: "columns"}, {0: "rows", 1: "columns"}, *[{0: "rows", 1: "width"}] * 4,
                None,
            )),
            score_infill=SavedStep(score_infill, folder, (
                {0: "logits"}, *[{0: "slots"}] * 4, {0: "eos"}, None, {}, {0: "text"}, {0: "slots"}, None, None,
            )),
            score_verify=SavedStep(score_verify, folder, (
                {0: "slots", 1: "width"}, {0: "slots"}, {0: "eos"}, None, {}, {}, {0: "text"}, {0: "slots"}, None,
            )),
            score_plan=SavedStep(score_plan, folder, (
                {0: "slots", 1: "width"}, {0: "slots"}, {0: "eos"}, None, {}, {0: "text"}, {0: "slots"}, None,
            )),
        )  # fmt: skip

    def __call__(self, input_ids, position_ids, attention_mask, cache: "SlotCache", use_cache: bool = True):
        shape = (*input_ids.shape, cache.max_cache_len)
        attention_mask = attention_mask.contiguous()  # (the package's input was exported contiguous)
        if shape not in self.runners:
            inputs = (
                input_ids, position_ids, attention_mask, cache.columns,
                [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers],
            )  # fmt: skip
            self.runners[shape] = self.load_or_compile(shape, inputs, cache)
        # the package's inputs as its pytree flattens them, run boxed: its own call reads its specs from JSON and
        # flattens the inputs every time
        flat = [input_ids, position_ids, attention_mask, cache.columns]
        flat += [layer.keys for layer in cache.layers] + [layer.values for layer in cache.layers]
        return self.runners[shape].boxed_run(flat)[0]

    def __deepcopy__(self, memo):
        return self  # a deep copy of the model compiles its own (`compiled_backbone` checks whose layers these are)

    def key(self, shape: tuple[int, int, int]) -> str:
        """What the package of forwards of `shape` (batch size, width, cache length) is built for."""
        return f"{self.fingerprint} | batch {shape[0]}, width {shape[1]}, cache {shape[2]}"

    def path(self, shape: tuple[int, int, int]) -> Path:
        """Where the package of forwards of `shape` (batch size, width, cache length) is kept."""
        return self.folder / f"{hashlib.sha256(self.key(shape).encode()).hexdigest()[:32]}.pt2"

    @property
    def kind(self) -> str:
        """The forwards' path as a price table's key names it (`price_key`)."""
        return "saved (AOTInductor)"

    def load_or_compile(self, shape: tuple[int, int, int], inputs: tuple, cache: "SlotCache"):
        """The runner of the package of forwards of `shape`, loaded, or compiled first (from `inputs`, over `cache`)."""
        narrow = self.narrow_attempts is not None and shape[1] <= NARROW_WIDTH

        head = self.model.get_output_embeddings() if shape[1] <= self.logits_width else None
        backbone = ExportedBackbone(self.model.get_decoder(), cache, head)
        tensors = dict(backbone.named_parameters(remove_duplicate=False))
        tensors.update(backbone.named_buffers(remove_duplicate=False))

        def build(package_path: str):
            exported = torch.export.export(backbone, inputs, strict=False)
            attempts = self.narrow_attempts if narrow else self.attempts
            if self.shares_weights and set(exported.constants) <= set(tensors):
                # unfrozen: built without its constants, to run on the model's tensors (`load_forward`); kept so only
                # where every constant it names is one of them (inductor makes some of its own, e.g. packed weights)
                compile_package(exported, shape, [{**attempt, **BARE_PACKAGE} for attempt in attempts], package_path)
                if set(torch._inductor.aoti_load_package(package_path).get_constant_fqns()) <= set(tensors):
                    return
                logger.info(f"The forward of {shape} compiled with constants of its own; keeping them in its package.")
            compile_package(exported, shape, attempts, package_path)
            if self.rival_attempts and shape[1] <= NARROW_WIDTH:
                self.keep_faster(exported, shape, inputs, package_path)

        def load(path: Path):
            self.bound[shape] = tensors
            return load_forward(path, tensors)

        return load_or_build_package(self.path(shape), self.key(shape), build, "forward", load)

    def keep_faster(self, exported, shape: tuple, inputs: tuple, package_path: str) -> None:
        """Compile the forward `exported` again with `rival_attempts` beside the package at `package_path` and leave
        there whichever runs faster on `inputs` (the forward's own: they write the same keys and values at the same
        columns as the forward will). A rival that does not compile leaves the package as it is, with a warning."""
        rival = Path(package_path).with_name(f"{Path(package_path).stem}.rival.pt2")
        try:
            try:
                compile_package(exported, shape, self.rival_attempts, str(rival))
            except Exception as error:
                logger.warning(f"Compiling the forward of {shape} with oneDNN's products alone failed "
                               f"({type(error).__name__}: {str(error)[:300]}); keeping it as configured.")  # fmt: skip
                return
            flat = [*inputs[:4], *inputs[4], *inputs[5]]
            configured, alone = race_packages([package_path, str(rival)], flat)
            kept = "oneDNN's" if alone < configured else "as configured"
            logger.info(f"The forward of {shape}: {1e3 * configured:.2f} ms as configured, {1e3 * alone:.2f} ms with "
                        f"oneDNN's products alone; keeping the package {kept}.")  # fmt: skip
            if alone < configured:
                os.replace(rival, package_path)
        finally:
            rival.unlink(missing_ok=True)


def compile_package(exported, shape: tuple, attempts: list[dict], package_path: str) -> None:
    """Compile the forward of `shape` `exported` into an AOTInductor package at `package_path` with the first of the
    inductor configs `attempts` that compiles it (the earlier ones: inductor's C++ GEMM template alone)."""
    for attempt, configs in enumerate(attempts, 1):
        try:
            torch._inductor.aoti_compile_and_package(exported, package_path=package_path, inductor_configs=configs)
            return
        except Exception as error:
            if attempt == len(attempts):
                raise
            logger.warning(f"Compiling the forward of {shape} with inductor's C++ GEMM template alone failed "
                           f"({type(error).__name__}: {str(error)[:300]}); compiling it with the compile config's "
                           "GEMM backends.")  # fmt: skip


def race_packages(paths: list[str], inputs: list[torch.Tensor], rounds: int = PACKAGE_RACE_ROUNDS) -> list[float]:
    """Seconds the fastest run of each saved forward's package at `paths` took on the flat `inputs` (CPU), the packages
    run in turn `rounds` times (so that a busy moment of the machine falls on each alike), the first round untimed."""
    runners = [load_forward(Path(path)) for path in paths]
    seconds = [[] for _ in paths]
    for _ in range(rounds):
        for runner, times in zip(runners, seconds):
            start = time.perf_counter()
            runner.boxed_run(list(inputs))
            times.append(time.perf_counter() - start)
    return [min(times[1:]) for times in seconds]


class SavedStep:
    """A step function compiled ahead of time (`torch.export` with dynamic sizes, then AOTInductor), kept in `folder`
    beside the saved forwards, and called through its package's boxed run. On a CPU the decoder's step functions run
    right after a forward, whose weights have flushed the caches: there a `torch.compile` call pays for the Python
    layers of dynamo and AOTAutograd, cold, whatever it computes, and a package's boxed run for little but the
    computing.

    `dims` gives, for each argument, the axes whose size varies (named; axes of one name have one size), `{}` for a
    tensor whose sizes are fixed and None for an argument that is not a tensor. The other arguments and the fixed
    sizes and dtypes are constants of a package: each set of them has a package of its own (`key`). A call with a
    tensor of size 0 runs the function itself."""

    def __init__(self, function: Callable, folder: Path, dims: tuple[dict[int, str] | None, ...]):
        self.function, self.folder, self.dims, self.runners, self.by_shapes = function, folder, dims, {}, {}
        self.tensors = [index for index, axes in enumerate(dims) if axes is not None]
        self.axes = [dims[index] for index in self.tensors]

    def __call__(self, *arguments):
        if len(arguments) != len(self.dims):
            raise TypeError(f"{self.function.__name__} takes {len(self.dims)} arguments here, not {len(arguments)}.")
        tensors = [arguments[index].contiguous() for index in self.tensors]
        if any(0 in tensor.shape for tensor in tensors):  # (a package serves sizes from 1 up)
            return self.function(*arguments)
        constants = tuple(argument for argument, axes in zip(arguments, self.dims) if axes is None)
        # (the runner by the exact shapes first: the signature's per-axis loop would run for every tensor of a call)
        shapes = (constants, *((tensor.dtype, tensor.device, tensor.shape) for tensor in tensors))
        runner = self.by_shapes.get(shapes)
        if runner is None:
            signature = tuple(
                (tensor.dtype, tensor.device, *(-1 if axis in axes else size for axis, size in enumerate(tensor.shape)))
                for tensor, axes in zip(tensors, self.axes)
            )
            runner = self.runners.get((signature, constants))
            if runner is None:
                runner = self.runners[signature, constants] = self.load_or_compile(arguments, signature, constants)
            if len(self.by_shapes) >= SHAPES_REMEMBERED:
                self.by_shapes.clear()
            self.by_shapes[shapes] = runner
        return tuple(runner.boxed_run(tensors))

    def key(self, signature: tuple, constants: tuple) -> str:
        """What a package depends on: the function, its constants and fixed sizes, this file's source, the versions
        of torch and transformers and the processor."""
        return " | ".join([
            self.function.__name__, repr(signature), repr(constants), repr(self.dims), source_digest(),
            f"torch {torch.__version__}, transformers {transformers_version}, {cpu_name()}",
        ])  # fmt: skip

    def load_or_compile(self, arguments: tuple, signature: tuple, constants: tuple):
        def build(package_path: str):
            # Traced on zeros in which every varying size is at least 2 (a size of 1 would be taken as fixed); the
            # package serves sizes from 1 up.
            named = {}
            for argument, axes in zip(arguments, self.dims):
                for axis, name in (axes or {}).items():
                    named[name] = max(named.get(name, 2), argument.shape[axis])
            dimensions = {name: torch.export.Dim(name.replace(" ", "_"), min=1) for name in named}
            examples, shapes = [], []
            for index in self.tensors:
                tensor, axes = arguments[index], self.dims[index]
                size = [named[axes[axis]] if axis in axes else length for axis, length in enumerate(tensor.shape)]
                examples.append(torch.zeros(size, dtype=tensor.dtype, device=tensor.device))
                shapes.append({axis: dimensions[name] for axis, name in axes.items()} or None)
            module = StepModule(self.function, arguments, self.tensors)
            exported = torch.export.export(module, tuple(examples), dynamic_shapes=(tuple(shapes),), strict=False)
            configs = cpu_kernel_configs(examples[0].device, {})
            torch._inductor.aoti_compile_and_package(exported, package_path=package_path, inductor_configs=configs)

        key = self.key(signature, constants)
        path = self.folder / f"step-{hashlib.sha256(key.encode()).hexdigest()[:32]}.pt2"
        return load_or_build_package(path, key, build, "step")


def load_package(path: Path, arguments: Callable[[list], tuple] = tuple):
    """The runner of the AOTInductor package at `path`: its `boxed_run` takes the flat inputs and gives the flat
    outputs (`PackageRunner.of`; `arguments` makes the flat inputs the package's arguments where that needs them)."""
    return PackageRunner.of(torch._inductor.aoti_load_package(str(path)), arguments)


class PackageRunner:
    """The one place that runs saved AOTInductor packages through a private hook, and the fallback where it is gone.

    `torch._inductor.aoti_load_package(path)` gives an `AOTICompiledModel`, whose public call takes the arguments
    the package was exported with and on every call reads the package's input and output specs (JSON) and flattens
    and unflattens by them. Its `loader` (a `torch._C._aoti.AOTIModelPackageLoader`) has `boxed_run(flat)`, private:
    the package run on its flat input tensors with nothing else done, which the decode's many small calls take. `of`
    decides once, at load: where the loader has a `boxed_run` it is the runner itself (calls cost what they did);
    where not (renamed or gone in another torch), the runner is this adapter, whose `boxed_run` makes the flat inputs
    the package's arguments (`arguments`: a step's tensors as they are, a forward's `forward_arguments`), makes the
    public call and flattens its outputs: decoding as before, slower, with one warning a process."""

    warned = False  # whether this process has warned that packages run through their public call

    def __init__(self, compiled, arguments: Callable[[list], tuple]):
        self.compiled, self.arguments = compiled, arguments

    @classmethod
    def of(cls, compiled, arguments: Callable[[list], tuple] = tuple):
        """The runner of the loaded package `compiled`: its loader where it has `boxed_run`, else an adapter."""
        loader = getattr(compiled, "loader", None)
        if callable(getattr(loader, "boxed_run", None)):
            return loader
        if not cls.warned:
            cls.warned = True
            logger.warning(f"This torch ({torch.__version__}) loads AOTInductor packages without the loader's "
                           "`boxed_run`; saved forwards and steps run through the packages' public call instead, "
                           "which costs more a call.")  # fmt: skip
        return cls(compiled, arguments)

    def boxed_run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return flat_tensors(self.compiled(*self.arguments(inputs)))


def flat_tensors(outputs) -> list:
    """`outputs` (a tensor, or tuples and lists of them, nested) as a flat list in order."""
    if isinstance(outputs, (tuple, list)):
        return [leaf for output in outputs for leaf in flat_tensors(output)]
    return [outputs]


def forward_arguments(inputs: list[torch.Tensor]) -> tuple:
    """A saved forward's flat inputs (the ids, positions, mask and write columns, every layer's keys, then every
    layer's values) as `ExportedBackbone.forward` takes them: the keys and the values each a list."""
    layers = (len(inputs) - 4) // 2
    return (*inputs[:4], list(inputs[4 : 4 + layers]), list(inputs[4 + layers :]))


def load_forward(path: Path, tensors: dict[str, torch.Tensor] | None = None):
    """The runner of the saved forward's package at `path` (`load_package`, its arguments `forward_arguments`). A
    package built without its constants (`MODEL_CONSTANTS` in its metadata: unfrozen weights) runs on `tensors` (the
    exported backbone's parameters and buffers by name) themselves, not copies (AOTInductor's public `load_constants`
    with `user_managed=True`): its weights are the model's, in memory once whatever the number of packages, and an
    in-place change to them reaches it. A constant it names that `tensors` lacks raises a `ValueError` naming it."""
    compiled = torch._inductor.aoti_load_package(str(path))
    if compiled.get_metadata().get("refusion_constants") == MODEL_CONSTANTS["refusion_constants"]:
        tensors = tensors or {}
        names = compiled.get_constant_fqns()
        missing = sorted(set(names) - set(tensors))
        if missing:
            raise ValueError(f"The saved forward {path} takes constants the model does not have: {missing[:5]}.")
        compiled.load_constants({name: tensors[name] for name in names}, check_full_update=True, user_managed=True)
    return PackageRunner.of(compiled, forward_arguments)


def load_or_build_package(path: Path, key: str, build: Callable[[str], None], what: str, load: Callable = load_package):
    """The runner of the AOTInductor package kept at `path` for `key`, loaded by `load`. Before it loads, a package
    is checked against the digest kept beside it (`package_problem`): loaded unchecked, one with damaged bytes decoded
    wrong tokens without a word or crashed the process inside torch, and another key's package under its name failed
    inside its C++ runner. Where there is no package, or it fails the check or does not load (built elsewhere; these
    two with a warning naming the saved `what`), `build(package_path)` compiles it into a partial file that is then
    renamed to `path`, and its digest is written beside it (`write_package_digest`): a package is seen whole or not at
    all, so processes may share a folder. A build killed on the way leaves the folder as it was but for a partial
    file that nothing loads, removed once `PARTIAL_STALE` old (`remove_stale_partials`: on a process's first package
    in the folder, and before each build). It is built without autograd whatever the caller's grad mode: exported with
    grad enabled, the weights stay the graph's parameters and inductor's freezing leaves them out (a slower package,
    then kept under the same key for every later process).

    A package loaded is marked used (its time of change set to now) and kept in `IN_USE`; where the folder has a bound
    (`FOLDER_BOUNDS`: `generate(compile_cache_max_gb=...)`), each build is followed by `bound_folder`."""
    if path.parent not in SWEPT_FOLDERS:
        SWEPT_FOLDERS.add(path.parent)
        remove_stale_partials(path.parent)
    if path.exists():
        problem = package_problem(path, key)
        if problem is not None:
            logger.warning(f"The saved {what} {path} {problem}; compiling it again.")
        else:
            try:
                return used(path, load(path))
            except Exception as error:  # any failure to load means: compile it again
                logger.warning(f"The saved {what} {path} did not load ({type(error).__name__}: {error}); compiling "
                               "it again.")  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(path.parent)
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.pt2")
    try:
        with torch.no_grad():
            build(str(partial))
        digest = file_digest(partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    write_package_digest(path, key, digest)
    runner = used(path, load(path))
    if path.parent in FOLDER_BOUNDS:
        bound_folder(path.parent, FOLDER_BOUNDS[path.parent])
    return runner


def used(path: Path, runner):
    """`runner`, the package at `path` just loaded, after marking the package used: now its time of change, by which
    `bound_folder` evicts the least recently used first, and in `IN_USE`, which this process never evicts."""
    IN_USE.add(path)
    try:
        os.utime(path)
    except OSError:  # (a read-only folder: its packages are never evicted by this process either)
        pass
    return runner


# The bound in bytes of the packages in each folder this process builds in (`generate(compile_cache_max_gb=...)`,
# set by `compiling_refusion.compiled_backbone`); a folder not here is unbounded.
FOLDER_BOUNDS: dict[Path, int] = {}
IN_USE: set[Path] = set()  # the packages this process has loaded: never evicted by it
PACKAGE_NAME = re.compile(r"(step-)?[0-9a-f]{32}\.pt2")  # a whole package's name (`SavedForwards.path`, `SavedStep`)
BOUND_WARNED: set[Path] = set()  # the folders whose packages in use exceed their bound, warned of in this process


def bound_folder(folder: Path, limit: int) -> None:
    """Evict the least recently used packages in `folder` (whole packages, `PACKAGE_NAME`, used as `used` marks
    them), each with its digest, until the packages left take at most `limit` bytes. Nothing else in the folder is
    touched (partial files, a user's own files), nor any package this process has loaded (`IN_USE`): where those
    alone exceed `limit`, a warning, once a folder. Another process that loaded an evicted package keeps running it;
    the next process to need it compiles it again."""
    packages = []
    for name in filter(PACKAGE_NAME.fullmatch, os.listdir(folder)):
        try:
            status = (folder / name).stat()
        except OSError:  # (removed meanwhile by another process)
            continue
        packages.append((status.st_mtime, status.st_size, folder / name))
    total = sum(size for _, size, _ in packages)
    for _, size, path in sorted(packages):
        if total <= limit:
            return
        if path in IN_USE:
            continue
        try:
            path.unlink()
            digest_path(path).unlink(missing_ok=True)
        except OSError:  # (removed meanwhile by another process)
            pass
        total -= size
    if total > limit and folder not in BOUND_WARNED:
        BOUND_WARNED.add(folder)
        logger.warning(f"The packages this process runs take {total / 1e9:.2f} GB of {folder}, over its bound of "
                       f"{limit / 1e9:.2f} GB (compile_cache_max_gb); none of them is evicted.")  # fmt: skip


SWEPT_FOLDERS: set[Path] = set()  # the folders of packages whose stale partial files this process has removed
# the partial files of a package, of the rival compiled beside it (`SavedForwards.keep_faster`) and of a digest
PARTIAL_NAME = re.compile(r".+\.\d+\.partial(\.rival)?\.pt2|.+\.pt2\.digest\.\d+\.partial")


def remove_stale_partials(folder: Path) -> None:
    """Remove the partial files of packages and digests in `folder` (`PARTIAL_NAME`) at least `PARTIAL_STALE` old:
    left by builds that were killed. Younger ones may be a live build's, in this process or another."""
    try:
        names = os.listdir(folder)
    except OSError:  # (no folder yet)
        return
    now = time.time()
    for name in filter(PARTIAL_NAME.fullmatch, names):
        try:
            if now - (folder / name).stat().st_mtime >= PARTIAL_STALE:
                (folder / name).unlink()
        except OSError:  # (removed meanwhile by another process)
            continue


def digest_path(path: Path) -> Path:
    """Where the digest of the package at `path` is kept: beside it, as `<name>.digest`."""
    return path.with_name(f"{path.name}.digest")


def file_digest(path: Path) -> str:
    """The sha256 of the bytes of the file at `path` (hex)."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def package_problem(path: Path, key: str) -> str | None:
    """What is wrong with the package at `path` as the one built for `key`, or None where nothing is: the digest kept
    beside it (`digest_path`, JSON: the key and the sha256 of its bytes) is missing or unreadable, names another key
    (another package put under this name: files swapped or copied), or another sha256 than the file's (damaged since).
    Checked once, as the package loads (a loaded runner is kept), by hashing the whole file. The digest is read after
    the file, so that a package another process has just built again here is judged with its own."""
    record_path = digest_path(path)
    try:
        digest = file_digest(path)
    except OSError as error:
        return f"could not be read ({error})"
    try:
        record = json.loads(record_path.read_text())
    except FileNotFoundError:
        return f"has no digest beside it ({record_path.name})"
    except (OSError, ValueError) as error:
        return f"has an unreadable digest {record_path.name} ({type(error).__name__})"
    if not isinstance(record, dict) or not isinstance(record.get("key"), str):
        return f"has an unreadable digest {record_path.name} (no key)"
    if record["key"] != key:
        return f"was built for another key than its name's (per {record_path.name}: another package put in its place)"
    if record.get("sha256") != digest:
        return f"does not match its digest {record_path.name} (its bytes changed since it was written)"
    return None


def write_package_digest(path: Path, key: str, digest: str) -> None:
    """Keep beside the package at `path` (`digest_path`) the `key` it was built for and the sha256 of its bytes
    (`digest`), written whole (a partial file, then renamed). Where it cannot be, a warning: the next process to load
    the package compiles it again."""
    record = digest_path(path)
    partial = record.with_name(f"{record.name}.{os.getpid()}.partial")
    try:
        partial.write_text(json.dumps({"key": key, "sha256": digest}))
        os.replace(partial, record)
    except OSError as error:
        logger.warning(f"The digest of the saved package {path} could not be written to {record} ({error}); the "
                       "next process will compile the package again.")  # fmt: skip
    finally:
        partial.unlink(missing_ok=True)


class StepModule(torch.nn.Module):
    """A step function as `torch.export` takes it: its tensor arguments (at `tensors`) are the inputs, the others
    the `arguments` given here."""

    def __init__(self, function: Callable, arguments: tuple, tensors: list[int]):
        super().__init__()
        self.function, self.tensors = function, tensors
        self.arguments = [None if index in tensors else argument for index, argument in enumerate(arguments)]

    def forward(self, *tensors):
        arguments = list(self.arguments)
        for index, tensor in zip(self.tensors, tensors):
            arguments[index] = tensor
        return self.function(*arguments)


class ExportedBackbone(torch.nn.Module):
    """The backbone as `torch.export` takes it: the cache's key/value tensors and write columns are inputs (written in
    place), so a package serves any cache of the same shape. Returns the last hidden states, or with a `head` (the
    output layer) the logits."""

    def __init__(self, decoder, cache: "SlotCache", head=None):
        super().__init__()
        self.decoder, self.cache, self.head = decoder, cache, head

    def forward(self, input_ids, position_ids, attention_mask, columns, keys, values):
        cache = copy.copy(self.cache)  # the same cache over the inputs' tensors
        cache.layers = [copy.copy(layer) for layer in self.cache.layers]
        for layer, layer_keys, layer_values in zip(cache.layers, keys, values):
            layer.keys, layer.values = layer_keys, layer_values
        cache.columns = columns
        cache.rows = torch.arange(columns.shape[0], device=columns.device)[:, None]  # (in the graph, not a constant)
        output = self.decoder(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, cache=cache, use_cache=True
        )
        return output.last_hidden_state if self.head is None else self.head(output.last_hidden_state)


def template_first(configs: dict) -> list[dict]:
    """Inductor `configs` as attempts in turn: with inductor's C++ GEMM template as the only backend first, then as
    given where that differs (for products the template has no kernel for)."""
    template = {**configs, "max_autotune_gemm_backends": "CPP"}
    return [template] if template == configs else [template, configs]


def amx_bfloat16(device) -> bool:
    """Whether `device` is a CPU with AMX's bfloat16 tiles (Intel Sapphire Rapids and later)."""
    return torch.device(device).type == "cpu" and bool(torch.cpu.get_capabilities().get("amx_bf16"))


def onednn_bfloat16() -> bool:
    """Whether oneDNN has bfloat16 kernels for this CPU (AVX512-BF16 or AMX)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def saved_forward_key(model, compile_config: CompileConfig) -> str:
    """What a saved forward depends on besides its input shape, as one string (see `SavedForwards`): with frozen
    weights their contents (the package holds them), else their names, dtypes and shapes alone (it runs on the
    model's)."""
    frozen, weights = freezes_weights(compile_config), hashlib.blake2b(digest_size=16)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        weights.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
        if frozen and tensor.numel():
            weights.update(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
    return " | ".join([
        type(model).__name__,
        hashlib.sha256(model.config.to_json_string(use_diff=False).encode()).hexdigest()[:16],
        f"{'weights' if frozen else 'layout'} {weights.hexdigest()}",
        f"{device_name(model)} {model.dtype}, attention {attention_fingerprint(model)}",
        json.dumps(compile_config.to_dict(), sort_keys=True, default=str),
        source_digest(),
        f"torch {torch.__version__}, transformers {transformers_version}",
    ])  # fmt: skip
