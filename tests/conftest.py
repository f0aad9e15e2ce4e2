"""Shared pytest setup: markers for slow and GPU tests."""

from __future__ import annotations

import os

import pytest
import torch

# NOTE: without a GPU the Triton kernels run in Triton's interpreter (set before triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_slow = config.getoption("--run-slow") or os.environ.get("GR_RUN_SLOW") == "1"
    has_gpu = torch.cuda.is_available()
    skip_slow = pytest.mark.skip(reason="slow: pass --run-slow (or GR_RUN_SLOW=1)")
    skip_gpu = pytest.mark.skip(reason="gpu: no CUDA device here")
    for item in items:
        if item.get_closest_marker("slow") and not run_slow:
            item.add_marker(skip_slow)
        if item.get_closest_marker("gpu") and not has_gpu:
            item.add_marker(skip_gpu)


# A real redis-server for the remote-tier tests (started on a free loopback port).
from tests.redis_server import redis_server, redis_url  # noqa: E402, F401
