"""Compiled forwards and step functions for a static-cache ReFusion decode (`compile_config=`).

`compiled_backbone` compiles the model's backbone once per model and config (with `compile_cache_dir`, ahead of time
into saved packages: `packages_refusion`, imported only then), `compiled_steps` the decode's step functions, and
`compile_forwards` warms up every width a decode may use, so that later decodes compile nothing. Also here: what
compiled code depends on (`device_name`, `source_digest`), which saved packages' keys and price tables hash.
"""

import copy
import functools
import hashlib
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import CompileConfig

try:
    from .decisions_refusion import EAGER_STEPS, StepFunctions
    from .decoder_refusion import PADDING
    from .executor_refusion import (
        LOGITS_IN_GRAPH_WIDTH,
        StaticLayout,
        run_model,
        slot_cache,
        width_buckets,
    )
    from .settings_refusion import attention_implementation
except ImportError:  # installed as top-level modules rather than loaded as Hub remote code
    from decisions_refusion import EAGER_STEPS, StepFunctions
    from decoder_refusion import PADDING
    from executor_refusion import (
        LOGITS_IN_GRAPH_WIDTH,
        StaticLayout,
        run_model,
        slot_cache,
        width_buckets,
    )
    from settings_refusion import attention_implementation


# The decoding's modules besides its entry point (`generation_refusion`, which runs none of the compiled code): saved
# packages' keys hash them (`source_digest`), and `write_custom_generate` copies them beside it. (The draft adapter's
# hooks run inside the compiled forwards.)
DECODING_FILES = (
    "settings_refusion.py",
    "adapter_refusion.py",
    "acceptance_refusion.py",
    "decisions_refusion.py",
    "decoder_refusion.py",
    "executor_refusion.py",
    "compiling_refusion.py",
    "prices_refusion.py",
    "packages_refusion.py",
)
RECOMPILE_LIMIT = 64  # graphs a compiled backbone may hold: width buckets x cache lengths x batch sizes
# Inductor's CPU kernels split a loop among the threads once each thread would get `cpp.min_chunk_size` elements
# (512 by default). A decoding forward's element-wise kernels (norms, RoPE, activations, the queries stacked for
# attention) over 2-8 new tokens hold a few thousand elements, for which starting and joining the threads costs more
# than the work: compiled forwards and steps on a CPU keep loops of fewer than `CPU_MIN_CHUNK` elements a thread on
# one thread (a compile config's own `cpp.min_chunk_size` option wins). Only how the loops are shared among the threads
# changes, not what they compute.
CPU_MIN_CHUNK = 8192


@functools.cache
def compiled_steps() -> StepFunctions:
    """`StepFunctions` under torch.compile with dynamic shapes, made once a process: a function's graphs serve every
    text length, cache length, width and vocabulary, save that dynamo gives sizes of one graphs of their own (one slot
    or several, one row or several, one new token or several; `warm_up_steps`), and so do dtypes and devices. A
    compiled call replaces dozens of small eager operations, which pays most for the functions of many operations on
    small tensors (copying drafts, the mask) and least for scoring many rows, whose work is the exponentials; right
    after a forward each compiled call also pays for a cold cache (see `SavedStep`)."""
    return StepFunctions(*(compile_step(getattr(EAGER_STEPS, field)) for field in StepFunctions.__dataclass_fields__))


def compile_step(function: Callable) -> Callable:
    """`function` under torch.compile with dynamic shapes and room for `RECOMPILE_LIMIT` graphs (dtypes, devices and
    sizes of one multiply them past dynamo's default of 8; torch before 2.13 keeps that default, past which the calls
    run eagerly: the same results, uncompiled)."""
    try:
        return torch.compile(function, dynamic=True, recompile_limit=RECOMPILE_LIMIT)
    except TypeError:  # a torch.compile without `recompile_limit`
        return torch.compile(function, dynamic=True)


def step_functions(compiled) -> StepFunctions:
    """The decoder's step functions for a decode through the `compiled` backbone (`compiled_backbone`; None: eager
    forwards): on a CPU beside saved forwards, all but sampling's infill decision compiled ahead of time too
    (`SavedForwards.steps`), else `compiled_steps()`."""
    saved_steps = getattr(compiled, "steps", None)  # saved forwards' own (`SavedForwards.steps`)
    if saved_steps is not None and compiled.model.device.type == "cpu":
        return saved_steps
    return compiled_steps() if compiled is not None else EAGER_STEPS


