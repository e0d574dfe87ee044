"""Linear layers through oneDNN with prepacked weights: the same model, cheaper wide forwards on a CPU. And attention
for compiled forwards that does not copy the shared key/value heads (`grouped_attention`, at the end).

    from kernels_refusion import prepack_linears, unpack_linears, use_grouped_attention

    prepack_linears(model)      # nn.Linear layers compute through oneDNN with prepacked weights where that wins
    with torch.no_grad():
        model(...)              # inference forwards use the packed weights; logits equal to float tolerance
    unpack_linears(model)       # plain nn.Linear again
    use_grouped_attention(model)  # SDPA over the shared key/value heads, uncopied ("refusion_grouped")

Why: PyTorch's `F.linear` on a CPU is MKL's GEMV for one row and its GEMM above, and in float32 a forward of two to
sixteen queries costs markedly more than a one-query forward. oneDNN with each weight reordered once into its own
blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, then `torch.ops.mkldnn._linear_pointwise`: what inductor's
weight freezing emits) prices those forwards nearer one row, and in bfloat16 on a CPU with AMX it beats
`F.linear` at every width. What wins depends on the CPU; `packing_plan()` says what is packed where, from
measurements of a small model's whole forward by width on CPUs of each kind (AVX2; AVX-512 with AMX; AVX-512 with
AVX512-BF16 and no AMX), each path against `F.linear` in float32 and bfloat16. A oneDNN call has a fixed cost over an
`F.linear` one, which its float32 AVX-512 kernels repay only from a few rows.

Where oneDNN has no bfloat16 kernels (AVX2), a bfloat16 weight is packed as float32 and each input converted to it
(`compute_dtype`): `F.linear` in bfloat16 is emulated there and its cost grows about a row's time per row, where the
float32 packs cost more for one row and grow slowly with the width.

What stays the same: each switched layer keeps its parameter objects (its class becomes `PackedLinear`, an
`nn.Linear` subclass with no new parameters or buffers), so parameter names, `state_dict()`, `save_pretrained`,
tied weights and `model.to(...)` are untouched. The packed path is taken only where it computes what `F.linear`
would (to float rounding): a CPU input and weight of a planned dtype, enough rows, no autocast, not under
`torch.compile` (inductor packs for itself) and no gradient to record. Every other call (training, a float64 or
CUDA model, a dtype that does not win here) is the ordinary `F.linear`.

Stale packs: a layer remembers what it packed (the weight's memory, dtype and version counter) and, before each
packed forward, checks that the weight is still that tensor with no in-place change since. `model.to(dtype or
device)`, `load_state_dict`, in-place ops on the parameter (`weight.mul_`, `copy_`, an optimizer step) and
`weight.data = ...` all fail the check: the layer repacks (or, when the new weight is not packable, computes with
`F.linear` and frees the old pack). A write through a `.data` alias (`weight.data += ...`, PEFT's LoRA merge, and
`weight.data.copy_(...)`, its `safe_merge` from 0.22) is the one change PyTorch does not count, so no forward can
see it cheaply; calling `prepack_linears(model)` again does (it compares a checksum of every packed weight and
repacks what changed), so call it after changing weights that way and before decoding. Copies (`copy.deepcopy`,
pickling) leave the packs out and repack on their first forward.

Memory: a packed weight is a second copy of the weight (about the model's size again; twice it for a bfloat16
weight packed as float32).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

_PACK = "_refusion_pack"
_PLAN = "_refusion_pack_plan"
_INTEGER_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def onednn_available() -> bool:
    """Whether this PyTorch build can run linear layers through oneDNN on this CPU."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _onednn_bfloat16() -> bool:
    """Whether oneDNN has bfloat16 kernels for this CPU (AVX512-BF16 or AMX)."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def packing_plan() -> dict[torch.dtype, int]:
    """The weight dtypes `prepack_linears` packs by default on this machine, each with the fewest rows (tokens in a
    forward) from which the packed kernel is used (fewer compute with `F.linear`), as measured on CPUs of each kind (the
    module's docstring): float32 from one row on AVX2 CPUs and from four on AVX-512 ones, whose MKL GEMV beats oneDNN
    below that (on Intel's; measured on AMD's too, packing wins there from one row); bfloat16 from one row on CPUs with
    bfloat16 arithmetic (AVX512-BF16 or AMX), and from four, packed as float32 (`compute_dtype`), on CPUs with none,
    where `F.linear` in bfloat16 is emulated and costs about a row's time per row (a one-row product streams half the
    bytes of float32 and stays with it). Empty without oneDNN."""
    if not onednn_available():
        return {}
    plan = {torch.float32: 4 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 1}
    plan[torch.bfloat16] = 1 if _onednn_bfloat16() else 4
    return plan


def _plan(dtypes: Mapping[torch.dtype, int] | Iterable[torch.dtype] | None) -> dict[torch.dtype, int]:
    if dtypes is None:
        return packing_plan()
    if isinstance(dtypes, Mapping):
        return {dtype: max(1, int(rows)) for dtype, rows in dtypes.items()}
    return dict.fromkeys(dtypes, 1)


class _Pack:
    """A prepacked weight and what it was packed from."""

    __slots__ = ("checksum", "compute", "dtype", "packed", "source", "version")

    def __init__(self, weight: torch.Tensor):
        with torch.no_grad():
            # Holding the source keeps its storage alive, so no later weight can occupy the same memory.
            self.source, self.dtype, self.version = weight.detach(), weight.dtype, weight._version
            self.compute = compute_dtype(weight.dtype)
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.source.to(self.compute), None)
            self.checksum = checksum(self.source)

    def packs(self, weight: torch.Tensor) -> bool:
        """Whether `weight` is still exactly the tensor this was packed from: the same memory (storage, offset, size,
        strides), dtype and version (no in-place change since)."""
        # A weight that is another tensor fails `is_set_to` before its version (which inference tensors lack) is read.
        return weight.is_set_to(self.source) and weight.dtype == self.dtype and weight._version == self.version


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a weight of `dtype` is packed and multiplied in: its own, except bfloat16 where oneDNN has no
    bfloat16 kernels for this CPU (no AVX512-BF16 or AMX): float32, into which the layer's input is converted and out
    of which its output is rounded back. A product of two bfloat16 numbers is exact in float32, so this computes what
    a bfloat16 matrix product accumulating in float32 does (to the order of the sums), at float32's speed."""
    return torch.float32 if dtype == torch.bfloat16 and not _onednn_bfloat16() else dtype


