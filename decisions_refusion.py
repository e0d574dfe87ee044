"""The decisions of a ReFusion decode as pure functions on tensors.

Each function takes a forward's logits or probabilities (and the tokens it checked) and returns what a decode keeps:
which slots a plan chooses (`choose_slots`), how many drafted tokens pass and which token corrects the first that
does not (`accept_and_correct`, `judge_verify`, `judge_infill`), drafts copied from earlier text (`lookup_drafts`),
how wide the next forward should be (`best_window`), and the attention mask of tokens stored out of order
(`attention_mask`, `static_mask`). They hold no state, read nothing back to the host and are tested one by one
(tests/test_decisions.py). `StepFunctions` bundles the ones a decode calls between forwards so that they can run
compiled; `EAGER_STEPS` is the bundle uncompiled.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

NEVER = 2**62  # storage rank of cache holes and padding: no token's prefix reaches it
NO_GROUP = -3  # the parent group of tokens that draft for no slot


# ---- pure decisions: plain tensors in, plain tensors out -----------------------------------------------------------
def passes(probabilities: torch.Tensor, threshold: float | torch.Tensor) -> torch.Tensor:
    """A probability passes a threshold when strictly above it; threshold 0 lets every probability through (a
    position with no draft, given -1, never passes). (`threshold` may be a 0-d tensor, as step functions compiled
    ahead of time take it: `SavedStep`.)"""
    if isinstance(threshold, torch.Tensor):
        return torch.where(threshold > 0, probabilities > threshold, probabilities >= 0)
    return probabilities > threshold if threshold > 0 else probabilities >= 0


def first_argmax(values: torch.Tensor, chunk: int = 128) -> torch.Tensor:
    """`values.argmax(dim=-1)`: the first index of the largest value along the last dimension (ties go to the lowest
    index, as in transformers' greedy search). Found as the maxima of runs of `chunk` columns, the first run holding
    the row's maximum, and the first maximum inside it: on a CPU, PyTorch's `argmax` and `topk` over a
    vocabulary-wide row do not vectorise, where the maxima of runs (`amax`) do."""
    width = values.shape[-1]
    rows = values.reshape(-1, width)
    body = width - width % chunk
    if body == 0:
        return values.argmax(dim=-1)
    maxima = rows[:, :body].reshape(rows.shape[0], body // chunk, chunk).amax(dim=-1)
    run = maxima.argmax(dim=-1)
    columns = run[:, None] * chunk + torch.arange(chunk, device=values.device)
    index = run * chunk + rows.gather(1, columns).argmax(dim=-1)
    if body < width:  # the last, shorter run wins only with a strictly larger value
        tail, tail_index = rows[:, body:].max(dim=-1)
        index = torch.where(tail > maxima.amax(dim=-1), body + tail_index, index)
    return index.reshape(values.shape[:-1])


def pick_tokens(probabilities: torch.Tensor, mask_token_id: int, do_sample: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy or sampled token of every row, never the mask token, and its probability. Sampling uses the
    exponential trick (no host sync)."""
    weights = probabilities.clone()
    if do_sample:
        weights[..., mask_token_id] = 0.0
        weights /= torch.empty_like(weights).exponential_(1)
    else:
        weights[..., mask_token_id] = -1.0
    tokens = first_argmax(weights)
    return tokens, probabilities.gather(-1, tokens[..., None])[..., 0]


def greedy_distributions(scores: torch.Tensor, mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax of every row of `scores` (in float32, or wider) and its greedy token, never the mask token: what
    `pick_tokens(scores.softmax(-1), mask_token_id, do_sample=False)` picks, with no copy of the table. The mask
    token's probability reads -1 in the table returned, as a draft that is not there does (it is never picked, so
    nothing else reads it). (Converting, then the softmax: on a CPU, `softmax(dtype=torch.float32)` of bfloat16
    rows gives the same values, several times more slowly.)"""
    probabilities = scores.to(torch.promote_types(scores.dtype, torch.float32)).softmax(dim=-1)
    probabilities[..., mask_token_id] = -1.0
    return probabilities, first_argmax(probabilities)


def greedy_logsumexp(scores: torch.Tensor, mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`greedy_distributions` without the table: each row's logsumexp (in float32, or wider) and greedy token (never
    the mask token); a token's probability is `exp(score - logsumexp)`. On a CPU scoring is the exponentials over
    every column, and a table of them costs passes more over memory (a compiled scoring step, `score_infill`, reads
    the rows fewer times without it), and writes a copy of the rows in their own dtype rather than two in float32."""
    never = torch.tensor([mask_token_id], device=scores.device)
    logsumexp = scores.to(torch.promote_types(scores.dtype, torch.float32)).logsumexp(dim=-1)
    return logsumexp, first_argmax(scores.index_fill(-1, never, float("-inf")))


def probabilities_at(scores: torch.Tensor, logsumexp: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor):
    """The probabilities of `tokens` in rows `rows` of `scores`, from the rows' `greedy_logsumexp`."""
    return (scores[rows, tokens].to(logsumexp.dtype) - logsumexp[rows]).exp()


def choose_slots(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """Slots whose confidence is above `threshold`, or else the single most confident one."""
    chosen = passes(confidence, threshold)
    best = torch.arange(confidence.shape[0], device=confidence.device) == confidence.argmax()
    return chosen | (best & ~chosen.any())


def accepted_lengths(passed: torch.Tensor) -> torch.Tensor:
    """Length of each row's leading run of passing tokens."""
    return passed.long().cumprod(dim=-1).sum(dim=-1)


def eos_offsets(tokens: torch.Tensor, counts: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """Offset of the first EOS among the first `counts` tokens of each slot (`slot_size` when there is none)."""
    offsets = torch.arange(tokens.shape[1], device=tokens.device)
    is_eos = torch.isin(tokens, eos) & (offsets < counts[:, None])
    return torch.where(is_eos, offsets, tokens.shape[1]).min(dim=1).values


def leading_complete(counts: list[int], eos: list[int], slot_size: int) -> int:
    """How many leading slots are complete: accepted in full, or up to an EOS (which ends them and the answer)."""
    leading = 0
    for count, offset in zip(counts, eos):
        if offset < count:
            return leading + 1
        if count < slot_size:
            break
        leading += 1
    return leading


def first_rejected(
    counts: torch.Tensor, ar_probability: torch.Tensor, threshold: float, checked_until: torch.Tensor | None = None
) -> torch.Tensor:
    """Offset of each slot's first draft, after its `counts` accepted tokens, that fails `threshold` among the
    positions checked (below `checked_until`, default the whole slot); `checked_until` when every one passes."""
    offsets = torch.arange(ar_probability.shape[1], device=ar_probability.device)
    if checked_until is None:
        checked_until = torch.full_like(counts, ar_probability.shape[1])
    passed = (offsets < counts[:, None]) | passes(ar_probability, threshold)
    return accepted_lengths(passed & (offsets < checked_until[:, None]))


def accept_and_correct(
    tokens: torch.Tensor,
    counts: torch.Tensor,
    ar_probability: torch.Tensor,
    ar_tokens: torch.Tensor,
    redrafts: torch.Tensor,
    threshold: float,
    checked_until: torch.Tensor | None = None,
    rejected: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One fast verification of the drafts after the first `counts` (already accepted) tokens of each slot.

    `ar_probability[:, i]` / `ar_tokens[:, i]` are the probability of `tokens[:, i]` and the model's own token at
    position i, both from the logits of position i - 1; they exist below `checked_until` (default: the whole slot).
    The passing drafts are kept, the model's token replaces the first rejected one, and the positions after it take
    `redrafts`; when every checked draft passes, no position past them is accepted. Returns the new tokens and
    accepted counts. (`rejected`: `first_rejected` of these arguments, where the caller has it already.)"""
    offsets = torch.arange(tokens.shape[1], device=tokens.device)
    if checked_until is None:
        checked_until = torch.full_like(counts, tokens.shape[1])
    if rejected is None:
        rejected = first_rejected(counts, ar_probability, threshold, checked_until)
    corrected = torch.where(offsets == rejected[:, None], ar_tokens, redrafts)
    tokens = torch.where(offsets < rejected[:, None], tokens, corrected)
    return tokens, torch.where(rejected < checked_until, rejected + 1, rejected)


def accept_reference(counts: torch.Tensor, ar_probability: torch.Tensor, threshold: float) -> torch.Tensor:
    """The authors' rule for one infill round: the first unaccepted position is accepted unchecked, the positions
    after it while their probability (from the previous position's logits) passes. Returns the new counts."""
    offsets = torch.arange(ar_probability.shape[1], device=ar_probability.device)
    return accepted_lengths((offsets <= counts[:, None]) | passes(ar_probability, threshold))


def judge_infill(
    tokens: torch.Tensor,
    counts: torch.Tensor,
    until: torch.Tensor,
    checked: torch.Tensor,
    ar_probability: torch.Tensor,
    ar_tokens: torch.Tensor,
    redrafts: torch.Tensor | None,
    eos: torch.Tensor,
    threshold: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One fast-rule infill round's decision for slots' `tokens` (`[slots, slot_size]`) with `counts` accepted and
    the positions `checked` (a mask, below `until`) scored: `accept_and_correct`'s new tokens and counts (`redrafts`
    None: the model's own tokens), their EOS offsets (`eos_offsets`) and the check's marks for
    `AcceptanceProfile.record` (offered drafts, accepted ones: `[2, slots, slot_size]`). (No two tensor arguments
    are one tensor: compiled, that would be a graph of its own.)"""
    redrafts = ar_tokens if redrafts is None else redrafts
    rejected = first_rejected(counts, ar_probability, threshold, until)
    tokens, counts = accept_and_correct(tokens, counts, ar_probability, ar_tokens, redrafts, threshold, until, rejected)
    return tokens, counts, eos_offsets(tokens, counts, eos), draft_marks(checked, rejected)


def infill_masks(stored: torch.Tensor, counts: torch.Tensor, until: torch.Tensor, size: int) -> tuple:
    """Where an infill round's tokens are in its slots (`[slots, size]` masks): the `fresh` accepted tokens (from
    `stored` up to `counts`), the drafts `queried` (from `counts` up to the last before `until`: the last position
    of a window scores nothing in it) and the positions `checked` (from `counts` up to `until`)."""
    offsets = torch.arange(size, device=counts.device)
    fresh = (offsets >= stored[:, None]) & (offsets < counts[:, None])
    checked = (offsets >= counts[:, None]) & (offsets < until[:, None])
    return fresh, checked & (offsets < until[:, None] - 1), checked


def score_infill(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    stored: torch.Tensor,
    counts: torch.Tensor,
    until: torch.Tensor,
    eos: torch.Tensor,
    mask_token_id: int,
    threshold: float | torch.Tensor,
    text: torch.Tensor,
    at: torch.Tensor,
    drafts: int,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A greedy fast-rule infill round scored whole, from the logits of its forward to what the host reads, for slots'
    `tokens` (`[slots, slot_size]`) with `stored`, `counts` and `until` as `infill_masks` reads them: the forward's
    rows are the slots' fresh tokens, then (`fused`: `fused_redraft`) a `[MASK]` query for each checked position,
    then their queried drafts (each in row-major order); position i is scored by the row of position i - 1. Decides
    as `greedy_distributions` (computed as `greedy_logsumexp`), then `judge_infill` with the `[MASK]` queries'
    greedy tokens as redrafts (else the model's own tokens), then with `drafts` (`lookup_drafts`) `copy_drafts` from
    `text` (`at`: the slots' text positions) do. Returns the host's values (the new counts, their EOS offsets, with
    `drafts` how many drafts each slot holds, then the check's `check_counts`), the slots' new tokens and the check's
    `draft_marks`. (One function, so that a compiled decode makes one call here a forward: on a CPU a call right
    after a forward runs from a cold cache, and several calls cost several times one.)"""
    logsumexp, greedy = greedy_logsumexp(logits, mask_token_id)
    fresh, queried, checked = infill_masks(stored, counts, until, tokens.shape[1])
    fresh, queried, flat_checked = fresh.flatten(), queried.flatten(), checked.flatten()
    first_draft_row = fresh.sum() + (flat_checked.sum() if fused else 0)
    rows = torch.where(fresh, fresh.cumsum(0) - 1, first_draft_row + queried.cumsum(0) - 1) * (fresh | queried)
    rows = rows.view_as(tokens)
    source = torch.cat([rows[:, :1], rows[:, :-1]], dim=1)  # the row scoring each position
    ar_tokens = torch.where(checked, greedy[source], tokens)
    drafted = probabilities_at(logits, logsumexp, source, tokens).masked_fill(tokens == mask_token_id, -1)
    ar_probability = torch.where(checked, drafted, 1.0)
    redrafts = None
    if fused:  # the `[MASK]` query of each checked position redrafts it
        mask_rows = ((fresh.sum() + flat_checked.cumsum(0) - 1) * flat_checked).view_as(tokens)
        redrafts = torch.where(checked, greedy[mask_rows], tokens)
    tokens, counts, eos_at, marks = judge_infill(
        tokens, counts, until, checked, ar_probability, ar_tokens, redrafts, eos, threshold
    )
    values = [counts, eos_at]
    if drafts:
        tokens, found = copy_drafts(text, at, tokens, counts, drafts, mask_token_id)
        values.append(found)
    return torch.cat([*values, check_counts(marks)]), tokens, marks


def judge_verify(
    tokens: torch.Tensor,
    scored: torch.Tensor,
    ar_probability: torch.Tensor,
    ar_tokens: torch.Tensor,
    eos: torch.Tensor,
    threshold: float | torch.Tensor,
    keep_drafts: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """A verify forward's decision on the chosen slots' drafts `tokens` (`[slots, slot_size]`), the positions
    `scored` (a mask: offsets 1 up to the forward's width; offset 0 always passes) having the model's own tokens
    `ar_tokens` and the drafts' probabilities `ar_probability`: each slot's accepted length and its EOS offset, and
    for the fast rule (`keep_drafts` given, a 0-d bool tensor) the tokens and counts a slot goes on with (the model's
    token at the first rejected draft; after it the plan's drafts where `keep_drafts` (`fused_redraft`), else the
    model's tokens) and their EOS offsets. Returns those values for the host, the tokens and the check's
    `draft_marks`."""
    offsets = torch.arange(tokens.shape[1], device=tokens.device)
    accepted = accepted_lengths((offsets == 0) | (scored & passes(ar_probability, threshold)))
    values = [accepted, eos_offsets(tokens, accepted, eos)]
    marks = draft_marks(scored, accepted)
    if keep_drafts is not None:
        until = scored.sum(dim=1) + 1  # (scored: offsets 1 .. until - 1)
        redrafts = torch.where(keep_drafts, tokens, ar_tokens)
        tokens, counts = accept_and_correct(tokens, torch.ones_like(accepted), ar_probability, ar_tokens, redrafts,
                                            threshold, until)  # fmt: skip
        values += [counts, eos_offsets(tokens, counts, eos)]
    return values, tokens, marks


def score_verify(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    eos: torch.Tensor,
    mask_token_id: int,
    threshold: torch.Tensor,
    keep_drafts: torch.Tensor,
    text: torch.Tensor,
    at: torch.Tensor,
    drafts: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A greedy fast-rule verify forward scored whole, from its logits to what the host reads: the chosen slots'
    drafts `tokens` (`[slots, slot_size]`) ran (each slot apart) with the same number of leading tokens a slot, so its
    `logits` are `[slots, width, vocabulary]` and the row of offset i - 1 scores offset i, up to the width. Decides
    as `greedy_distributions` (computed as `greedy_logsumexp`) then `judge_verify` do, then with `drafts`
    (`lookup_drafts`) `copy_drafts` from `text` (`at`: the slots' text positions) does. Returns the host's values
    (`judge_verify`'s, with `drafts` how many drafts each slot holds, then the check's `check_counts`), the slots'
    new tokens and the check's `draft_marks`. (One call a verify forward, as `score_infill` is an infill round's.)"""
    (slots, width), size = logits.shape[:2], tokens.shape[1]
    logits = logits.reshape(slots * width, -1)
    logsumexp, greedy = greedy_logsumexp(logits, mask_token_id)
    offsets = torch.arange(size, device=tokens.device)
    scored = ((offsets > 0) & (offsets <= width)).expand(slots, size)
    rows = torch.arange(slots, device=tokens.device)[:, None] * width + (offsets - 1).clamp(min=0, max=width - 1)
    ar_tokens = torch.where(scored, greedy[rows], tokens)
    drafted = probabilities_at(logits, logsumexp, rows, tokens).masked_fill(tokens == mask_token_id, -1)
    ar_probability = torch.where(scored, drafted, 1.0)
    values, tokens, marks = judge_verify(tokens, scored, ar_probability, ar_tokens, eos, threshold, keep_drafts)
    if drafts:
        tokens, found = copy_drafts(text, at, tokens, values[2], drafts, mask_token_id)
        values.append(found)
    return torch.cat([*values, check_counts(marks)]), tokens, marks


def score_plan(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    eos: torch.Tensor,
    mask_token_id: int,
    threshold: torch.Tensor,
    text: torch.Tensor,
    at: torch.Tensor,
    copies: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A greedy plan forward scored whole, from its logits to what the host reads: the masked slots' `[MASK]` queries
    (`logits` `[slots, width, vocabulary]`, the first `width` tokens of each slot) give each slot's greedy drafts,
    written over the first `width` of its `drafts` (`[slots, slot_size]`); the slots whose first draft's probability
    passes `threshold` are chosen (else the most confident, `choose_slots`), and with `copies` (`lookup_drafts`) the
    drafts after each first one are copied from `text` (`at`: the slots' text positions), as `copy_drafts` does.
    Returns the host's values (which slots are chosen, then for slots of one token which drafts are in `eos`, or
    with `copies` how many drafts each holds) and the slots' drafts. (One call a plan forward, as `score_infill` is
    an infill round's.)"""
    (slots, width), vocabulary = logits.shape[:2], logits.shape[2]
    logits = logits.reshape(slots * width, vocabulary)
    logsumexp, greedy = greedy_logsumexp(logits, mask_token_id)
    picked = probabilities_at(logits, logsumexp, torch.arange(slots * width, device=logits.device), greedy)
    offsets = torch.arange(drafts.shape[1], device=drafts.device)
    drafted = greedy.view(slots, width).gather(1, offsets.clamp(max=width - 1).expand(slots, -1))
    drafts = torch.where(offsets < width, drafted, drafts)
    values = [choose_slots(picked.view(slots, width)[:, 0], threshold).long()]
    if drafts.shape[1] == 1:  # a one-token slot is complete once chosen: the host needs to know which ended
        values.append(torch.isin(drafts[:, 0], eos).long())
    if copies:
        drafts, found = copy_drafts(text, at, drafts, torch.ones_like(values[0]), copies, mask_token_id)
        values.append(found)
    return torch.cat(values), drafts


def score_redraft(
    logits: torch.Tensor, tokens: torch.Tensor, drafting: torch.Tensor, row_of: torch.Tensor, mask_token_id: int
) -> torch.Tensor:
    """A greedy redraft forward of the authors' infill rule: the slots' `tokens` (`[slots, slot_size]`) with the
    positions `drafting` (a mask) replaced by the greedy token (never the mask token) of their `[MASK]` query, whose
    row of `logits` is `row_of` (`[slots, slot_size]`)."""
    _, greedy = greedy_logsumexp(logits, mask_token_id)
    return torch.where(drafting, greedy[row_of], tokens)


def score_recheck(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    counts: torch.Tensor,
    row_of: torch.Tensor,
    eos: torch.Tensor,
    mask_token_id: int,
    threshold: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A greedy recheck forward of the authors' infill rule, the slots' `tokens` (`[slots, slot_size]`, `counts`
    accepted) ran causally, the token at offset i in row `row_of[:, i]` of `logits`: each position after the first
    unaccepted one is scored by the row before it (`accept_reference`). Returns the new counts with their EOS offsets
    (`eos_offsets`), and the positions scored (a mask)."""
    logsumexp, _ = greedy_logsumexp(logits, mask_token_id)
    offsets = torch.arange(tokens.shape[1], device=tokens.device)
    scored = offsets > counts[:, None]
    source = torch.cat([row_of[:, :1], row_of[:, :-1]], dim=1)
    drafted = probabilities_at(logits, logsumexp, source, tokens).masked_fill(tokens == mask_token_id, -1)
    counts = accept_reference(counts, torch.where(scored, drafted, 1.0), threshold)
    return torch.cat([counts, eos_offsets(tokens, counts, eos)]), scored


def draft_marks(checked: torch.Tensor, run_end: torch.Tensor) -> torch.Tensor:
    """The drafts a check offered and those it accepted, `[2, slots, slot_size]`: of the `checked` ones, those up to
    each slot's first rejected draft (at offset `run_end`, `slot_size` when none), and those before it."""
    offsets = torch.arange(checked.shape[1], device=checked.device)
    ends = run_end[:, None]
    return torch.stack([offsets <= ends, offsets < ends]) & checked


def check_counts(marks: torch.Tensor) -> torch.Tensor:
    """A check's drafts offered and accepted, `[2]`, from its `draft_marks`."""
    return marks.sum(dim=(1, 2))


def lookup_drafts(
    text: torch.Tensor, starts: torch.Tensor, count: int, unknown: int, ngram: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts copied from earlier text, as prompt lookup decoding makes them: for each position `starts[i]` of the
    1-D `text` (tokens; `unknown` where not yet decoded), the `count` tokens that followed the last occurrence before
    it of the `ngram` (else fewer, down to one) tokens just before it. Returns the drafts `[len(starts), count]` and
    how many of each row's are found: the leading ones that follow a match and are known."""
    length = text.shape[0]
    follows = torch.full_like(starts, -1)  # where the copied tokens begin; -1 where nothing matched
    # A match of d tokens is a position e before the start whose d tokens before it equal the start's d tokens before
    # it: the matches of d + 1 tokens are those of d tokens whose (d + 1)-th tokens before e and the start agree too.
    # (Positions before the text read -1, and a start's token before it -2 where it is unknown or before the text,
    # so that one comparison says all: no token is negative.)
    after = torch.arange(length, device=text.device)  # e: where the copied tokens would begin
    matches = after[None] < starts[:, None]
    for size in range(1, ngram + 1):  # a longer match overrides a shorter one
        shifted = torch.nn.functional.pad(text, (size, 0), value=-1)[:length]  # each e's size-th token before it
        before = text[(starts - size).clamp(min=0)]  # the start's
        before = before.masked_fill((before == unknown) | (starts < size), -2)
        matches &= shifted[None] == before[:, None]
        last = torch.where(matches, after, -1).amax(dim=-1)
        follows = torch.where(last >= 0, last, follows)
    at = follows[:, None] + torch.arange(count, device=text.device)
    drafts = text[at.clamp(0, length - 1)]
    known = (follows[:, None] >= 0) & (at < length) & (drafts != unknown)
    return drafts, accepted_lengths(known)


def copy_drafts(
    text: torch.Tensor, at: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor, count: int, unknown: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write into slots' `tokens` (`[slots, slot_size]`, at text positions `at`), after each one's `counts` accepted
    tokens, up to `count` drafts copied from the `text` (`lookup_drafts`) as it reads with those accepted tokens in
    place. Returns the tokens and how many drafts each slot holds now."""
    size = tokens.shape[1]
    offsets = torch.arange(size, device=tokens.device)
    accepted = offsets < counts[:, None]
    text = text.index_put((at,), torch.where(accepted, tokens, text[at]))
    drafts, found = lookup_drafts(text, at[:, 0] + counts, count, unknown)
    found = torch.minimum(found, size - counts)
    ahead = offsets - counts[:, None]
    copied = (ahead >= 0) & (ahead < found[:, None])
    return torch.where(copied, drafts.gather(1, ahead.clamp(0, count - 1)), tokens), found


def expected_tokens(rate: float, drafts: int) -> float:
    """Tokens a slot gains from a check of its first open position and `drafts` drafts after it, when each passes
    with probability `rate` given the ones before it: the first always yields one (its draft or the model's own
    token), each later one when every draft before it passed."""
    return sum(rate**step for step in range(drafts + 1))


def best_window(price, rate: float, widths: list[int], free: float = 0.0) -> int:
    """The number of drafts k per slot that maximises expected tokens per price: `widths[k]` is the forward's width
    when every slot takes k drafts, `price(width)` what such a forward costs, and a slot earns `free` plus
    `expected_tokens(rate, k)`. The fewest drafts win a tie."""
    values = [(free + expected_tokens(rate, k)) / price(width) for k, width in enumerate(widths)]
    return max(range(len(values)), key=lambda k: (values[k], -k))


# ---- many rows: one batched forward per step -----------------------------------------------------------------------
def attention_mask(key_ranks, key_groups, ranks, prefixes, groups, parents, columns, dtype) -> torch.Tensor:
    """Additive mask `[batch, 1, new, keys]`: a token sees the keys of its row ranked below its prefix, and the keys
    of its own group and of its parent group ranked up to itself, and always itself (so that padding rows stay
    finite): the new tokens sit at cache `columns` (`[batch, new]`, or an int `past`: columns past, past + 1, ...)."""
    below = key_ranks[:, None, :] <= ranks[:, :, None]
    sees = key_ranks[:, None, :] < prefixes[:, :, None]
    sees |= (key_groups[:, None, :] == groups[:, :, None]) & below
    sees |= (key_groups[:, None, :] == parents[:, :, None]) & below
    if isinstance(columns, int):
        columns = columns + torch.arange(ranks.shape[1], device=ranks.device).expand_as(ranks)
    sees.scatter_(2, columns[:, :, None], True)
    mask = torch.zeros(sees.shape, dtype=dtype, device=sees.device)
    return mask.masked_fill(~sees, torch.finfo(dtype).min)[:, None]


def static_mask(pointers, lengths, key_columns, key_groups, ranks, prefixes, groups, parents, dtype):
    """Where a padded forward's new tokens go in a `SlotCache` and their attention mask: row r brings `lengths[r]` new
    tokens (its last ones; the left padding before them) and has `pointers[r]` stored at columns 0 .. pointers[r] -
    1; the new tokens are written from its pointer on, the padding after them, where the next forward overwrites it.
    `key_columns` is `arange(cache length)`, `key_groups` (`[batch, cache length]`) the group of each column's token.
    Returns the write columns (`[batch, width]`), the key groups with the new tokens' and the mask (`attention_mask`);
    a column not yet written hides behind rank `NEVER`."""
    width = ranks.shape[1]
    columns = pointers[:, None] + (torch.arange(width, device=ranks.device) + lengths[:, None]) % width
    key_groups = key_groups.scatter(1, columns, groups)
    key_ranks = torch.where(key_columns < (pointers + lengths)[:, None], key_columns, NEVER)
    return columns, key_groups, attention_mask(key_ranks, key_groups, ranks, prefixes, groups, parents, columns, dtype)


@dataclass(frozen=True)
class StepFunctions:
    """The decoder's tensor work between forwards that decodes through compiled forwards run compiled too: each
    function's dozens of small operations become one call of generated code (on a GPU a kernel or a few, where each
    operation was a launch). `EAGER_STEPS` holds the functions themselves, `compiled_steps()` them compiled, and
    beside saved forwards on a CPU `SavedForwards.steps` all but `judge_infill` (sampling's) compiled ahead of time
    (`SavedStep`: there a call skips the Python layers of a `torch.compile` call)."""

    copy_drafts: Callable  # drafts copied from earlier text (`lookup_drafts`), written into the slots
    static_mask: Callable  # where a forward's tokens go in a `SlotCache`, and their attention mask
    judge_infill: Callable  # the decision of a fast-rule infill round, when sampling (or reading the context)
    score_infill: Callable  # a greedy fast-rule infill round, from its logits to its decision
    score_verify: Callable  # a greedy verify forward, from its logits to its decision
    score_plan: Callable  # a greedy plan forward, from its logits to the slots chosen


EAGER_STEPS = StepFunctions(copy_drafts, static_mask, judge_infill, score_infill, score_verify, score_plan)