@torch.no_grad()  # (as decodes run: grad mode is among a graph's guards)
def warm_up_steps(model, lookup_drafts: int = 0, steps: StepFunctions | None = None) -> None:
    """Compile `compiled_steps()`'s greedy plan, verify and infill forwards scored whole (one slot and several, one
    row and several; infill rounds with `[MASK]` queries too where no drafts are copied; with `lookup_drafts` drafts
    copied), sampling's infill decisions (one slot and several) now, and with `lookup_drafts` the copying of that many
    drafts (one slot and several). The masks compile with the forwards (`compile_forwards`)."""
    device, vocab = model.device, model.get_output_embeddings().weight.shape[0]
    steps, eos = steps or compiled_steps(), torch.tensor([2, -1, -1], device=device)  # (as `SlotDecoder.eos`)
    threshold = torch.tensor(0.5, dtype=torch.float64, device=device)  # (as `SlotDecoder.token_threshold`)
    for rows in (1, 2):
        tokens = torch.zeros(rows, 4, dtype=torch.long, device=device)
        counts = torch.ones(rows, dtype=torch.long, device=device)  # (`ones_like` of a column keeps its stride)
        # (in float32, or wider: as `SlotDecoder._probabilities` gives them)
        probability = torch.full((rows, 4), 0.25, dtype=torch.promote_types(model.dtype, torch.float32), device=device)
        for redrafts in (None, tokens + 1):  # the model's own tokens, or `[MASK]` queries' (`fused_redraft`)
            steps.judge_infill(tokens, counts, counts + 2, tokens == 0, probability, tokens + 2, redrafts, eos, 0.5)
    # a whole infill round (`score_infill`): one slot with one row or several, several slots with several rows
    text = torch.zeros(16, dtype=torch.long, device=device)
    for slots, rows in ((1, 1), (1, 2), (2, 2)):
        at = 4 + torch.arange(slots * 4, device=device).view(slots, 4)
        # each slot's first token fresh, the first slot's next rows - slots drafts queried
        stored = torch.zeros(slots, dtype=torch.long, device=device)
        counts, until = stored + 1, stored + 2
        until[0] += rows - slots
        for fused in (False,) if lookup_drafts else (False, True):  # (fused: a `[MASK]` query per checked position)
            width = rows + (int((until - counts).sum()) if fused else 0)
            logits = torch.zeros(width, vocab, dtype=model.dtype, device=device)
            steps.score_infill(logits, at - 4, stored, counts, until, eos, model.config.mask_token_id, threshold,
                               text, at, lookup_drafts, fused)  # fmt: skip
    # a whole verify forward (`score_verify`): one slot or several, one token each or several
    keep_drafts = torch.tensor(False, device=device)
    for slots, width in ((1, 1), (1, 2), (2, 1), (2, 2)):
        logits = torch.zeros(slots, width, vocab, dtype=model.dtype, device=device)
        at = 4 + torch.arange(slots * 4, device=device).view(slots, 4)
        steps.score_verify(logits, at - 4, eos, model.config.mask_token_id, threshold, keep_drafts, text, at,
                           lookup_drafts)  # fmt: skip
        # a whole plan forward (`score_plan`): the slots' first tokens, or all of them
        steps.score_plan(logits, at - 4, eos, model.config.mask_token_id, threshold, text, at, lookup_drafts)
        if width == 1 and not lookup_drafts:  # slots of one token
            steps.score_plan(logits, at[:, :1] - 4, eos, model.config.mask_token_id, threshold, text, at[:, :1], 0)
    if lookup_drafts:
        warm_up_copies(device, lookup_drafts, model.config.mask_token_id, steps)


@torch.no_grad()  # (as decodes run: grad mode is among a graph's guards)
def warm_up_copies(device, count: int, unknown: int, steps: StepFunctions | None = None) -> None:
    """Compile `compiled_steps().copy_drafts` (or `steps.copy_drafts`) for `count` drafts on `device` now, for one slot
    and for several."""
    slot_size = 4  # (any size above one: sizes are dynamic)
    text = torch.zeros(4 * slot_size, dtype=torch.long, device=device)
    for slots in (1, 2):
        at = slot_size + torch.arange(slots * slot_size, device=device).view(slots, slot_size)
        counts = torch.ones(slots, dtype=torch.long, device=device)
        (steps or compiled_steps()).copy_drafts(text, at, torch.zeros_like(at), counts, count, unknown)


