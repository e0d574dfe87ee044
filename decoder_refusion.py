"""One row of a ReFusion decode: what it has stored and what it asks of the next forward.

`SlotDecoder` is a state machine over the phases of the decode (plan, verify, infill, commit; see
`generation_refusion`): `request()` gives the next forward's tokens with their position ids and what they attend to
(`Request`, `Queries`), `score(logits)` reads that forward on the device into a few integers, and `advance(values)`
decides from them (with the functions of `decisions_refusion`) and moves on. `StoredSequence` records the order in
which a row's tokens were stored and what each attends to; `Infilling` the slots being infilled; its
`AcceptanceProfile` (`acceptance_refusion`) how many drafts of each kind passed. A row's `watcher`
(`generation_refusion.InOrderWatcher`) sees each commit.
"""

import array
from dataclasses import dataclass, field

import torch
from transformers.generation import logits_process as lp

try:
    from .acceptance_refusion import AcceptanceProfile
    from .decisions_refusion import (
        EAGER_STEPS,
        NEVER,
        NO_GROUP,
        StepFunctions,
        accept_reference,
        best_window,
        check_counts,
        choose_slots,
        eos_offsets,
        infill_masks,
        judge_verify,
        leading_complete,
        pick_tokens,
        score_recheck,
        score_redraft,
    )
    from .settings_refusion import CONTEXT_FREE, DecodingSettings
except ImportError:  # installed as top-level modules rather than loaded as Hub remote code
    from acceptance_refusion import AcceptanceProfile
    from decisions_refusion import (
        EAGER_STEPS,
        NEVER,
        NO_GROUP,
        StepFunctions,
        accept_reference,
        best_window,
        check_counts,
        choose_slots,
        eos_offsets,
        infill_masks,
        judge_verify,
        leading_complete,
        pick_tokens,
        score_recheck,
        score_redraft,
    )
    from settings_refusion import CONTEXT_FREE, DecodingSettings


def upload(values: list[int], device) -> torch.Tensor:
    """A flat host list of ints as a 1-D long tensor on `device`, copied without waiting for the device's queued work.
    (Read from an `array`'s buffer: `torch.tensor` converts a list item by item, which a decode paid about twice a
    forward; the buffer is read whole.)"""
    host = torch.frombuffer(array.array("q", values), dtype=torch.long) if values else torch.zeros(0, dtype=torch.long)
    return host if torch.device(device).type == "cpu" else host.to(device, non_blocking=True)


def positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Flat (row-major) indices of the true entries of `mask`, of which the host knows there are `count`: found
    without reading the mask to the host, as boolean indexing would."""
    return torch.nonzero_static(mask.flatten(), size=count)[:, 0]


# ---- the passive record of one row ---------------------------------------------------------------------------------
# What a forward's token carries, in this order, and the value of each in left padding
PADDING = {"ids": 0, "positions": 0, "ranks": NEVER, "prefixes": 0, "groups": -2, "parents": NO_GROUP}
FIELDS = tuple(PADDING)


@dataclass
class Queries:
    """Tokens of one forward after what is stored, as the rows of one `[6, n]` tensor (`FIELDS`: token ids, RoPE
    positions, ranks, prefixes, groups, parents; the ranks row is set when requested). Each token sees the stored
    tokens ranked below its `prefix`, the earlier tokens of its own group, and those of its `parent` group (a `[MASK]`
    query, the slot it drafts for)."""

    fields: torch.Tensor

    @classmethod
    def of(cls, ids, positions, prefixes, groups, parents) -> "Queries":
        return cls(torch.stack([ids, positions, ids, prefixes, groups, parents]))  # (ranks: a placeholder)

    @classmethod
    def causal(cls, ids: torch.Tensor, positions: torch.Tensor, start: int, group: int) -> "Queries":
        """A run in which each token sees everything before it."""
        prefixes = torch.arange(start, start + ids.shape[0], device=ids.device)
        return cls.of(ids, positions, prefixes, torch.full_like(ids, group), torch.full_like(ids, NO_GROUP))

    def __len__(self) -> int:
        return self.fields.shape[1]


@dataclass(frozen=True)
class Request:
    """One row's new tokens for one forward: `len - num_queries` pending stored tokens, then the queries; `fields`
    holds them as `Queries` does, ranks (storage indices) set."""

    fields: torch.Tensor
    num_queries: int

    def __len__(self) -> int:
        return self.fields.shape[1]


class StoredSequence:
    """What one row has stored, in storage order (as `Queries` fields), and how far the KV cache holds it. A stored
    token's parent is always `NO_GROUP` (only `[MASK]` queries have parents, and they are never stored)."""

    def __init__(self, device):
        self.fields = torch.zeros((len(FIELDS), 0), dtype=torch.long, device=device)
        self.computed = 0  # leading tokens whose K/V are in the cache
        self.kept = 0  # queries of the last request that stayed

    def __len__(self) -> int:
        return self.fields.shape[1]

    def append(self, queries: Queries, computed: bool = False) -> None:
        """Store tokens (whose K/V the next forward computes, unless `computed`)."""
        self.fields = torch.cat([self.fields, queries.fields], dim=1)
        if computed:
            self.computed = len(self)

    def request(self, queries: Queries, recompute: bool) -> Request:
        """The request for one forward: the pending tokens (all stored tokens when `recompute`) then `queries`."""
        start = 0 if recompute else self.computed
        fields = torch.cat([self.fields[:, start:], queries.fields], dim=1)
        fields[FIELDS.index("ranks")] = torch.arange(start, len(self) + len(queries), device=fields.device)
        self.computed, self.kept = len(self), 0
        return Request(fields, num_queries=len(queries))

    def keep(self, queries: Queries) -> None:
        """The leading `queries` of the request just run stay in the sequence with the K/V it computed."""
        self.append(queries, computed=True)
        self.kept = len(queries)


