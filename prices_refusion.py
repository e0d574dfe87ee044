"""The price schedule (`draft_schedule="price"`): what forwards of each width cost on this machine.

`ForwardPrices` holds a table of seconds per forward width; the decoder weighs it against the acceptance seen so far
to choose how many drafts each forward checks (`decisions_refusion.best_window`). A table is measured once per model,
device, cache and forward path (`measure_forward_prices`, keyed by `price_key`), kept on the model and in a file
between processes (`price_file`), and measured again when a decode shows it stale. A caller can pass one instead
(`forward_prices=`).
"""

import hashlib
import json
import math
import os
import shutil
from pathlib import Path

import torch
from transformers import CompileConfig
from transformers.utils import logging

try:
    from .compiling_refusion import device_name, freezes_weights
    from .executor_refusion import SlotCache, pad_width, prompt_runs_eagerly, timed_forward
    from .settings_refusion import attention_fingerprint, check_forward_prices
except ImportError:  # installed as top-level modules rather than loaded as Hub remote code
    from compiling_refusion import device_name, freezes_weights
    from executor_refusion import SlotCache, pad_width, prompt_runs_eagerly, timed_forward
    from settings_refusion import attention_fingerprint, check_forward_prices

logger = logging.get_logger(__name__)

# `draft_schedule="price"`: the forward widths whose price is measured (others are interpolated), and the variable
# naming the file measured prices are kept in between processes (default ~/.cache/refusion/forward_prices.json;
# empty: keep none). Measuring a width of compiled forwards compiles it, before the decode's first token: the widths a
# priced decode mostly runs are measured (one new token a slot and a few drafts each, and the prompt's 64), and
# those between 8 and 64, whose forwards cost about in proportion to their width, are interpolated; a decode compiles
# one when it first runs it. Measuring stops at the first width that costs `PRICE_LINEAR` times its width in one-query
# forwards (no economy of width left: wider forwards are prorated), and a width takes a warm-up and a single timed
# forward once the timed forwards have spent `PRICE_SECONDS`: a batch of 32 on a CPU would otherwise spend as long
# pricing its forwards as decoding.
PRICE_WIDTHS = (1, 2, 4, 8, 64)
PRICE_LINEAR = 0.9
PRICE_SECONDS = 4.0
# A kept table is measured again when a decode over the cache it was measured on ran a forward of one of its widths in
# less than this share of its price (a forward with its scoring costs no less than the forward alone, so the table was
# measured while the machine was busy, or in a state decodes are not in).
PRICE_STALE = 0.75
PRICE_CACHE_VARIABLE = "REFUSION_PRICE_CACHE"
# A measured width priced within this share above the narrowest width's price is priced as the narrowest: width that
# costs about nothing is taken as free. The schedule's expected tokens rest on the acceptance seen so far, low early in
# a prompt (`draft_prior`) and pooled over drafts of every kind, so a near-tie between widths goes to the narrower one
# where the wider would have paid: widths priced alike leave the choice to the acceptance, which takes the wider
# drafts, more tokens a forward for forwards that cost about the same. A caller's table is taken as given.
PRICE_FREE = 0.08