def compiled_backbone(
    model, compile_config: CompileConfig, saved_in: str | os.PathLike | None = None, saved_max_gb: float | None = None
):
    """The model's backbone (`get_decoder()`) under `torch.compile` with `compile_config`, compiled once per model and
    config, called as the backbone is and returning the last hidden states of its new tokens, or their logits where the
    new tokens number no more than its `logits_width` (see below; `run_model` reads it). Its graphs (one per width
    bucket, cache length and batch size) are reused by later `generate()` calls. They may number more than dynamo's
    default limit of graphs per function (8; past it a `fullgraph` compile fails), so the calls raise that limit to
    `RECOMPILE_LIMIT` while they run. The function compiled is this file's own (dynamo counts graphs per function:
    compiling `module.__call__` would share the count with every other compiled module, such as a compiled AR's).

    With inductor's weight freezing (`"freezing": True` among `compile_config.options`, which here may go with a
    `mode`, or `torch._inductor.config.freezing = True`), the weights become constants of the graphs, packed for the
    machine's GEMM kernels. Dynamo reads that switch while it traces, where torch.compile's options do not reach, so
    the calls set it themselves. Graphs then hold the weights of the moment they were compiled: when a weight has
    changed since (in place or replaced), a fresh backbone compiles again, so a decode never runs old weights. Then
    the graphs of up to `LOGITS_IN_GRAPH_WIDTH` new tokens also run the output layer (its `logits_width`; 0 without
    freezing, where a graph would multiply by the same unpacked weight as an eager call, over a whole bucket).

    With `saved_in` (a folder: `generate(compile_cache_dir=...)`) the forwards are compiled ahead of time instead and
    kept there (`SavedForwards`), so that a later process loads them rather than compiling; a weight change also
    means a fresh backbone (its packages hold frozen weights, or are bound to the model's tensors as they were).
    `saved_max_gb` bounds the packages kept there (`packages_refusion.bound_folder`: the least recently used go first);
    None: unbounded."""
    saved = Path(saved_in) if saved_in is not None else None
    weights = frozen_weights(model, compile_config, held=saved is not None)
    compiled = getattr(model, "_refusion_compiled", None)
    # The backbone's id too: a deep copy of the model carries this record, whose functions run the original's layers.
    # The attention implementation too: the graphs are traced through it.
    record = (compile_config, weights, saved, id(model.get_decoder()), attention_implementation(model))
    if compiled is None or compiled[:5] != record:
        if saved is not None:
            backbone = saved_packages()[0](model, compile_config, saved)
        else:
            arguments = compile_config.to_dict()
            options = {key: value for key, value in (arguments.pop("options") or {}).items() if key != "freezing"}
            freezing, logits_width = weights is not None, graph_logits_width(compile_config)
            compiled_function = torch.compile(
                decoder_function(model, logits_width), **arguments, options=options or None
            )

            kernels = cpu_kernel_configs(model.device, {"freezing": freezing})

            def backbone(**inputs):
                limit = max(RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)
                with torch._dynamo.config.patch(recompile_limit=limit), torch._inductor.config.patch(kernels):
                    return compiled_function(inputs)

            backbone.logits_width = logits_width

        compiled = (copy.deepcopy(compile_config), *record[1:], backbone)
        model._refusion_compiled = compiled
    if saved is not None:  # (the bound is the folder's, whichever decode set it last)
        bounds = saved_packages()[1]
        if saved_max_gb is None:
            bounds.pop(saved, None)
        else:
            bounds[saved] = int(saved_max_gb * 1e9)
    return compiled[5]


def saved_packages() -> tuple:
    """`packages_refusion.SavedForwards` and its `FOLDER_BOUNDS`, imported only for decodes that keep packages."""
    try:
        from .packages_refusion import FOLDER_BOUNDS, SavedForwards
    except ImportError:
        from packages_refusion import FOLDER_BOUNDS, SavedForwards
    return SavedForwards, FOLDER_BOUNDS


def cpu_kernel_configs(device, configs: dict) -> dict:
    """Inductor `configs` for compiling forwards or steps on `device`, with `cpp.min_chunk_size` at `CPU_MIN_CHUNK`
    on a CPU where they do not name it."""
    if torch.device(device).type == "cpu":
        return {"cpp.min_chunk_size": CPU_MIN_CHUNK, **configs}
    return configs


def decoder_function(model, logits_width: int):
    """The model's backbone as a function of its inputs with a code object of its own (dynamo keeps compiled graphs
    per code object, so a new one starts with none: graphs with frozen weights of an earlier compile are not reused),
    returning the last hidden states, or the logits where the new tokens number at most `logits_width`."""
    decoder, head = model.get_decoder(), model.get_output_embeddings()

    def backbone(inputs: dict):
        hidden = decoder(**inputs).last_hidden_state
        return head(hidden) if hidden.shape[1] <= logits_width else hidden

    code = backbone.__code__.replace(co_name=f"refusion_backbone_{id(decoder):x}")
    return type(backbone)(code, backbone.__globals__, code.co_name, None, backbone.__closure__)


