"""The server's environment fixes: libpython first on LD_LIBRARY_PATH, the stub in a numpy-1 venv."""

from __future__ import annotations

import os
import subprocess
import sysconfig

import pytest
import pytriton.server.triton_server as triton_server

from gr_plugin.serving.triton_env import prepare_triton_environment, stub_env_ready


def test_prepare_sets_the_library_path_and_the_stub_env(monkeypatch, stub_env):
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/other")
    monkeypatch.setattr(triton_server, "get_triton_python_backend_python_env",
                        triton_server.get_triton_python_backend_python_env)  # restored afterwards
    assert prepare_triton_environment(stub_env, create=False) == stub_env
    libdir = sysconfig.get_config_var("LIBDIR")
    assert os.environ["LD_LIBRARY_PATH"].split(os.pathsep) == [libdir, "/opt/other"]
    prepare_triton_environment(stub_env, create=False)  # idempotent: not prepended twice
    assert os.environ["LD_LIBRARY_PATH"].split(os.pathsep) == [libdir, "/opt/other"]
    assert triton_server.get_triton_python_backend_python_env() == stub_env
    out = subprocess.run([str(stub_env / "bin" / "python"), "-c", "import numpy, zmq; print(numpy.__version__)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.startswith("1.")  # what the stub of tritonserver 2.44 can read outputs from


def test_a_missing_stub_env_is_a_clear_error(tmp_path):
    assert not stub_env_ready(tmp_path / "none")
    with pytest.raises(FileNotFoundError, match=r"python -m gr_plugin\.serving\.triton_env"):
        prepare_triton_environment(tmp_path / "none", create=False)
