"""How good are the drafts a `[MASK]` query makes, by how far ahead it drafts: what extra queries could buy.

    python -m benchmarks.draft_sources [--prompts 32] [--max_new_tokens 64] [--max_distance 16] [--dtype float32]
        [--prompt_set everyday] [--model DIR]

The shipped model (SmolLM2 with the shipped adapter) answers each prompt (the held-out ones, or with `--prompt_set
everyday` the everyday ones) by its own greedy AR (`generate()`, token by token). Then, in one forward per prompt,
`[MASK]` queries are put at every distance d = 1..`max_distance` ahead of every point of that answer: a query at
distance d sees the prompt and the first a answer tokens and sits at the RoPE position of answer token a + d - 1 (d = 1:
the next token). That is the draft a plan forward makes at slot offset d - 1 for a slot that starts right after the a
tokens, and the draft any extra query of a one-slot-at-a-time step could make. Each draft is checked as the decoder
checks it: accepted when the model's AR probability of it, given the answer before it, is above `token_threshold`.
Reported by distance:

- accepted: the share of drafts that pass the check (what a draft of that distance adds to tokens per forward);
- AR's token: the share equal to the AR's greedy token there;
- confident: the share whose probability is above `slot_threshold` (a plan would choose the slot), and of those, the
  share equal to AR's token.

What a second query could buy a step that decodes one slot token by token (one query, one token): a step of two
queries `[last token, draft]` gains 2 tokens when the draft passes and 1 when it does not; the draft must come from a
`[MASK]` query of the step before, which then has no draft to check, so steps alternate and two-query steps give
1 + r/2 tokens each, r the acceptance at distance 2. Starting the next slot while this one is decoded needs its first
token confident (the `slot_threshold` rule) at distance 16 - c when this slot holds c tokens. The summary prints both.
"""

import argparse

import torch

from benchmarks.settings import shipped
from finetune.chat import prompt_token_ids
from recipe.decoding import decode
from recipe.evaluate import benchmark_prompts
from recipe.model import decoding_dtype, load_base, load_refusion, with_adapter
from recipe.prompts import PROMPT_SETS


def draft_queries(prompt_length: int, answer_length: int, max_distance: int) -> tuple[torch.Tensor, ...]:
    """The `[MASK]` queries after a sequence of `prompt_length + answer_length` tokens: for every answer point a
    (answer tokens seen, 0 up to `answer_length - 1`) and distance d (1 up to `max_distance`) whose target, answer
    token a + d - 1, exists. Returns each query's a, d and target answer index (1-D long tensors, a-major)."""
    seen = torch.arange(answer_length)[:, None].expand(-1, max_distance)
    distance = torch.arange(1, max_distance + 1)[None, :].expand(answer_length, -1)
    target = seen + distance - 1
    keep = target < answer_length
    return seen[keep], distance[keep], target[keep]


