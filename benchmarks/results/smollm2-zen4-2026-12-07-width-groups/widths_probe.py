"""Which widths a priced decode's forwards run at (bucketed as compiled forwards pad them), over 16 held-out prompts,
eagerly with a given price table (the tokens and widths do not depend on the path, given the table).

    python widths_probe.py 1=14.3 2=11.7 4=13.3 8=20.5 16=26.3 32=39.3 64=67.4   # from the repository root
"""

import collections
import sys

import torch

import executor_refusion
from finetune.chat import prompt_token_ids
from recipe.evaluate import benchmark_prompts
from recipe.model import load_base, prepare_for_decoding, with_adapter

prices = {int(key): float(value) for key, value in (item.split("=") for item in sys.argv[1:])}
base, tokenizer = load_base()
model, tokenizer = with_adapter(base.eval(), tokenizer)
model = model.to(torch.bfloat16)
prepare_for_decoding(model)
counts = collections.Counter()
run_model = executor_refusion.run_model


def counted(model_, compiled, batch, mask, cache, num_logits):
    counts[executor_refusion.pad_width(batch["ids"].shape[1], (1, 2, 4, 8, 16, 32, 64))] += 1
    return run_model(model_, compiled, batch, mask, cache, num_logits)


executor_refusion.run_model = counted
for prompt in benchmark_prompts(16):
    ids = torch.tensor([prompt_token_ids(tokenizer, [prompt.text])[0]])
    model.generate(ids, max_new_tokens=64, do_sample=False, draft_schedule="price", lookup_drafts=4,
                   token_threshold=0.5, forward_prices=prices)  # fmt: skip
total = sum(counts.values())
cost = {width: counts[width] * prices[width] for width in counts}
for width in sorted(counts):
    share, time_share = counts[width] / total, cost[width] / sum(cost.values())
    print(f"width {width}: {counts[width]} forwards ({share:.1%}), {time_share:.1%} of the priced time")
