"""Logging of error bursts: one warning when a run of failures starts, one line when it ends.

Owns `BurstLog` and `ThrottledLog`. A tier that loses its disk or its server fails every page of
every call, and a store holding many damaged values fails verification at every read; logging each
would flood the log and slow the failing path. This module does not count errors for stats
(the stores do).
"""

from __future__ import annotations

import logging
import threading
import time


class BurstLog:
    """``failure(msg)`` logs the first failure of a burst (and a reminder every ``repeat_s``);
    ``success()`` ends the burst with one info line saying how many failures it held."""

    def __init__(self, logger: logging.Logger, what: str, repeat_s: float = 30.0) -> None:
        self._logger = logger
        self._what = what
        self._repeat_s = repeat_s
        self._lock = threading.Lock()
        self._failures = 0
        self._last_log = 0.0

    @property
    def failing(self) -> bool:
        return self._failures > 0

    def failure(self, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._failures += 1
            first = self._failures == 1
            due = first or now - self._last_log >= self._repeat_s
            if due:
                self._last_log = now
            count = self._failures
        if first:
            self._logger.warning("%s failing (its pages are misses, or errors where fail_open=False): %s",
                                 self._what, message)
        elif due:
            self._logger.warning("%s still failing after %d errors: %s", self._what, count, message)

    def success(self) -> None:
        if not self._failures:  # NOTE: unlocked fast path; a racing failure is logged by its own call
            return
        with self._lock:
            count, self._failures = self._failures, 0
        if count:
            self._logger.info("%s working again after %d errors", self._what, count)


class ThrottledLog:
    """``warn(n, detail)`` reports ``n`` values that failed verification: the first at once, then at
    most one line every ``every_s`` seconds with how many failed since the last line."""

    def __init__(self, logger: logging.Logger, what: str, every_s: float = 30.0) -> None:
        self._logger = logger
        self._what = what
        self._every_s = every_s
        self._lock = threading.Lock()
        self._pending = 0
        self._last_log: float | None = None

    def warn(self, n: int, detail: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._pending += n
            if self._last_log is not None and now - self._last_log < self._every_s:
                return
            count, self._pending, first = self._pending, 0, self._last_log is None
            self._last_log = now
        if first:
            self._logger.warning("%s: %d value(s) failed verification (read as misses); first %s", self._what,
                                 count, detail)
        else:
            self._logger.warning("%s: %d more value(s) failed verification (read as misses) since the last "
                                 "report; e.g. %s (reported at most every %.0f s)", self._what, count, detail,
                                 self._every_s)
