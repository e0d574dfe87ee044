"""Which widths a priced decode's forwards run at (bucketed as compiled forwards pad them), over 16 held-out prompts,
eagerly with a given price table (the tokens and widths do not depend on the path, given the table)."""
import collections, sys, torch
import executor_refusion
from finetune.chat import prompt_token_ids
from recipe.evaluate import benchmark_prompts
from recipe.model import load_base, with_adapter, prepare_for_decoding

prices = {int(k): float(v) for k, v in (item.split("=") for item in sys.argv[1:])}
base, tok = load_base()
model, tok = with_adapter(base.eval(), tok)
model = model.to(torch.bfloat16); prepare_for_decoding(model)
counts = collections.Counter()
run_model = executor_refusion.run_model
def counted(model_, compiled, batch, mask, cache, num_logits):
    counts[executor_refusion.pad_width(batch["ids"].shape[1], (1, 2, 4, 8, 16, 32, 64))] += 1
    return run_model(model_, compiled, batch, mask, cache, num_logits)
executor_refusion.run_model = counted
for prompt in benchmark_prompts(16):
    ids = torch.tensor([prompt_token_ids(tok, [prompt.text])[0]])
    model.generate(ids, max_new_tokens=64, do_sample=False, draft_schedule="price", lookup_drafts=4,
                   token_threshold=0.5, forward_prices=prices)
total = sum(counts.values())
cost = {w: counts[w] * prices[w] for w in counts}
for w in sorted(counts):
    print(f"width {w}: {counts[w]} forwards ({counts[w] / total:.1%}), {cost[w] / sum(cost.values()):.1%} of the priced time")
