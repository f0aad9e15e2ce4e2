"""The process environment PyTriton's Triton server needs on this stack.

Owns two fixes, applied before PyTriton starts ``tritonserver`` (the server and its Python-backend
stub inherit this process's environment):

- ``LD_LIBRARY_PATH`` starts with the running interpreter's ``LIBDIR``: the stub links
  ``libpython3.11.so`` and would otherwise load an older 3.11 patch from the system and die with
  ``'_thread.RLock' object has no attribute '_recursion_count'``.
- The stub runs in a small venv of its own with numpy 1.x and pyzmq (`ensure_stub_env`): PyTriton
  0.5.5 bundles tritonserver 2.44, whose stub is built with a pybind11 that predates numpy 2's ABI,
  so an output tensor made from a numpy-2 array reaches the client empty ("cannot reshape array of
  size 0"). The stub imports only numpy and pyzmq; this process keeps the project's numpy 2, and
  the two exchange raw bytes, so the versions need not match.

It does not start or configure the server (see `server`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

logger = logging.getLogger(__name__)

STUB_REQUIREMENTS = ("numpy==1.26.4", "pyzmq==27.3.0")
_STAMP = ".gr-stub-stamp"


def default_stub_env() -> Path:
    """``<this interpreter's prefix>/triton-stub`` (inside the project's ``.venv``)."""
    return Path(sys.prefix) / "triton-stub"


def _site_packages(env: Path) -> Path:
    return env / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def stub_env_ready(env: str | Path) -> bool:
    env = Path(env)
    stamp = env / _STAMP
    return (env / "bin" / "python").exists() and stamp.is_file() and stamp.read_text() == "\n".join(STUB_REQUIREMENTS)


def ensure_stub_env(env: str | Path | None = None) -> Path:
    """Create the stub's venv at ``env`` (default `default_stub_env`) unless it is ready; idempotent.

    Installs `STUB_REQUIREMENTS` with this interpreter's pip (the package index it is configured
    with). Raises ``RuntimeError`` with pip's output when the install fails.
    """
    env = Path(env) if env is not None else default_stub_env()
    if stub_env_ready(env):
        return env
    env.parent.mkdir(parents=True, exist_ok=True)
    # NOTE: replicas started together on a fresh machine would otherwise build the same venv at once.
    with open(env.parent / f".{env.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not stub_env_ready(env):
            _create(env)
    return env


def _create(env: Path) -> None:
    logger.warning("creating the Triton Python-backend stub environment at %s (%s); later starts reuse it",
                   env, ", ".join(STUB_REQUIREMENTS))
    # NOTE: same base interpreter as this process: PyTriton picks the stub build for our Python version.
    venv.EnvBuilder(with_pip=False, symlinks=True, clear=env.exists()).create(env)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
           "--target", str(_site_packages(env)), *STUB_REQUIREMENTS]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"could not install {STUB_REQUIREMENTS} into {env}:\n{out.stdout}\n{out.stderr}")
    (env / _STAMP).write_text("\n".join(STUB_REQUIREMENTS))


def prepare_triton_environment(stub_env: str | Path | None = None, *, create: bool = True) -> Path:
    """Apply both fixes to this process (call before PyTriton starts its server); returns the stub env.

    ``create=False`` raises ``FileNotFoundError`` instead of creating a missing stub env.
    """
    env = Path(stub_env) if stub_env else default_stub_env()
    if not stub_env_ready(env):
        if not create:
            raise FileNotFoundError(f"the Triton stub environment {str(env)!r} is missing; create it with "
                                    "`python -m gr_plugin.serving.triton_env`")
        ensure_stub_env(env)
    libdir = sysconfig.get_config_var("LIBDIR")
    current = os.environ.get("LD_LIBRARY_PATH", "")
    if libdir and not current.startswith(libdir + os.pathsep) and current != libdir:
        os.environ["LD_LIBRARY_PATH"] = libdir + (os.pathsep + current if current else "")
    import pytriton.server.triton_server as triton_server

    # NOTE: PyTriton puts `<returned env>/bin` first on the server's PATH, and the stub's embedded
    # interpreter finds its prefix (and site-packages) from the `python3` it sees there.
    triton_server.get_triton_python_backend_python_env = lambda: env
    return env


if __name__ == "__main__":  # python -m gr_plugin.serving.triton_env [PATH]
    logging.basicConfig(level=logging.INFO, force=True)
    logger.info("Triton stub environment ready at %s", ensure_stub_env(sys.argv[1] if len(sys.argv) > 1 else None))
