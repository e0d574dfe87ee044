"""Training data for ReFusion fine-tuning: load rows, check them, and tokenize them into prompt and response ids.

Three row formats are accepted, recognised from the column names:

* the ReFusion authors' ``{"query": str, "response": str}``;
* TRL's prompt-completion ``{"prompt", "completion"}``, each a string or a list of chat messages;
* TRL's conversational ``{"messages": [...]}``, whose last assistant turn is the response.

The prompt goes through the tokenizer's chat template when it has one; the response is the assistant text followed
by the EOS token. Rows are numbered from 0 in file order; a row that cannot be used raises `DataFormatError` naming
the row and the field, before any training starts.
"""

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from datasets import Dataset, load_dataset
from datasets.exceptions import DatasetGenerationError
from transformers import PreTrainedTokenizerBase

from finetune.chat import Message, prompt_token_ids

if TYPE_CHECKING:  # TRL's argument classes, read by `prepare_training_data`; not imported for the rest
    from trl import ScriptArguments, SFTConfig

logger = logging.getLogger("finetune.sft")  # the run's log, which `finetune.sft` shows

BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
FORMATS = {
    "query_response": ("query", "response"),
    "prompt_completion": ("prompt", "completion"),
    "messages": ("messages",),
}
OVERLONG_POLICIES = ("truncate", "drop")


class DataFormatError(ValueError):
    """A data file or row that cannot be trained on; the message names the file, or the row and the field."""


@dataclass(frozen=True)
class PreparedData:
    """The tokenized dataset (`prompt_ids`, `response_ids`) and what preparation did to reach it."""

    dataset: Dataset
    row_format: str
    rows_in: int
    truncated: int
    dropped: int

    def summary(self, max_length: int | None) -> str:
        """One line for the log: rows kept, truncated and dropped."""
        limit = f"max_length={max_length}" if max_length is not None else "no max_length"
        return (
            f"{len(self.dataset)} of {self.rows_in} rows ({self.row_format} format) ready for training; "
            f"{self.truncated} truncated and {self.dropped} dropped for {limit}."
        )


def load_rows(name_or_path: str | os.PathLike, config_name: str | None = None, split: str = "train") -> Dataset:
    """Load raw rows from a `.json` (a list), `.jsonl` or `.parquet` file, a folder of such files, or a Hub dataset.

    A single file is the train split. In a folder, files named after a split (`train.jsonl`, `test-00001.parquet`,
    ...) form that split, and when none is, every file is train data, as with `datasets.load_dataset`.
    """
    path = Path(name_or_path)
    if not path.exists():
        return load_dataset(str(name_or_path), config_name, split=split)
    if path.is_file():
        if path.suffix not in BUILDERS:
            raise DataFormatError(f"{str(path)!r} is not a .json, .jsonl or .parquet file.")
        if split != "train":
            raise DataFormatError(f"{str(path)!r} is a single file, the train split only; {split!r} is not available.")
        builder, location = BUILDERS[path.suffix], {"data_files": str(path)}
    else:
        builders = {BUILDERS[file.suffix] for file in path.rglob("*") if file.is_file() and file.suffix in BUILDERS}
        if len(builders) != 1:
            kinds = "both .json/.jsonl and .parquet files" if builders else "no .json, .jsonl or .parquet file"
            raise DataFormatError(f"The folder {str(path)!r} holds {kinds}; keep one kind per folder.")
        builder, location = builders.pop(), {"data_dir": str(path)}
    try:
        return load_dataset(builder, split=split, **location)
    except DatasetGenerationError as error:
        raise DataFormatError(f"Could not read {str(path)!r}: {error.__cause__ or error}") from error


def detect_format(column_names: Sequence[str]) -> str:
    """Name the row format given the dataset's columns (see the module docstring)."""
    for name, columns in FORMATS.items():
        if all(column in column_names for column in columns):
            return name
    accepted = "; ".join("{" + ", ".join(repr(c) for c in columns) + "}" for columns in FORMATS.values())
    raise DataFormatError(f"Unrecognised columns {sorted(column_names)}: rows need one of {accepted}.")