class ForwardPrices:
    """What a forward of `width` new tokens per row costs, from a table of measured widths: interpolated linearly
    between them, the narrowest's price below it, prorated past the widest. A width is never priced above a wider
    one (it could run padded to it), which also bounds a measurement's noise; in a measured table (`key`), no width
    within `PRICE_FREE` of the narrowest's price above it. With the width `buckets` of compiled forwards, widths are
    first padded to their bucket, as the forward runs."""

    def __init__(self, table: dict[int, float], buckets: tuple[int, ...] | None = None, key: str | None = None):
        self.table, self.buckets = check_forward_prices(table), buckets
        self.measured = dict(self.table)  # before the narrower widths are capped below
        self.widths = list(self.table)
        self.key = key  # the `price_key` of a measured table; None for the caller's
        self.seen: dict[int, float] = {}  # each measured width's fastest forward in a decode (`observe`)
        self.tried: set[int] = set()  # buckets run once at their own width before padding them (`run_width`)
        for narrower, wider in zip(reversed(self.widths[:-1]), reversed(self.widths[1:])):
            self.table[narrower] = min(self.table[narrower], self.table[wider])
        if key is not None:  # measured: widths within `PRICE_FREE` of the narrowest are free
            narrowest = self.table[self.widths[0]]
            for width, price in self.table.items():
                if price <= (1 + PRICE_FREE) * narrowest:
                    self.table[width] = narrowest

    def __call__(self, width: int) -> float:
        width = pad_width(width, self.buckets)
        widths, table = self.widths, self.table
        if width <= widths[0]:
            return table[widths[0]]
        if width >= widths[-1]:
            return table[widths[-1]] * width / widths[-1]
        above = next(index for index, known in enumerate(widths) if known >= width)
        low, high = widths[above - 1], widths[above]
        return table[low] + (table[high] - table[low]) * (width - low) / (high - low)

    def run_width(self, width: int) -> int:
        """The width a forward of `width` new tokens runs at: its bucket, or a wider bucket priced cheaper (a width's
        price being the least of its measured one and the fastest a decode saw, `observe`). A measured table's bucket
        is run once before it is padded to a wider one: a table that prices it too high (measured on a busy machine,
        or kept from another state of it) would otherwise never see it run, and so never be found stale."""
        width = pad_width(width, self.buckets)
        if self.buckets is None or width not in self.measured:
            return width
        wider = [bucket for bucket in self.buckets if bucket >= width and bucket in self.measured]
        cheapest = min(wider, key=lambda bucket: (min(self.measured[bucket], self.seen.get(bucket, math.inf)), bucket))
        if cheapest != width and self.key is not None and width not in self.tried:
            self.tried.add(width)
            return width
        return cheapest

    def observe(self, width: int, seconds: float) -> None:
        """A decode's forward of `width` (as run: padded) took `seconds`, its scoring and the host's read included."""
        if width in self.measured:
            self.seen[width] = min(seconds, self.seen.get(width, math.inf))

    def stale(self) -> tuple[int, float] | None:
        """A width whose forwards ran in less than `PRICE_STALE` of its measured price, and the fastest of them."""
        return next(
            ((width, seconds) for width, seconds in self.seen.items() if seconds < PRICE_STALE * self.measured[width]),
            None,
        )


def measure_forward_prices(
    model,
    cache: SlotCache,
    compiled=None,
    widths=PRICE_WIDTHS,
    repeats=3,
    buckets=None,
    seconds=PRICE_SECONDS,
    prompt_width: int | None = None,
) -> dict[int, float]:
    """Seconds a forward of each of `widths` new tokens per row takes over `cache` (through the `compiled` backbone
    where given, at the width it pads to among its `buckets`), the fastest of `repeats` timed forwards after a warm-up.
    Widths go narrowest first, a warm-up and a timed forward each, and stop at the first that costs `PRICE_LINEAR` times
    as many one-query forwards as it has queries (timed again, with the one-query forward, before believing it: a busy
    moment does not end the measuring): wider forwards then cost in proportion (`ForwardPrices` prorates past the widest
    measured width) and measuring them would take longest. The other repeats go round the measured widths a forward
    each, so that a busy spell of the machine falls on every width alike and the prices keep their ratios, by which the
    schedule decides (on a busy machine, repeats back to back priced some forwards below narrower ones). Once the timed
    forwards have taken `seconds`, a width gets its warm-up and one timed forward only. Warm-ups do not count towards
    `seconds`, and no width is priced from its warm-up: where a width's forward is compiled on its first call (saved
    forwards not compiled yet), the warm-up takes the compiling (seconds to minutes), which would otherwise spend the
    time and be taken for the width's price.

    First, a forward of `prompt_width` (a decode's first forward, its prompt's) where given: the decode's forwards
    run after it, and so are measured. What a forward costs depends on what ran before: glibc's allocator serves
    large tensors from fresh pages until larger ones have been freed, so that a narrow forward measured first costs
    more than the same forward after a wide one, as in a decode. The forwards run on padding:
    what they write, the mask of a decode hides."""
    if prompt_width:  # run as a decode's (`execute`); its logits as many as the widest measured forward's
        eager = prompt_runs_eagerly(model, compiled, cache, prompt_width, buckets)
        first = prompt_width if eager else pad_width(prompt_width, buckets)
        timed_forward(model, None if eager else compiled, cache, first, min(prompt_width, max(widths)))
    runs = {}  # per padded width, its warm-up and then its timed forwards

    def timed(width: int) -> None:
        """One more timed forward of `width` (padded): its first whatever the time, others while time is left."""
        if len(runs[width]) < 2 or sum(sum(times[1:]) for times in runs.values()) < seconds:
            runs[width].append(timed_forward(model, compiled, cache, width, width))

    def fastest(width: int) -> float:
        return min(runs[pad_width(width, buckets)][1:])

    def linear(width: int) -> bool:
        return width > widths[0] and fastest(width) >= PRICE_LINEAR * width * fastest(widths[0]) / widths[0]

    measured = []
    for width in widths:
        padded = pad_width(width, buckets)
        if padded not in runs:
            runs[padded] = [timed_forward(model, compiled, cache, padded, padded)]
            timed(padded)
        measured.append(width)
        if linear(width):  # once more each before ending there: a busy moment is not the end of width's economy
            timed(padded)
            timed(pad_width(widths[0], buckets))
            if linear(width):
                break
    for _ in range(repeats):  # the repeats, a round at a time
        for padded, times in runs.items():
            if len(times) <= repeats:
                timed(padded)
    return {width: fastest(width) for width in measured}


