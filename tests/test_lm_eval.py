"""lm-evaluation-harness: the `refusion` model runs a local generation task and a loglikelihood task offline."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import tiny_backbone, tiny_tokenizer

from finetune.convert import convert_to_refusion, save_refusion

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [
    ("What is the capital of France?", "Paris"),
    ("Two plus two is", "four"),
    ("Water boils at", "one hundred degrees"),
    ("A cat sat on the", "mat"),
]
GENERATION_TASK = """
task: refusion_local_generation
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
"""
CHOICE_TASK = """
task: refusion_local_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm-eval")
    tokenizer = tiny_tokenizer()
    model, tokenizer = convert_to_refusion(tiny_backbone("llama", vocab_size=len(tokenizer)), tokenizer)
    save_refusion(model, tokenizer, root / "model")
    rows = [{"question": q, "answer": a} for q, a in QUESTIONS]
    (root / "generation.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    choices = [{"question": q, "choices": [a, "blue", "seven"], "label": 0} for q, a in QUESTIONS]
    (root / "choice.jsonl").write_text("".join(json.dumps(row) + "\n" for row in choices))
    (root / "tasks").mkdir()
    (root / "tasks" / "generation.yaml").write_text(GENERATION_TASK.format(data=root / "generation.jsonl"))
    (root / "tasks" / "choice.yaml").write_text(CHOICE_TASK.format(data=root / "choice.jsonl"))
    return root


def test_command_line_runs_generation_and_loglikelihood_tasks(workspace):
    command = [
        sys.executable, "-m", "refusion_eval", "--model", "refusion",
        "--model_args", f"pretrained={workspace / 'model'},slot_size=4,block_length=8,dtype=float32",
        "--tasks", "refusion_local_generation,refusion_local_choice", "--include_path", str(workspace / "tasks"),
        "--device", "cpu", "--batch_size", "2", "--output_path", str(workspace / "results"), "--log_samples",
    ]  # fmt: skip
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=workspace, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    results_file = next((workspace / "results").rglob("results_*.json"))
    results = json.loads(results_file.read_text())["results"]
    assert 0.0 <= results["refusion_local_generation"]["exact_match,none"] <= 1.0
    assert 0.0 <= results["refusion_local_choice"]["acc,none"] <= 1.0


def test_generation_requests_are_answered_by_refusion_decoding(workspace):
    import lm_eval
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import refusion_eval  # noqa: F401  (registers the model)

    output = lm_eval.simple_evaluate(
        model="refusion",
        model_args=f"pretrained={workspace / 'model'},slot_size=4,block_length=8,dtype=float32",
        tasks=["refusion_local_generation"],
        task_manager=TaskManager(include_path=str(workspace / "tasks")),
        device="cpu",
        batch_size=1,
        log_samples=True,
    )
    model = AutoModelForCausalLM.from_pretrained(workspace / "model", trust_remote_code=True, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(workspace / "model", trust_remote_code=True)
    samples = output["samples"]["refusion_local_generation"]
    assert len(samples) == len(QUESTIONS)
    for sample in samples:
        context, arguments = sample["arguments"][0]
        ids = tokenizer(context, return_tensors="pt")["input_ids"]
        answer = model.generate(
            ids, max_new_tokens=arguments["max_gen_toks"], slot_size=4, block_length=8, stop_strings=["\n"],
            tokenizer=tokenizer,
        )  # fmt: skip
        expected = tokenizer.decode(answer[0, ids.shape[1] :], skip_special_tokens=True).split("\n")[0]
        assert sample["resps"][0][0] == expected
