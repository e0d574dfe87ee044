"""The KV cache of a ReFusion decode and the forwards that fill it.

`execute` runs the requests of all rows of a batch as one forward, reads every row's integers to the host at once (a
step waits for the device once) and hands them back to each row's `SlotDecoder`. The cache is a `DynamicCache`, or
with `cache_implementation="static"` a `SlotCache` allocated once, where each row stores its tokens in the order they
were decoded (`StaticLayout` says where, and builds the attention mask), whose forwards can run compiled, padded to a
few widths (`WIDTH_BUCKETS`).
"""

import contextlib
import threading
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, StaticLayer

try:
    from .decisions_refusion import EAGER_STEPS, NEVER, StepFunctions, attention_mask
    from .decoder_refusion import FIELDS, PADDING, Request, SlotDecoder, upload
except ImportError:  # installed as top-level modules rather than loaded as Hub remote code
    from decisions_refusion import EAGER_STEPS, NEVER, StepFunctions, attention_mask
    from decoder_refusion import FIELDS, PADDING, Request, SlotDecoder, upload


# Compiled forwards run at these widths: a forward's new tokens are padded up to the nearest, so that a decode compiles
# a bounded number of graphs. Wider forwards (a long plan) run eagerly over the same static cache, and so does the
# prompt's where the model's linear layers are prepacked for it and that measured cheaper (`prompt_runs_eagerly`).
# Priced drafts (`draft_schedule="price"`) also get the narrow buckets: where width is dear they choose forwards of one
# or two queries, which padded to 8 would cost what 8 cost.
WIDTH_BUCKETS = (8, 16, 32, 64)
NARROW_BUCKETS = (1, 2, 4)
# With the weights frozen into the graphs, a compiled forward of up to this many new tokens ends with the output layer
# (over all of them), whose weight inductor then packs for its own GEMM kernels: at these widths cheaper than the eager
# output layer, prepacked or not, and most of all in bfloat16 on a CPU without oneDNN's bfloat16 kernels (AVX2), which
# has no packed eager kernel for it. Wider forwards (a prompt) keep it eager over the tokens whose logits are used
# (`run_model`).
LOGITS_IN_GRAPH_WIDTH = 8
CACHE_LENGTH_MULTIPLE = 128  # static caches are sized in these steps, so that prompts of other lengths share graphs


class SlotCache(Cache):
    """Static K/V storage for slot decoding: `[batch, kv heads, max_cache_len, head dim]` per layer, allocated once
    (transformers' `StaticLayer`), which `torch.compile` can capture. Each row keeps its stored tokens in storage
    order at columns 0, 1, ... (a token's column is its rank); a forward writes its new tokens at the `columns`
    (`[batch, width]`) the executor sets, and keeping only the accepted queries is moving the row's write pointer
    back: the next forward overwrites the rest, and the mask hides every column not yet written or dropped. A forward
    attends over every column, as transformers' `StaticCache` does: one compiled graph per width and cache length."""

    def __init__(self, model, batch_size: int, max_cache_len: int):
        text_config = model.config.get_text_config(decoder=True)
        super().__init__(layers=[StaticLayer(max_cache_len) for _ in range(text_config.num_hidden_layers)])
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        self.early_initialization(batch_size, text_config.num_key_value_heads, head_dim, model.dtype, model.device)
        self.max_cache_len = max_cache_len
        self.columns = torch.zeros(batch_size, 1, dtype=torch.long, device=model.device)
        self.rows = torch.arange(batch_size, device=model.device)[:, None]  # each row's index, against its columns
        self.lock = threading.Lock()  # held by the decode using the cache (`claimed`)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        # An indexed assignment, which inductor writes in place into the cache tensors; `scatter_` there became a copy
        # of each layer's keys and values, written back after attention.
        layer, rows = self.layers[layer_idx], self.rows[: key_states.shape[0]]
        layer.keys[rows, :, self.columns] = key_states.transpose(1, 2)
        layer.values[rows, :, self.columns] = value_states.transpose(1, 2)
        return layer.keys, layer.values

    def __getstate__(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if key != "lock"}  # (a copy gets a lock of its own)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, lock=threading.Lock())

    @contextlib.contextmanager
    def claimed(self):
        """Hold the cache for one decode: a model keeps its compiled decodes' cache, and two threads decoding with it
        at once would overwrite each other's keys and values."""
        if not self.lock.acquire(blocking=False):
            raise RuntimeError(
                "This model is already decoding over its static cache in another thread: decode from one thread at a "
                "time, give each thread a model of its own, or use cache_implementation='dynamic'."
            )
        try:
            yield self
        finally:
            self.lock.release()

    def fits(self, model, batch_size: int, max_cache_len: int) -> bool:
        """Whether this cache serves a decode of `batch_size` rows needing `max_cache_len` columns on `model`."""
        keys = self.layers[0].keys
        return (keys.shape[0], keys.dtype, keys.device) == (batch_size, model.dtype, model.device) and (
            max_cache_len <= self.max_cache_len
        )


