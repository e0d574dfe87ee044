"""ReFusion decoding: iterative plan-and-infill over slots with exact KV-cache reuse.

The answer is cut into slots of `slot_size` consecutive tokens, grouped into serial blocks of `block_length`
tokens. Inside a block every iteration runs:

1. **plan**   one forward over the block's masked slots (after everything committed) drafts every masked token;
              a slot's confidence is the probability of its first draft token. Slots above `slot_threshold`
              are chosen, or the single most confident one.
2. **verify** one causal forward over the chosen drafts in position order gives every drafted token its
              autoregressive probability. The leading chosen slots whose tokens all pass `token_threshold` (a
              slot's first token always passes) are committed with the K/V of this very forward.
3. **infill** the other chosen slots are completed in parallel, in one forward per round, each attending only
              to the committed sequence and to itself. A round accepts the drafts that pass and then one token
              of the model's own (so every round advances), and redrafts the rest from the same forward.
              Accepted tokens enter the sequence in the next round's forward, in their slot's own group, so
              each is computed once.
4. **commit** finished slots are appended to the sequence and the KV cache in commit order with their own
              position ids; their K/V are computed once, at the start of the next forward.

Every forward is `[pending tokens | queries]` after the cache: pending tokens (finished but not yet in the cache)
are kept, the queries' K/V are cropped away again. Each stored token remembers what it attended to (a prefix of
the sequence and its own slot), so `use_cache=False` can recompute every forward from scratch with exactly the
same attention and must return exactly the same tokens.

Batches: each row's decisions are a generator (`SlotDecoder.steps`) that yields its next request; `execute` runs
the requests of all rows as one batched forward over one `DynamicCache`. Rows of different lengths leave holes in
the shared cache, hidden by a per-row storage rank of every cache column; finished rows leave the batch. The host
is consulted once per row and step, for the decisions that shape the next request (chosen slots, accepted counts).
"""

import copy
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import DynamicCache, GenerationConfig, MaxTimeCriteria, StoppingCriteriaList, StopStringCriteria
from transformers.utils import ModelOutput

DECODING_FIELDS = ("slot_size", "slot_threshold", "token_threshold", "block_length")
NEVER = 2**62  # storage rank of cache holes and padding: no token's prefix reaches it


@dataclass
class RefusionGenerateOutput(ModelOutput):
    """`sequences` (prompt + answer), the number of model calls and the answer tokens committed per call."""

    sequences: torch.LongTensor | None = None
    num_forward_passes: int | None = None
    tokens_per_forward: float | None = None


@dataclass
class DecodingSettings:
    """Everything `generate` decides before decoding, validated."""

    slot_size: int
    slot_threshold: float
    token_threshold: float
    block_length: int
    max_new_tokens: int
    mask_token_id: int
    eos_token_ids: list[int]
    pad_token_id: int
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    use_cache: bool