def checksum(weight: torch.Tensor) -> int:
    """A fingerprint of the weight's contents that any change of one element changes: its bits summed as 64-bit
    integers (wrapping). Reads the weight once (about a sixth of the time of packing it)."""
    with torch.no_grad():
        bits = weight.detach().reshape(-1)
        size = bits.element_size()
        if (bits.numel() * size) % 8 or (bits.storage_offset() * size) % 8:
            return int(bits.view(_INTEGER_OF_SIZE[size]).sum(dtype=torch.int64))
        return int(bits.view(torch.int64).sum())


class PackedLinear(nn.Linear):
    """An `nn.Linear` whose inference forwards compute through oneDNN with a prepacked weight (see the module's
    docstring). Layers become one through `prepack_linears`, which switches their class in place."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        # Under torch.compile the layer is an ordinary linear: inductor packs weights itself (freezing).
        pack = None if torch.compiler.is_compiling() else self._pack(weight, bias, input)
        if pack is None:
            return F.linear(input, weight, bias)
        if pack.compute == input.dtype:
            return torch.ops.mkldnn._linear_pointwise.default(input, pack.packed, bias, "none", [], "")
        bias = None if bias is None else bias.to(pack.compute)
        output = torch.ops.mkldnn._linear_pointwise.default(input.to(pack.compute), pack.packed, bias, "none", [], "")
        return output.to(input.dtype)

    def packed_from(self, dtype: torch.dtype) -> int | None:
        """The fewest rows (tokens in a forward) from which an inference forward with a weight of `dtype` computes
        through a packed weight; None when never (a dtype not planned, or a weight oneDNN cannot pack)."""
        rows = self.__dict__.get(_PLAN, {}).get(dtype)
        return rows if rows is not None and onednn_available() and _packable(self.weight, self.bias) else None

    def _pack(
        self, weight: torch.Tensor, bias: torch.Tensor | None, input: torch.Tensor | None = None, repack: bool = False
    ) -> _Pack | None:
        """The packed weight for a forward on `input` (without one: for an inference forward of enough rows), packed
        again if the weight changed since; None where this forward must be `F.linear` (and then a pack that is
        stale or of a dtype no longer planned is freed)."""
        pack, rows = self.__dict__.get(_PACK), self.__dict__.get(_PLAN, {}).get(weight.dtype)
        usable = rows is not None and (bias is None or bias.dtype == weight.dtype)
        if usable and input is not None:
            usable = (
                input.numel() >= rows * self.in_features
                and type(input) is torch.Tensor
                and input.is_cpu
                and input.dtype == weight.dtype
                and input.layout == torch.strided
                and not (
                    torch.is_grad_enabled()
                    and (input.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
                )
                and not torch.is_autocast_enabled("cpu")
            )
        if usable and not repack and pack is not None and pack.packs(weight):
            return pack
        if pack is not None and (rows is None or repack or not pack.packs(weight)):
            del self.__dict__[_PACK]  # stale, or of a dtype no longer packed: free it
        if not usable or not _packable(weight, bias):
            return None
        pack = self.__dict__[_PACK] = _Pack(weight)
        return pack

    def _apply(self, fn, recurse=True):
        # `model.to(...)`, `.double()`, `.cuda()`: free a pack the converted weight no longer is (a no-op keeps it).
        result = super()._apply(fn, recurse)
        pack = self.__dict__.get(_PACK)
        if pack is not None and not pack.packs(self.weight):
            del self.__dict__[_PACK]
        return result

    def __getstate__(self):
        state = super().__getstate__()
        state.pop(_PACK, None)  # oneDNN's opaque tensors cannot be copied or pickled; a copy repacks when used
        return state


def _packable(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether oneDNN can pack `weight` and we can tell when it changes (inference tensors have no version)."""
    return (
        type(weight) in (nn.Parameter, torch.Tensor)
        and weight.is_cpu
        and weight.layout == torch.strided
        and not weight.is_inference()
        and (bias is None or bias.is_cpu)
    )


