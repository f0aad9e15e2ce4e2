"""Fixtures of the remote-tier tests: a real ``redis-server`` that a test may kill and restart.

``redis_server`` (session) starts ``/usr/bin/redis-server`` on a free port of 127.0.0.1 with no
persistence; ``redis_url`` (per test) makes sure it runs and is empty. A missing ``redis-server``
fails the remote tests with a message instead of skipping them: CI installs it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REDIS_SERVER = "/usr/bin/redis-server"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ping(port: int, timeout_s: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` process on a fixed port: ``kill()`` (SIGKILL, like a crash) and
    ``restart()`` (same port, empty) let a test cut the store's server from under it."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = workdir / "redis.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> None:
        assert not self.alive, "redis-server already running"
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--daemonize", "no", "--dir", str(self.workdir)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not _ping(self.port):
            if self.proc.poll() is not None:
                pytest.fail(f"redis-server exited with {self.proc.returncode}; log:\n{self.log_path.read_text()}")
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"redis-server did not answer PING on port {self.port} within {timeout_s} s")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL the server (a crash: open connections break, nothing is saved)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    binary = REDIS_SERVER if os.path.exists(REDIS_SERVER) else shutil.which("redis-server")
    if binary is None:
        pytest.fail(f"redis-server is not installed (looked for {REDIS_SERVER} and on PATH): the remote-tier "
                    "tests need a real server; install it (apt-get install redis-server)")
    server = RedisServer(binary, tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The server's URL, with the server running and its database empty."""
    if not redis_server.alive:
        redis_server.start()
    with socket.create_connection(("127.0.0.1", redis_server.port), timeout=2) as s:
        s.sendall(b"FLUSHALL\r\n")
        assert s.recv(16).startswith(b"+OK")
    return redis_server.url
