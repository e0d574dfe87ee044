"""Hybrid-objective batches for ReFusion fine-tuning: reordered clean slots (AR loss) plus masked slots (MDM loss).

For every (prompt, response) example one slot size is drawn, the response is cut into slots of that size (the
last one may be short), a noise level ``p = (1 - eps) * t + eps`` with ``t ~ U(0, 1)`` is drawn and every slot is
masked with probability ``p``. Each row of the batch is then laid out as

    prompt | clean slots in a random order | masked slots in reading order, as [MASK] | padding

with every token keeping its reading-order index as position id, so RoPE sees true distances while attention
follows storage order. Labels are aligned with the inputs (the model does not shift them): inside a clean slot a
token is labelled with the next token of that slot, a ``[MASK]`` is labelled with the original token it hides.

Which slots are masked (`MASKED_SLOTS`): ``random`` (the paper's) masks each slot with probability ``p``; ``tail``
masks the last ``ceil(p * slots)`` slots of the response (at least one), so that every ``[MASK]`` sees only text
before it in reading order, as when a decode drafts past the text it has committed; its noise level is then the share
of the response its masked slots hold, so the MDM term still averages over the masks.

Slot masking (`SLOT_MASKINGS`): ``whole`` (the paper's) hides every token of a masked slot. ``suffix`` keeps a
uniformly drawn clean prefix of 0..length-1 of the slot's own tokens in front of its ``[MASK]`` s, the pattern the
decoder's infill asks for (draft the rest of a slot after its accepted prefix); ``mixed`` draws ``whole`` or
``suffix`` per slot with equal odds. A clean prefix token stays in the masked region, in reading order, and is
unlabelled: it is context for its slot's masks (as an accepted prefix is in decoding), not a training target, since
the region also holds other slots' masks that no autoregressive context in decoding ever contains.

The whole transform is vectorised over the batch: one composite sort key per token and a single ``argsort``.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.nn.utils.rnn import pad_sequence

IGNORE_INDEX = -100  # same value as `modeling_refusion.IGNORE_INDEX` and PyTorch's cross-entropy default

# Storage groups, in row order; a token's sort key is `group * max_slots * width + key within the group`.
_PROMPT, _CLEAN, _MASKED, _PADDING = range(4)
SLOT_MASKINGS = ("whole", "suffix", "mixed")
MASKED_SLOTS = ("random", "tail")

TokenIds = torch.Tensor | Sequence[int]


class HybridObjectiveConfig(Protocol):
    """The fields of `RefusionConfig` that the hybrid objective reads."""

    mask_token_id: int | None
    train_slot_sizes: Sequence[int]
    mask_eps: float


def build_hybrid_batch(
    prompts: Sequence[TokenIds],
    responses: Sequence[TokenIds],
    *,
    mask_token_id: int,
    pad_token_id: int,
    slot_sizes: Sequence[int] = (4, 8, 16, 32),
    eps: float = 1e-3,
    generator: torch.Generator | None = None,
    slot_masking: str = "whole",
    acceptance_decay: float | None = None,
    masked_slots: str = "random",
) -> dict[str, torch.Tensor]:
    """Return a right-padded hybrid-objective batch ready for `RefusionForCausalLM.forward(**batch)`.

    Keys (``B`` examples, ``T`` = longest prompt + response):

    * ``input_ids`` (long, ``[B, T]``): prompt, clean slots shuffled, masked slots (their clean prefix, if any, then
      ``mask_token_id``), padding;
    * ``attention_mask`` (long, ``[B, T]``): 1 on real tokens, 0 on padding;
    * ``position_ids`` (long, ``[B, T]``): reading-order index of each token in prompt + response; 0 on padding
      (any in-range value would do, the padding is never attended to nor labelled);
    * ``labels`` (long, ``[B, T]``): aligned hybrid labels, ``IGNORE_INDEX`` on the prompt, padding and the last
      token of every clean slot;
    * ``is_masked`` (bool, ``[B, T]``): True exactly at ``[MASK]`` positions;
    * ``noise_level`` (float32, ``[B]``): masking probability ``p`` of each example (with ``tail``, the share of
      its response in masked slots);
    * ``response_length`` (long, ``[B]``) and ``slot_size`` (long, ``[B]``, for logging);
    * with ``acceptance_decay`` only, ``mdm_token_weight`` (float32, ``[B, T]``): the weight of the MDM term at
      each ``[MASK]``, ``decay ** k`` for the k-th mask of its slot, scaled so that a slot's weights sum to its mask
      count (the MDM term moves toward a slot's first drafts, the ones an accepted run starts with, at the same
      total); 0 off the masks. `RefusionSFTTrainer` takes it; `forward` does not.

    ``slot_masking`` is one of `SLOT_MASKINGS` and ``masked_slots`` one of `MASKED_SLOTS` (see the module
    docstring). All randomness comes from ``generator`` (torch's global RNG when None), so a seeded generator gives
    the same batch every time. Tensors are built on the device of the first prompt.
    """
    prompt_rows, response_rows = _validate(prompts, responses, mask_token_id, slot_sizes, eps)
    if slot_masking not in SLOT_MASKINGS:
        raise ValueError(f"slot_masking must be one of {', '.join(SLOT_MASKINGS)}, got {slot_masking!r}.")
    if masked_slots not in MASKED_SLOTS:
        raise ValueError(f"masked_slots must be one of {', '.join(MASKED_SLOTS)}, got {masked_slots!r}.")
    if acceptance_decay is not None and not 0.0 < acceptance_decay <= 1.0:
        raise ValueError(f"acceptance_decay must lie in (0, 1], got {acceptance_decay}.")
    device = prompt_rows[0].device
    batch_size = len(prompt_rows)

    prompt_length = torch.tensor([len(row) for row in prompt_rows], device=device)
    response_length = torch.tensor([len(row) for row in response_rows], device=device)
    total_length = prompt_length + response_length
    # Reading-order tokens: column q of a row holds the token whose position id is q.
    tokens = pad_sequence(
        [torch.cat(pair) for pair in zip(prompt_rows, response_rows)], batch_first=True, padding_value=pad_token_id
    )
    width = tokens.shape[1]
    position = torch.arange(width, device=device).expand(batch_size, width)

    # torch samples on the generator's own device; the draws then move to the batch's device.
    sample_device = generator.device if generator is not None else device
    sizes = torch.tensor([int(size) for size in slot_sizes], device=device)
    slot_size = sizes[torch.randint(len(sizes), (batch_size,), generator=generator, device=sample_device).to(device)]
    noise_level = (1.0 - eps) * torch.rand(batch_size, generator=generator, device=sample_device).to(device) + eps
    max_slots = int(((response_length + slot_size - 1) // slot_size).max())
    slot_draws = torch.rand(2, batch_size, max_slots, generator=generator, device=sample_device).to(device)
    slot_is_masked = slot_draws[0] < noise_level[:, None]
    if masked_slots == "tail":  # the last ceil(p * slots) slots of each response
        slots = (response_length + slot_size - 1) // slot_size
        masked_count = (noise_level * slots).ceil().long().clamp(min=1)
        first_masked = slots - masked_count
        slot_is_masked = torch.arange(max_slots, device=device) >= first_masked[:, None]
        noise_level = (response_length - first_masked * slot_size).double() / response_length
    # Rank of each slot in a uniformly random permutation; only clean slots use it.
    slot_rank = slot_draws[1].argsort(dim=1).argsort(dim=1)
    # Drawn after the paper's draws, so `whole` batches stay what they were for a given seed.
    slot_prefix = _clean_prefix_lengths(slot_masking, response_length, slot_size, max_slots, generator, sample_device)

    is_prompt = position < prompt_length[:, None]
    is_real = position < total_length[:, None]
    is_response = is_real & ~is_prompt
    offset = (position - prompt_length[:, None]).clamp(min=0)  # index inside the response
    slot = torch.where(is_response, offset // slot_size[:, None], 0)
    in_masked_slot = is_response & slot_is_masked.gather(1, slot)
    clean = is_response & ~in_masked_slot
    # Index among the slot's [MASK]s: negative on a masked slot's clean prefix.
    mask_index = offset - slot * slot_size[:, None] - slot_prefix.gather(1, slot)
    masked = in_masked_slot & (mask_index >= 0)

    group = torch.full_like(position, _PADDING)
    group[is_prompt] = _PROMPT
    group[clean] = _CLEAN
    group[in_masked_slot] = _MASKED
    # Clean slots are ordered by their random rank, everything else by position; tokens of a slot stay in order.
    # Keys within a group are unique and below `max_slots * width`, so one argsort gives the whole layout.
    key_in_group = torch.where(clean, slot_rank.gather(1, slot) * width + position, position)
    order = (group * max_slots * width + key_in_group).argsort(dim=1)

    next_token = torch.cat([tokens[:, 1:], tokens.new_full((batch_size, 1), IGNORE_INDEX)], dim=1)
    has_next_in_slot = clean & ((offset + 1) % slot_size[:, None] != 0) & (offset + 1 < response_length[:, None])
    labels = torch.where(masked, tokens, torch.where(has_next_in_slot, next_token, IGNORE_INDEX))

    stored_real = is_real.gather(1, order)
    stored_masked = masked.gather(1, order)
    input_ids = torch.where(stored_masked, mask_token_id, tokens.gather(1, order))
    batch = {
        "input_ids": torch.where(stored_real, input_ids, pad_token_id),
        "attention_mask": stored_real.long(),
        "position_ids": torch.where(stored_real, order, 0),
        "labels": labels.gather(1, order),
        "is_masked": stored_masked,
        "noise_level": noise_level.float(),
        "response_length": response_length,
        "slot_size": slot_size,
    }
    if acceptance_decay is not None:
        weight = _acceptance_weights(masked, mask_index, slot, max_slots, acceptance_decay)
        batch["mdm_token_weight"] = weight.gather(1, order)
    return batch


def _clean_prefix_lengths(
    slot_masking: str,
    response_length: torch.Tensor,
    slot_size: torch.Tensor,
    max_slots: int,
    generator: torch.Generator | None,
    sample_device: torch.device,
) -> torch.Tensor:
    """How many leading tokens of each slot stay clean if the slot is masked, ``[B, max_slots]``: 0 for `whole`,
    uniform over 0..length-1 of the slot for `suffix`, either of the two with equal odds for `mixed`."""
    device = response_length.device
    if slot_masking == "whole":
        return torch.zeros(len(response_length), max_slots, dtype=torch.long, device=device)
    slot_start = torch.arange(max_slots, device=device) * slot_size[:, None]
    slot_length = torch.minimum(response_length[:, None] - slot_start, slot_size[:, None]).clamp(min=0)
    draws = torch.rand(2, len(response_length), max_slots, generator=generator, device=sample_device).to(device)
    prefix = torch.minimum((draws[0] * slot_length).floor().long(), (slot_length - 1).clamp(min=0))
    return torch.where(draws[1] < 0.5, 0, prefix) if slot_masking == "mixed" else prefix


def _acceptance_weights(
    masked: torch.Tensor, mask_index: torch.Tensor, slot: torch.Tensor, max_slots: int, decay: float
) -> torch.Tensor:
    """Per-[MASK] weights in reading order: ``decay ** k`` for the k-th mask of a slot, normalised so that each
    slot's weights sum to its number of masks; 0 elsewhere."""
    raw = torch.where(masked, decay ** mask_index.clamp(min=0).double(), 0.0)
    slot_total = torch.zeros(masked.shape[0], max_slots, dtype=torch.float64, device=masked.device)
    slot_count = torch.zeros_like(slot_total)
    slot_total.scatter_add_(1, slot, raw)
    slot_count.scatter_add_(1, slot, masked.double())
    scale = slot_count / slot_total.clamp(min=torch.finfo(torch.float64).tiny)
    return (raw * scale.gather(1, slot)).float()


def _validate(
    prompts: Sequence[TokenIds],
    responses: Sequence[TokenIds],
    mask_token_id: int,
    slot_sizes: Sequence[int],
    eps: float,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Check the arguments of `build_hybrid_batch` and return the examples as 1-D long tensors."""
    if len(slot_sizes) == 0 or any(int(size) != size or size < 1 for size in slot_sizes):
        raise ValueError(f"slot_sizes must be a non-empty sequence of integers >= 1, got {tuple(slot_sizes)}.")
    if not 0.0 < eps < 1.0:
        raise ValueError(f"eps must lie in (0, 1), got {eps}.")
    if len(prompts) != len(responses):
        raise ValueError(f"Got {len(prompts)} prompts but {len(responses)} responses; they must pair up.")
    if len(prompts) == 0:
        raise ValueError("Cannot build a hybrid batch from zero examples.")
    rows = {"prompt": [], "response": []}
    for index, pair in enumerate(zip(prompts, responses)):
        for name, ids in zip(rows, pair):
            row = torch.as_tensor(ids, dtype=torch.long)
            if row.ndim != 1:
                raise ValueError(f"The {name} of example {index} must be 1-D token ids, got shape {tuple(row.shape)}.")
            if row.numel() == 0:
                raise ValueError(
                    f"The {name} of example {index} is empty; every example needs a prompt and a response."
                )
            if bool((row == mask_token_id).any()):
                raise ValueError(f"The {name} of example {index} contains mask_token_id={mask_token_id}.")
            rows[name].append(row)
    return rows["prompt"], rows["response"]


@dataclass
class HybridObjectiveCollator:
    """`data_collator` that turns features with `prompt_ids` and `response_ids` into a hybrid-objective batch.

    The collator owns its `torch.Generator`: seeded with `seed`, or, when `seed` is None, from torch's global RNG
    at construction (so it follows `transformers.set_seed`). Inside a `DataLoader` worker the generator is
    reseeded once from the worker's seed, so workers do not replay each other's noise and each epoch's fresh
    workers draw new noise. Use `remove_unused_columns=False` with the HF `Trainer`, which would otherwise drop
    `prompt_ids` and `response_ids` because the model's `forward` does not take them.
    """

    mask_token_id: int
    pad_token_id: int
    slot_sizes: tuple[int, ...] = (4, 8, 16, 32)
    eps: float = 1e-3
    seed: int | None = None
    slot_masking: str = "whole"
    acceptance_decay: float | None = None
    masked_slots: str = "random"
    generator: torch.Generator = field(init=False, repr=False)
    _worker_seed: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        """Seed the collator's own generator."""
        self.slot_sizes = tuple(int(size) for size in self.slot_sizes)
        seed = self.seed if self.seed is not None else int(torch.randint(2**63 - 1, ()).item())
        self.generator = torch.Generator().manual_seed(seed)

    @classmethod
    def from_config(
        cls,
        config: HybridObjectiveConfig,
        pad_token_id: int,
        seed: int | None = None,
        slot_masking: str = "whole",
        acceptance_decay: float | None = None,
        masked_slots: str = "random",
    ) -> "HybridObjectiveCollator":
        """Build the collator from a `RefusionConfig` (`mask_token_id`, `train_slot_sizes`, `mask_eps`) and the
        objective options that are training settings rather than model fields."""
        if config.mask_token_id is None:
            raise ValueError("The config has no mask_token_id; add a [MASK] token to the model first.")
        return cls(
            mask_token_id=config.mask_token_id,
            pad_token_id=pad_token_id,
            slot_sizes=tuple(config.train_slot_sizes),
            eps=config.mask_eps,
            seed=seed,
            slot_masking=slot_masking,
            acceptance_decay=acceptance_decay,
            masked_slots=masked_slots,
        )

    def __call__(self, features: Sequence[dict[str, TokenIds]]) -> dict[str, torch.Tensor]:
        """Collate `features` (dicts with `prompt_ids` and `response_ids`) into one hybrid-objective batch."""
        worker = torch.utils.data.get_worker_info()
        if worker is not None and self._worker_seed != worker.seed:
            self._worker_seed = worker.seed
            self.generator.manual_seed(worker.seed)
        return build_hybrid_batch(
            [feature["prompt_ids"] for feature in features],
            [feature["response_ids"] for feature in features],
            mask_token_id=self.mask_token_id,
            pad_token_id=self.pad_token_id,
            slot_sizes=self.slot_sizes,
            eps=self.eps,
            generator=self.generator,
            slot_masking=self.slot_masking,
            acceptance_decay=self.acceptance_decay,
            masked_slots=self.masked_slots,
        )


__all__ = ["IGNORE_INDEX", "MASKED_SLOTS", "SLOT_MASKINGS", "HybridObjectiveCollator", "build_hybrid_batch"]