def cache_length(needed: int) -> int:
    """`needed` columns rounded up to a multiple of `CACHE_LENGTH_MULTIPLE`."""
    return -(-needed // CACHE_LENGTH_MULTIPLE) * CACHE_LENGTH_MULTIPLE


def slot_cache(model, batch_size: int, needed: int, keep: bool = True) -> SlotCache:
    """A static cache of at least `needed` columns (rounded up to `CACHE_LENGTH_MULTIPLE`). With `keep`, the model's
    kept one when it fits, else a new one kept in its place (`model._refusion_slot_cache`): compiled forwards then see
    the same cache tensors from one `generate()` call to the next. The kept cache is the size of the longest decode
    since; `del model._refusion_slot_cache` frees it. Without `keep`, a new cache for the caller alone."""
    length = cache_length(needed)
    if not keep:
        return SlotCache(model, batch_size, length)
    cache = getattr(model, "_refusion_slot_cache", None)
    if cache is None or not cache.fits(model, batch_size, length):
        cache = SlotCache(model, batch_size, length)
        model._refusion_slot_cache = cache
    return cache


class CacheLayout:
    """Where the rows' tokens are in a `DynamicCache` (or, with no cache, in a forward that recomputes them): one
    column per token of the batch, appended forward after forward; rows of different lengths leave holes, hidden by
    giving them rank `NEVER`. Rows that finish leave the batch."""

    def __init__(self, cache: DynamicCache | None, batch_size: int, device):
        self.cache, self.rows = cache, list(range(batch_size))
        self.ranks = torch.zeros((batch_size, 0), dtype=torch.long, device=device)  # per row and cache column
        self.groups = torch.zeros_like(self.ranks)

    def batch_rows(self, live: list[int]) -> list[int]:
        """The rows of the next forward's batch: the `live` ones (the cache drops the others)."""
        if live != self.rows and self.cache is not None:
            # one upload for all three (a tensor indexed with a list copies it to the device and waits there)
            keep = upload([self.rows.index(row) for row in live], self.ranks.device)
            self.cache.batch_select_indices(keep)
            self.ranks, self.groups = self.ranks[keep], self.groups[keep]
        self.rows = live
        return live

    def mask(self, batch: dict, sizes: list[int], dtype) -> torch.Tensor:
        """The attention mask of the batch's new tokens (`sizes` per row, before left padding), appended after the
        cache's columns."""
        key_ranks = torch.cat([self.ranks, batch["ranks"]], dim=1)
        key_groups = torch.cat([self.groups, batch["groups"]], dim=1)
        return attention_mask(key_ranks, key_groups, batch["ranks"], batch["prefixes"], batch["groups"],
                              batch["parents"], self.ranks.shape[1], dtype)  # fmt: skip

    def keep(self, batch: dict, sizes: list[int], kept: list[int]) -> None:
        """After a forward: each row keeps its first `kept` new tokens (pending and accepted queries), the rest goes."""
        if self.cache is None:
            return
        width = batch["ids"].shape[1]
        kept_ends = [width - size + count for size, count in zip(sizes, kept)]
        end = max(kept_ends)
        keep = torch.arange(end, device=self.ranks.device) < upload(kept_ends, self.ranks.device)[:, None]
        self.ranks = torch.cat([self.ranks, batch["ranks"][:, :end].masked_fill(~keep, NEVER)], dim=1)
        self.groups = torch.cat([self.groups, batch["groups"][:, :end]], dim=1)
        self.cache.crop(end - width)


class StaticLayout:
    """Where the rows' tokens are in a `SlotCache`: row r's stored tokens at columns 0 .. pointer[r] - 1; a forward's
    new tokens at pointer[r] onwards, its left padding after them. The batch keeps its rows (finished rows run as
    padding), so shapes stay static."""

    def __init__(self, cache: SlotCache, batch_size: int, device, steps: StepFunctions | None = None):
        self.cache, self.pointers, self.steps = cache, [0] * batch_size, steps or EAGER_STEPS
        self.columns = torch.arange(cache.max_cache_len, device=device)
        self.groups = torch.full((batch_size, cache.max_cache_len), PADDING["groups"], device=device)

    def batch_rows(self, live: list[int]) -> list[int]:
        return list(range(len(self.pointers)))

    def mask(self, batch: dict, sizes: list[int], dtype) -> torch.Tensor:
        """The attention mask of the batch's new tokens (`sizes` per row, before left padding), which go to the cache
        at its rows' pointers (`static_mask`), over every column of the cache."""
        width, needed = batch["ids"].shape[1], max(self.pointers) + batch["ids"].shape[1]
        if needed > self.cache.max_cache_len:
            raise RuntimeError(
                f"The static cache ({self.cache.max_cache_len} columns) is too short for this forward: a row has "
                f"{max(self.pointers)} stored tokens and {width} new ones. This is a bug in sizing the cache."
            )
        pointers, lengths = upload([*self.pointers, *sizes], self.columns.device).view(2, -1)
        self.cache.columns, self.groups, mask = self.steps.static_mask(
            pointers, lengths, self.columns, self.groups, batch["ranks"], batch["prefixes"], batch["groups"],
            batch["parents"], dtype,
        )  # fmt: skip
        return mask

    def keep(self, batch: dict, sizes: list[int], kept: list[int]) -> None:
        self.pointers = [pointer + count for pointer, count in zip(self.pointers, kept)]


def width_buckets(draft_schedule: str) -> tuple[int, ...]:
    """The widths compiled forwards run at under `draft_schedule`: `WIDTH_BUCKETS`, and for priced drafts the
    `NARROW_BUCKETS` too."""
    return NARROW_BUCKETS + WIDTH_BUCKETS if draft_schedule == "price" else WIDTH_BUCKETS


def packed_for(model, width: int) -> bool:
    """Whether every linear layer of `model` computes a forward of `width` new tokens through prepacked kernels
    (`kernels_refusion.prepack_linears`: layers with a `packed_from(dtype)`, the fewest rows packed in that dtype)."""

    def packs(layer) -> bool:
        rows = layer.packed_from(layer.weight.dtype) if hasattr(layer, "packed_from") else None
        return rows is not None and rows <= width

    # (lazily: a model whose first linear layer is not packed, as one never prepacked, is answered there)
    layers = (module for module in model.modules() if isinstance(module, torch.nn.Linear))
    first = next(layers, None)
    return first is not None and packs(first) and all(map(packs, layers))


def pad_width(width: int, buckets: tuple[int, ...] | None) -> int:
    """The width a forward of `width` new tokens runs at: the nearest of the compiled forwards' `buckets` (None:
    eager); wider than the widest, as it is (it runs eagerly)."""
    if buckets is None or width > buckets[-1]:
        return width
    return next(bucket for bucket in buckets if bucket >= width)


def padded_batch(requests: list["Request | None"], width: int, padding: torch.Tensor) -> dict[str, torch.Tensor]:
    """A forward's `FIELDS`, `[rows, width]` each: each row's request left-padded with the `padding` column (the
    `PADDING` values, `[len(FIELDS), 1]`; a row without a request is padding only). One concatenation a row and one
    stack: padding each field apart took six calls a row, which decoding paid every forward."""
    if len(requests) == 1 and requests[0] is not None and len(requests[0]) == width:  # one row, no padding: views
        return dict(zip(FIELDS, requests[0].fields[:, None].unbind()))
    rows = [padding.expand(-1, width - len(request or ())) for request in requests]
    rows = [torch.cat([row, request.fields], dim=1) if request else row for row, request in zip(rows, requests)]
    return dict(zip(FIELDS, torch.stack(rows, dim=1).unbind()))


def run_model(model, compiled, batch: dict, mask: torch.Tensor, cache, num_logits: int) -> torch.Tensor:
    """The logits of each row's last `num_logits` tokens: when the batch's width is a bucket, through the `compiled`
    backbone, whose graphs up to its `logits_width` end with the output layer (frozen weights), and otherwise the
    output layer over those tokens only, eagerly (prepacked weights serve it there; inside a graph of a wide bucket
    it would run over every padded token, a large share of a prompt's forward, and graphs that do not freeze the
    weights get no packed kernel for it); else through the model eagerly."""
    inputs = dict(input_ids=batch["ids"], position_ids=batch["positions"], attention_mask=mask, cache=cache)
    width = batch["ids"].shape[1]
    if compiled is not None and width <= WIDTH_BUCKETS[-1]:  # a bucket (`pad_width`)
        output = compiled(**inputs, use_cache=True)
        if width <= compiled.logits_width:
            return output[:, -num_logits:]
        return model.get_output_embeddings()(output[:, -num_logits:])
    return model(**inputs, use_cache=cache is not None, logits_to_keep=num_logits).logits


def execute(
    model, decoders: list[SlotDecoder], cache: DynamicCache | SlotCache | None, compiled=None, buckets=None
) -> int:
    """Decode the rows of `decoders` to the end as batched forwards over one `cache` (without a cache every request
    carries its whole sequence), through the `compiled` backbone where given, padded to its width `buckets`. Returns
    the number of forwards. Each forward is one step of five, reading the device once:"""
    executor = Executor(model, decoders, cache, compiled, buckets)
    requests = [decoder.request() for decoder in decoders]
    forwards = 0
    while any(request is not None for request in requests):
        forward = executor.queries(requests, first=not forwards)  # 1. the rows' requests as one padded batch
        logits = executor.run(forward)  # 2. the model's forward
        scores = executor.score(forward, logits)  # 3. each row reads its logits on the device into a few integers
        values = executor.read(forward, scores)  # ... and all rows' come to the host at once: the one wait
        kept = executor.decide(forward, scores, values, requests)  # 4. each row decides; its next request
        executor.keep(forward, kept)  # 5. the new tokens each row keeps stay in the cache, the rest go
        forwards += 1
    return forwards


@dataclass
class Forward:
    """One batched forward of `execute`: the batch's rows, their requests (None: a row that runs as padding) and new
    tokens each, its inputs (`FIELDS`, left-padded to its width), attention mask and the logits it keeps per row, the
    backbone it runs through (None: eagerly) and when it started."""

    rows: list[int]
    requests: list[Request | None]
    sizes: list[int]
    batch: dict[str, torch.Tensor]
    mask: torch.Tensor
    num_logits: int
    graph: object = None
    started: float = 0.0


class Executor:
    """The steps of `execute` over one cache: where the rows' tokens are in it (`CacheLayout` or `StaticLayout`), the
    width a forward runs at, and with `draft_schedule="price"` the forward prices, which choose widths (compiled
    forwards, `ForwardPrices.run_width`) and, for a measured table over a static cache, learn what forwards took."""

    def __init__(self, model, decoders: list[SlotDecoder], cache, compiled=None, buckets=None):
        self.model, self.decoders, self.cache, self.compiled, self.buckets = model, decoders, cache, compiled, buckets
        device = decoders[0].device
        if isinstance(cache, SlotCache):
            self.layout = StaticLayout(cache, len(decoders), device, decoders[0].steps)
        else:
            self.layout = CacheLayout(cache, len(decoders), device)
        prices = decoders[0].prices
        self.pricing = prices if compiled is not None else None
        observed = isinstance(cache, SlotCache) and prices is not None and prices.key is not None
        self.observed = prices if observed else None  # (a caller's table is taken as given)
        self.padding = upload(list(PADDING.values()), device)[:, None]
        self.dtype = model.dtype  # (read once: transformers finds it by walking the parameters, each time)

    def queries(self, requests: list[Request | None], first: bool) -> Forward:
        """The rows' requests as one forward: left-padded so that every row's queries end the batch (logits are
        computed for those only), to the width bucket of the compiled backbone (priced cheapest, with prices), or
        eagerly at its own width for the `first` forward (the prompts') where prepacked kernels serve it cheaper."""
        rows = self.layout.batch_rows([row for row, request in enumerate(requests) if request is not None])
        batch_requests = [requests[row] for row in rows]
        sizes = [len(request) if request else 0 for request in batch_requests]
        eager_prompt = first and prompt_runs_eagerly(self.model, self.compiled, self.cache, max(sizes), self.buckets)
        graph, buckets = (None, None) if eager_prompt else (self.compiled, self.buckets)
        width = pad_width(max(sizes), buckets)
        if buckets is not None and self.pricing is not None:
            width = self.pricing.run_width(width)
        batch = padded_batch(batch_requests, width, self.padding)
        mask = self.layout.mask(batch, sizes, self.dtype)
        num_logits = max(request.num_queries for request in batch_requests if request)
        return Forward(rows, batch_requests, sizes, batch, mask, num_logits, graph)

    def run(self, forward: Forward) -> torch.Tensor:
        """The logits of each row's last `num_logits` tokens."""
        forward.started = time.perf_counter()
        return run_model(self.model, forward.graph, forward.batch, forward.mask, self.cache, forward.num_logits)

    def score(self, forward: Forward, logits: torch.Tensor) -> list[torch.Tensor | None]:
        """Each row's `SlotDecoder.score` of its own queries' logits (None for a row without a request)."""
        return [
            self.decoders[row].score(logits[position, forward.num_logits - request.num_queries :]) if request else None
            for position, (row, request) in enumerate(zip(forward.rows, forward.requests))
        ]

    def read(self, forward: Forward, scores: list[torch.Tensor | None]) -> list[int]:
        """All rows' scores on the host, in one read; a measured price table learns what the forward took, as it
        was measured (every new token scored)."""
        read = [score for score in scores if score is not None and score.shape[0]]
        values = (read[0] if len(read) == 1 else torch.cat(read)).tolist() if read else []
        width = forward.batch["ids"].shape[1]
        if self.observed is not None and read and forward.num_logits == width:
            self.observed.observe(width, time.perf_counter() - forward.started)
        return values

    def decide(self, forward: Forward, scores: list, values: list[int], requests: list[Request | None]) -> list[int]:
        """Each row decides from its share of `values` (`SlotDecoder.advance`) and makes its next request, in place in
        `requests`; returns how many of each row's new tokens stay in the cache."""
        kept, start = [], 0
        for row, request, score in zip(forward.rows, forward.requests, scores):
            if request is None:
                kept.append(0)
                continue
            decoder, end = self.decoders[row], start + score.shape[0]
            queries_kept = decoder.advance(values[start:end])
            start = end
            requests[row] = decoder.request()
            kept.append(len(request) - request.num_queries + queries_kept)
        return kept

    def keep(self, forward: Forward, kept: list[int]) -> None:
        self.layout.keep(forward.batch, forward.sizes, kept)


def static_cache_columns(prompt_length: int, max_new_tokens: int, slot_size: int, block_length: int) -> int:
    """Columns a static cache needs for prompts of up to `prompt_length` tokens: each row stores its prompt and
    answer (whole slots) once, and a forward's new tokens (the prompt and a block's plan at first, then at most a
    block's fresh tokens, `[MASK]` queries and drafts plus the tokens committed since the last forward) go after
    them, padded up to a width bucket."""
    answer = -(-max_new_tokens // slot_size) * slot_size
    widest = max(4 * block_length, WIDTH_BUCKETS[-1])
    return max(prompt_length + block_length, prompt_length + answer + widest)


def timed_forward(model, compiled, cache: SlotCache, width: int, num_logits: int) -> float:
    """Seconds one forward of `width` new tokens a row takes over `cache` through the `compiled` backbone (None:
    eagerly), waiting for the device. The tokens are padding: what they write, the mask of a decode hides."""
    batch_size, device = cache.layers[0].keys.shape[0], model.device
    batch = {name: torch.full((batch_size, width), value, dtype=torch.long, device=device)
             for name, value in PADDING.items()}  # fmt: skip
    mask = StaticLayout(cache, batch_size, device).mask(batch, [0] * batch_size, model.dtype)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    run_model(model, compiled, batch, mask, cache, num_logits).sum().item()  # waits for the device
    return time.perf_counter() - start


def prompt_runs_eagerly(model, compiled, cache, width: int, buckets: tuple[int, ...] | None) -> bool:
    """Whether a decode's first forward (its prompts', `width` new tokens a row) through the `compiled` backbone runs
    eagerly at its own width rather than padded to its bucket in a graph: where the model's linear layers are
    prepacked for it (`packed_for`) and cost no more so, by the prices `prompt_prices` measured once per backbone,
    batch size, cache length and bucket (kept on the model). Past the widest bucket a forward runs eagerly anyway.
    Which is cheaper depends on the CPU (the eager packed kernels against the graph's, and the graph's padding), so
    it is measured rather than assumed."""
    if compiled is None or not isinstance(cache, SlotCache):
        return False
    bucket = pad_width(width, buckets)
    in_graph = buckets is not None and bucket <= buckets[-1]
    known = getattr(model, "_refusion_prompt_prices", None)
    if known is None:
        known = model._refusion_prompt_prices = {}
    key = (id(compiled), cache.layers[0].keys.shape[0], cache.max_cache_len, bucket)
    if in_graph and key in known and known[key][0] * width > known[key][1]:
        return False  # the graph is cheaper, as measured (asked first: `packed_for` walks every layer)
    if not packed_for(model, width):
        return False
    if not in_graph:
        return True
    if key not in known:
        known[key] = prompt_prices(model, compiled, cache, width, bucket)
    eager_per_token, graph = known[key]
    return eager_per_token * width <= graph


def prompt_prices(model, compiled, cache: SlotCache, width: int, bucket: int, repeats: int = 2) -> tuple[float, float]:
    """What a first forward costs eagerly, per new token (measured at `width`: a narrower one is prorated, which
    prices it low, so that a prompt goes eagerly, as it did before prices were measured, wherever in doubt), and
    through `compiled` padded to `bucket`: each the fastest of `repeats`, after a warm-up, the two timed in turn."""
    num_logits = min(width, LOGITS_IN_GRAPH_WIDTH)
    eager, graph = [], []
    for _ in range(repeats + 1):
        eager.append(timed_forward(model, None, cache, width, num_logits))
        graph.append(timed_forward(model, compiled, cache, bucket, num_logits))
    return min(eager[1:]) / width, min(graph[1:])
