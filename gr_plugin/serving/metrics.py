"""The replica's own Prometheus endpoint: serving counters and the KV cache's counters as text.

Owns the exposition (`render_prometheus`: ``gr_serve_*`` from `ServingCounters`, ``gr_kvcache_*``
from the cache's ``stats()``, counters suffixed ``_total``, state as gauges, plus
``gr_kvcache_tokens_reused_tier_total{tier=...}``: reused history tokens per tier), its parser for
clients (`parse_prometheus`), the per-tier split (`tier_tokens`) and `MetricsServer`, a small HTTP
server answering ``GET /metrics``. Triton's own endpoint (``nv_inference_*``: request counts,
queue and compute time per model) runs beside it on Triton's metrics port; Prometheus scrapes both.
It does not compute any statistic of its own.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TIERS = ("device", "host", "ssd", "remote")
# NOTE: the cache's stats() mixes counters and current state; these (and the suffix rules in
# `_is_gauge`) are the state.
_GAUGES = frozenset({"hit_rate", "device_users", "device_pages_free", "device_pages_used", "host_users",
                     "ssd_users", "ssd_pages_stored", "ssd_queued", "page_size"})
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def _is_gauge(name: str) -> bool:
    return name in _GAUGES or name.endswith(("_in_flight", "_max", "_failing")) or "_slot" in name


def tier_tokens(stats: Mapping[str, float]) -> dict[str, float]:
    """Reused history tokens per tier from cache counters (tokens a step read from SSD / Redis
    into the host tier and onboarded are in the host tier's count too, so they are taken out of it)."""
    ssd = stats.get("tokens_reused_ssd", 0)
    remote = stats.get("tokens_reused_remote", 0)
    return {"device": stats.get("tokens_reused_device", 0), "host": stats.get("tokens_reused_host", 0) - ssd - remote,
            "ssd": ssd, "remote": remote}


def _fmt(v: float) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("+Inf" if v > 0 else "-Inf")
    return repr(v) if isinstance(v, float) else str(int(v))


def _escape(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: Mapping[str, str], **extra: str) -> str:
    items = {**labels, **extra}
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in items.items()) + "}" if items else ""


def render_prometheus(stats: Mapping[str, Mapping[str, Any]], labels: Mapping[str, str] | None = None) -> str:
    """Prometheus text exposition of ``{"serve": counters, "kvcache": cache stats}`` (either may be
    missing); non-numeric values (paths, URLs) are left out."""
    labels = dict(labels or {})
    lines: list[str] = []

    def emit(name: str, kind: str, value: float, **extra: str) -> None:
        lines.append(f"# TYPE {name} {kind}")
        lines.append(f"{name}{_labels(labels, **extra)} {_fmt(value)}")

    for key, value in (stats.get("serve") or {}).items():
        emit(f"gr_serve_{key}_total", "counter", value)
    cache = stats.get("kvcache")
    if cache:
        for key, value in cache.items():
            if not isinstance(value, int | float):
                continue
            if _is_gauge(key):
                emit(f"gr_kvcache_{key}", "gauge", value)
            else:
                emit(f"gr_kvcache_{key}_total", "counter", value)
        name = "gr_kvcache_tokens_reused_tier_total"
        lines.append(f"# TYPE {name} counter")
        for tier, value in tier_tokens(cache).items():
            lines.append(f"{name}{_labels(labels, tier=tier)} {_fmt(value)}")
    return "\n".join(lines) + "\n"


def parse_prometheus(text: str, prefix: str = "") -> dict[str, float]:
    """``{metric name (labels dropped, ``_total`` kept): value}`` of the samples whose name starts
    with ``prefix``; samples of one name with different labels are summed."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line.strip())
        if m is None or not m.group(1).startswith(prefix):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


def cache_counters(text: str) -> dict[str, float]:
    """The ``gr_kvcache_*`` samples of an exposition, keyed as in the cache's ``stats()``."""
    out = {}
    for name, value in parse_prometheus(text, "gr_kvcache_").items():
        key = name[len("gr_kvcache_"):]
        if key == "tokens_reused_tier_total":
            continue
        out[key[: -len("_total")] if key.endswith("_total") else key] = value
    return out


class MetricsServer:
    """``GET /metrics`` on ``address:port`` (port 0: the OS picks; see `port`), in a daemon thread."""

    def __init__(self, stats_fn: Callable[[], Mapping[str, Any]], address: str = "127.0.0.1", port: int = 0,
                 labels: Mapping[str, str] | None = None) -> None:
        render = lambda: render_prometheus(stats_fn(), labels)  # noqa: E731

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served here")
                    return
                body = render().encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt: str, *args: Any) -> None:
                logger.debug("metrics: " + fmt, *args)

        self._httpd = ThreadingHTTPServer((address, port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="gr-metrics", daemon=True)

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(timeout=5)
        self._httpd.server_close()
