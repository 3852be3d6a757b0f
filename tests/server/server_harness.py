"""A real `pagellm serve` process on a free loopback port, and small helpers to talk to it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

STARTUP_TIMEOUT = 240  # seconds: imports + loading the embedded model, on a busy 2-core machine
BASE_ARGS = ["--kv-cache-memory", "0.25", "--max-model-len", "256"]
# The embedded model is a base model with no template of its own, and chat without one is a 400
# (test_chat_page.py checks that): the chat tests talk to it in Gemma's turn format, built in
GEMMA_CHAT = ["--chat-template", "gemma"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], log_dir: Path, api_key: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.stdout_path, self.stderr_path = log_dir / "stdout.log", log_dir / "stderr.log"
        cmd = [sys.executable, "-m", "pagellm.cli", "serve", "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=Path(__file__).parents[2],
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.health_statuses: list[int] = []  # every /health answer seen while starting

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} while starting:\n{self.stderr()}")
            try:
                status = httpx.get(self.url + "/health", timeout=5).status_code
            except httpx.TransportError:
                status = None
            if status is not None:
                self.health_statuses.append(status)
                if status == 200:
                    return
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT} s:\n{self.stderr()}")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        """The un-labelled pagellm: samples of /metrics."""
        text = httpx.get(self.url + "/metrics", headers=self.headers(), timeout=10).text
        values = {}
        for line in text.splitlines():
            if line.startswith("pagellm:") and "{" not in line:
                name, value = line.rsplit(" ", 1)
                values[name.removeprefix("pagellm:")] = float(value)
        return values

    def wait_for_metrics(self, predicate, timeout: float = 60.0) -> dict[str, float]:
        """Poll /metrics until predicate(metrics) holds; the last metrics either way."""
        deadline = time.monotonic() + timeout
        while True:
            metrics = self.metrics()
            if predicate(metrics) or time.monotonic() > deadline:
                return metrics
            time.sleep(0.1)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float = 60.0) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def start_server(args: list[str], log_dir: Path, api_key: str | None = None) -> ServerProcess:
    server = ServerProcess(args, log_dir, api_key)
    try:
        server.wait_ready()
    except BaseException:
        server.kill()
        raise
    return server


def stop_with(server: ServerProcess, sig: int) -> None:
    """End the server with sig; it must exit 0 without a traceback."""
    if server.proc.poll() is None:
        server.signal(sig)
        try:
            server.wait_exit(60)
        finally:
            server.kill()
    assert server.proc.returncode == 0, server.stderr()
    assert "Traceback" not in server.stderr(), server.stderr()


def sse_events(lines) -> list:
    """The JSON payloads (and the final "[DONE]") of a server-sent-event stream's lines."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events
