"""Streaming and stopping act on the in-order prefix; num_return_sequences; the text-generation pipeline."""

import io
import threading
from contextlib import redirect_stdout

import pytest
import torch
from test_generation import PROMPT, sharpened_model
from tiny import tiny_tokenizer
from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer, TextStreamer, pipeline
from transformers.generation.streamers import BaseStreamer

from finetune.convert import save_refusion

SETTINGS = dict(max_new_tokens=20, slot_size=4, slot_threshold=0.5, token_threshold=0.5, pad_token_id=0)


class Collector(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        assert not self.ended
        self.puts.append(value.reshape(-1))

    def end(self):
        self.ended = True


class StopAfterToken(StoppingCriteria):
    def __init__(self, token_id: int):
        self.token_id = token_id

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token_id


@pytest.fixture(scope="module")
def model():
    return sharpened_model("qwen3", scale=4.0)


def answer_of(sequences):
    return sequences[0, PROMPT.shape[1] :]


@pytest.mark.parametrize("eos", [[], "early"])
def test_streamed_tokens_concatenate_to_the_answer(model, eos):
    free = answer_of(model.generate(PROMPT, eos_token_id=[], **SETTINGS)).tolist()
    eos_token_id = [] if eos == [] else next(token for token in free[8:] if token not in free[:8])
    streamer = Collector()
    answer = answer_of(model.generate(PROMPT, eos_token_id=eos_token_id, streamer=streamer, **SETTINGS))
    assert streamer.ended
    assert torch.equal(streamer.puts[0], PROMPT[0])
    if eos == []:
        assert len(streamer.puts) > 2  # the answer arrives in several pieces as its in-order prefix grows
    assert torch.equal(torch.cat(streamer.puts[1:]), answer)
    assert answer.shape[0] == (len(free) if eos == [] else free.index(eos_token_id) + 1)


def test_text_streamers_receive_the_decoded_answer(model):
    tokenizer = tiny_tokenizer()
    answer = answer_of(model.generate(PROMPT, eos_token_id=[], **SETTINGS))
    expected = tokenizer.decode(answer)

    printed = io.StringIO()
    with redirect_stdout(printed):
        model.generate(PROMPT, eos_token_id=[], streamer=TextStreamer(tokenizer, skip_prompt=True), **SETTINGS)
    assert printed.getvalue().strip() == expected.strip()

    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    worker = threading.Thread(
        target=model.generate, args=(PROMPT,), kwargs=dict(streamer=streamer, eos_token_id=[], **SETTINGS)
    )
    worker.start()
    text = "".join(streamer)
    worker.join()
    assert text.strip() == expected.strip()


def test_stopping_criteria_end_the_answer_at_the_first_hit(model):
    free = answer_of(model.generate(PROMPT, eos_token_id=[], return_dict_in_generate=True, **SETTINGS).sequences)
    stop_token = int(free[7])
    first = int((free == stop_token).long().argmax())
    stopped = model.generate(
        PROMPT, eos_token_id=[], stopping_criteria=StoppingCriteriaList([StopAfterToken(stop_token)]),
        return_dict_in_generate=True, **SETTINGS,
    )  # fmt: skip
    answer = answer_of(stopped.sequences)
    assert torch.equal(answer, free[: first + 1])  # nothing committed after the stop point is returned
    assert (
        stopped.num_forward_passes
        <= model.generate(PROMPT, eos_token_id=[], return_dict_in_generate=True, **SETTINGS).num_forward_passes
    )


def test_stop_strings_need_the_tokenizer_and_stop_the_text(model):
    tokenizer = tiny_tokenizer()
    free = answer_of(model.generate(PROMPT, eos_token_id=[], **SETTINGS))
    # two answer tokens that decode to text of their own (not bytes of a character cut in two)
    end = next(end for end in range(5, free.shape[0]) if "\ufffd" not in tokenizer.decode(free[end - 2 : end]))
    stop = tokenizer.decode(free[end - 2 : end])
    with pytest.raises(ValueError, match="tokenizer"):
        model.generate(PROMPT, stop_strings=[stop], **SETTINGS)
    answer = answer_of(model.generate(PROMPT, eos_token_id=[], stop_strings=[stop], tokenizer=tokenizer, **SETTINGS))
    assert tokenizer.decode(answer).endswith(stop) or stop in tokenizer.decode(answer)
    assert answer.shape[0] <= end
    assert torch.equal(answer, free[: answer.shape[0]])


def test_max_time_stops_early(model):
    output = model.generate(PROMPT, eos_token_id=[], max_time=0.0, return_dict_in_generate=True, **SETTINGS)
    assert answer_of(output.sequences).shape[0] < SETTINGS["max_new_tokens"]


def test_num_return_sequences_samples_several_answers_per_prompt(model):
    torch.manual_seed(0)
    first = model.generate(PROMPT, do_sample=True, num_return_sequences=3, eos_token_id=[], **SETTINGS)
    torch.manual_seed(0)
    second = model.generate(PROMPT, do_sample=True, num_return_sequences=3, eos_token_id=[], **SETTINGS)
    assert first.shape[0] == 3 and torch.equal(first, second)
    assert len({tuple(row.tolist()) for row in first}) > 1
    with pytest.raises(ValueError, match="do_sample"):
        model.generate(PROMPT, num_return_sequences=2, **SETTINGS)


def test_text_generation_pipeline_with_text_and_chat(model, tmp_path):
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"mask_token": "<|mask|>"})
    save_refusion(model.float(), tokenizer, tmp_path / "model")
    model.double()
    generator = pipeline("text-generation", model=str(tmp_path / "model"), trust_remote_code=True)
    assert type(generator.model).__name__ == "RefusionForCausalLM"
    text = generator("The capital of France is", max_new_tokens=8, slot_size=4, do_sample=False)
    assert text[0]["generated_text"].startswith("The capital of France is")
    chat = generator([{"role": "user", "content": "Name a colour."}], max_new_tokens=8, slot_size=4)
    assert chat[0]["generated_text"][-1]["role"] == "assistant"
    batch = generator(["Two plus two is", "A cat sat"], max_new_tokens=6, slot_size=2, batch_size=2)
    assert len(batch) == 2
