"""Serving fixtures: a tiny checkpoint (session) and the Triton stub environment."""

from __future__ import annotations

import pytest

from gr_plugin.serving.triton_env import ensure_stub_env
from tests.serving.helpers import save_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("serve-ckpt") / "tiny.ckpt")


@pytest.fixture(scope="session")
def stub_env():
    """The Triton stub's venv (created once if missing; `scripts/setup.sh` normally makes it)."""
    return ensure_stub_env()