def _text(row: int, field: str, value: Any) -> str:
    """Return `value` if it is a non-empty string, else raise naming the row and the field."""
    if value is None:
        raise DataFormatError(f"Row {row}: field {field!r} is missing.")
    if not isinstance(value, str):
        raise DataFormatError(f"Row {row}: field {field!r} must be a string, got {type(value).__name__}.")
    if not value.strip():
        raise DataFormatError(f"Row {row}: field {field!r} is empty.")
    return value


def _messages(row: int, field: str, value: Any) -> list[Message]:
    """Return `value` if it is a non-empty list of `{"role": str, "content": str}` messages."""
    if value is None:
        raise DataFormatError(f"Row {row}: field {field!r} is missing.")
    if not isinstance(value, list) or not value:
        raise DataFormatError(f"Row {row}: field {field!r} must be a non-empty list of messages.")
    for turn, message in enumerate(value):
        if not isinstance(message, dict) or not all(isinstance(message.get(key), str) for key in ("role", "content")):
            raise DataFormatError(
                f"Row {row}: field {field!r}, message {turn} must be a dict with string 'role' and 'content'."
            )
    return value


def _split_conversation(row: int, field: str, conversation: list[Message]) -> tuple[list[Message], str]:
    """Cut a conversation at its last assistant turn: the turns before it are the prompt, its text the response."""
    last = max((turn for turn, message in enumerate(conversation) if message["role"] == "assistant"), default=None)
    if last is None:
        raise DataFormatError(f"Row {row}: field {field!r} has no assistant turn to learn as the response.")
    if last == 0:
        raise DataFormatError(f"Row {row}: field {field!r} has no turn before the assistant's to use as the prompt.")
    if not conversation[last]["content"].strip():
        raise DataFormatError(f"Row {row}: field {field!r} has an empty last assistant turn.")
    return conversation[:last], conversation[last]["content"]


def _prompt_and_response(row: int, example: dict[str, Any], row_format: str) -> tuple[str | list[Message], str]:
    """The prompt (text or messages) and the response text of one raw row."""
    if row_format == "query_response":
        return _text(row, "query", example["query"]), _text(row, "response", example["response"])
    if row_format == "messages":
        return _split_conversation(row, "messages", _messages(row, "messages", example["messages"]))
    prompt, completion = example["prompt"], example["completion"]
    if isinstance(completion, list):
        completion = _messages(row, "completion", completion)
        if not any(message["role"] == "assistant" for message in completion):
            raise DataFormatError(f"Row {row}: field 'completion' has no assistant turn.")
        if isinstance(prompt, list):
            prompt = _messages(row, "prompt", prompt)
        else:
            prompt = [{"role": "user", "content": _text(row, "prompt", prompt)}]
        return _split_conversation(row, "completion", prompt + completion)
    prompt = _messages(row, "prompt", prompt) if isinstance(prompt, list) else _text(row, "prompt", prompt)
    return prompt, _text(row, "completion", completion)


def _tokenize_batch(
    batch: dict[str, list],
    rows: list[int],
    *,
    tokenizer: PreTrainedTokenizerBase,
    row_format: str,
    max_length: int | None,
    overlong: str,
    mask_token_id: int,
) -> dict[str, list]:
    """Check and tokenize a batch of raw rows; over-long rows are dropped or truncated (and flagged)."""
    examples = [dict(zip(batch, values)) for values in zip(*batch.values())]
    pairs = [_prompt_and_response(row, example, row_format) for row, example in zip(rows, examples)]
    if tokenizer.chat_template is None:
        conversational = [row for row, (prompt, _) in zip(rows, pairs) if isinstance(prompt, list)]
        if conversational:
            raise DataFormatError(
                f"Row {conversational[0]}: the prompt is a list of messages but the tokenizer has no chat "
                "template; pass --chat_template_path with a .jinja file."
            )
    prompt_ids = prompt_token_ids(tokenizer, [prompt for prompt, _ in pairs])
    response_ids = tokenizer([response for _, response in pairs], add_special_tokens=False)["input_ids"]

    kept: dict[str, list] = {"prompt_ids": [], "response_ids": [], "truncated": []}
    for row, prompt, response in zip(rows, prompt_ids, response_ids):
        response = [*response, tokenizer.eos_token_id]
        for field, ids in (("prompt", prompt), ("response", response)):
            if mask_token_id in ids:
                raise DataFormatError(f"Row {row}: the {field} contains the mask token {tokenizer.mask_token!r}.")
        if not prompt:
            raise DataFormatError(f"Row {row}: the prompt tokenizes to nothing.")
        too_long = max_length is not None and len(prompt) + len(response) > max_length
        if too_long and (overlong == "drop" or len(prompt) >= max_length):
            continue
        kept["prompt_ids"].append(prompt)
        kept["response_ids"].append(response[: max_length - len(prompt)] if too_long else response)
        kept["truncated"].append(too_long)
    return kept


