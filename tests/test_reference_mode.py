"""`infill_mode="reference"` reproduces the authors' released decoder (ML-GSAI/ReFusion, generate.py) token for token.

`authors_rule` below restates their rules as plainly as possible, for one prompt and without a cache: every forward
runs the whole stored sequence plus its queries under an explicit "who sees whom" matrix, and each infilled slot is
run on its own, as their decoder runs it as its own batch row:

* plan: one forward over the block's masked slots (causal among themselves); a slot's confidence is the
  probability of its first draft; chosen = strictly above the slot threshold, else the single most confident.
* global verify: the chosen drafts as one causal run; a draft passes when the probability the run gives it (from
  the position before it) is above the token threshold, a slot's first token always passes. If an EOS lies in the
  run's passing prefix, the slots up to it are committed (cut after the EOS) and the block ends there; else the
  leading fully passed slots are committed and the other chosen slots go back to [MASK]; if there are none, the
  chosen slots are infilled.
* infill, in lockstep rounds of two forwards: the unaccepted positions of each slot are drafted as [MASK] queries
  after its accepted tokens, then the slot is run causally; the first unaccepted position is accepted unchecked, the
  next ones while they pass. After each round, the first slot with an accepted EOS ends the answer: the chosen
  slots after it are dropped. The infilled slots are committed together at the end.
* every slot sees the sequence committed before its step and itself; the answer is read in position order.

Deliberate difference: when an EOS is accepted during infill, the authors' code also drops the block's unchosen
slots *before* the EOS slot (it indexes the block's slots with the chosen slots' index) and returns the answer with
those positions missing; we (and `authors_rule`) decode them.
"""

import itertools

import pytest
import torch
from test_generation import PROMPT, frequent_token_of, sharpened_model

NEG = -1e30


def passes(probability: float, threshold: float) -> bool:
    return threshold == 0 or probability > threshold


class AuthorsRule:
    """One prompt decoded by the authors' rules; `forwards` counts them as their decoder runs them."""

    def __init__(self, model, prompt, max_new_tokens, slot_size, block_length, slot_threshold, token_threshold, eos):
        self.model, self.mask = model, model.config.mask_token_id
        self.size, self.block_length = slot_size, block_length
        self.slot_threshold, self.token_threshold, self.eos = slot_threshold, token_threshold, set(eos)
        self.prompt_length = len(prompt)
        self.num_slots = -(-max_new_tokens // slot_size)
        self.max_new_tokens = max_new_tokens
        # stored tokens: (token, position, indices of the stored tokens it sees besides itself)
        self.stored = [(token, i, set(range(i))) for i, token in enumerate(prompt)]
        self.answer = {}
        self.end = self.num_slots * slot_size
        self.done = set()
        self.forwards = self.rounds = 0

    # one forward: `queries` are (token, position, stored indices seen, query indices seen)
    def run(self, queries) -> torch.Tensor:
        n_stored, n = len(self.stored), len(self.stored) + len(queries)
        ids = [token for token, _, _ in self.stored] + [q[0] for q in queries]
        positions = [p for _, p, _ in self.stored] + [q[1] for q in queries]
        sees = torch.eye(n, dtype=torch.bool)
        for i, (_, _, seen) in enumerate(self.stored):
            sees[i, list(seen)] = True
        for j, (_, _, seen_stored, seen_queries) in enumerate(queries):
            sees[n_stored + j, list(seen_stored)] = True
            sees[n_stored + j, [n_stored + k for k in seen_queries]] = True
        mask = torch.zeros(1, 1, n, n, dtype=self.model.dtype).masked_fill(~sees, NEG)
        with torch.no_grad():
            logits = self.model(
                input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]), attention_mask=mask
            ).logits[0, n_stored:]
        return logits.softmax(dim=-1)

    def draft(self, probabilities: torch.Tensor) -> tuple[int, float]:
        """The most probable token other than [MASK], and its probability."""
        order = probabilities.argsort(descending=True)
        token = int(order[0]) if int(order[0]) != self.mask else int(order[1])
        return token, float(probabilities[token])

    def position(self, slot: int, offset: int) -> int:
        return self.prompt_length + slot * self.size + offset

    def causal_run(self, tokens_by_slot, seen_stored):
        """Queries for the slots' tokens, one causal run after `seen_stored`."""
        queries = []
        for slot, tokens in tokens_by_slot:
            for offset, token in enumerate(tokens):
                queries.append((token, self.position(slot, offset), seen_stored, set(range(len(queries)))))
        return queries

    def commit(self, slot: int, tokens: list[int], seen: set[int]) -> None:
        """Store a slot's tokens, each seeing `seen` and the slot's tokens before it; an EOS ends the answer."""
        first = len(self.stored)
        for offset, token in enumerate(tokens):
            self.stored.append((token, self.position(slot, offset), seen | set(range(first, first + offset))))
            self.answer[slot * self.size + offset] = token
            if token in self.eos:
                self.end = min(self.end, slot * self.size + offset + 1)
                break
        self.done.add(slot)

    def decode(self) -> list[int]:
        per_block = self.block_length // self.size
        for first in range(0, self.num_slots, per_block):
            block = range(first, min(first + per_block, self.num_slots))
            while masked := [s for s in block if s not in self.done and s * self.size < self.end]:
                self.step(masked)
        length = min(self.end, self.max_new_tokens)
        return [self.answer[i] for i in range(length)]

    def step(self, masked: list[int]) -> None:
        everything = set(range(len(self.stored)))
        plan = self.run(self.causal_run([(s, [self.mask] * self.size) for s in masked], everything))
        self.forwards += 1
        drafts = {s: [self.draft(plan[j * self.size + o]) for o in range(self.size)] for j, s in enumerate(masked)}
        confidence = [drafts[s][0][1] for s in masked]
        chosen = [s for s, c in zip(masked, confidence) if passes(c, self.slot_threshold)]
        chosen = chosen or [masked[max(range(len(masked)), key=lambda j: (confidence[j], -j))]]
        tokens = {s: [token for token, _ in drafts[s]] for s in chosen}

        verify = self.run(self.causal_run([(s, tokens[s]) for s in chosen], everything))
        self.forwards += 1
        tags = {}
        for j, s in enumerate(chosen):
            tags[s] = [True] + [
                passes(float(verify[j * self.size + o - 1][tokens[s][o]]), self.token_threshold)
                for o in range(1, self.size)
            ]
        prefix = []  # the run's passing prefix, slot by slot
        for s in chosen:
            run = next((o for o, tag in enumerate(tags[s]) if not tag), self.size)
            prefix.append((s, run))
            if run < self.size:
                break
        eos_slot = next((i for i, (s, run) in enumerate(prefix) if any(t in self.eos for t in tokens[s][:run])), None)
        if eos_slot is not None or (prefix and prefix[0][1] == self.size):
            last = eos_slot if eos_slot is not None else max(i for i, (_, run) in enumerate(prefix) if run == self.size)
            for s, _ in prefix[: last + 1]:
                self.commit(s, tokens[s], set(range(len(self.stored))))  # a causal run: sees all before
            return
        self.infill(chosen, tokens, tags)

    def infill(self, chosen, tokens, tags) -> None:
        seen = set(range(len(self.stored)))
        active = list(chosen)
        while not all(all(tags[s]) for s in active):
            self.forwards += 2
            self.rounds += 1
            for s in active:  # MDM redraft of the unaccepted positions
                masked = [token if tag else self.mask for token, tag in zip(tokens[s], tags[s])]
                probabilities = self.run(self.causal_run([(s, masked)], seen))
                tokens[s] = [
                    token if tag else self.draft(probabilities[o])[0]
                    for o, (token, tag) in enumerate(zip(tokens[s], tags[s]))
                ]
            for s in active:  # causal check; the first unaccepted position passes unchecked
                probabilities = self.run(self.causal_run([(s, tokens[s])], seen))
                new = [True]
                for o in range(1, self.size):
                    checked = tags[s][o - 1] or passes(float(probabilities[o - 1][tokens[s][o]]), self.token_threshold)
                    new.append(new[-1] and checked)
                tags[s] = new
            with_eos = [
                i for i, s in enumerate(active) if any(t in self.eos for t, tag in zip(tokens[s], tags[s]) if tag)
            ]
            if with_eos:
                first = with_eos[0]
                for s in active[first + 1 :]:
                    self.done.add(s)  # dropped after the EOS
                active = active[: first + 1]
                tags[active[first]] = [True] * self.size
        for s in active:
            self.commit(s, tokens[s], seen)