def resolve_settings(
    model, generation_config: GenerationConfig | None, prompt_length: int, kwargs: dict
) -> tuple[DecodingSettings, GenerationConfig]:
    """Merge the model's defaults, `generation_config` and `kwargs` (which win) into validated decoding settings;
    also return the merged generation config."""
    explicit = {name: kwargs[name] for name in DECODING_FIELDS if kwargs.get(name) is not None}
    config = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    unused = config.update(**kwargs)
    for name, value in unused.items():
        if name not in DECODING_FIELDS and name != "mask_token_id":
            raise ValueError(f"generate() got an argument ReFusion does not use: {name}={value!r}.")
    decoding = {name: explicit.get(name, getattr(config, name, None)) for name in DECODING_FIELDS}
    for name, value in decoding.items():
        if value is None:
            decoding[name] = getattr(model.config, name)
    slot_size, block_length = decoding["slot_size"], decoding["block_length"]
    if not isinstance(slot_size, int) or slot_size < 1:
        raise ValueError(f"slot_size must be an integer >= 1, got {slot_size!r}.")
    if "block_length" not in explicit and block_length % slot_size:
        block_length = -(-block_length // slot_size) * slot_size  # adapt the default to whole slots
    if not isinstance(block_length, int) or block_length < 1 or block_length % slot_size:
        raise ValueError(f"block_length ({block_length}) must be a positive multiple of slot_size ({slot_size}).")
    for name in ("slot_threshold", "token_threshold"):
        if not 0.0 <= decoding[name] <= 1.0:
            raise ValueError(f"{name} must lie in [0, 1], got {decoding[name]}.")

    mask_token_id = kwargs.get("mask_token_id", getattr(config, "mask_token_id", None))
    mask_token_id = mask_token_id if mask_token_id is not None else model.config.mask_token_id
    if mask_token_id is None:
        raise ValueError("The model has no mask_token_id; convert it with finetune.convert first.")
    eos = config.eos_token_id
    eos_token_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    pad_token_id = config.pad_token_id if config.pad_token_id is not None else (eos_token_ids or [None])[0]
    if pad_token_id is None:
        raise ValueError("generate() needs a pad_token_id or an eos_token_id to fill the answer after it ends.")
    if mask_token_id in eos_token_ids or mask_token_id == pad_token_id:
        raise ValueError(f"The mask token id {mask_token_id} must differ from the EOS and pad token ids.")

    max_new_tokens = config.max_new_tokens
    if max_new_tokens is None:
        max_new_tokens = config.max_length - prompt_length
    if max_new_tokens < 1:
        raise ValueError(
            f"Nothing to generate: max_new_tokens={max_new_tokens} (max_length={config.max_length}, "
            f"prompt length {prompt_length}). Pass max_new_tokens >= 1."
        )
    if config.num_beams not in (None, 1):
        raise ValueError("ReFusion decoding does not support beam search (num_beams > 1).")
    do_sample = bool(config.do_sample)
    temperature = 1.0 if config.temperature is None else float(config.temperature)
    top_k = int(config.top_k or 0)
    top_p = 1.0 if config.top_p is None else float(config.top_p)
    if do_sample and temperature <= 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}.")
    if not 0.0 < top_p <= 1.0 or top_k < 0:
        raise ValueError(f"top_p must lie in (0, 1] and top_k be >= 0, got top_p={top_p}, top_k={top_k}.")
    settings = DecodingSettings(
        slot_size=slot_size,
        slot_threshold=float(decoding["slot_threshold"]),
        token_threshold=float(decoding["token_threshold"]),
        block_length=block_length,
        max_new_tokens=int(max_new_tokens),
        mask_token_id=int(mask_token_id),
        eos_token_ids=eos_token_ids,
        pad_token_id=int(pad_token_id),
        do_sample=do_sample,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        use_cache=bool(config.use_cache),
    )
    return settings, config


def passes(probabilities: torch.Tensor, threshold: float) -> torch.Tensor:
    """A probability passes a threshold when strictly above it; threshold 0 lets everything through."""
    return probabilities > threshold if threshold > 0 else torch.ones_like(probabilities, dtype=torch.bool)


def token_distribution(logits: torch.Tensor, settings: DecodingSettings) -> torch.Tensor:
    """Probabilities that drafts are drawn from and checked against; the mask token is never proposed."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)
    logits[..., settings.mask_token_id] = float("-inf")
    if not settings.do_sample:
        return logits.softmax(dim=-1)
    logits = logits / settings.temperature
    if settings.top_k:
        kth = logits.topk(min(settings.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if settings.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - sorted_logits.softmax(dim=-1) >= settings.top_p  # keep the top token always
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return logits.softmax(dim=-1)


def pick_tokens(probabilities: torch.Tensor, do_sample: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy or sampled token per row and its probability; sampling uses the exponential trick (no host sync)."""
    if do_sample:
        tokens = (probabilities / torch.empty_like(probabilities).exponential_(1)).argmax(dim=-1)
    else:
        tokens = probabilities.argmax(dim=-1)
    return tokens, probabilities.gather(-1, tokens[..., None])[..., 0]