def prepare_dataset(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_length: int | None,
    overlong: str = "truncate",
    num_proc: int | None = None,
) -> PreparedData:
    """Tokenize raw rows into `prompt_ids`/`response_ids` for `HybridObjectiveCollator`.

    A row longer than `max_length` tokens (prompt + response + EOS) is dropped when `overlong="drop"`; with
    `"truncate"` its response is cut to fit, and it is dropped only when the prompt alone leaves no room.
    """
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"overlong must be one of {OVERLONG_POLICIES}, got {overlong!r}.")
    if tokenizer.eos_token_id is None or tokenizer.mask_token_id is None:
        raise ValueError("The tokenizer needs an EOS token and a mask token (convert the model to ReFusion first).")
    if len(dataset) == 0:
        raise DataFormatError("The dataset has no rows.")
    row_format = detect_format(dataset.column_names)
    tokenized = dataset.map(
        _tokenize_batch,
        batched=True,
        with_indices=True,
        remove_columns=dataset.column_names,
        num_proc=num_proc,
        fn_kwargs={
            "tokenizer": tokenizer,
            "row_format": row_format,
            "max_length": max_length,
            "overlong": overlong,
            "mask_token_id": tokenizer.mask_token_id,
        },
        desc="Tokenizing",
    )
    truncated = sum(tokenized["truncated"])
    tokenized = tokenized.remove_columns("truncated")
    if len(tokenized) == 0:
        raise DataFormatError(f"Every row is longer than max_length={max_length}; nothing is left to train on.")
    return PreparedData(tokenized, row_format, len(dataset), truncated, len(dataset) - len(tokenized))


def prepare_training_data(
    script_args: "ScriptArguments",
    training_args: "SFTConfig",
    tokenizer: PreTrainedTokenizerBase,
    *,
    overlong: str = "truncate",
) -> tuple[PreparedData, PreparedData | None]:
    """The train split, and the test split when evaluating, loaded and tokenized as TRL's arguments ask.

    The tokenizer first takes `--eos_token` and `--chat_template_path`, since the rows are tokenized with them. The
    main process prepares the data first, the others after it (from the `datasets` cache where there is one).
    """
    if training_args.eos_token is not None:
        if training_args.eos_token not in tokenizer.get_vocab():
            raise ValueError(f"--eos_token {training_args.eos_token!r} is not in the tokenizer's vocabulary.")
        tokenizer.eos_token = training_args.eos_token
    if script_args.dataset_name is None:
        raise ValueError("--dataset_name is required (a .json/.jsonl/.parquet file, a folder of them, or a Hub id).")
    if script_args.dataset_streaming:
        raise ValueError("--dataset_streaming is not supported: rows are checked before training starts.")
    if training_args.chat_template_path is not None:
        tokenizer.chat_template = Path(training_args.chat_template_path).read_text(encoding="utf-8")
    splits = [script_args.dataset_train_split]
    if training_args.eval_strategy != "no":
        splits.append(script_args.dataset_test_split)
    prepared = []
    with training_args.main_process_first(desc="dataset preparation"):
        for split in splits:
            rows = load_rows(script_args.dataset_name, script_args.dataset_config, split=split)
            prepared.append(
                prepare_dataset(
                    rows,
                    tokenizer,
                    max_length=training_args.max_length,
                    overlong=overlong,
                    num_proc=training_args.dataset_num_proc,
                )
            )
            logger.info("%s split: %s", split, prepared[-1].summary(training_args.max_length))
    return prepared[0], (prepared[1] if len(prepared) > 1 else None)
