"""JIT build directories of the C++ libraries: which directory a build uses, and which process may build or
load there.

Owns two rules, used by both builders (`gr_plugin.csrc.build`, `gr_plugin.csrc.core.build`):

- `build_key`: a build directory is keyed by its sources' content *and* by where the build reads them
  from. ``cpp_extension`` writes absolute paths into ``build.ninja`` (the sources, torch's and Python's
  include directories, torch's library directory), and ninja rebuilds everything when a command
  changes: two checkouts (or two spellings of a venv) sharing one directory rebuilt each other's
  library on every switch. Each now has its own directory, and none invalidates another's. Directories
  of old keys are left behind (nothing here knows whether another process still loads from one).
- `build_turn`: hold an ``flock`` of ``<build directory>/build.flock`` around
  ``torch.utils.cpp_extension.load``. The kernel drops an flock when its holder dies, so a killed build
  never blocks a later one. Under it, a ``lock`` file in the directory (``cpp_extension``'s own build
  lock: a plain file that a build killed inside ``load`` leaves behind, and that every later load would
  wait on forever) can only be stale, and is removed with a warning. A wait for another holder is logged
  (a warning), and so is the start of a build of a library not built yet in the directory (info); a
  filesystem without ``flock`` builds without the turn (as before it), with a warning.

Imports only the standard library at import time (`build_key` asks torch, which its callers have loaded).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

logger = logging.getLogger(__name__)


def build_key(files: Iterable[Path]) -> str:
    """``<content>-<location>``: 12 hex digits of the files' bytes (in the order given) and 8 of where a build
    reads them from: the directories holding them (resolved: the builders pass ``cpp_extension`` the
    resolved paths, so a symlinked spelling of a checkout is the same checkout) and the torch and Python
    include directories ``cpp_extension`` puts on its command lines (as it spells them)."""
    from torch.utils.cpp_extension import include_paths

    files = [Path(f).resolve() for f in files]
    content = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:12]
    where = [*sorted({str(f.parent) for f in files}), *include_paths("cpu"),
             str(sysconfig.get_path("include", scheme="posix_prefix"))]
    location = hashlib.sha256("\0".join(where).encode()).hexdigest()[:8]
    return f"{content}-{location}"


@contextlib.contextmanager
def build_turn(directory: Path, library: Path | None = None) -> Iterator[None]:
    """Hold ``directory``'s build flock (waiting for another holder); drop a stale ``cpp_extension`` lock.
    ``library``: the file the build makes; while it is missing, say that a build (a slow one) starts."""
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
            if library is not None and not Path(library).exists():
                logger.info("building %s (not built yet in %s; this takes a while)", Path(library).name, directory)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
