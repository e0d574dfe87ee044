"""Writing into folders and files a user owns without losing what they hold, and reading back what was written.

A model is written into a hidden staging folder inside its output folder and moved in only once complete, file by
file, `config.json` last: a run killed while it writes leaves the folder as it was (a previous model still loads),
one killed while the files move in leaves no `config.json`, so a mix never loads, and never any file of other
names touched. A text file the project reads back is replaced atomically; a JSONL file is read with errors that name
the file and the line.
"""

import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

STAGING = ".refusion-staging"  # inside the output folder (same filesystem); hidden, so never mistaken for the model
# The weight files of a model's earlier save that `save_pretrained` would leave stale beside new ones: a single
# `model.safetensors`, its shards and their index (a stale single file would even be loaded before a new index).
WEIGHT_FILE = re.compile(r"model\.safetensors|model\.safetensors\.index\.json|model-\d{5}-of-\d{5}\.safetensors")


def user_entries(folder: Path) -> list[Path]:
    """What `folder` holds besides a staging folder left by a killed run (empty when it does not exist)."""
    if not folder.is_dir():
        return []
    return [entry for entry in folder.iterdir() if entry.name != STAGING]


def check_output_dir(output_dir: str | os.PathLike, overwrite_output_dir: bool = False) -> None:
    """Refuse an output folder that is a file, or that holds files unless `overwrite_output_dir` (the Trainer's
    convention): a model is then written into it, replacing only files of the same names."""
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise NotADirectoryError(f"Output folder {os.path.abspath(output_dir)} is a file, not a folder.")
    if not overwrite_output_dir and user_entries(output_dir):
        raise FileExistsError(
            f"Output folder {os.path.abspath(output_dir)} exists and is not empty: pass --overwrite_output_dir "
            "(overwrite_output_dir=True) to write the model into it, replacing only files of the same names."
        )


def discard_staging(output_dir: Path) -> None:
    """Remove the staging folder a killed run left in `output_dir`, saying so."""
    staging = output_dir / STAGING
    if staging.exists():
        logger.warning("Removing %s, the partial files of an earlier run that was stopped while writing.", staging)
        shutil.rmtree(staging)


@contextmanager
def staged_output(output_dir: str | os.PathLike, overwrite_output_dir: bool = False) -> Iterator[Path]:
    """Yield an empty staging folder inside `output_dir` to write a model into; when the block ends without error,
    move its files into `output_dir` (`publish`). On an error the staging folder, and any folder this made, go.

    `output_dir` is checked first (`check_output_dir`); missing folders are made with the permissions `mkdir`
    gives (0o777 less the umask), as `save_pretrained` makes them."""
    output_dir = Path(output_dir)
    check_output_dir(output_dir, overwrite_output_dir)
    made = [folder for folder in (output_dir, *output_dir.parents) if not folder.exists()]
    output_dir.mkdir(parents=True, exist_ok=True)
    discard_staging(output_dir)
    staging = output_dir / STAGING
    staging.mkdir()
    published = False
    try:
        yield staging
        publish(staging, output_dir)
        published = True
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if not published:
            for folder in made:  # innermost first; only folders left empty
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()


def publish(staging: Path, output_dir: Path) -> None:
    """Move every file staged in `staging` into `output_dir` at the same relative path, `config.json` last.

    The old `config.json` goes first, so that a run stopped half-way never leaves an old config over new weights (or
    the reverse) that would load as a model; weight files of an earlier save that the new ones do not replace go too
    (see `WEIGHT_FILE`). Every other file and folder of `output_dir` is kept. Subfolders are merged file by file.
    """
    staged = sorted(path.relative_to(staging) for path in staging.rglob("*") if not path.is_dir())
    staged.sort(key=lambda path: path == Path("config.json"))  # stable: the rest keep their order
    for relative in staged:  # a folder where a file goes (or the reverse) stops it before anything changes
        for part in (*reversed(relative.parents[:-1]), relative):
            target = output_dir / part
            if target.exists() and target.is_dir() != (part != relative):
                kind = "a folder" if target.is_dir() else "a file"
                raise FileExistsError(f"{target} is {kind} where the model's {relative} goes; move it away first.")
    if Path("config.json") in staged:
        (output_dir / "config.json").unlink(missing_ok=True)
    new_names = {str(path) for path in staged}
    if any(WEIGHT_FILE.fullmatch(name) for name in new_names):
        for entry in output_dir.iterdir():
            if WEIGHT_FILE.fullmatch(entry.name) and entry.name not in new_names and entry.is_file():
                entry.unlink()
    for relative in staged:
        target = output_dir / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / relative, target)
    shutil.rmtree(staging)


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` through a partial file beside it, renamed over `path` when complete: a run stopped
    while writing leaves the previous content, never a truncated file."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    try:
        with open(partial, "w", encoding="utf-8") as sink:
            sink.write(text)
            sink.flush()
            os.fsync(sink.fileno())
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)  # gone once renamed; otherwise what an error interrupted


def read_json(path: str | os.PathLike, default: object = None) -> object:
    """The JSON value in `path`, or `default` when the file does not exist; a file that is not JSON raises a
    `ValueError` naming it."""
    path = Path(path)
    if not path.exists():
        return default
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}).") from None


def read_jsonl(path: str | os.PathLike, required: tuple[str, ...] = ()) -> list[dict]:
    """The JSON objects of a JSONL file, one a line (blank lines skipped; none when the file does not exist), each
    with a string in every field of `required`.

    A line that is not such an object raises a `ValueError` naming the file and the line, except a last line that
    does not end with a newline: what a run killed while appending leaves. That one is dropped with a warning (see
    `drop_torn_line`)."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines):  # the text does not end with a newline: an append that was cut off
                logger.warning("%s:%d: an incomplete last line (a write that was stopped); ignored.", path, number)
                break
            raise ValueError(f"{path}:{number}: not a JSON line ({error.msg}).") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: a JSON {type(row).__name__}, not an object.")
        for field in required:
            if not isinstance(row.get(field), str):
                raise ValueError(f"{path}:{number}: the field {field!r} must be a string, got {row.get(field)!r}.")
        rows.append(row)
    return rows


def drop_torn_line(path: str | os.PathLike) -> None:
    """Cut an incomplete last line (no final newline) off a JSONL file before appending to it, with a warning, so
    that a new row is not glued to it."""
    path = Path(path)
    if not path.exists():
        return
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return
    keep = data.rfind(b"\n") + 1
    logger.warning("%s: cutting off an incomplete last line (a write that was stopped) before appending.", path)
    with open(path, "r+b") as file:
        file.truncate(keep)
