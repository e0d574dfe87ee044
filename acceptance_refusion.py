"""What one row's draft checks showed: by source (plan drafts checked by the verify forward, redrafts checked in infill
rounds) and slot offset, the drafts offered and those that passed. The price schedule reads the share that passed
(`AcceptanceProfile.rate`); `generate` returns the tables (`RefusionGenerateOutput.draft_offered`, ...).
"""

import torch

try:
    from .decisions_refusion import check_counts, draft_marks
except ImportError:  # installed as top-level modules rather than loaded as Hub remote code
    from decisions_refusion import check_counts, draft_marks


class AcceptanceProfile:
    """Draft checks of one row by source (`PLAN`, `REDRAFT`) and slot offset. Each check's marks stay on the device
    (for the tables by offset, `tables`); its two counts, drafts offered and accepted (`check_counts`), end the
    tensor the decoder's scoring gives the host, which adds them to `known` (`read`) when it reads that tensor:
    recording a check never waits for the host. `rate` uses `known`; `prior` is the rate assumed before any check."""

    PLAN, REDRAFT = range(2)

    def __init__(self, slot_size: int, device, prior: float = 0.5):
        self.prior, self.slot_size, self.device = prior, slot_size, device
        self.checks: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # per source: each check's marks
        self.forwards = 0
        self.known = [0, 0, 0, 0]  # PLAN offered, PLAN accepted, REDRAFT offered, REDRAFT accepted, as read

    def add(self, source: int, checked: torch.Tensor, run_end: torch.Tensor) -> torch.Tensor:
        """One forward's check: `checked` (`[slots, slot_size]`) marks the drafts it scored, `run_end` the offset of
        each slot's first rejected draft (`slot_size` when none): a draft counts as offered up to it, accepted
        before it. Returns the check's counts (`check_counts`), for the host to `read`."""
        marks = draft_marks(checked, run_end)
        self.record(source, marks)
        return check_counts(marks)

    def record(self, source: int, marks: torch.Tensor) -> None:
        """One forward's check as its `draft_marks` (whose counts the caller hands the host)."""
        self.checks[source].append(marks)
        self.forwards += 1

    def read(self, source: int, counts: list[int]) -> None:
        """The host's copy of a check's counts (offered, accepted), read with its forward's decision."""
        self.known[2 * source] += counts[0]
        self.known[2 * source + 1] += counts[1]

    def tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Drafts offered and accepted by source and slot offset (`[2, slot_size]` each), and the checks that
        offered any by source."""
        offered = torch.zeros(2, self.slot_size, dtype=torch.long, device=self.device)
        accepted, runs = torch.zeros_like(offered), torch.zeros_like(offered[:, 0])
        for source, checks in enumerate(self.checks):
            if checks:
                marks = torch.cat(checks, dim=1)
                offered[source], accepted[source] = marks.sum(dim=1)
                runs[source] = marks[0].any(dim=1).sum()
        return offered, accepted, runs

    def rate(self, source: int) -> float:
        """The share of `source`'s offered drafts that passed, as the host last read them, with two drafts counted in
        advance that passed at the `prior` rate (so `prior` before any check)."""
        offered, accepted = self.known[2 * source : 2 * source + 2]
        return (accepted + 2 * self.prior) / (offered + 2)

    @staticmethod
    def output_fields(profiles: list["AcceptanceProfile"]) -> dict:
        """The `RefusionGenerateOutput` fields of `profiles` summed over rows."""
        offered, accepted, runs = (sum(tables) for tables in zip(*(profile.tables() for profile in profiles)))
        return {
            "draft_offered": offered,
            "draft_accepted": accepted,
            "draft_runs": runs,
            "verify_forwards": sum(profile.forwards for profile in profiles),
        }
