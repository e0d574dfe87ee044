"""Fine-tuning data: every file layout and row format, the tokenized layout, over-long rows, and malformed rows."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tiny import tiny_tokenizer

from finetune.convert import add_mask_token
from finetune.data import DataFormatError, detect_format, load_rows, prepare_dataset, prompt_token_ids

QUESTION, ANSWER = "Two plus two?", "Two plus two is four."
CHAT_PROMPT = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = tiny_tokenizer()
    add_mask_token(tokenizer)
    return tokenizer


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


ROWS_BY_FORMAT = {
    "query_response": {"query": QUESTION, "response": ANSWER},
    "prompt_completion": {"prompt": QUESTION, "completion": ANSWER},
    "conversational prompt_completion": {
        "prompt": [{"role": "user", "content": QUESTION}],
        "completion": [{"role": "assistant", "content": ANSWER}],
    },
    "messages": {
        "messages": [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": ANSWER},
        ]
    },
}


@pytest.mark.parametrize("row_format", ROWS_BY_FORMAT)
def test_each_format_gives_chat_templated_prompt_and_response_ending_in_eos(tmp_path, tokenizer, row_format):
    rows = load_rows(write_jsonl(tmp_path / "train.jsonl", [ROWS_BY_FORMAT[row_format]] * 3))
    prepared = prepare_dataset(rows, tokenizer, max_length=None)
    assert prepared.row_format == row_format.split()[-1]
    assert prepared.dataset.column_names == ["prompt_ids", "response_ids"]
    assert prepared.dataset[0]["prompt_ids"] == ids(tokenizer, CHAT_PROMPT)
    assert prepared.dataset[0]["response_ids"] == [*ids(tokenizer, ANSWER), tokenizer.eos_token_id]


def test_training_and_inference_see_the_same_prompt_tokens(tmp_path, tokenizer):
    questions = [QUESTION, "List three colours.", "def add(a, b):"]
    rows = load_rows(write_jsonl(tmp_path / "train.jsonl", [{"query": q, "response": ANSWER} for q in questions]))
    trained_on = prepare_dataset(rows, tokenizer, max_length=None).dataset["prompt_ids"]
    at_inference = prompt_token_ids(tokenizer, questions)  # what recipe.decoding and the benchmarks feed generate()
    assert trained_on == at_inference
    assert at_inference == [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]
        for q in questions
    ]  # fmt: skip


def test_messages_use_the_last_assistant_turn_and_keep_earlier_turns_in_the_prompt(tmp_path, tokenizer):
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": ANSWER},
    ]
    rows = load_rows(write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation}]))
    example = prepare_dataset(rows, tokenizer, max_length=None).dataset[0]
    expected_prompt = tokenizer.apply_chat_template(conversation[:-1], add_generation_prompt=True, tokenize=False)
    assert example["prompt_ids"] == ids(tokenizer, expected_prompt)
    assert example["response_ids"] == [*ids(tokenizer, ANSWER), tokenizer.eos_token_id]


def test_without_a_chat_template_the_prompt_is_tokenized_as_is(tmp_path):
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = None
    add_mask_token(tokenizer)
    rows = load_rows(write_jsonl(tmp_path / "plain.jsonl", [{"query": QUESTION, "response": ANSWER}]))
    example = prepare_dataset(rows, tokenizer, max_length=None).dataset[0]
    assert example["prompt_ids"] == tokenizer(QUESTION)["input_ids"]


def test_json_list_jsonl_parquet_and_folders_of_them_load_the_same_rows(tmp_path):
    rows = [{"query": f"q{i}", "response": f"r{i}"} for i in range(6)]
    shards = tmp_path / "shards"
    (shards / "more").mkdir(parents=True)
    (shards / "list.json").write_text(json.dumps(rows[:2]), encoding="utf-8")
    write_jsonl(shards / "more" / "lines.jsonl", rows[2:4])
    pq.write_table(pa.Table.from_pylist(rows[4:]), tmp_path / "table.parquet")
    assert list(load_rows(shards / "list.json")["query"]) == ["q0", "q1"]
    assert list(load_rows(shards / "more" / "lines.jsonl")["query"]) == ["q2", "q3"]
    assert list(load_rows(tmp_path / "table.parquet")["query"]) == ["q4", "q5"]
    assert sorted(load_rows(shards)["query"]) == ["q0", "q1", "q2", "q3"]


def test_a_folder_with_split_named_files_gives_each_split(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"query": "q", "response": "train"}])
    write_jsonl(tmp_path / "test.jsonl", [{"query": "q", "response": "test"}])
    assert list(load_rows(tmp_path)["response"]) == ["train"]
    assert list(load_rows(tmp_path, split="test")["response"]) == ["test"]
    with pytest.raises(ValueError, match="Unknown split"):
        load_rows(tmp_path, split="validation")


def test_overlong_rows_are_truncated_or_dropped_and_counted(tmp_path, tokenizer):
    short, long = {"query": "Hi", "response": "Yes."}, {"query": "Hi", "response": "A cat sat on the mat. " * 20}
    huge_prompt = {"query": "The capital of France is Paris. " * 40, "response": "Yes."}
    rows = load_rows(write_jsonl(tmp_path / "mixed.jsonl", [short, long, huge_prompt, short]))
    prompt_length = len(prepare_dataset(rows.select([0]), tokenizer, max_length=None).dataset[0]["prompt_ids"])
    max_length = prompt_length + 12

    truncated = prepare_dataset(rows, tokenizer, max_length=max_length)
    assert (len(truncated.dataset), truncated.truncated, truncated.dropped) == (3, 1, 1)
    cut = truncated.dataset[1]
    assert len(cut["prompt_ids"]) + len(cut["response_ids"]) == max_length
    assert cut["response_ids"][-1] != tokenizer.eos_token_id  # a cut answer does not teach the model to stop
    summary = truncated.summary(max_length)
    assert "3 of 4 rows" in summary and "1 truncated and 1 dropped" in summary

    dropped = prepare_dataset(rows, tokenizer, max_length=max_length, overlong="drop")
    assert (len(dropped.dataset), dropped.truncated, dropped.dropped) == (2, 0, 2)


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"query": "a", "response": "b"}, {"query": "c"}], "Row 1: field 'response' is missing"),
        ([{"query": "a", "response": "b"}, {"query": "  ", "response": "d"}], "Row 1: field 'query' is empty"),
        ([{"query": "a", "response": "b"}] * 2 + [{"query": "a", "response": 7}], "Row 2: field 'response' must be"),
        ([{"prompt": "a", "completion": ""}], "Row 0: field 'completion' is empty"),
        ([{"messages": [{"role": "user", "content": "hi"}]}], "Row 0: field 'messages' has no assistant turn"),
        (
            [{"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}],
            "Row 0: field 'messages', message 0",
        ),
        ([{"messages": "hello"}], "Row 0: field 'messages' must be a non-empty list"),
        ([{"messages": [{"role": "assistant", "content": "x"}]}], "Row 0: field 'messages' has no turn before"),
        (
            [{"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "user", "content": "b"}]}],
            "Row 0: field 'completion' has no assistant turn",
        ),
        ([{"query": "a", "response": "b <|mask|> c"}], "Row 0: the response contains the mask token '<|mask|>'"),
        ([{"question": "a", "answer": "b"}], "Unrecognised columns ['answer', 'question']"),
    ],
)
def test_a_malformed_row_is_reported_with_its_row_and_field(tmp_path, tokenizer, rows, message):
    with pytest.raises(DataFormatError) as error:
        prepare_dataset(load_rows(write_jsonl(tmp_path / "bad.jsonl", rows)), tokenizer, max_length=None)
    assert message in str(error.value)


def test_unreadable_and_missing_data_fail_with_a_message(tmp_path):
    (tmp_path / "broken.jsonl").write_text('{"query": "a", "response": "b"}\n{"query": "a", "resp\n')
    with pytest.raises(DataFormatError, match="Could not read .*broken.jsonl"):
        load_rows(tmp_path / "broken.jsonl")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(DataFormatError, match="not a .json, .jsonl or .parquet file"):
        load_rows(tmp_path / "notes.txt")
    with pytest.raises(DataFormatError, match="the train split only"):
        load_rows(tmp_path / "broken.jsonl", split="test")
    pq.write_table(pa.Table.from_pylist([{"query": "q", "response": "r"}]), tmp_path / "rows.parquet")
    with pytest.raises(DataFormatError, match="both .json/.jsonl and .parquet files"):
        load_rows(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataFormatError, match="no .json, .jsonl or .parquet file"):
        load_rows(tmp_path / "empty")
    assert detect_format(["messages", "id"]) == "messages"


def test_conversational_rows_need_a_chat_template(tmp_path):
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = None
    add_mask_token(tokenizer)
    rows = load_rows(write_jsonl(tmp_path / "chat.jsonl", [ROWS_BY_FORMAT["messages"]]))
    with pytest.raises(DataFormatError, match="Row 0: the prompt is a list of messages but the tokenizer has no chat"):
        prepare_dataset(rows, tokenizer, max_length=None)
