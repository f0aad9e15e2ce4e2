"""Run a callable in a forked child so that a crash (SIGSEGV, SIGFPE) or a hang fails one test
instead of killing the test run. Outcome: ("value_error", msg) | ("returned", repr) |
("error", "Type: msg") | ("signal", n) | ("timeout", seconds)."""

from __future__ import annotations

import os
import signal
import time


def run_in_child(fn, timeout: float = 5.0):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            out = fn()
            msg = b"returned\0" + repr(out)[:500].encode()
        except ValueError as e:
            msg = b"value_error\0" + str(e)[:500].encode()
        except BaseException as e:  # any failure is reported to the parent
            msg = b"error\0" + f"{type(e).__name__}: {e}"[:500].encode()
        os.write(w, msg)
        os._exit(0)
    os.close(w)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            return ("timeout", timeout)
        time.sleep(0.01)
    data = os.read(r, 4096)
    os.close(r)
    if os.WIFSIGNALED(status):
        return ("signal", os.WTERMSIG(status))
    kind, _, text = data.partition(b"\0")
    return (kind.decode(), text.decode())