@dataclass
class Chunk:
    """Tokens stored together. Each sees the tokens of its row stored before `prefix` (before itself when
    `prefix` is None) plus the earlier tokens of its own group."""

    ids: torch.Tensor
    positions: torch.Tensor
    groups: torch.Tensor
    prefix: int | None = None
    start: int = 0  # storage index of the first token

    def __len__(self) -> int:
        return self.ids.shape[0]

    def prefixes(self) -> torch.Tensor:
        """Per token: how many of the row's stored tokens it sees in full."""
        if self.prefix is None:
            return self.start + torch.arange(len(self), device=self.ids.device)
        return torch.full_like(self.ids, self.prefix)


@dataclass
class Request:
    """The new tokens of one row for one forward: `num_pending` tokens that stay in the sequence, then queries."""

    ids: torch.Tensor
    positions: torch.Tensor
    ranks: torch.Tensor  # storage index of each token in its row
    prefixes: torch.Tensor
    groups: torch.Tensor
    num_pending: int

    def __len__(self) -> int:
        return self.ids.shape[0]


class SlotDecoder:
    """Plan-and-infill decisions for one prompt, written as a generator of model requests.

    `steps()` yields a `Request` per forward and receives the logits of its queries; the executor runs the
    requests of many rows as one batched forward. The sequence holds the prompt and the committed slots in commit
    order; with a cache their K/V are computed once, as pending tokens of the next request.
    """

    MASKED, INFILLING, DONE = range(3)

    def __init__(self, prompt: torch.LongTensor, settings: DecodingSettings):
        self.settings, self.device = settings, prompt.device
        self.prompt_length = prompt.shape[0]
        self.num_slots = -(-settings.max_new_tokens // settings.slot_size)
        self.offsets = torch.arange(settings.slot_size, device=self.device)
        self.answer = torch.full((self.num_slots * settings.slot_size,), settings.mask_token_id, device=self.device)
        self.drafts = self.answer.clone()
        self.eos = torch.tensor(settings.eos_token_ids, dtype=torch.long, device=self.device)
        self.status = [self.MASKED] * self.num_slots
        self.end = self.answer.shape[0]  # answer length; moves to just after the first committed EOS
        self.recompute = not settings.use_cache  # requests then carry the whole sequence
        self.stored: list[Chunk] = []  # the sequence, in storage order
        self.pending: list[Chunk] = []  # its tail whose K/V the next request computes
        self.length = 0
        self.next_group = 0
        self.keep = 0  # query tokens of the last request to keep in the sequence
        self._store(self._chunk(prompt, torch.arange(self.prompt_length, device=self.device)))

    # ---- the decoding loop ---------------------------------------------------------------------------------
    def steps(self):
        """Decode block by block, yielding one `Request` per forward and receiving its queries' logits."""
        slots_per_block = self.settings.block_length // self.settings.slot_size
        for first in range(0, self.num_slots, slots_per_block):
            block = range(first, min(first + slots_per_block, self.num_slots))
            while masked := [slot for slot in block if self.status[slot] == self.MASKED]:
                chosen = yield from self.plan(masked)
                infilling = yield from self.verify(chosen)
                yield from self.infill(infilling)

    def frontier(self) -> int:
        """Length of the answer prefix that is final in reading order (what can be streamed)."""
        undecided = next((slot for slot, status in enumerate(self.status) if status != self.DONE), self.num_slots)
        return min(undecided * self.settings.slot_size, self.end, self.settings.max_new_tokens)

    def answer_length(self) -> int:
        return min(self.end, self.settings.max_new_tokens)

    def finished(self) -> bool:
        return self.frontier() >= self.answer_length()

    def stop_at(self, length: int) -> None:
        """End the answer after `length` tokens (a stopping criterion fired there); later slots are dropped."""
        self.end = min(self.end, length)
        for slot in range(self.num_slots):
            if slot * self.settings.slot_size >= self.end:
                self.status[slot] = self.DONE

    def result(self) -> torch.LongTensor:
        """The answer, `max_new_tokens` long, with `pad_token_id` after its end."""
        answer = self.answer[: self.settings.max_new_tokens]
        after_end = torch.arange(answer.shape[0], device=self.device) >= self.answer_length()
        return answer.masked_fill(after_end, self.settings.pad_token_id)

    def plan(self, masked: list[int]):
        """Draft every token of the `masked` slots in one forward; return the slots chosen for decoding."""
        index = self._slot_index(masked)
        masks = torch.full_like(index, self.settings.mask_token_id)
        logits = yield from self._forward(self._chunk(masks.flatten(), index.flatten() + self.prompt_length))
        tokens, probabilities = pick_tokens(token_distribution(logits, self.settings), self.settings.do_sample)
        self.drafts[index.flatten()] = tokens
        confidence = probabilities.view(len(masked), -1)[:, 0]
        chosen = passes(confidence, self.settings.slot_threshold)
        chosen |= (torch.arange(len(masked), device=self.device) == confidence.argmax()) & ~chosen.any()
        return [slot for slot, keep in zip(masked, chosen.tolist()) if keep]

    def verify(self, chosen: list[int]):
        """Check the chosen drafts as one causal run. Commit the leading fully accepted slots with this forward's
        K/V; return the other chosen slots with the length of their accepted prefix."""
        index = self._slot_index(chosen)
        tokens = self.drafts[index]
        size = self.settings.slot_size
        if size == 1:  # nothing to verify: a slot's first token always passes
            accepted = [1] * len(chosen)
            eos_offsets = self._eos_offsets(tokens, torch.ones_like(index[:, 0])).tolist()
            leading = self._leading(chosen, accepted, eos_offsets)
            self._commit(chosen[:leading], tokens[:leading], index[:leading], None, accepted[:leading])
            return {}
        logits = yield from self._forward(self._chunk(tokens.flatten(), index.flatten() + self.prompt_length))
        probabilities = token_distribution(logits, self.settings).view(len(chosen), size, -1)
        ar_probability = probabilities[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
        first = torch.ones_like(tokens[:, :1], dtype=torch.bool)
        passed = torch.cat([first, passes(ar_probability, self.settings.token_threshold)], dim=1)
        accepted = passed.long().cumprod(dim=1).sum(dim=1)
        accepted, eos_offsets = torch.stack([accepted, self._eos_offsets(tokens, accepted)]).tolist()
        leading = self._leading(chosen, accepted, eos_offsets)
        lengths = self._lengths(eos_offsets[:leading])
        self.keep = sum(lengths)
        self._commit(chosen[:leading], tokens[:leading], index[:leading], None, lengths, computed=True)
        rest = zip(chosen[leading:], accepted[leading:], eos_offsets[leading:])
        rest = {slot: min(count, eos + 1) for slot, count, eos in rest if self.status[slot] != self.DONE}
        for slot in rest:
            self.status[slot] = self.INFILLING
        return rest

    def infill(self, known: dict[int, int]):
        """Complete the given slots (slot -> tokens already accepted) in parallel, each attending only to the
        committed sequence and to itself; every round accepts the passing drafts plus one token of the model's.

        A round's request holds each slot's newly accepted tokens (kept: they enter the sequence, in the slot's
        own group) and then its remaining drafts (dropped again), so no accepted token is computed twice.
        """
        prefix, size = self.length, self.settings.slot_size
        groups = dict(zip(known, self._new_groups(len(known)).tolist()))
        stored = dict.fromkeys(known, 0)  # leading tokens of each slot already in the sequence
        while known := {slot: count for slot, count in known.items() if self.status[slot] == self.INFILLING}:
            slots = list(known)
            index = self._slot_index(slots)
            counts = torch.tensor(list(known.values()), device=self.device)[:, None]
            fresh = (self.offsets >= torch.tensor([stored[slot] for slot in slots], device=self.device)[:, None]) & (
                self.offsets < counts
            )
            drafting = self.offsets >= counts
            tokens = self.drafts[index]  # accepted tokens, then the latest drafts
            slot_groups = torch.tensor([groups[slot] for slot in slots], device=self.device)[:, None].expand_as(index)
            query = Chunk(
                torch.cat([tokens[fresh], tokens[drafting]]),
                torch.cat([index[fresh], index[drafting]]) + self.prompt_length,
                torch.cat([slot_groups[fresh], slot_groups[drafting]]),
                prefix,
            )
            logits = yield from self._forward(query)
            num_fresh = sum(count - stored[slot] for slot, count in known.items())
            self.keep = num_fresh
            self._store(
                Chunk(query.ids[:num_fresh], query.positions[:num_fresh], query.groups[:num_fresh], prefix), True
            )
            stored.update(known)
            # Query row of every (slot, offset) in this request; offset i is predicted from offset i - 1.
            row_of = torch.zeros_like(index)
            row_of[fresh] = torch.arange(num_fresh, device=self.device)
            row_of[drafting] = num_fresh + torch.arange(len(query) - num_fresh, device=self.device)
            source = torch.cat([row_of[:, :1], row_of[:, :-1]], dim=1)[drafting]
            probabilities = token_distribution(logits[source], self.settings)
            predicted = torch.zeros_like(tokens)
            predicted[drafting], _ = pick_tokens(probabilities, self.settings.do_sample)
            ar_probability = torch.ones_like(tokens, dtype=probabilities.dtype)
            ar_probability[drafting] = probabilities.gather(-1, tokens[drafting][:, None])[:, 0]
            passed = ~drafting | passes(ar_probability, self.settings.token_threshold)
            first_failure = passed.long().cumprod(dim=1).sum(dim=1)  # the model's own token goes here
            # Accepted tokens stay; from the first failure on, each position takes the model's prediction.
            tokens = torch.where(self.offsets < first_failure[:, None], tokens, predicted)
            self.drafts[index] = tokens
            new_counts = (first_failure + 1).clamp(max=size)
            new_counts, eos_offsets = torch.stack([new_counts, self._eos_offsets(tokens, new_counts)]).tolist()
            finished = [
                row for row in range(len(slots)) if new_counts[row] == size or eos_offsets[row] < new_counts[row]
            ]
            finished_slots = [slots[row] for row in finished]
            self._end_at(finished_slots, [eos_offsets[row] for row in finished])
            lengths = self._lengths([eos_offsets[row] for row in finished])
            for slot, row, length in zip(finished_slots, finished, lengths):
                self._finish_slot(slot, tokens[row], index[row], stored[slot], length, groups[slot], prefix)
            known = dict(zip(slots, new_counts))

    # ---- bookkeeping ---------------------------------------------------------------------------------------
    def _slot_index(self, slots: list[int]) -> torch.Tensor:
        """Answer indices of the tokens of `slots`, shape `[len(slots), slot_size]`."""
        return torch.tensor(slots, device=self.device)[:, None] * self.settings.slot_size + self.offsets

    def _new_groups(self, count: int) -> torch.Tensor:
        self.next_group += count
        return torch.arange(self.next_group - count, self.next_group, device=self.device)

    def _chunk(self, ids: torch.Tensor, positions: torch.Tensor) -> Chunk:
        """A causal chunk: each token sees everything stored before it."""
        return Chunk(ids, positions, self._new_groups(1).expand(ids.shape[0]))

    def _eos_offsets(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Offset of the first EOS among the first `counts` tokens of each slot (`slot_size` when none)."""
        is_eos = torch.isin(tokens, self.eos) & (self.offsets < counts[:, None])
        return torch.where(is_eos, self.offsets, self.settings.slot_size).min(dim=1).values

    def _lengths(self, eos_offsets: list[int]) -> list[int]:
        """Tokens kept of each finished slot: up to and including its EOS."""
        return [min(offset + 1, self.settings.slot_size) for offset in eos_offsets]

    def _leading(self, chosen: list[int], accepted: list[int], eos_offsets: list[int]) -> int:
        """How many leading chosen slots are complete: fully accepted, or accepted up to an EOS (which ends them)."""
        size, leading = self.settings.slot_size, 0
        while leading < len(chosen) and (accepted[leading] == size or eos_offsets[leading] < accepted[leading]):
            leading += 1
            if eos_offsets[leading - 1] < size:
                break
        self._end_at(chosen[:leading], eos_offsets[:leading])
        return leading

    def _end_at(self, slots: list[int], eos_offsets: list[int]) -> None:
        """Move the end of the answer to the first committed EOS and drop the slots after it."""
        size = self.settings.slot_size
        for slot, offset in zip(slots, eos_offsets):
            if offset < size:
                self.stop_at(slot * size + offset + 1)

    def _commit(self, slots, tokens, index, prefix, lengths, computed: bool = False) -> None:
        """Append the first `lengths[i]` tokens of each slot to the sequence: as one causal chunk (`prefix` None)
        or with each slot seeing `prefix` tokens and itself. `computed`: their K/V are already in the cache."""
        if not slots:
            return
        for slot in slots:
            self.status[slot] = self.DONE
        keep = self.offsets < torch.tensor(lengths, device=self.device)[:, None]
        self.answer[index[keep]] = tokens[keep]
        ids, positions = tokens[keep], index[keep] + self.prompt_length
        if prefix is None:
            chunk = self._chunk(ids, positions)
        else:
            chunk = Chunk(ids, positions, self._new_groups(len(slots)).repeat_interleave(keep.sum(dim=1)), prefix)
        self._store(chunk, computed)

    def _finish_slot(self, slot, tokens, index, stored: int, length: int, group: int, prefix: int) -> None:
        """Commit an infilled slot: its tokens not yet in the sequence join it, in the slot's group."""
        self.status[slot] = self.DONE
        self.answer[index[:length]] = tokens[:length]
        if length > stored:
            ids, positions = tokens[stored:length], index[stored:length] + self.prompt_length
            self._store(Chunk(ids, positions, torch.full_like(ids, group), prefix))

    def _store(self, chunk: Chunk, computed: bool = False) -> None:
        chunk.start = self.length
        self.stored.append(chunk)
        self.length += len(chunk)
        if not computed:
            self.pending.append(chunk)

    def _forward(self, queries: Chunk):
        """Yield `[pending | queries]` (the whole sequence and the queries when recomputing); return the
        queries' logits. Pending tokens are then part of the cached sequence."""
        queries.start = self.length
        chunks = [*(self.stored if self.recompute else self.pending), queries]
        request = Request(
            ids=torch.cat([chunk.ids for chunk in chunks]),
            positions=torch.cat([chunk.positions for chunk in chunks]),
            ranks=torch.cat([chunk.start + torch.arange(len(chunk), device=self.device) for chunk in chunks]),
            prefixes=torch.cat([chunk.prefixes() for chunk in chunks]),
            groups=torch.cat([chunk.groups for chunk in chunks]),
            num_pending=sum(len(chunk) for chunk in chunks[:-1]),
        )
        logits = yield request
        self.pending, self.keep = [], 0
        return logits


def attention_mask(key_ranks, key_groups, ranks, prefixes, groups, past: int, dtype) -> torch.Tensor:
    """Additive mask `[batch, 1, new, past + new]` from each token's storage rank, prefix and group: a token sees
    the keys of its row ranked below its prefix and the keys of its group ranked up to itself (and always itself,
    so that padding rows stay finite)."""
    sees = key_ranks[:, None, :] < prefixes[:, :, None]
    sees |= (key_groups[:, None, :] == groups[:, :, None]) & (key_ranks[:, None, :] <= ranks[:, :, None])
    new = torch.arange(ranks.shape[1], device=ranks.device)
    sees[:, new, past + new] = True
    mask = torch.zeros(sees.shape, dtype=dtype, device=sees.device)
    return mask.masked_fill(~sees, torch.finfo(dtype).min)[:, None]


PADDING = {"ids": 0, "positions": 0, "ranks": NEVER, "prefixes": 0, "groups": -2}  # padding sees only itself


class InOrderMonitor:
    """Streams, and applies stopping criteria to, the in-order prefix of each answer as it grows.

    ReFusion commits slots out of reading order; only the contiguous prefix is final text. When a criterion fires
    inside a newly final run of tokens, the answer ends at the first token where it does.
    """

    def __init__(self, decoders: list[SlotDecoder], prompts: list[torch.Tensor], streamer=None, criteria=None):
        self.decoders, self.prompts, self.streamer, self.criteria = decoders, prompts, streamer, criteria
        self.emitted = [0] * len(prompts)
        if streamer is not None:
            streamer.put(prompts[0][None].cpu())

    def update(self) -> None:
        for row, decoder in enumerate(self.decoders):
            frontier = decoder.frontier()
            if frontier <= self.emitted[row]:
                continue
            if self.criteria:
                for length in range(self.emitted[row] + 1, frontier + 1):
                    sequence = torch.cat([self.prompts[row], decoder.answer[:length]])[None]
                    if self.criteria(sequence, None).any():
                        decoder.stop_at(length)
                        frontier = length
                        break
            if self.streamer is not None:
                self.streamer.put(decoder.answer[self.emitted[row] : frontier].cpu())
            self.emitted[row] = frontier

    def end(self) -> None:
        if self.streamer is not None:
            self.streamer.end()


def execute(
    model, decoders: list[SlotDecoder], cache: DynamicCache | None, monitor: InOrderMonitor | None = None
) -> int:
    """Run the decoders' requests as batched forwards over one `cache` (rows of different lengths leave masked
    holes in it; without a cache every request carries its whole sequence); finished rows leave the batch.
    `monitor` sees every step. Returns the number of forwards."""
    device = decoders[0].device
    steps = [decoder.steps() for decoder in decoders]
    rows = list(range(len(decoders)))
    requests = [next(step) for step in steps]
    use_cache = cache is not None
    cached_ranks = torch.zeros((len(rows), 0), dtype=torch.long, device=device)  # per row and cache column
    cached_groups = torch.zeros_like(cached_ranks)
    forwards = 0
    while rows:
        # Left-pad the new tokens so that every row's queries end the batch: logits are computed for those only.
        batch = {
            name: pad_sequence([getattr(request, name) for request in requests], True, value, padding_side="left")
            for name, value in PADDING.items()
        }
        width = batch["ids"].shape[1]
        query_lengths = [len(request) - request.num_pending for request in requests]
        past = cached_ranks.shape[1]
        key_ranks = torch.cat([cached_ranks, batch["ranks"]], dim=1)
        key_groups = torch.cat([cached_groups, batch["groups"]], dim=1)
        mask = attention_mask(
            key_ranks, key_groups, batch["ranks"], batch["prefixes"], batch["groups"], past, model.dtype
        )
        logits = model(
            input_ids=batch["ids"],
            position_ids=batch["positions"],
            attention_mask=mask,
            cache=cache,
            use_cache=use_cache,
            logits_to_keep=max(query_lengths),
        ).logits
        forwards += 1
        kept_ends, next_requests = [], []
        for row, (length, step) in enumerate(zip(query_lengths, (steps[r] for r in rows))):
            try:
                next_requests.append(step.send(logits[row, logits.shape[1] - length :]))
            except StopIteration:
                next_requests.append(None)
            kept_ends.append(width - length + decoders[rows[row]].keep)  # pending and kept queries stay
        if cache is not None:
            kept = max(kept_ends)
            keep = torch.arange(kept, device=device) < torch.tensor(kept_ends, device=device)[:, None]
            cached_ranks = torch.cat([cached_ranks, batch["ranks"][:, :kept].masked_fill(~keep, NEVER)], dim=1)
            cached_groups = torch.cat([cached_groups, batch["groups"][:, :kept]], dim=1)
            cache.crop(kept - width)
        if monitor is not None:
            monitor.update()
        alive = [
            row
            for row, request in enumerate(next_requests)
            if request is not None and not decoders[rows[row]].finished()
        ]
        if len(alive) < len(rows) and alive and cache is not None:
            cache.batch_select_indices(torch.tensor(alive, device=device))
            cached_ranks, cached_groups = cached_ranks[alive], cached_groups[alive]
        rows = [rows[row] for row in alive]
        requests = [next_requests[row] for row in alive]
    return forwards


def stopping_criteria_for(config: GenerationConfig, stopping_criteria, tokenizer) -> StoppingCriteriaList:
    """The caller's criteria plus those the config's `stop_strings` and `max_time` ask for."""
    criteria = StoppingCriteriaList(stopping_criteria or [])
    if stop_strings := config.stop_strings:
        if tokenizer is None:
            raise ValueError("stop_strings needs the tokenizer: pass tokenizer=... to generate().")
        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    if config.max_time is not None:
        criteria.append(MaxTimeCriteria(max_time=config.max_time))
    return criteria


def refusion_generate(
    model,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None = None,
    generation_config: GenerationConfig | None = None,
    return_dict_in_generate: bool | None = None,
    streamer=None,
    stopping_criteria: StoppingCriteriaList | None = None,
    tokenizer=None,
    **kwargs,
) -> torch.LongTensor | RefusionGenerateOutput:
    """ReFusion decoding of a left-padded batch: one batched forward per step for all rows (use_cache), or each
    row recomputed from scratch at every forward (use_cache=False, the reference). `streamer` receives, and
    `stopping_criteria`, `stop_strings` and `max_time` act on, the in-order prefix of each answer."""
    if input_ids is None or input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError("generate() needs a non-empty 2D input_ids prompt of shape (batch, length).")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids {tuple(input_ids.shape)}.")
    settings, config = resolve_settings(model, generation_config, input_ids.shape[1], kwargs)
    if return_dict_in_generate is None:
        return_dict_in_generate = bool(config.return_dict_in_generate)
    num_return_sequences = config.num_return_sequences or 1
    if num_return_sequences > 1 and not settings.do_sample:
        raise ValueError("num_return_sequences > 1 needs do_sample=True: greedy decoding gives one answer.")
    if streamer is not None and input_ids.shape[0] * num_return_sequences > 1:
        raise ValueError("A streamer follows a single answer: use batch size 1 and num_return_sequences=1.")
    criteria = stopping_criteria_for(config, stopping_criteria, tokenizer)
    input_ids = input_ids.repeat_interleave(num_return_sequences, dim=0)
    attention_mask = attention_mask.repeat_interleave(num_return_sequences, dim=0)
    prompts = []
    for row, mask in zip(input_ids, attention_mask.bool()):
        prompt = row[mask]
        if prompt.shape[0] == 0:
            raise ValueError("Every prompt in the batch needs at least one token (attention_mask has an empty row).")
        if not mask[mask.long().argmax() :].all():
            raise ValueError("Prompts must be left-padded: attention_mask has a gap inside a row.")
        if (prompt == settings.mask_token_id).any():
            raise ValueError(
                f"A prompt contains the mask token (id {settings.mask_token_id}); it marks undecoded tokens only."
            )
        prompts.append(prompt)

    decoders = [SlotDecoder(prompt, settings) for prompt in prompts]
    monitor = InOrderMonitor(decoders, prompts, streamer, criteria) if streamer is not None or criteria else None
    with torch.no_grad():
        if settings.use_cache:
            forwards = execute(model, decoders, DynamicCache(), monitor)
        else:
            forwards = sum(execute(model, [decoder], None, monitor) for decoder in decoders)
    if monitor is not None:
        monitor.end()
    ends = [decoder.answer_length() for decoder in decoders]
    answers = torch.stack([decoder.result() for decoder in decoders])
    sequences = torch.cat([input_ids, answers[:, : max(ends)]], dim=1)
    if not return_dict_in_generate:
        return sequences
    committed = sum(ends)
    return RefusionGenerateOutput(
        sequences=sequences, num_forward_passes=forwards, tokens_per_forward=committed / max(forwards, 1)
    )