def price_key(model, cache: SlotCache, compile_config: CompileConfig | None, buckets=None, saved: str = "") -> str:
    """What a price table holds for: the model (name, config, kinds of linear layer, attention implementation), the
    device and threads, the dtype, the forward path (eager, or the compile config, width `buckets` and for saved
    forwards their `saved` kind, `SavedForwards.kind`), the batch size and cache length, and torch's version."""
    config = model.config.to_json_string(use_diff=False)
    linears = sorted({type(module).__name__ for module in model.modules() if isinstance(module, torch.nn.Linear)})
    keys = cache.layers[0].keys
    return " | ".join([
        model.config._name_or_path or model.config.model_type,
        hashlib.sha256(config.encode()).hexdigest()[:16],
        "+".join(linears) + f", attention {attention_fingerprint(model)}",
        f"{device_name(model)} {torch.get_num_threads()} threads",
        str(model.dtype),
        "eager" if compile_config is None else f"compiled {compile_config.to_dict()}, widths {buckets}"
        + (", frozen weights" if freezes_weights(compile_config) else "")
        + (f", {saved}" if saved else ""),
        f"batch {keys.shape[0]}, cache {keys.shape[2]}",
        f"torch {torch.__version__}",
    ])  # fmt: skip


def price_file() -> Path | None:
    """Where measured prices are kept between processes: the file `REFUSION_PRICE_CACHE` names (none when it is
    empty), by default `forward_prices.json` in the user's cache folder."""
    named = os.environ.get(PRICE_CACHE_VARIABLE)
    if named is not None:
        return Path(named).expanduser() if named else None
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "refusion" / "forward_prices.json"


PRICE_FILE_WARNED: set[tuple[str, str]] = set()  # (price file, kind of problem) warned of in this process


def warn_price_file(path: Path, kind: str, message: str) -> None:
    """Log `message` (one line naming the price file `path`), once a process for each `kind` of problem with it."""
    if (str(path), kind) not in PRICE_FILE_WARNED:
        PRICE_FILE_WARNED.add((str(path), kind))
        logger.warning(message)


def read_price_file(path: Path | None) -> dict | None:
    """The tables kept in `path` that pass `check_forward_prices`, by key; none where there is no file. Problems warn
    once a process, naming the file: a table that fails the check is left out alone (the others stay, and the file
    keeps them when it is next written); a file that is not a JSON object (damaged) is moved aside first, never
    overwritten (`move_aside_price_file`), so that its tables are measured again and kept in a new one. None where the
    file cannot be read (a folder, no permission) or moved aside: it is left as it is (`keep_prices` writes nothing
    over it), and prices are measured in each process."""
    if path is None:
        return {}
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):  # (no such file)
        return {}
    except OSError as error:
        warn_price_file(path, "unreadable", f"The forward price file {path} could not be read ({error}); prices are "
                        "measured again in each process and kept nowhere.")  # fmt: skip
        return None
    try:
        stored = json.loads(data)
        if not isinstance(stored, dict):
            raise ValueError(f"a JSON {type(stored).__name__}, not an object of tables")
    except ValueError as error:  # (bytes that are not UTF-8 too)
        return move_aside_price_file(path, f"{type(error).__name__}: {error}")
    tables, damaged = {}, []
    for key, table in stored.items():
        try:
            tables[key] = check_forward_prices(table)
        except ValueError:
            damaged.append(key)
    if damaged:
        warn_price_file(path, "tables", f"The forward price file {path} holds {len(damaged)} damaged table(s) (not "
                        f"positive finite prices by width; the first for {damaged[0][:60]!r}...): they are dropped, "
                        f"the {len(tables)} others kept.")  # fmt: skip
    return tables


def move_aside_price_file(path: Path, problem: str) -> dict | None:
    """Move the price file `path` that does not parse (`problem`: why) aside, with a warning: its target (through a
    symbolic link) renamed to `<name>.corrupt`, or `<name>.corrupt.<n>` where that is taken, so that nothing a user
    may want to read is overwritten. No tables: {} where it was moved (a new file is written in its place), None where
    it could not be (it stays, and nothing is written over it)."""
    target = path.resolve()
    aside, number = target.with_name(f"{target.name}.corrupt"), 0
    while aside.exists() or aside.is_symlink():
        number += 1
        aside = target.with_name(f"{target.name}.corrupt.{number}")
    try:
        os.rename(target, aside)
    except OSError as error:
        warn_price_file(path, "corrupt", f"The forward price file {path} is damaged ({problem}) and could not be "
                        f"moved aside ({error}); it is left as it is, and prices are kept nowhere.")  # fmt: skip
        return None
    warn_price_file(path, f"moved to {aside}", f"The forward price file {path} is damaged ({problem}): moved to "
                    f"{aside}; its prices are measured again and kept in a new file.")  # fmt: skip
    return {}