def frozen_weights(model, compile_config: CompileConfig, held: bool = False) -> tuple | None:
    """None unless `compile_config` freezes weights into the graphs (its `options`' "freezing", by default inductor's
    global `torch._inductor.config.freezing`) or the compiled forwards hold them anyway (`held`: saved forwards); then
    what identifies the model's current weights: each parameter's and buffer's memory, dtype and version (any
    in-place change moves the version)."""
    if not (held or freezes_weights(compile_config)):
        return None
    return tuple((tensor.data_ptr(), tensor.dtype, tensor._version if not tensor.is_inference() else -1)
                 for tensor in module_tensors(model))  # fmt: skip


def module_tensors(model) -> list[torch.Tensor]:
    """Every parameter and buffer of `model` and its submodules, in a fixed order (a shared one as often as it is
    registered). (A walk of the modules' own dicts: `parameters()` and `buffers()` build every submodule's dotted name
    on the way, which `generate()` paid once a call.)"""
    tensors, modules = [], [model]
    while modules:
        module = modules.pop()
        own = (*module._parameters.values(), *module._buffers.values())
        tensors += [tensor for tensor in own if tensor is not None]
        modules += module._modules.values()
    return tensors


def freezes_weights(compile_config: CompileConfig) -> bool:
    """Whether inductor compiles under `compile_config` with the weights frozen into the graphs."""
    return bool((compile_config.options or {}).get("freezing", torch._inductor.config.freezing))


def graph_logits_width(compile_config: CompileConfig) -> int:
    """Up to how many new tokens a compiled forward under `compile_config` ends with the output layer: with frozen
    weights `LOGITS_IN_GRAPH_WIDTH` (inductor packs the output layer's weight there), else 0 (see `run_model`)."""
    return LOGITS_IN_GRAPH_WIDTH if freezes_weights(compile_config) else 0


def compile_forwards(
    model,
    compile_config: CompileConfig,
    batch_size: int,
    max_cache_len: int,
    draft_schedule: str = "fixed",
    compile_cache_dir: str | os.PathLike | None = None,
    lookup_drafts: int = 0,
) -> None:
    """Compile the forward of every width bucket of `draft_schedule` now, over the static cache for `batch_size`
    rows and `max_cache_len` columns (`static_cache_columns`), so that later `generate(cache_implementation="static",
    compile_config=compile_config)` calls of that batch size and draft schedule whose cache fits compile nothing
    (with `compile_cache_dir`, the same as theirs: load or compile and keep the saved forwards), and their step
    functions (`compiled_steps()`): the attention masks, the scoring of logits, and with `lookup_drafts` the copying
    of that many drafts. The forwards run on padding: what they write, the mask of a decode hides."""
    cache = slot_cache(model, batch_size, max_cache_len)
    compiled = compiled_backbone(model, compile_config, compile_cache_dir)
    steps = step_functions(compiled)
    layout = StaticLayout(cache, batch_size, model.device, steps)
    with torch.no_grad():
        for width in width_buckets(draft_schedule):
            batch = {
                name: torch.full((batch_size, width), value, dtype=torch.long, device=model.device)
                for name, value in PADDING.items()
            }
            run_model(model, compiled, batch, layout.mask(batch, [0] * batch_size, model.dtype), cache, 1)
        warm_up_steps(model, lookup_drafts, steps)


def device_name(model) -> str:
    """The model's device as compiled code and prices depend on it: the GPU's name, or the processor's with its
    instruction set."""
    if model.device.type == "cuda":
        return torch.cuda.get_device_name(model.device)
    return f"{cpu_name()} {torch.backends.cpu.get_cpu_capability()}"


def source_digest() -> str:
    """A hash of the decoding's code (`DECODING_FILES`, read now): a saved package or step of other code is not
    taken for its own."""
    digest = hashlib.sha256()
    for name in DECODING_FILES:
        digest.update((Path(__file__).parent / name).read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def cpu_name() -> str:
    """This machine's `processor_name` (Linux; elsewhere the machine type), read once a process."""
    try:
        return processor_name(Path("/proc/cpuinfo").read_text())
    except OSError:
        return platform.machine()


def processor_name(cpuinfo: str) -> str:
    """The first processor's model name in `cpuinfo` (the text of Linux's /proc/cpuinfo) with its family and model
    numbers, and "AMX" when it has AMX tiles. Prices and compiled code differ between processors that a virtual machine
    may name alike: "AMD EPYC" is both a Zen 4 (family 25) and a Zen 5 (family 26), which the family and model
    numbers tell apart."""
    fields = {}
    for line in cpuinfo.splitlines():
        if not line.strip():  # (the first processor's fields end here)
            break
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return f"{name}{' AMX' if 'amx_tile' in fields.get('flags', '').split() else ''}"
