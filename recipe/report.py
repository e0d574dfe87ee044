"""Results as the benchmarks and the recipe's ablations write them, and the cells of their Markdown tables.

    write_results(output_dir, "forward_cost", markdown(results), results, plot=lambda path: plot(results, path))

writes `forward_cost.json` (every figure), `forward_cost.md` (the table) and `forward_cost.png` into `output_dir`.
"""

import json
from collections.abc import Callable
from pathlib import Path

from finetune.files import write_text_atomically


def cell(value: float | None, spec: str = ".2f") -> str:
    """A table cell: `value` formatted by `spec` (two decimals by default), or '-' where there is no figure (not
    measured, or not recorded by an older run)."""
    return "-" if value is None else format(value, spec)


def write_results(
    output_dir: str | Path,
    stem: str,
    table: str,
    results: dict | None = None,
    plot: Callable[[Path], None] | None = None,
    plot_stem: str | None = None,
) -> list[Path]:
    """Write `table` to `<stem>.md` in `output_dir` (made when missing), `results` (when given) to `<stem>.json`,
    and `plot` (when given, called with the path) to `<plot_stem or stem>.png`; print and return the paths
    written. A run stopped while writing leaves each file as it was (`finetune.files.write_text_atomically`)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if results is not None:
        written.append(output_dir / f"{stem}.json")
        write_text_atomically(written[-1], json.dumps(results, indent=1) + "\n")
    written.append(output_dir / f"{stem}.md")
    write_text_atomically(written[-1], table)
    if plot is not None:
        written.append(output_dir / f"{plot_stem or stem}.png")
        plot(written[-1])
    print("written:", ", ".join(map(str, written)), flush=True)
    return written
