"""Run code as a Hub user would: an isolated interpreter with only the installed packages, none of this project."""

import json
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

# `python -I -S`: no user site, no .pth files (so no editable install of this project), no repository on sys.path;
# only the interpreter's site-packages is added back, and importing this project's modules is made to fail.
PROLOGUE = """
import importlib.abc, json, sys
sys.path.append({site_packages!r})

class RefuseProject(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {{"finetune", "configuration_refusion", "modeling_refusion", "generation_refusion",
                                  "kernels_refusion"}}:
            raise ImportError(f"{{name}} must not be needed by a Hub user")

sys.meta_path.insert(0, RefuseProject())
"""


def run_as_hub_user(code: str, workdir: Path) -> dict:
    """Run `code` (which prints one JSON line last) offline in a fresh folder under `workdir`; return that JSON."""
    elsewhere = workdir / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    script = PROLOGUE.format(site_packages=sysconfig.get_paths()["purelib"]) + textwrap.dedent(code)
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", script],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(workdir / "hf-home"), "PATH": "", "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