@dataclass
class Infilling:
    """Chosen slots being completed: their tokens (accepted prefix, then drafts) on the device and, known to the host,
    how many of each are accepted and stored, their attention groups, and the sequence length they all see."""

    slots: list[int]
    tokens: torch.Tensor
    counts: list[int]
    stored: list[int]
    groups: list[int]
    prefix: int
    found: list[int] | None = None  # `lookup_drafts`: the drafts copied from earlier text after each count

    @property
    def fresh(self) -> int:
        """Accepted tokens not yet stored in the cache, over all slots: the next round's forward writes them."""
        return sum(count - stored for count, stored in zip(self.counts, self.stored))

    def select(self, rows: list[int]) -> "Infilling":
        if rows == list(range(len(self.slots))):  # all of them: no copy of the tokens
            return self
        return Infilling(
            [self.slots[row] for row in rows],
            self.tokens[upload(rows, self.tokens.device)],
            [self.counts[row] for row in rows],
            [self.stored[row] for row in rows],
            [self.groups[row] for row in rows],
            self.prefix,
            None if self.found is None else [self.found[row] for row in rows],
        )


# ---- one row: a state machine the executor steps -------------------------------------------------------------------
@dataclass
class PlanForward:
    """A plan forward: the answer indices it drafts (every token of the masked slots, or only their first)."""

    index: torch.Tensor | None = None


@dataclass
class VerifyForward:
    """A verify forward: the drafts copied after each chosen slot's first token (`lookup_drafts`, from the plan),
    the slots' answer indices `[slots, slot_size]`, their tokens (the drafts checked; once scored, the tokens each slot
    goes on with) and how many leading tokens of each slot the forward holds (`width`)."""

    found: list[int] | None = None
    index: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    width: int = 0
    queries: Queries | None = None


@dataclass
class InfillRound:
    """A fast-rule infill round, as `SlotDecoder._infill_layout` lays it out: flat positions in `[slots, slot_size]`
    of the `fresh` accepted tokens not yet stored, the drafts `queried` and the positions `checked` (host lists); on
    the device, the slots' answer indices, their stored and accepted counts and checked ends (`until`), the queries'
    fields but their ids and where in the slots' tokens each query's id is (`at`). Then the sizes of the query spans
    (fresh, `[MASK]` queries where fused, drafts), the fresh queries that stay stored, and once scored the tokens each
    slot goes on with."""

    fresh: list[int]
    checked: list[int]
    queried: list[int]
    index: torch.Tensor
    stored: torch.Tensor
    counts: torch.Tensor
    until: torch.Tensor
    fields: torch.Tensor
    at: torch.Tensor
    sizes: list[int] = field(default_factory=list)
    fresh_queries: Queries | None = None
    tokens: torch.Tensor | None = None


@dataclass
class ReferenceRound:
    """A round of the authors' infill rule (a redraft forward, then a recheck): the slots' answer indices, their
    accepted counts, the flat positions of the slots still open (`live`) and of the tokens redrafted (`drafting`), the
    forward row of each position, and once redrafted the slots' tokens."""

    index: torch.Tensor
    counts: torch.Tensor
    live: torch.Tensor
    row_of: torch.Tensor
    drafting: torch.Tensor
    tokens: torch.Tensor | None = None


@dataclass
class Phase:
    """Where a row's decode stands between two forwards: which forward it asks for next (`kind`) and what that
    forward's logits are read against (`forward`, a record of the kind's own, filled as its queries are built)."""

    kind: int
    slots: list[int] = field(default_factory=list)  # PLAN: the masked slots; VERIFY: the chosen ones
    state: Infilling | None = None  # INFILL, REDRAFT, RECHECK: the slots being completed
    forward: PlanForward | VerifyForward | InfillRound | ReferenceRound | None = None