def query_mask(prompt_length: int, answer_length: int, seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask `[1, 1, n, n]` of the sequence (causal) followed by the queries: a query sees the prompt, the
    `seen` answer tokens before it, the queries of the same answer point at smaller distances and itself, as the
    `[MASK]`s of one slot see each other in a plan forward (a slot's group)."""
    length = prompt_length + answer_length
    total = length + seen.shape[0]
    columns = torch.arange(total)
    sees = columns[None, :] <= columns[:, None]
    sees[length:] = columns[None, :] < prompt_length + seen[:, None]
    sees[length:, length:] = (seen[None, :] == seen[:, None]) & (columns[None, length:] <= columns[length:, None])
    return torch.zeros(total, total, dtype=dtype).masked_fill(~sees, torch.finfo(dtype).min)[None, None]


@torch.no_grad()
def check_drafts(model, prompt: list[int], answer: list[int], max_distance: int, settings: dict) -> dict:
    """One forward over the prompt, the answer and every draft query; per query its distance, whether the check
    accepts its draft, whether it is AR's token and whether it is confident."""
    mask_token_id, device = model.generation_config.mask_token_id, model.device
    prompt_length, answer_length = len(prompt), len(answer)
    seen, distance, target = draft_queries(prompt_length, answer_length, max_distance)
    ids = torch.tensor(prompt + answer + [mask_token_id] * seen.shape[0])
    positions = torch.cat([torch.arange(prompt_length + answer_length), prompt_length + target])
    mask = query_mask(prompt_length, answer_length, seen, model.dtype)
    logits = model(input_ids=ids[None].to(device), position_ids=positions[None].to(device),
                   attention_mask=mask.to(device)).logits[0].float()  # fmt: skip
    probabilities = logits.softmax(dim=-1)
    probabilities[:, mask_token_id] = -1.0  # a draft is never the mask token
    draft_probability, drafts = probabilities[prompt_length + answer_length :].max(dim=-1)
    ar = probabilities[prompt_length - 1 + target.to(device)]  # AR's distribution of answer token `target`
    ar_tokens = torch.tensor(answer, device=device)[target.to(device)]
    return dict(
        distance=distance,
        accepted=(ar.gather(1, drafts[:, None])[:, 0] > settings["token_threshold"]).cpu(),
        ar_token=(drafts == ar_tokens).cpu(),
        confident=(draft_probability > settings["slot_threshold"]).cpu(),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt_set", default="held_out", choices=PROMPT_SETS,
                        help="the recipe's held-out prompts, or the everyday ones (benchmarks/data)")  # fmt: skip
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--max_distance", type=int, default=16, help="the farthest draft, in tokens ahead")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--model",
        default=None,
        help="a saved ReFusion folder (e.g. a finetune.sft output) instead of the shipped model",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    settings = shipped()
    if args.model is None:
        base, tokenizer = load_base()
        model, refusion_tokenizer = with_adapter(base.eval(), tokenizer)
    else:
        model, refusion_tokenizer = load_refusion(args.model)
        tokenizer = refusion_tokenizer
    model = model.to(args.device, decoding_dtype(args.dtype, args.device))
    prompts = prompt_token_ids(tokenizer, [prompt.text for prompt in benchmark_prompts(args.prompts, args.prompt_set)])
    answers = decode(model, refusion_tokenizer, prompts, args.max_new_tokens, autoregressive=True,
                     time_forwards=False).answers  # fmt: skip
    checks = [check_drafts(model, prompt, answer, args.max_distance, settings)
              for prompt, answer in zip(prompts, answers) if answer]  # fmt: skip
    merged = {name: torch.cat([check[name] for check in checks]) for name in checks[0]}

    print(f"{len(checks)} {args.prompt_set} prompts answered by {args.model or 'the shipped model'}'s own AR "
          f"({sum(map(len, answers))} tokens, {model.dtype}); token_threshold {settings['token_threshold']}, "
          f"slot_threshold {settings['slot_threshold']}\n")  # fmt: skip
    print("| distance | drafts | accepted | AR's token | confident | confident and AR's token |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    rates = {}
    for distance in range(1, args.max_distance + 1):
        rows = merged["distance"] == distance
        count = int(rows.sum())
        if not count:
            continue
        share = {name: merged[name][rows].float().mean().item() for name in ("accepted", "ar_token", "confident")}
        confident = merged["confident"][rows]
        right = merged["ar_token"][rows][confident].float().mean().item() if confident.any() else float("nan")
        rates[distance] = share["accepted"]
        print(f"| {distance} | {count} | {share['accepted']:.3f} | {share['ar_token']:.3f} | "
              f"{share['confident']:.3f} | {right:.3f} |")  # fmt: skip
    if 2 in rates:
        print(f"\nTwo-query steps that alternate a [MASK] query and its draft's check: {1 + rates[2] / 2:.3f} tokens "
              f"per forward (one-query AR steps: 1). A two-query step pays only where it costs less than that times "
              f"one query's price.")  # fmt: skip


if __name__ == "__main__":
    main()