def prepack_linears(model: nn.Module, dtypes: Mapping[torch.dtype, int] | Iterable[torch.dtype] | None = None) -> int:
    """Make every `nn.Linear` of `model` compute its inference forwards through oneDNN with a prepacked weight, and
    make every pack current: pack the weights that are packable now and pack again those whose contents changed by
    any route (a checksum of each packed weight is compared, so this also sees writes through a `.data` alias, such
    as PEFT's default LoRA merge, which forwards cannot see). `dtypes`: the weight dtypes to pack, each from how many
    rows on (a mapping dtype -> rows; a list of dtypes means from one row), by default `packing_plan()`. Returns how
    many layers compute through packed weights now (0 where oneDNN is unavailable, and then nothing changes).
    Subclasses of `nn.Linear` (quantized or adapter layers) are left alone. Calling it again (before each
    generation, say) costs one read of the packed weights when nothing changed."""
    if not onednn_available():
        return 0
    plan = _plan(dtypes)
    packed = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = PackedLinear
        if type(module) is PackedLinear:
            module.__dict__[_PLAN] = plan
            weight, pack = module.weight, module.__dict__.get(_PACK)
            changed = pack is not None and pack.packs(weight) and pack.checksum != checksum(weight)
            packed += module._pack(weight, module.bias, repack=changed) is not None
    return packed


def unpack_linears(model: nn.Module) -> int:
    """Turn the layers `prepack_linears` switched back into plain `nn.Linear` and free their packed weights. Returns
    how many it turned back."""
    unpacked = 0
    for module in model.modules():
        if type(module) is PackedLinear:
            module.__dict__.pop(_PACK, None)
            module.__dict__.pop(_PLAN, None)
            module.__class__ = nn.Linear
            unpacked += 1
    return unpacked


# ---- attention for compiled forwards ---------------------------------------------------------------------------------
GROUPED_ATTENTION = "refusion_grouped"  # the `attn_implementation` name `use_grouped_attention` registers


def grouped_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Attention over the shared key/value heads as they are, through PyTorch's `scaled_dot_product_attention` with
    the additive mask, where transformers' SDPA attention, given a mask, first copies each key/value head once per
    query head that shares it (SmolLM2: 9 query heads over 3 key/value heads), and its eager attention's graphs
    materialize the same copies. One query: `enable_gqa=True`. Several: the query heads of each key/value head
    stacked along the query axis (`[batch, kv_heads, groups x queries, dim]`, the mask repeated for each), so that the
    kernel reads each key/value head once for all of them. The output of SDPA to float rounding; no attention weights
    (None), as with SDPA. `enable_gqa` is the cheaper for one query and stacking for several, and either costs less
    in compiled forwards than attention over the copied heads."""
    batch, heads, queries, dim = query.shape
    kv_heads, dropout = key.shape[1], dropout if module.training else 0.0
    groups = heads // kv_heads
    stack = queries > 1 and groups > 1 and (attention_mask is None or attention_mask.shape[1] == 1)
    if not stack:
        output = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
        )
        return output.transpose(1, 2).contiguous(), None
    stacked = query.reshape(batch, kv_heads, groups * queries, dim)  # row g x queries + q: query head g of the group
    mask = attention_mask.repeat(1, 1, groups, 1) if attention_mask is not None else None
    output = F.scaled_dot_product_attention(stacked, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return output.view(batch, heads, queries, dim).transpose(1, 2).contiguous(), None


def register_grouped_attention() -> None:
    """Register `grouped_attention` with transformers as `GROUPED_ATTENTION`, with eager attention's mask (additive,
    in the model's dtype; without a mask function of its own, transformers would give it no causal mask at all)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask

    AttentionInterface.register(GROUPED_ATTENTION, grouped_attention)
    AttentionMaskInterface.register(GROUPED_ATTENTION, eager_mask)


def use_grouped_attention(model: nn.Module) -> None:
    """Switch `model` to `grouped_attention` (registered first). The config's JSON does not record an attention
    implementation: a saved model loads with its default again."""
    register_grouped_attention()
    model.set_attn_implementation(GROUPED_ATTENTION)
