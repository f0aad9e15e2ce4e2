"""The gr_kv library's build directory under concurrent and killed builds (`gr_plugin.csrc.build`).

Each case loads the library in a fresh process (a process loads it once) from a copy of this session's
build directory, so nothing is compiled: the sources and the build's mtimes are unchanged.
"""

from __future__ import annotations

import fcntl
import os
import queue
import shutil
import subprocess
import sys
import threading
import time

import pytest

from gr_plugin.csrc.build import build_directory, load_library

LOAD = "import logging; logging.basicConfig(); from gr_plugin.csrc.build import load_library; print(load_library())"


@pytest.fixture
def build_copy(tmp_path):
    load_library()  # built in this session
    copy = tmp_path / build_directory().name
    shutil.copytree(build_directory(), copy, symlinks=True)  # copy2: mtimes kept, so ninja finds it up to date
    return copy


def _load(build_copy) -> subprocess.Popen:
    env = {**os.environ, "GR_PLUGIN_BUILD_DIR": str(build_copy.parent)}
    return subprocess.Popen([sys.executable, "-c", LOAD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _finish(proc: subprocess.Popen) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def test_a_lock_left_by_a_killed_build_is_removed_not_waited_on(build_copy):
    (build_copy / "lock").touch()  # cpp_extension's build lock, as a SIGKILLed build leaves it
    out, err = _finish(_load(build_copy))  # before: waited on the file forever
    assert out.strip() == str(build_copy / "gr_kv_ops.so")
    assert f"removing {build_copy / 'lock'}" in err
    assert not (build_copy / "lock").exists()


def test_a_live_build_is_waited_for_and_its_lock_left_alone(build_copy):
    (build_copy / "lock").touch()
    with open(build_copy / "build.flock", "a") as held:  # another process building: it holds the flock
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = _load(build_copy)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
        waiting = _first_line(proc, lines, "waiting for")  # the loader reached the flock and waits on it
        assert str(build_copy / "build.flock") in waiting
        time.sleep(0.5)
        assert proc.poll() is None
        assert (build_copy / "lock").exists()  # a live build's lock is not taken from it
        (build_copy / "lock").unlink()  # the build finishes: its lock file goes, then the flock
        fcntl.flock(held, fcntl.LOCK_UN)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.stdout.read().strip() == str(build_copy / "gr_kv_ops.so")
    time.sleep(0.2)  # (the reading thread's last lines)
    assert not any("removing" in line for line in list(lines.queue))


def _first_line(proc: subprocess.Popen, lines: queue.Queue, text: str, timeout: float = 60.0) -> str:
    """The first line holding ``text`` of the child's stderr, which a thread puts into ``lines``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            break
        if text in line:
            return line
    proc.kill()
    raise AssertionError(f"no {text!r} line from the loader in {timeout} s")