class SlotDecoder:
    """Plan-and-infill decisions for one prompt, stepped by the executor in three calls a forward: `request()` gives
    the row's next forward (None when its answer is done); `score(logits)` reads the logits of that forward's
    queries on the device and returns, as one small integer tensor, all that the host needs to decide; the executor
    reads the tensors of all rows to the host at once, and `advance(values)` decides what is committed and what
    comes next, and returns how many of the queries stay in the sequence (with their K/V). So a decode step waits
    for the device once, however many rows it batches: slot status and every count the queries are built from are
    known to the host, and the queries are built from them without reading the device."""

    MASKED, INFILLING, DONE = range(3)  # slot status
    PLAN, VERIFY, INFILL, REDRAFT, RECHECK, FINISHED = range(6)  # phase kinds; REDRAFT/RECHECK: the reference rule
    # the phases whose scoring checks drafts, and the source it counts as (their scores end with its counts)
    CHECKS = {VERIFY: AcceptanceProfile.PLAN, INFILL: AcceptanceProfile.REDRAFT, RECHECK: AcceptanceProfile.REDRAFT}

    def __init__(
        self,
        prompt: torch.LongTensor,
        settings: DecodingSettings,
        processors=None,
        watcher=None,
        prices=None,
        steps: "StepFunctions | None" = None,
    ):
        self.settings, self.device, self.prices = settings, prompt.device, prices  # prices: `draft_schedule="price"`
        self.steps = steps or EAGER_STEPS  # compiled with the forwards (`compiled_steps()`) or not
        self.processors, self.watcher = processors or lp.LogitsProcessorList(), watcher
        self.context_free = all(isinstance(processor, CONTEXT_FREE) for processor in self.processors)
        # Greedy decoding with no processor that reads earlier tokens scores each forward whole, logits to host values,
        # in one step function a phase (`score_plan`, `score_verify`, `score_infill`, `score_redraft`, `score_recheck`);
        # sampling, or such a processor, scores the rows each decision reads (`_pick`, `_ar_check`).
        self.greedy = not settings.do_sample and self.context_free
        # (a 0-d tensor, as step functions compiled ahead of time take it: one package serves every threshold)
        self.token_threshold = torch.tensor(settings.token_threshold, dtype=torch.float64, device=self.device)
        self.keep_drafts = torch.tensor(settings.fused_redraft, device=self.device)  # (`judge_verify`'s, so too)
        self.slot_threshold = torch.tensor(settings.slot_threshold, dtype=torch.float64, device=self.device)
        self.prompt = prompt
        size = settings.slot_size
        self.num_slots = -(-settings.max_new_tokens // size)
        self.offsets = torch.arange(size, device=self.device)
        # the prompt and the answer as one text (`_look_up` copies drafts from it); the answer is a view of it
        masks = torch.full((self.num_slots * size,), settings.mask_token_id, device=self.device)
        self.text = torch.cat([prompt, masks])
        self.answer = self.text[prompt.shape[0] :]
        self.drafts = self.answer.clone()
        # the EOS ids, and two that no token has: so that the tensor's size is never 0 or 1, which compiled step
        # functions would take as graphs of their own
        self.eos = torch.tensor([*settings.eos_token_ids, -1, -1], dtype=torch.long, device=self.device)
        self.status = [self.MASKED] * self.num_slots
        self.end = self.answer.shape[0]  # answer length; moves to just after the first committed EOS
        self.record = StoredSequence(self.device)
        self.next_group = 0
        self.forwards = self.committed_slots = 0
        self.step_ratios: list[float] = []  # per plan step: slot_size x committed slots / forwards (authors' TPF)
        self.step_start = (0, 0)  # forwards and committed slots when the current plan step began
        self.profile = AcceptanceProfile(size, self.device, settings.draft_prior)
        prompt_positions = torch.arange(prompt.shape[0], device=self.device)
        self.record.append(Queries.causal(prompt, prompt_positions, 0, self._new_group()))
        self.block = 0  # first slot of the block being decoded
        self.context = 0  # stored tokens when the current plan step began: what its chosen slots are checked against
        self.phase = self._next_step()

    # ---- the loop: one forward a round of calls -----------------------------------------------------------------
    def request(self) -> Request | None:
        """The row's next forward: the pending stored tokens and the queries of the current phase (None when done)."""
        build = {
            self.PLAN: self._plan_queries,
            self.VERIFY: self._verify_queries,
            self.INFILL: self._infill_queries,
            self.REDRAFT: self._redraft_queries,
            self.RECHECK: self._recheck_queries,
        }.get(self.phase.kind)
        if build is None:
            return None
        self.forwards += 1
        return self.record.request(build(self.phase), recompute=not self.settings.use_cache)

    def score(self, logits: torch.Tensor) -> torch.Tensor:
        """Read the logits of the last request's queries on the device; returns the 1-D long tensor of what the host
        must know to decide (ending with the counts of the drafts checked, in the phases that check some)."""
        score = {
            self.PLAN: self._score_plan,
            self.VERIFY: self._score_verify,
            self.INFILL: self._score_infill,
            self.REDRAFT: self._score_redraft,
            self.RECHECK: self._score_recheck,
        }[self.phase.kind]
        return score(self.phase, logits)

    def advance(self, values: list[int]) -> int:
        """Decide from the host's copy of `score`'s tensor and move to the next phase; returns how many leading
        queries of the last request stay in the sequence."""
        source = self.CHECKS.get(self.phase.kind)
        if source is not None:
            values, checked = values[:-2], values[-2:]
            self.profile.read(source, checked)
        decide = {
            self.PLAN: self._planned,
            self.VERIFY: self._verified,
            self.INFILL: self._infilled,
            self.REDRAFT: self._redrafted,
            self.RECHECK: self._rechecked,
        }[self.phase.kind]
        self.phase = decide(self.phase, values)
        return self.record.kept

    def _next_step(self) -> Phase:
        """The next plan step: the masked slots of the first block that has any (blocks are decoded in order), or
        FINISHED when none is left."""
        slots_per_block = self.settings.block_length // self.settings.slot_size
        while self.block < self.num_slots:
            block = range(self.block, min(self.block + slots_per_block, self.num_slots))
            if masked := [slot for slot in block if self.status[slot] == self.MASKED]:
                self.step_start = (self.forwards, self.committed_slots)
                self.context = len(self.record)
                return Phase(self.PLAN, slots=masked)
            self.block += slots_per_block
        return Phase(self.FINISHED)

    def _step_done(self) -> Phase:
        """Record the plan step just finished (the authors' tokens per forward) and begin the next."""
        forwards, committed = self.step_start
        size = self.settings.slot_size
        self.step_ratios.append(size * (self.committed_slots - committed) / (self.forwards - forwards))
        return self._next_step()

    def _infilling(self, state: Infilling | None, eos: list[int] | None = None) -> Phase:
        """Go on completing `state`'s slots by the infill rule in force, or end the step when none is left (the
        reference rule commits them all at its end, `eos` being their EOS offsets)."""
        if state is None:
            return self._step_done()
        if self.settings.infill_mode != "reference":
            return Phase(self.INFILL, state=state)
        if all(count >= self.settings.slot_size for count in state.counts):
            self._settle(state, eos)
            return self._step_done()
        return Phase(self.REDRAFT, state=state)

    # ---- plan -------------------------------------------------------------------------------------------------
    def _plan_queries(self, phase: Phase) -> Queries:
        """Draft every token of the masked slots in one forward; only their first tokens (which choose the slots)
        where the price schedule finds that drafts do not pay (the slots are then completed token by token) or where
        the drafts after them are copied from the text (`lookup_drafts`). The authors' rule drafts them as one causal
        run; the fast rule drafts each slot apart, so that how many drafts a plan takes never changes which slots it
        chooses."""
        index = self._slot_index(phase.slots)
        if self.settings.lookup_drafts or self.prices is not None and not self._drafts_pay(len(phase.slots)):
            index = index[:, :1]
        phase.forward = PlanForward(index.flatten())
        return self._run(torch.full_like(index, self.settings.mask_token_id), index)

    def _score_plan(self, phase: Phase, logits: torch.Tensor) -> torch.Tensor:
        """Keep the drafts; choose the slots to decode by their first draft's confidence (and, for one-token slots,
        which drafts are EOS)."""
        index, settings = phase.forward.index, self.settings
        if self.greedy:
            slots = self._slot_index(phase.slots)
            values, self.drafts[slots] = self.steps.score_plan(
                self._processed(logits).view(len(phase.slots), -1, logits.shape[-1]), self.drafts[slots], self.eos,
                settings.mask_token_id, self.slot_threshold, self.text, slots + self.prompt.shape[0],
                settings.lookup_drafts,
            )  # fmt: skip
            return values
        tokens, probabilities = self._pick(logits, torch.arange(logits.shape[0], device=self.device), index)
        self.drafts[index] = tokens
        chosen = choose_slots(probabilities.view(len(phase.slots), -1)[:, 0], settings.slot_threshold)
        if settings.slot_size == 1:
            return torch.cat([chosen.long(), torch.isin(tokens, self.eos).long()])
        if not settings.lookup_drafts:
            return chosen.long()
        # the drafts after each slot's first one, copied from the text
        slots = self._slot_index(phase.slots)
        self.drafts[slots], found = self._look_up(slots, self.drafts[slots], slots.new_ones(slots.shape[0]))
        return torch.cat([chosen.long(), found])

    def _planned(self, phase: Phase, values: list[int]) -> Phase:
        slots = len(phase.slots)
        chosen = [slot for slot, keep in zip(phase.slots, values[:slots]) if keep]
        if self.settings.slot_size > 1:
            found = [count for count, keep in zip(values[slots:], values[:slots]) if keep]
            return Phase(self.VERIFY, slots=chosen, forward=VerifyForward(found=found or None))
        # one-token slots: nothing to check, a slot's only token always passes; the run ends at the first EOS
        eos = [0 if is_eos else 1 for is_eos, keep in zip(values[slots:], values[:slots]) if keep]
        leading = leading_complete([1] * len(chosen), eos, 1)
        tokens = self.drafts[self._slot_index(chosen[:leading])]
        self._commit_run(chosen[:leading], tokens, eos[:leading])
        return self._step_done()

    # ---- verify -----------------------------------------------------------------------------------------------
    def _verify_queries(self, phase: Phase) -> Queries:
        """The chosen drafts, each slot's leading `_verify_width` tokens: as one causal run by the authors' rule, each
        slot apart by the fast rule (checked against the sequence its plan step saw, whatever the width)."""
        index = self._slot_index(phase.slots)
        tokens = self.drafts[index]
        forward = phase.forward
        forward.index, forward.tokens = index, tokens
        forward.width = width = self._verify_width(len(phase.slots), forward.found)
        forward.queries = self._run(tokens[:, :width], index[:, :width])
        return forward.queries

    def _score_verify(self, phase: Phase, logits: torch.Tensor) -> torch.Tensor:
        """Check the drafts: each slot's accepted length and EOS offset and, for the fast rule, the tokens and counts
        it goes on with (the model's own token at the first rejected draft, redrafts after it) and their EOS."""
        forward, size, settings = phase.forward, self.settings.slot_size, self.settings
        index, tokens, width, slots = forward.index, forward.tokens, forward.width, len(phase.slots)
        fast = settings.infill_mode != "reference"
        if self.greedy:  # (the authors' rule reads the accepted lengths and EOS offsets only, and keeps the drafts)
            values, corrected, marks = self.steps.score_verify(
                self._processed(logits).view(slots, width, -1), tokens, self.eos, settings.mask_token_id,
                self.token_threshold, self.keep_drafts, self.text, index + self.prompt.shape[0], settings.lookup_drafts,
            )  # fmt: skip
            if fast:
                forward.tokens = corrected
            self.profile.record(AcceptanceProfile.PLAN, marks)  # (`values` end with its counts)
            return values
        until = min(width + 1, size)  # the logits at offset i score offset i + 1; offset 0 always passes
        scored = ((self.offsets > 0) & (self.offsets < until)).expand_as(tokens)
        at = (torch.arange(slots, device=self.device)[:, None] * size + self.offsets[1:until]).flatten()
        rows = (torch.arange(slots, device=self.device)[:, None] * width + self.offsets[: until - 1]).flatten()
        ar_tokens, ar_probability = self._ar_check(logits, rows, tokens, index, at)
        values, forward.tokens, marks = judge_verify(
            tokens,
            scored,
            ar_probability,
            ar_tokens,
            self.eos,
            settings.token_threshold,
            self.keep_drafts if fast else None,
        )
        self.profile.record(AcceptanceProfile.PLAN, marks)
        if fast and settings.lookup_drafts:
            forward.tokens, found = self._look_up(index, forward.tokens, values[2])
            values.append(found)
        return torch.cat([*values, check_counts(marks)])

    def _verified(self, phase: Phase, values: list[int]) -> Phase:
        """Commit the leading complete slots with this forward's K/V; infill the other chosen slots."""
        chosen, forward, size = phase.slots, phase.forward, self.settings.slot_size
        slots = len(chosen)
        accepted, eos = values[:slots], values[slots : 2 * slots]
        leading = leading_complete(accepted, eos, size) if forward.width == size else 0  # else not all computed
        self._commit_run(chosen[:leading], forward.tokens[:leading], eos[:leading], computed=forward.queries)
        groups = self._new_groups(slots - leading)
        if self.settings.infill_mode == "reference":
            if leading:  # the other chosen slots return to [MASK] and are planned again
                return self._step_done()
            state = Infilling(chosen, forward.tokens, accepted, [0] * slots, groups, self.context)
            return self._infilling(state, eos)
        counts, eos = values[2 * slots + leading : 3 * slots], values[3 * slots + leading : 4 * slots]
        found = values[4 * slots + leading :] if self.settings.lookup_drafts else None
        state = Infilling(chosen[leading:], forward.tokens[leading:], counts, [0] * len(counts), groups,
                          self.context, found)  # fmt: skip
        return self._infilling(self._settle(state, eos))

    # ---- infill, fast rule ------------------------------------------------------------------------------------
    def _infill_queries(self, phase: Phase) -> Queries:
        """One round for all the slots: `[fresh accepted tokens | MASK queries (fused) | drafts]`. Fresh tokens stay
        in the sequence (in their slot's group); the drafts are checked, the model's own token replaces the first
        rejected one, and the rest are redrafted from the same forward. Every field but the token ids is known to
        the host and goes to the device with the round's layout (`_infill_layout`); the ids are gathered from the
        slots' tokens."""
        state = phase.state
        windows = self._infill_windows(state)
        spans = [("fresh", state.groups, None)]
        if self.settings.fused_redraft and not self.settings.lookup_drafts and max(windows) > 0:
            # (with no drafts there is nothing to redraft; copied drafts are found again after each round)
            spans.append(("checked", self._new_groups(len(state.slots)), state.groups))
        spans.append(("queried", state.groups, None))
        phase.forward = layout = self._infill_layout(state, windows, spans)
        ids = state.tokens.flatten()[layout.at]
        sizes = [len(getattr(layout, name)) for name, _, _ in spans]
        if len(spans) == 3:
            ids[sizes[0] : sizes[0] + sizes[1]] = self.settings.mask_token_id
        queries = Queries(torch.cat([ids[None], layout.fields]))
        layout.sizes, layout.fresh_queries = sizes, Queries(queries.fields[:, : sizes[0]])
        return queries

    def _score_infill(self, phase: Phase, logits: torch.Tensor) -> torch.Tensor:
        """Check the drafts and correct the first rejected one: each slot's new accepted count and EOS offset."""
        state, layout = phase.state, phase.forward
        if self.greedy:
            values, layout.tokens, marks = self.steps.score_infill(
                self._processed(logits), state.tokens, layout.stored, layout.counts, layout.until, self.eos,
                self.settings.mask_token_id, self.token_threshold, self.text, layout.index + self.prompt.shape[0],
                self.settings.lookup_drafts, len(layout.sizes) == 3,
            )  # fmt: skip
            self.profile.record(AcceptanceProfile.REDRAFT, marks)  # (`values` end with its counts)
            return values
        index = layout.index
        at = [layout.fresh, layout.queried, layout.checked]
        fresh, queried, checked = upload(sum(at, []), self.device).split(list(map(len, at)))
        num_fresh, num_queried = layout.sizes[0], layout.sizes[-1]
        row_of = torch.zeros_like(index)
        row_of.view(-1)[fresh] = torch.arange(num_fresh, device=self.device)
        row_of.view(-1)[queried] = len(logits) - num_queried + torch.arange(num_queried, device=self.device)
        source = torch.cat([row_of[:, :1], row_of[:, :-1]], dim=1)  # position i is scored by position i - 1
        ar_tokens, ar_probability = self._ar_check(logits, source.flatten()[checked], state.tokens, index, checked)
        redrafts = None  # the model's own tokens
        if len(layout.sizes) == 3:  # fused: the [MASK] queries' drafts
            mask_rows = torch.arange(num_fresh, len(logits) - num_queried, device=self.device)
            redrafts = state.tokens.clone()
            redrafts.view(-1)[checked] = self._pick(logits, mask_rows, index.flatten()[checked], state.tokens,
                                                    checked)[0]  # fmt: skip
        _, _, checked_mask = infill_masks(layout.stored, layout.counts, layout.until, self.settings.slot_size)
        layout.tokens, counts, eos, marks = self.steps.judge_infill(state.tokens, layout.counts, layout.until,
            checked_mask, ar_probability, ar_tokens, redrafts, self.eos, self.settings.token_threshold)  # fmt: skip
        self.profile.record(AcceptanceProfile.REDRAFT, marks)
        values = [counts, eos]
        if self.settings.lookup_drafts:
            layout.tokens, found = self._look_up(index, layout.tokens, counts)
            values.append(found)
        return torch.cat([*values, check_counts(marks)])

    def _infilled(self, phase: Phase, values: list[int]) -> Phase:
        state, slots = phase.state, len(phase.state.slots)
        self.record.keep(phase.forward.fresh_queries)
        state.stored, state.tokens, state.counts = state.counts, phase.forward.tokens, values[:slots]
        if self.settings.lookup_drafts:
            state.found = values[2 * slots :]
        return self._infilling(self._settle(state, values[slots : 2 * slots]))

    # ---- infill, the authors' rule ------------------------------------------------------------------------------
    # A round of two forwards over the slots not yet complete: the unaccepted positions are redrafted by `[MASK]`
    # queries after the accepted tokens, then the slot is checked causally and the first unaccepted position is
    # accepted unchecked. After each round the first slot with an accepted EOS completes and the slots after it are
    # dropped. All slots are committed together at the end.
    def _redraft_queries(self, phase: Phase) -> Queries:
        state, size = phase.state, self.settings.slot_size
        index = self._slot_index(state.slots)
        counts = upload(state.counts, self.device)
        live_rows = sum(count < size for count in state.counts)
        live = positions((counts < size)[:, None].expand_as(index), live_rows * size)
        row_of = torch.zeros_like(index)
        row_of.view(-1)[live] = torch.arange(live_rows * size, device=self.device)
        drafting_mask = self.offsets >= counts[:, None]
        drafting = positions(drafting_mask, sum(size - count for count in state.counts))
        masked = torch.where(drafting_mask, self.settings.mask_token_id, state.tokens)
        phase.forward = ReferenceRound(index, counts, live, row_of, drafting)
        return self._grouped(state, index, live, masked, upload(self._new_groups(len(state.slots)), self.device))

    def _score_redraft(self, phase: Phase, logits: torch.Tensor) -> torch.Tensor:
        state, reference = phase.state, phase.forward
        if self.greedy:
            drafting_mask = self.offsets >= reference.counts[:, None]  # (as `_redraft_queries` found the positions)
            reference.tokens = score_redraft(self._processed(logits), state.tokens, drafting_mask, reference.row_of,
                                             self.settings.mask_token_id)  # fmt: skip
            return reference.tokens.new_zeros(0)
        drafting, index = reference.drafting, reference.index
        tokens = state.tokens.clone()
        picked = self._pick(logits, reference.row_of.flatten()[drafting], index.flatten()[drafting], state.tokens,
                            drafting)[0]  # fmt: skip
        tokens.view(-1)[drafting] = picked
        reference.tokens = tokens
        return tokens.new_zeros(0)  # nothing for the host: the check comes next

    def _redrafted(self, phase: Phase, values: list[int]) -> Phase:
        return Phase(self.RECHECK, state=phase.state, forward=phase.forward)

    def _recheck_queries(self, phase: Phase) -> Queries:
        state, reference = phase.state, phase.forward
        groups = upload(self._new_groups(len(state.slots)), self.device)
        return self._grouped(state, reference.index, reference.live, reference.tokens, groups)

    def _score_recheck(self, phase: Phase, logits: torch.Tensor) -> torch.Tensor:
        """Accept by the authors' rule: each slot's new count and EOS offset."""
        state, reference, size = phase.state, phase.forward, self.settings.slot_size
        index, tokens, counts, row_of = reference.index, reference.tokens, reference.counts, reference.row_of
        if self.greedy:
            values, scored_mask = score_recheck(self._processed(logits), tokens, counts, row_of, self.eos,
                                                self.settings.mask_token_id, self.token_threshold)  # fmt: skip
            checked = self.profile.add(AcceptanceProfile.REDRAFT, scored_mask, values[: len(state.slots)])
            return torch.cat([values, checked])
        scored_mask = self.offsets > counts[:, None]  # by the checked position before it
        scored = positions(scored_mask, sum(max(size - count - 1, 0) for count in state.counts))
        source = torch.cat([row_of[:, :1], row_of[:, :-1]], dim=1)
        _, ar_probability = self._ar_check(logits, source.flatten()[scored], tokens, index, scored)
        counts = accept_reference(counts, ar_probability, self.settings.token_threshold)
        checked = self.profile.add(AcceptanceProfile.REDRAFT, scored_mask, counts)
        return torch.cat([counts, eos_offsets(tokens, counts, self.eos), checked])

    def _rechecked(self, phase: Phase, values: list[int]) -> Phase:
        state, size = phase.state, self.settings.slot_size
        slots = len(state.slots)
        state.tokens, state.counts, eos = phase.forward.tokens, values[:slots], values[slots:]
        ended = next((row for row in range(slots) if eos[row] < state.counts[row]), None)
        if ended is not None:  # the first slot with an accepted EOS completes; the slots after it are dropped
            state.counts[ended] = size
            self._stop_at(state.slots[ended] * size + eos[ended] + 1)
            state, eos = state.select(list(range(ended + 1))), eos[: ended + 1]
        return self._infilling(state, eos)

    # ---- results -----------------------------------------------------------------------------------------------
    def frontier(self) -> int:
        """Length of the answer prefix that is final in reading order (what can be streamed)."""
        undecided = next((slot for slot, status in enumerate(self.status) if status != self.DONE), self.num_slots)
        return min(undecided * self.settings.slot_size, self.answer_length())

    def answer_length(self) -> int:
        return min(self.end, self.settings.max_new_tokens)

    def result(self) -> torch.LongTensor:
        """The answer, `max_new_tokens` long, with `pad_token_id` after its end."""
        answer = self.answer[: self.settings.max_new_tokens]
        after_end = torch.arange(answer.shape[0], device=self.device) >= self.answer_length()
        return answer.masked_fill(after_end, self.settings.pad_token_id)

    # ---- scoring -----------------------------------------------------------------------------------------------
    def _processed(self, rows: torch.Tensor) -> torch.Tensor:
        """Logit `rows` after processors that read no context but the prompt (in float32, or wider)."""
        if not self.processors:
            return rows
        rows = rows.to(torch.promote_types(rows.dtype, torch.float32))
        return self.processors(self.prompt[None].expand(rows.shape[0], -1), rows)

    def _probabilities(self, rows, targets, slot_tokens=None, at=None):
        """Token distributions of logit `rows` after the processors. `targets`: the answer index each row scores. A
        processor that reads the tokens before a position sees the prompt, the committed answer and, with
        `slot_tokens` (`[slots, size]`) and `at` (the flat positions in it that the rows score), the slot's tokens
        (such processors read the targets to the host)."""
        if self.context_free:
            rows = self._processed(rows)
        else:
            rows = rows.to(torch.promote_types(rows.dtype, torch.float32))
            context = self.answer.expand(rows.shape[0], -1).clone()
            if slot_tokens is not None:
                size = self.settings.slot_size
                columns = (targets - targets % size)[:, None] + self.offsets
                before = self.offsets < (targets % size)[:, None]
                known = slot_tokens[at // size]
                context.scatter_(1, columns, torch.where(before, known, context.gather(1, columns)))
            scores = torch.empty_like(rows)
            for target in targets.unique().tolist():
                chosen = (targets == target).nonzero()[:, 0]
                ids = torch.cat([self.prompt.expand(chosen.shape[0], -1), context[chosen, :target]], dim=1)
                scores[chosen] = self.processors(ids, rows[chosen])
            rows = scores
        return rows.to(torch.promote_types(rows.dtype, torch.float32)).softmax(dim=-1)

    def _scored(self, logits, rows, targets, slot_tokens=None, at=None):
        """The distributions of the logit `rows` (indices into this forward's `logits`), one a row, and the token
        picked from each. The arguments after `rows` are `_probabilities`'."""
        probabilities = self._probabilities(logits[rows], targets, slot_tokens, at)
        tokens, _ = pick_tokens(probabilities, self.settings.mask_token_id, self.settings.do_sample)
        return probabilities, tokens

    def _pick(self, logits, rows, targets, slot_tokens=None, at=None):
        """A draft token for each of the logit `rows` (indices into `logits`), and its probability."""
        probabilities, tokens = self._scored(logits, rows, targets, slot_tokens, at)
        return tokens, probabilities.gather(1, tokens[:, None])[:, 0]

    def _ar_check(self, logits, rows, tokens, index, at):
        """`logits[rows[j]]`: the logits scoring the slots' `tokens` at flat position `at[j]`. Returns the model's own
        token at each position and the probability of `tokens` there (1 elsewhere)."""
        probabilities, own = self._scored(logits, rows, index.flatten()[at], tokens, at)
        ar_tokens = tokens.clone()
        ar_tokens.view(-1)[at] = own
        ar_probability = torch.ones(tokens.shape, dtype=probabilities.dtype, device=self.device)
        drafts = tokens.flatten()[at]
        drafted = probabilities.gather(1, drafts[:, None])[:, 0]
        ar_probability.view(-1)[at] = drafted.masked_fill(drafts == self.settings.mask_token_id, -1)  # not drafted
        return ar_tokens, ar_probability

    # ---- bookkeeping -------------------------------------------------------------------------------------------
    def _settle(self, state: Infilling, eos: list[int]) -> Infilling | None:
        """Apply accepted EOS tokens (at offsets `eos`, `slot_size` where none; the answer ends at the first, later
        slots are dropped) and commit the slots that are complete; return the rest (None when none is left)."""
        size = self.settings.slot_size
        for slot, offset in zip(state.slots, eos):
            if offset < size:
                self._stop_at(slot * size + offset + 1)
        rest = []
        for row, slot in enumerate(state.slots):
            if self.status[slot] == self.DONE:
                continue
            count, stored = state.counts[row], state.stored[row]
            if count < size and eos[row] >= count:
                self.status[slot] = self.INFILLING
                rest.append(row)
                continue
            length = min(eos[row] + 1, size)
            index = slot * size + self.offsets[:length]
            tokens = state.tokens[row, :length]
            self.answer[index] = tokens
            self.status[slot] = self.DONE
            self.committed_slots += 1
            if length > stored:  # the tokens not yet stored join the sequence in the slot's group
                self.record.append(self._in_group(tokens[stored:], index[stored:], state.prefix, state.groups[row]))
        self._watch()
        return state.select(rest) if rest else None

    def _commit_run(self, slots: list[int], tokens: torch.Tensor, eos: list[int], computed: Queries | None = None):
        """Commit the slots, each up to its EOS (at offset `eos[i]`, `slot_size` when none; only the last slot of a run
        can hold one, as an EOS ends the answer): as the leading queries `computed` of the forward just run (the verify
        forward's leading slots), with its K/V; else as one causal run whose K/V the next forward computes."""
        if not slots:
            return
        size = self.settings.slot_size
        length = size * (len(slots) - 1) + min(eos[-1] + 1, size)
        index = self._slot_index(slots).flatten()[:length]
        run = tokens.flatten()[:length]
        self.answer[index] = run
        self.committed_slots += len(slots)
        for slot, offset in zip(slots, eos):
            self.status[slot] = self.DONE
            if offset < size:
                self._stop_at(slot * size + offset + 1)
        if computed is None:
            self.record.append(self._causal(run, index))
        else:
            self.record.keep(Queries(computed.fields[:, :length]))
        self._watch()

    def _stop_at(self, length: int) -> None:
        """End the answer after `length` tokens; the slots after it are dropped."""
        self.end = min(self.end, length)
        for slot in range(self.num_slots):
            if slot * self.settings.slot_size >= self.end:
                self.status[slot] = self.DONE

    def _watch(self) -> None:
        if self.watcher is not None and (stop := self.watcher.advance(self.answer, self.frontier())) is not None:
            self._stop_at(stop)

    def _verify_width(self, slots: int, found: list[int] | None = None) -> int:
        """Leading tokens of each of `slots` chosen slots in the verify forward: `draft_window` (whole slots when
        None), or under `draft_schedule="price"` the number up to it that earns most per price (the first token is
        free: it always passes; each one in the forward scores the next). With `lookup_drafts`, the first token and
        up to `lookup_drafts` (or the priced number) of the drafts copied after it, as many as every slot has
        (`found`)."""
        size, settings = self.settings.slot_size, self.settings
        cap = min(settings.draft_window or size, size)
        if settings.lookup_drafts:
            cap = min(settings.lookup_drafts, size - 1, *(found or [0])) + 1
        if self.prices is None:
            return cap
        rate = self.profile.rate(AcceptanceProfile.PLAN)
        return 1 + best_window(self.prices, rate, [slots * (drafts + 1) for drafts in range(cap)], free=1.0)

    def _infill_windows(self, state: Infilling) -> list[int]:
        """Drafts of each slot queried in the next infill round: `draft_window` (whole slots when None), or under
        `draft_schedule="price"` the number up to it that earns most per price. With `lookup_drafts`, the drafts
        copied from earlier text only: up to `lookup_drafts` (or the priced number up to it) of those found."""
        slots, settings = len(state.slots), self.settings
        if settings.lookup_drafts:
            window = settings.lookup_drafts
            if self.prices is not None:
                fresh, drafting = state.fresh, sum(1 for found in state.found if found)
                widths = [fresh + drafting * drafts for drafts in range(window + 1)]
                window = best_window(self.prices, self.profile.rate(AcceptanceProfile.REDRAFT), widths)
            return [min(window, found) for found in state.found]
        if self.prices is None:
            return [settings.draft_window or settings.slot_size] * slots
        return [self._priced_window(slots, state.fresh)] * slots

    def _priced_window(self, slots: int, fresh: int) -> int:
        """The drafts per slot that earn most per price in an infill round of `slots` slots bringing `fresh` tokens;
        with `fused_redraft` k drafts bring k + 1 `[MASK]` queries (none when k is 0)."""
        size, masks = self.settings.slot_size, self.settings.fused_redraft
        cap = min(self.settings.draft_window or size, size - 1)
        widths = [fresh + slots * (k + (k + 1 if masks and k else 0)) for k in range(cap + 1)]
        return best_window(self.prices, self.profile.rate(AcceptanceProfile.REDRAFT), widths)

    def _drafts_pay(self, slots: int) -> bool:
        """Whether `slots` chosen slots would take drafts into their verify forward or their first infill round."""
        return self._verify_width(slots) > 1 or self._priced_window(slots, slots) > 0

    def _infill_layout(self, state: Infilling, windows: list[int], spans: list[tuple]) -> InfillRound:
        """Where the tokens of an infill round go, as flat positions in `[slots, slot_size]`: `fresh` accepted tokens
        not yet stored, drafts `queried` in the forward, and the positions `checked` by it (below `until`): the first
        draft by the last fresh token, each later one by the draft before it. At most `windows[i]` drafts of slot i
        are queried; the last position of a slot scores nothing in it, so its draft is never queried. The host finds
        them from its counts (lists), and the forward's queries from them: `spans` of (positions, each slot's group,
        each slot's parent group or None), in order; it uploads in one call what the device needs (the stored and
        accepted counts and the ends, from which the device finds the positions again, `infill_masks`; the slots'
        answer indices, the queries' fields but their ids, as `Queries` rows 1-5, and `at`, where in the slots' tokens
        each query's id is)."""
        size, slots, start = self.settings.slot_size, len(state.slots), self.prompt.shape[0]
        until = [min(count + window + 1, size) for count, window in zip(state.counts, windows)]  # > count: open
        layout = dict(fresh=[], checked=[], queried=[])
        for row, (count, stored, end) in enumerate(zip(state.counts, state.stored, until)):
            first = row * size
            layout["fresh"] += range(first + stored, first + count)
            layout["checked"] += range(first + count, first + end)
            layout["queried"] += range(first + count, first + end - 1)
        index = [slot * size + offset for slot in state.slots for offset in range(size)]
        at, rope, groups, parents = [], [], [], []
        for name, slot_groups, slot_parents in spans:
            for position in layout[name]:
                row = position // size
                at.append(position)
                rope.append(start + index[position])
                groups.append(slot_groups[row])
                parents.append(NO_GROUP if slot_parents is None else slot_parents[row])
        n = len(at)
        values = upload([*state.stored, *state.counts, *until, *index,
                         *rope, *at, *[state.prefix] * n, *groups, *parents, *at], self.device)  # fmt: skip
        stored, counts, ends, index_tensor, fields, at_tensor = values.split([slots, slots, slots, slots * size, 5 * n,
                                                                              n])  # fmt: skip
        return InfillRound(
            **layout,
            index=index_tensor.view(slots, size),
            stored=stored,
            counts=counts,
            until=ends,
            fields=fields.view(5, n),  # positions, ranks (a placeholder: set when requested), prefixes, groups, parents
            at=at_tensor,
        )

    def _look_up(self, index, tokens, counts) -> tuple[torch.Tensor, torch.Tensor]:
        """Write into the slots' `tokens` (answer indices `index`), after each one's `counts` accepted tokens, the
        drafts copied from earlier text (`lookup_drafts`): the prompt, the answer and the slots' accepted tokens.
        Returns the tokens and how many drafts each slot holds now."""
        at = index + self.prompt.shape[0]
        return self.steps.copy_drafts(self.text, at, tokens, counts, self.settings.lookup_drafts,
                                      self.settings.mask_token_id)  # fmt: skip

    def _grouped(self, state, index, at, tokens, groups, parents=None) -> Queries:
        """The tokens at flat positions `at` of the infilling slots' `tokens` (`[slots, slot_size]`, answer indices
        `index`), each seeing the sequence before `state.prefix` and its slot's group (`groups`, one per slot)."""
        rows = at // self.settings.slot_size
        ids = tokens.flatten()[at]
        parent_of = torch.full_like(ids, NO_GROUP) if parents is None else parents[rows]
        rope_positions = index.flatten()[at] + self.prompt.shape[0]
        return Queries.of(ids, rope_positions, torch.full_like(ids, state.prefix), groups[rows], parent_of)

    def _in_group(self, ids, index, prefix: int, group: int) -> Queries:
        return Queries.of(ids, index + self.prompt.shape[0], torch.full_like(ids, prefix), torch.full_like(ids, group),
                          torch.full_like(ids, NO_GROUP))  # fmt: skip

    def _causal(self, ids: torch.Tensor, index: torch.Tensor) -> Queries:
        return Queries.causal(ids, index + self.prompt.shape[0], len(self.record), self._new_group())

    def _run(self, ids: torch.Tensor, index: torch.Tensor) -> Queries:
        """A plan or verify forward's `[slots, width]` tokens: one causal run by the authors' rule; by the fast rule
        each slot in a group of its own that sees the sequence as the plan step found it (`context`)."""
        if self.settings.infill_mode == "reference":
            return self._causal(ids.flatten(), index.flatten())
        groups = upload(self._new_groups(ids.shape[0]), self.device)[:, None].expand_as(ids).flatten()
        ids = ids.flatten()
        return Queries.of(ids, index.flatten() + self.prompt.shape[0], torch.full_like(ids, self.context), groups,
                          torch.full_like(ids, NO_GROUP))  # fmt: skip

    def _slot_index(self, slots: list[int]) -> torch.Tensor:
        """Answer indices of the tokens of `slots`, shape `[len(slots), slot_size]`."""
        return upload(slots, self.device)[:, None] * self.settings.slot_size + self.offsets

    def _new_group(self) -> int:
        self.next_group += 1
        return self.next_group - 1

    def _new_groups(self, count: int) -> list[int]:
        self.next_group += count
        return list(range(self.next_group - count, self.next_group))