@pytest.fixture(scope="module")
def model():
    return sharpened_model("qwen2", scale=4.0)


@pytest.fixture(scope="module")
def frequent_token(model):
    return frequent_token_of(model)


GRID = list(itertools.product((2, 4, 8), (0.0, 0.5, 0.9), (0.1, 0.4, 0.8), (1, 2)))


@pytest.mark.parametrize(("slot_size", "slot_threshold", "token_threshold", "blocks"), GRID)
def test_reference_mode_equals_the_authors_rules(
    model, frequent_token, slot_size, slot_threshold, token_threshold, blocks
):
    max_new_tokens = 16
    block_length = max_new_tokens // blocks
    for eos in ([], [frequent_token]):
        settings = dict(
            max_new_tokens=max_new_tokens, slot_size=slot_size, block_length=block_length,
            slot_threshold=slot_threshold, token_threshold=token_threshold,
        )  # fmt: skip
        authors = AuthorsRule(model, PROMPT[0].tolist(), eos=eos, **settings)
        expected = authors.decode()
        output = model.generate(
            PROMPT, infill_mode="reference", eos_token_id=eos, pad_token_id=0, return_dict_in_generate=True, **settings
        )
        assert output.sequences[0, PROMPT.shape[1] :].tolist() == expected
        assert output.num_forward_passes == authors.forwards


def test_the_grid_exercises_infill_rounds_and_answers_ended_by_eos(model, frequent_token):
    rounds, ended = 0, 0
    for slot_size, token_threshold in ((4, 0.4), (8, 0.8)):
        authors = AuthorsRule(
            model, PROMPT[0].tolist(), max_new_tokens=16, slot_size=slot_size, block_length=16, slot_threshold=0.5,
            token_threshold=token_threshold, eos=[frequent_token],
        )  # fmt: skip
        ended += len(authors.decode()) < 16
        rounds += authors.rounds
    assert rounds >= 2 and ended >= 1


def test_reference_mode_is_the_same_cached_recomputed_and_batched(model):
    settings = dict(max_new_tokens=20, slot_size=4, slot_threshold=0.5, token_threshold=0.4, infill_mode="reference")
    short = torch.tensor([[11, 12, 13]])
    batch, mask = torch.tensor([[0, 0, 0, 11, 12, 13], PROMPT[0].tolist()]), torch.tensor([[0, 0, 0, 1, 1, 1], [1] * 6])
    together = model.generate(batch, attention_mask=mask, eos_token_id=[], **settings)
    assert torch.equal(together[1], model.generate(PROMPT, eos_token_id=[], use_cache=False, **settings)[0])
    assert torch.equal(together[0, 3:], model.generate(short, eos_token_id=[], **settings)[0])
