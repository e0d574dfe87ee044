"""A vLLM server started by `scripts/serve.sh` and the few OpenAI-API calls the tests and the benchmark make.

Standard library only (urllib), loopback only. The server runs in its own process group and is stopped by that
group's id, so that the engine processes vLLM spawns stop with it.
"""

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVE = ROOT / "scripts" / "serve.sh"
SHIPPED_NATIVE = ROOT / "outputs" / "refusion-smollm2-native"


class HTTPError(RuntimeError):
    """A non-2xx answer: its status code and the server's message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def request(url: str, payload: dict | None = None, timeout: float = 120.0) -> dict | str:
    """POST `payload` as JSON (GET when None); the decoded JSON answer (text when not JSON)."""
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=timeout) as response:
            body = response.read().decode()
    except urllib.error.HTTPError as error:
        raise HTTPError(error.code, error.read().decode(errors="replace")) from None
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        return body


def stream(url: str, payload: dict, timeout: float = 120.0) -> Iterator[dict]:
    """POST `payload` with `stream: true` and yield each server-sent event's JSON until `[DONE]`."""
    data = json.dumps({**payload, "stream": True}).encode()
    headers = {"Content-Type": "application/json"}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=timeout) as response:
            for line in response:
                line = line.decode().strip()
                if not line.startswith("data:"):
                    continue
                body = line[len("data:") :].strip()
                if body == "[DONE]":
                    return
                yield json.loads(body)
    except urllib.error.HTTPError as error:
        raise HTTPError(error.code, error.read().decode(errors="replace")) from None


@dataclass
class Server:
    """`scripts/serve.sh` as a child process: `start()` waits until `/health` answers, `stop()` ends it."""

    model_dir: Path | None = None  # None: the shipped model
    drafts: int = 0
    vllm_args: Sequence[str] = ()
    log_path: Path = Path("serve.log")
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model(self) -> str:
        """The served model name: the name of the folder vLLM loads."""
        return (self.model_dir or SHIPPED_NATIVE).name

    def command(self) -> list[str]:
        command = ["bash", str(SERVE), "--port", str(self.port)]
        if self.drafts:
            command += ["--drafts", str(self.drafts)]
        if self.model_dir is not None:
            command.append(str(self.model_dir))
        return [*command, "--", *self.vllm_args]

    def start(self, timeout: float = 900.0) -> "Server":
        """Start the server (its own process group) and wait for `/health`; raise with the log's tail if it dies
        or does not answer within `timeout` seconds."""
        log = open(self.log_path, "w")  # noqa: SIM115 - the child writes it for its whole life
        self.process = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                request(f"{self.url}/health", timeout=5)
                return self
            except (OSError, HTTPError):
                time.sleep(2)
        self.stop()
        raise TimeoutError(f"vLLM did not answer within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL if it is still there after 30 s."""
        if self.process is None or self.process.poll() is not None:
            return
        for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.process.pid, sig)
                self.process.wait(grace)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *_) -> None:
        self.stop()

    def chat(self, messages: str | list[dict], max_tokens: int = 32, **extra) -> dict:
        """A greedy chat completion (a string is one user turn), with the prompt's and the answer's token ids."""
        return request(f"{self.url}/v1/chat/completions", self.chat_payload(messages, max_tokens, **extra))

    def chat_stream(self, messages: str | list[dict], max_tokens: int = 32, **extra) -> Iterator[dict]:
        return stream(f"{self.url}/v1/chat/completions", self.chat_payload(messages, max_tokens, **extra))

    def chat_payload(self, messages: str | list[dict], max_tokens: int, **extra) -> dict:
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        payload = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
        return {**payload, "return_token_ids": True, **extra}

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus counters and gauges (`name{labels}` -> value), histograms' `_sum`/`_count`."""
        values = {}
        for line in str(request(f"{self.url}/metrics")).splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                try:
                    values[name] = float(value)
                except ValueError:
                    continue
        return values
