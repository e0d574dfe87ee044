"""`scripts/serve.sh` stops at bad input and at a failed export with one line that says what to do, before vLLM.

No vLLM here: the script runs against a stand-in for vLLM's environment (`REFUSION_VLLM_ENV`) whose stamps say it is
built and whose `python` records a vLLM start instead of starting one, with a `python3` first on PATH that refuses to
build an environment. Each run takes a fraction of a second; the only port opened is one on 127.0.0.1.
"""

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from serving.client import ROOT, SERVE, free_port


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def checkpoint(folder: Path, config: dict | str | None) -> Path:
    """A folder with `config` as its config.json (a string: written as it is; None: no config.json)."""
    folder.mkdir(parents=True)
    if config is not None:
        text = config if isinstance(config, str) else json.dumps(config)
        (folder / "config.json").write_text(text)
    return folder


@dataclass
class StandIn:
    root: Path
    environment: dict

    @property
    def vllm_log(self) -> Path:
        return self.root / "vllm-started"

    def run(self, *args: str, **environment: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(SERVE), *args],
            cwd=self.root,
            env={**self.environment, **environment},
            capture_output=True,
            text=True,
            timeout=120,
        )

    def vllm_args(self) -> list[str] | None:
        """What the stand-in vLLM was started with, or None when the script never started it."""
        return self.vllm_log.read_text().splitlines() if self.vllm_log.exists() else None


@pytest.fixture
def stand_in(tmp_path) -> StandIn:
    real = sys.executable
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    # The stamps serve.sh writes after a build, computed the way it computes them: the environment counts as built.
    stamps = {
        ".refusion-pins": 'sha256sum < "$1/serving/requirements-vllm.txt"',
        ".refusion-plugin": 'cd "$1"/serving/refusion_vllm && cat pyproject.toml refusion_vllm/*.py | sha256sum',
    }
    for name, command in stamps.items():
        digest = subprocess.run(["bash", "-c", command, "_", str(ROOT)], capture_output=True, text=True, check=True)
        (venv / name).write_text(digest.stdout)
    log = tmp_path / "vllm-started"
    executable(
        venv / "bin" / "python",
        f"""#!/usr/bin/env bash
if [[ "$1" == -m && "$2" == vllm.* ]]; then shift 2; printf '%s\\n' "$@" > "{log}"; exit 0; fi
if [[ "$1" == -m && "$2" == refusion_vllm.* ]]; then echo "$3-drafter"; exit 0; fi
exec "{real}" "$@"
""",
    )
    executable(venv / "bin" / "pip", '#!/usr/bin/env bash\necho "test: serve.sh ran pip $*" >&2\nexit 97\n')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    executable(
        bin_dir / "python3",
        f"""#!/usr/bin/env bash
if [[ "$1" == -m && "$2" == venv ]]; then echo "test: serve.sh tried to build vLLM's environment" >&2; exit 97; fi
exec "{real}" "$@"
""",
    )
    # An interpreter without this package's requirements: no site-packages (-S), no PYTHONPATH (-E).
    without = executable(bin_dir / "python-without-package", f'#!/usr/bin/env bash\nexec "{real}" -E -S "$@"\n')
    environment = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
    environment.update(
        PATH=f"{bin_dir}{os.pathsep}{environment.get('PATH', '')}",
        REFUSION_VLLM_ENV=str(venv),
        PYTHON=str(without),  # any export a test did not mean to reach fails at once instead of loading a model
    )
    return StandIn(tmp_path, environment)


