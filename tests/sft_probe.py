"""Run `python -m finetune.sft` with test-only instrumentation, chosen by environment variables.

* `SFT_PROBE_RECORD=<folder>`: every process appends the prompts of each batch it collates to
  `<folder>/rank<N>.jsonl`, so a test can check that processes see different batches;
* `SFT_PROBE_STEP_DELAY=<seconds>`: every optimisation step sleeps that long, so a test can kill the run mid-way.
"""

import json
import os
import sys
import time
from pathlib import Path

from accelerate import PartialState

from finetune import sft
from finetune.hybrid import HybridObjectiveCollator


def _recording_collate(folder: Path):
    collate = HybridObjectiveCollator.__call__

    def record_then_collate(self, features):
        with open(folder / f"rank{PartialState().process_index}.jsonl", "a", encoding="utf-8") as sink:
            sink.write(json.dumps([list(feature["prompt_ids"]) for feature in features]) + "\n")
        return collate(self, features)

    return record_then_collate


def _slow_training_step(delay: float):
    training_step = sft.RefusionSFTTrainer.training_step

    def slow_step(self, *args, **kwargs):
        time.sleep(delay)
        return training_step(self, *args, **kwargs)

    return slow_step


if __name__ == "__main__":
    if folder := os.environ.get("SFT_PROBE_RECORD"):
        HybridObjectiveCollator.__call__ = _recording_collate(Path(folder))
    if delay := float(os.environ.get("SFT_PROBE_STEP_DELAY", "0")):
        sft.RefusionSFTTrainer.training_step = _slow_training_step(delay)
    sys.exit(sft.main())