def measured_prices(
    model, compile_config: CompileConfig | None, cache: SlotCache, compiled=None, buckets=None, prompt_width=None
) -> ForwardPrices:
    """The price table of a decode's forwards over `cache` (through `compiled`, built from `compile_config`, padded
    to its width `buckets`): the one measured before for the same `price_key` (kept on the model and in
    `price_file()`), else one measured now, after a forward of the decode's `prompt_width` (once: a few seconds)."""
    saved = getattr(compiled, "kind", "")  # saved forwards name their kind (`SavedForwards.kind`)
    key = price_key(model, cache, compile_config, buckets, saved)
    known = getattr(model, "_refusion_prices", None)
    if known is None:
        known = model._refusion_prices = {}
    if key not in known:
        measured_here = model.__dict__.setdefault("_refusion_prices_measured", set())  # the keys measured now
        try:
            known[key] = check_forward_prices((read_price_file(price_file()) or {}).get(key))
            measured_here.discard(key)
        except ValueError:  # not kept, or damaged
            known[key] = measure_forward_prices(model, cache, compiled, buckets=buckets, prompt_width=prompt_width)
            keep_prices(key, known[key])
            measured_here.add(key)
    return ForwardPrices(known[key], buckets, key)


def keep_prices(key: str, table: dict[int, float] | None) -> None:
    """Write `table` as the one kept for `key` in `price_file()` (None: drop it), beside the file's other valid
    tables (`read_price_file`; nothing where it cannot be read). Written whole, a partial file renamed over the file
    (removed on any failure, so none is left behind), through a symbolic link to its target, with the file's
    permissions. A file that cannot be written warns once a process."""
    path = price_file()
    if path is None:
        return
    tables = read_price_file(path)
    if tables is None:  # (warned: a file that cannot be read is not written over)
        return
    tables.pop(key, None)
    if table is not None:
        tables[key] = table
    partial = None
    try:
        target = path.resolve()  # (through a symbolic link, to the file it names)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(tables, indent=1, allow_nan=False))
        if target.exists():
            shutil.copymode(target, partial)
        os.replace(partial, target)
    except (OSError, RuntimeError, ValueError) as error:  # (RuntimeError: a loop of links; ValueError: not finite)
        warn_price_file(path, "unwritable", f"Measured forward prices could not be kept in {path} ({error}); set "
                        f"{PRICE_CACHE_VARIABLE} to a writable file, or to '' to keep none.")  # fmt: skip
    finally:
        if partial is not None:
            partial.unlink(missing_ok=True)


def forget_stale_prices(model, prices: ForwardPrices | None) -> None:
    """Deal with a measured table that the decode found stale (`ForwardPrices.stale`). One kept from an earlier
    process is dropped from the model and the price file, so that the next decode measures it again (the machine was
    busy then). One measured in this process, where measuring again would as likely give the same prices (some
    forwards measure dearer on their own than amid a decode), takes the decode's times for the widths it beat. Where
    the narrowest width is among them, the machine was busy while measuring: every width's price first scales by as
    much as the narrowest's fell, so that the ratios, by which the schedule decides, hold. (The one-query forward runs
    most, so a decode sees its fastest: lowered alone, it would leave the wider widths priced dear against it, and
    the schedule choosing narrower drafts, fewer tokens a forward, pass by pass.)"""
    stale = prices.stale() if prices is not None else None
    if stale is None:
        return
    width, seconds = stale
    if prices.key in getattr(model, "_refusion_prices_measured", ()):
        table, seen, narrowest = model._refusion_prices[prices.key], prices.seen, prices.widths[0]
        beaten = {each for each, fastest in seen.items() if fastest < PRICE_STALE * prices.measured[each]}
        scale = seen[narrowest] / prices.measured[narrowest] if narrowest in beaten else 1.0
        for each, price in prices.measured.items():
            table[each] = min(price * scale, seen[each] if each in beaten else math.inf)
        keep_prices(prices.key, table)
        return
    logger.warning(
        f"Forward prices will be measured again: forwards of {width} new tokens took {seconds:.4g} s in this decode, "
        f"against {prices.measured[width]:.4g} s when measured (the machine was busy then, or in another state)."
    )
    model._refusion_prices.pop(prices.key, None)
    keep_prices(prices.key, None)