def one_line(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, f"not one line on stderr (status {result.returncode}):\n{result.stderr}"
    assert lines[0].startswith("serve.sh: "), lines[0]
    return lines[0]


NATIVE = {"model_type": "llama", "mask_token_id": 7}

BAD_INPUT = {  # name: (folders to make: {name: config}, arguments, what the line says)
    "vLLM option before --": ({"model": NATIVE}, ["--max-model-len", "64", "model"], ["--max-model-len", "after --"]),
    "unknown option": ({}, ["--prot", "8001"], ["unknown option --prot", "--port N"]),
    "option without its value": ({}, ["--port"], ["--port needs a value"]),
    "port not a number": ({"model": NATIVE}, ["--port", "80a", "model"], ["--port takes a port number", "'80a'"]),
    "port out of range": ({"model": NATIVE}, ["--port", "70000", "model"], ["from 1 to 65535"]),
    "drafts not a number": ({"model": NATIVE}, ["--drafts", "two", "model"], ["--drafts takes a number", "'two'"]),
    "two folders": ({"a": NATIVE, "b": NATIVE}, ["a", "b"], ["one MODEL_DIR only", "'a'", "'b'"]),
    "no such folder": ({}, ["no-such-owner/no-such-model"], ["no folder 'no-such-owner/no-such-model'", "hf download"]),
    "folder without config.json": ({"weights": None}, ["weights"], ["'weights' holds no config.json"]),
    "config.json not JSON": ({"broken": "{not json"}, ["broken"], ["broken/config.json is not a checkpoint's config"]),
    "drafts without a mask token": (
        {"plain": {"model_type": "llama"}},
        ["--drafts", "2", "plain"],
        ["--drafts needs a ReFusion checkpoint", "mask_token_id"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_gets_one_line_and_stops_before_anything_is_built(stand_in, case):
    folders, args, says = BAD_INPUT[case]
    for name, config in folders.items():
        checkpoint(stand_in.root / name, config)
    result = stand_in.run(*args)
    line = one_line(result)
    assert result.returncode == 2, line
    for words in says:
        assert words in line
    assert stand_in.vllm_args() is None


def test_port_in_use_gets_one_line(stand_in):
    model = checkpoint(stand_in.root / "model", NATIVE)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        result = stand_in.run("--port", str(port), str(model))
    line = one_line(result)
    assert result.returncode == 2, line
    assert f"port {port} on 127.0.0.1 is in use" in line and "--port N" in line
    assert stand_in.vllm_args() is None


def test_failed_export_stops_with_its_error_and_the_next_step(stand_in):
    """The issue's bug: under a Python without this package the export failed, the script went on, and minutes
    later vLLM looked the folder that was never written up on the Hub."""
    source = checkpoint(stand_in.root / "refusion-model", {"model_type": "refusion"})
    result = stand_in.run(str(source))
    assert result.returncode == 1, result.stderr
    assert "ModuleNotFoundError: No module named" in result.stderr  # the export's own error, as it printed it
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("serve.sh: the export failed (ModuleNotFoundError: No module named"), last
    assert "pip install -e '.'" in last and "set PYTHON" in last
    assert "building vLLM's environment" not in result.stderr
    assert stand_in.vllm_args() is None
    assert not (stand_in.root / "refusion-model-native").exists()


def test_python_that_is_not_there_stops_the_export(stand_in):
    source = checkpoint(stand_in.root / "refusion-model", {"model_type": "refusion"})
    result = stand_in.run(str(source), PYTHON=str(stand_in.root / "no-such-python"))
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("serve.sh: the export failed") and "is no interpreter here" in last, last
    assert stand_in.vllm_args() is None


def test_native_folder_is_served_as_it_is_with_vllm_arguments_after_the_separator(stand_in):
    model = checkpoint(stand_in.root / "model", NATIVE)
    port = free_port()
    result = stand_in.run("--port", str(port), "--drafts", "3", str(model), "--", "--max-model-len", "64")
    assert result.returncode == 0, result.stderr
    args = stand_in.vllm_args()
    assert args[:4] == ["--model", str(model), "--host", "127.0.0.1"]
    assert args[args.index("--port") + 1] == str(port)
    assert f"{model}-drafter" in args[args.index("--speculative-config") + 1]
    assert args[-2:] == ["--max-model-len", "64"]


def test_refusion_folder_is_exported_beside_it_then_served(stand_in):
    """A stand-in export (the real one loads the model) that writes the native folder: the script serves it."""
    source = checkpoint(stand_in.root / "refusion-model", {"model_type": "refusion"})
    export = executable(
        stand_in.root / "bin" / "python-exporting",
        f"""#!{sys.executable}
import json, pathlib, sys
args = sys.argv[1:]
assert args[:2] == ["-m", "serving.export"], args
target = pathlib.Path(args[args.index("--output_dir") + 1])
target.mkdir()
(target / "config.json").write_text(json.dumps({json.dumps(NATIVE)}))
""",
    )
    result = stand_in.run("--setup", str(source), PYTHON=str(export))
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"serve.sh: ready to serve {source}-native"
    assert stand_in.vllm_args() is None
    result = stand_in.run("--port", str(free_port()), str(source), PYTHON=str(stand_in.root / "no-such-python"))
    assert result.returncode == 0, result.stderr  # exported already: no export, no PYTHON needed
    assert stand_in.vllm_args()[:2] == ["--model", f"{source}-native"]


def test_an_environment_folder_the_script_did_not_build_is_never_removed(stand_in):
    model = checkpoint(stand_in.root / "model", NATIVE)
    mine = stand_in.root / "my-env"
    (mine / "bin").mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    result = stand_in.run("--setup", str(model), REFUSION_VLLM_ENV=str(mine))
    line = one_line(result)
    assert result.returncode == 2, line
    assert f"REFUSION_VLLM_ENV={mine} holds files this script did not put there" in line
    assert (mine / "notes.txt").read_text() == "mine" and (mine / "bin").is_dir()

    # A folder it built (its mark) or an empty one is built again: the stand-in python3 refuses to build here.
    for folder in (stand_in.root / "empty-env", stand_in.root / "built-env"):
        folder.mkdir()
    (stand_in.root / "built-env" / ".refusion-vllm-env").touch()
    for folder in (stand_in.root / "empty-env", stand_in.root / "built-env"):
        result = stand_in.run("--setup", str(model), REFUSION_VLLM_ENV=str(folder))
        assert "tried to build vLLM's environment" in result.stderr, result.stderr
