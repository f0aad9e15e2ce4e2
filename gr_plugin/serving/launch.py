"""`ServerProcess`: a replica (``python -m recipes.serve``) as a child process, for tests, benchmarks
and scripts that start replicas on one machine.

Owns starting it with Hydra overrides and a ready file, waiting until it serves (or failing with
its log when it dies or times out), graceful `stop` (SIGTERM: drain, flush, exit 0) and `kill`.
Ports come from `free_port` (the OS picks). It does not decide the replica's configuration.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port(address: str = "127.0.0.1") -> int:
    """A port the OS considers free on ``address`` now (it may be taken again before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m recipes.serve <overrides>`` with fresh loopback ports; `start` waits for its
    ready file. ``info`` then holds its endpoints (``http``, ``grpc``, ``metrics``, ...)."""

    def __init__(self, overrides: list[str], workdir: str | Path, *, name: str = "replica",
                 cwd: str | Path = REPO_ROOT, env: dict[str, str] | None = None) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.ready_file = self.workdir / f"{name}.ready.json"
        self.log_path = self.workdir / f"{name}.log"
        self.ports = {k: free_port() for k in ("http", "grpc", "triton_metrics", "metrics")}
        self.cmd = [sys.executable, "-m", "recipes.serve", *overrides,
                    f"triton.http_port={self.ports['http']}", f"triton.grpc_port={self.ports['grpc']}",
                    f"triton.metrics_port={self.ports['triton_metrics']}", f"metrics_port={self.ports['metrics']}",
                    f"triton.workspace_dir={self.workdir / 'pytriton'}", f"ready_file={self.ready_file}",
                    f"hydra.run.dir={self.workdir / ('hydra-' + name)}"]
        self.cwd = Path(cwd)
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.info: dict[str, Any] = {}

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def launch(self) -> ServerProcess:
        """Start the process and return at once (see `wait_ready`)."""
        self.ready_file.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=self.cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> ServerProcess:
        """Wait for the ready file; raises with the log's tail if the process dies or times out."""
        deadline = time.monotonic() + timeout_s
        while not self.ready_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before serving; log tail:\n"
                                   f"{self.log()[-4000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"{self.name} did not serve within {timeout_s} s; log tail:\n{self.log()[-4000:]}")
            time.sleep(0.1)
        self.info = json.loads(self.ready_file.read_text())
        logger.info("%s serving: %s", self.name, self.info)
        return self

    def start(self, timeout_s: float = 120.0) -> ServerProcess:
        return self.launch().wait_ready(timeout_s)

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM and wait (graceful: drain, flush); kills it after ``timeout_s``. Returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop within %s s; killing it", self.name, timeout_s)
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
