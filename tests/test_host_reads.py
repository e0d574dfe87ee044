"""A decode step waits for the device once: the decoder reads what it must decide from to the host as one small
tensor per batched forward, however many rows the batch holds, and builds the next forward's queries from counts the
host already knows. Counted with a torch function mode that sees every operation that copies a tensor's values to
the host (on a GPU, each is a wait for the queued kernels)."""

import pytest
import torch
from test_batching import PROMPTS, left_padded
from test_generation import sharpened_model
from torch.overrides import TorchFunctionMode

import executor_refusion
import generation_refusion

HOST_READS = {
    torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__index__,
    torch.Tensor.__float__, torch.Tensor.nonzero, torch.nonzero, torch.unique, torch.Tensor.unique,
    torch.Tensor.masked_select, torch.masked_select, torch.Tensor.cpu, torch.Tensor.numpy,
}  # fmt: skip


class HostReads(TorchFunctionMode):
    """Counts operations that read tensor values to the host or wait for the device: boolean-mask indexing (its size
    is data) included, and indexing with a Python list (on a GPU, a copy of the list that waits for the queued work:
    what CUDA's sync debug mode caught in `CacheLayout.batch_rows`)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.count += 1
        elif func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            self.count += any(
                isinstance(part, list) or isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in index
            )
        return func(*args, **(kwargs or {}))


SETTINGS = {
    "fast": dict(slot_size=4, slot_threshold=0.5, token_threshold=0.4),
    "fused, window": dict(slot_size=8, block_length=16, slot_threshold=0.3, token_threshold=0.3, fused_redraft=True,
                          draft_window=2),
    "reference": dict(slot_size=4, slot_threshold=0.5, token_threshold=0.4, infill_mode="reference"),
    "one-token slots": dict(slot_size=1, slot_threshold=0.5, token_threshold=0.4),
    "priced": dict(slot_size=4, slot_threshold=0.5, token_threshold=0.4, draft_schedule="price",
                   forward_prices={1: 1.0, 4: 1.5, 16: 4.0}),
}  # fmt: skip


@pytest.fixture(scope="module")
def model():
    return sharpened_model("qwen2", scale=4.0)


def test_the_counter_sees_boolean_indexing_and_tolist():
    x = torch.arange(6)
    with HostReads() as reads:
        x[x > 2]
        x[torch.tensor([0, 1])]
        x[[0, 1]]
        x.tolist()
    assert reads.count == 3


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
@pytest.mark.parametrize("batch", [1, 4])
def test_each_decode_step_reads_the_device_at_most_once(model, monkeypatch, name, cache_implementation, batch):
    counted = {}
    execute = executor_refusion.execute

    def counted_execute(*args, **kwargs):
        with HostReads() as reads:
            forwards = execute(*args, **kwargs)
        counted.update(reads=reads.count, forwards=forwards)
        return forwards

    monkeypatch.setattr(generation_refusion, "execute", counted_execute)
    ids, mask = left_padded(PROMPTS[:batch])
    output = model.generate(
        ids, attention_mask=mask, max_new_tokens=20, eos_token_id=[], pad_token_id=0, return_dict_in_generate=True,
        cache_implementation=cache_implementation, **SETTINGS[name],
    )  # fmt: skip
    assert counted["forwards"] == output.num_forward_passes > 1
    # one read after every forward whose logits decide anything (the reference rule's redraft decides nothing)
    assert 0 < counted["reads"] <= counted["forwards"]
    if name != "reference":
        assert counted["reads"] == counted["forwards"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["fast", "fused, window", "priced"])
def test_on_cuda_the_decoder_synchronizes_once_a_step_outside_the_forwards(monkeypatch, name):
    """CUDA's own count: with `set_sync_debug_mode("warn")` every synchronizing call warns; the model's forwards
    (transformers' code) run unwatched."""
    import warnings

    run_model, execute, counted = executor_refusion.run_model, executor_refusion.execute, {}

    def forward_unwatched(*args, **kwargs):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return run_model(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("warn")

    def watched_execute(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                counted["forwards"] = execute(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        counted["syncs"] = sum("synchroniz" in str(warning.message) for warning in caught)
        return counted["forwards"]

    monkeypatch.setattr(executor_refusion, "run_model", forward_unwatched)
    monkeypatch.setattr(generation_refusion, "execute", watched_execute)
    model = sharpened_model("qwen2", scale=4.0).to("cuda")
    ids, mask = left_padded(PROMPTS[:4])
    model.generate(ids.to("cuda"), attention_mask=mask.to("cuda"), max_new_tokens=20, eos_token_id=[], pad_token_id=0,
                   **SETTINGS[name])  # fmt: skip
    assert 0 < counted["syncs"] <= counted["forwards"]
