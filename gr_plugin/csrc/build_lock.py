"""Turns on a JIT build directory: which process may build or load the C++ libraries built there.

Owns one rule, used by both builders (`gr_plugin.csrc.build`, `gr_plugin.csrc.core.build`): hold an
``flock`` of ``<build directory>/build.flock`` around ``torch.utils.cpp_extension.load``. The kernel
drops an flock when its holder dies, so a killed build never blocks a later one. Under it, a ``lock``
file in the directory (``cpp_extension``'s own build lock: a plain file that a build killed inside
``load`` leaves behind, and that every later load would wait on forever) can only be stale, and is
removed with a warning. A wait for another holder is logged; a filesystem without ``flock`` builds
without the turn (as before it), with a warning. Imports only the standard library.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def build_turn(directory: Path) -> Iterator[None]:
    """Hold ``directory``'s build flock (waiting for another holder); drop a stale ``cpp_extension`` lock."""
    path = Path(directory) / "build.flock"
    with open(path, "a") as f:
        try:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                logger.warning("waiting for %s: another process is building or loading this library", path)
                fcntl.flock(f, fcntl.LOCK_EX)
        except OSError as e:  # (no flock on this filesystem: build as cpp_extension alone would)
            logger.warning("cannot lock %s (%s): building without it; a killed build may leave %s behind",
                           path, e, Path(directory) / "lock")
            yield
            return
        try:
            stale = Path(directory) / "lock"  # cpp_extension's FileBaton; its holder died (we hold the flock)
            if stale.exists():
                logger.warning("removing %s, a build lock left by a build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
