"""Tier configuration in FlexKV's user-facing form.

Owns `TierConfig` (the sizes, places and policies of the host, SSD and remote tiers),
`load_tier_config` (a YAML file or a mapping, unknown keys rejected), `tier_keys` (the keys such a source
names: what it overrides), `tier_config_to_yaml` and `redact` (a URL's password hidden, for logs and files).
FlexKV's keys keep their meaning: ``cpu_cache_gb``, ``ssd_cache_gb``, ``ssd_cache_dir``,
``enable_3rd_remote``. FlexKV names the remote address differently across versions and
deployments; ``remote_url`` is this project's name, and ``remote_cache_address`` (``host:port`` or a
URL) or ``redis_host`` + ``redis_port`` (+ ``redis_db``) are accepted as aliases for it. Sizes in GB
are GiB (2**30 bytes). It builds no store and imports no torch; ``omegaconf`` is imported only
to read or write YAML.
"""

from __future__ import annotations

import dataclasses
import os
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any

WRITE_POLICIES = ("write_through", "on_evict")
_O_DIRECT = {"auto": "auto", "true": True, "on": True, "false": False, "off": False}
_ALIASES = ("remote_cache_address", "redis_host", "redis_port", "redis_db")
_GIB = 1 << 30
# NOTE: Redis takes a key's expiry as a 64-bit count of ms from now; a TTL past it makes every SET fail.
MAX_TTL_S = 2**31 - 1  # (68 years)
_CREDENTIALS = re.compile(r"(?<=://)[^@/\s]*@")


def _url_problem(url: str) -> str | None:
    """What is wrong with a redis:// / rediss:// URL's port or database that the client would not say
    until it connects, or ignores (``/abc`` as the database: the client silently uses 0); None: nothing.
    As the client reads them: a ``?db=`` beats the path, the path is %-decoded. Names no part of the URL
    (an unencoded ``/`` in a password puts it where the port or path would be)."""
    if url.startswith("unix://"):
        return None
    parts = urllib.parse.urlparse(url)
    try:
        parts.port  # noqa: B018 - (the property raises for a port out of range or not a number)
    except ValueError:
        return "the port must be a number in [0, 65535]"
    query = urllib.parse.parse_qs(parts.query).get("db", [])
    values = query or ([db] if (db := urllib.parse.unquote(parts.path).strip("/")) else [])
    if any(not v.isdigit() for v in values):
        return "the database (its path, or ?db=) must be a number"
    return None


def _shown_url(url: str) -> str:
    """``url`` for an error message: `redact`'s form, or, where a password could not be told apart (an
    unencoded ``/`` or ``@`` in it), only what follows the last ``@``."""
    shown = redact(url)
    if "@" in shown and "***@" not in shown:
        scheme, _, rest = url.partition("://")
        shown = f"{scheme}://***@{rest.rpartition('@')[2]}"
    return shown


def redact(value: Any) -> Any:
    """``value`` with the credentials of every URL in it (``scheme://user:password@host``) shown as ``***@``;
    mappings and lists are walked, other values returned as they are. Logs and result files hold this,
    never a password."""
    if isinstance(value, str):
        return _CREDENTIALS.sub("***@", value)
    if isinstance(value, Mapping):
        return {k: redact(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redact(v) for v in value)
    return value


@dataclasses.dataclass
class TierConfig:
    """Sizes and policies of the tiers below the device pages.

    ``cpu_cache_gb``: pinned host tier. ``ssd_cache_gb`` (0: no SSD tier) in ``ssd_cache_dir``
    (FlexKV allows several directories joined by ``;``; see `ssd_cache_dirs`). ``enable_3rd_remote``:
    a Redis/Valkey tier at ``remote_url``. ``ssd_num_threads``, ``ssd_o_direct`` (``"auto"``,
    ``True``/``False`` or ``"true"``/``"false"``): SSD I/O. ``write_policy``: ``"write_through"``
    (host → SSD on every commit) or ``"on_evict"`` (host → SSD when the host tier evicts).
    ``remote_write_through``: pages also go to the remote tier as they are written to SSD.
    ``fail_open``: a failing lower tier turns into misses instead of errors (`TieredBackend`); with
    False, a remote tier that a lookup has to ask and cannot reach (down, backing off after an error,
    or refusing), or that stops answering a read task, is an error (``TierReadError``, from the lookup
    or the allocate), not a miss; a missing or corrupt page is a miss either way. ``task_timeout_s``: the
    longest a caller waits for a lower-tier transfer before treating it as a miss. ``remote_ttl_s``
    (None: never): a remote page expires this many seconds after it was last written, read or
    renewed, so the pages of namespaces no longer read (older weights) leave a shared server. A
    replica serving a user from its device, host or SSD tier reads nothing from Redis; it renews the
    pages a lookup finds there instead (`TieredBackend`, in the background: all of them at most once a
    quarter of the TTL per user), so a page outlives the last lookup that found it, on any replica, by
    at least 3/4 of the TTL while the server is reachable. Needs Redis >= 6.2 (reads renew the TTL through GETEX).
    """

    cpu_cache_gb: float = 1.0
    ssd_cache_gb: float = 0.0
    ssd_cache_dir: str = ""
    enable_3rd_remote: bool = False
    remote_url: str = "redis://127.0.0.1:6379/0"
    ssd_num_threads: int = 4
    # NOTE: typed Any because OmegaConf has no str|bool union; normalized to "auto", True or False.
    ssd_o_direct: Any = "auto"
    write_policy: str = "write_through"
    remote_write_through: bool = True
    fail_open: bool = True
    task_timeout_s: float = 2.0
    remote_ttl_s: int | None = None

    def __post_init__(self) -> None:
        for name in ("cpu_cache_gb", "ssd_cache_gb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0 or value == float("inf"):
                raise ValueError(f"TierConfig.{name} must be a finite number >= 0, got {value!r}")
            setattr(self, name, float(value))
        if not isinstance(self.ssd_cache_dir, str):
            raise ValueError(f"TierConfig.ssd_cache_dir must be a str, got {self.ssd_cache_dir!r}")
        if self.ssd_cache_gb > 0 and not self.ssd_cache_dirs:
            raise ValueError(f"TierConfig.ssd_cache_dir must be set when ssd_cache_gb={self.ssd_cache_gb} > 0, "
                             f"got {self.ssd_cache_dir!r}")
        for name in ("enable_3rd_remote", "remote_write_through", "fail_open"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"TierConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.remote_url, str) or not self.remote_url.startswith(("redis://", "rediss://",
                                                                                     "unix://")):
            raise ValueError(f"TierConfig.remote_url must be a redis://, rediss:// or unix:// URL, "
                             f"got {redact(self.remote_url)!r}")
        why = _url_problem(self.remote_url)
        if why is not None:
            raise ValueError(f"TierConfig.remote_url {_shown_url(self.remote_url)!r}: {why}")
        n = self.ssd_num_threads
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 256:
            raise ValueError(f"TierConfig.ssd_num_threads must be an int in [1, 256], got {n!r}")
        od = self.ssd_o_direct
        if isinstance(od, bool):
            pass
        elif isinstance(od, str) and od.lower() in _O_DIRECT:
            self.ssd_o_direct = _O_DIRECT[od.lower()]
        else:
            raise ValueError(f"TierConfig.ssd_o_direct must be 'auto', true or false, got {od!r}")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"TierConfig.write_policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}")
        t = self.task_timeout_s
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t < float("inf"):
            raise ValueError(f"TierConfig.task_timeout_s must be a number > 0, got {t!r}")
        self.task_timeout_s = float(t)
        ttl = self.remote_ttl_s
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or not 0 < ttl <= MAX_TTL_S):
            raise ValueError(f"TierConfig.remote_ttl_s must be an int in [1, {MAX_TTL_S}] (seconds) or None, "
                             f"got {ttl!r}")

    @property
    def cpu_cache_bytes(self) -> int:
        return int(self.cpu_cache_gb * _GIB)

    @property
    def ssd_cache_bytes(self) -> int:
        return int(self.ssd_cache_gb * _GIB)

    @property
    def ssd_cache_dirs(self) -> list[str]:
        """``ssd_cache_dir`` split on ``;`` (FlexKV's way to spread slabs over several SSDs)."""
        return [d.strip() for d in self.ssd_cache_dir.split(";") if d.strip()]

    @property
    def ssd_enabled(self) -> bool:
        return self.ssd_cache_gb > 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _remote_url_from_aliases(raw: dict[str, Any]) -> str | None:
    """``remote_url`` spelled through an alias (removed from ``raw``), or None if none is used."""
    address = raw.pop("remote_cache_address", None)
    host = raw.pop("redis_host", None)
    port = raw.pop("redis_port", None)
    db = raw.pop("redis_db", None)
    if address is not None and (host is not None or port is not None):
        raise ValueError(f"tier config: give remote_cache_address={redact(address)!r} or redis_host/redis_port, "
                         "not both")
    if isinstance(address, str) and "://" in address and db is not None:
        raise ValueError(f"tier config: remote_cache_address={redact(address)!r} is a URL (its path names the "
                         f"database): redis_db={db!r} would be ignored; give one")
    if address is not None:
        if not isinstance(address, str) or not address:
            raise ValueError(f"tier config: remote_cache_address must be 'host:port' or a URL, got {redact(address)!r}")
        if "://" in address:
            return address
        host, _, port_text = address.rpartition(":")
        if not host or not port_text.isdigit():
            raise ValueError(f"tier config: remote_cache_address must be 'host:port' or a URL, got {redact(address)!r}")
        port = int(port_text)
    elif host is None:
        if port is not None or db is not None:
            raise ValueError(f"tier config: redis_port={port!r} / redis_db={db!r} need redis_host")
        return None
    if not isinstance(host, str) or not host:
        raise ValueError(f"tier config: redis_host must be a host name, got {host!r}")
    port = 6379 if port is None else port
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"tier config: redis_port must be a port number, got {port!r}")
    db = 0 if db is None else db
    if isinstance(db, bool) or not isinstance(db, int) or db < 0:
        raise ValueError(f"tier config: redis_db must be an int >= 0, got {db!r}")
    return f"redis://{host}:{port}/{db}"


def load_tier_config(source: str | os.PathLike | Mapping[str, Any] | TierConfig) -> TierConfig:
    """A `TierConfig` from a YAML file path or a mapping (a dict or an OmegaConf ``DictConfig``); the
    keys it does not name take their defaults.

    Unknown keys raise `ValueError` naming them; aliases of ``remote_url`` are resolved (giving an
    alias and a different ``remote_url`` is an error).
    """
    if isinstance(source, TierConfig):
        return source
    return TierConfig(**tier_keys(source))


def tier_keys(source: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """The `TierConfig` fields a YAML file path or a mapping names, as `load_tier_config` reads them (aliases
    resolved, unknown keys refused), without the defaults of those it does not name: what it overrides."""
    if isinstance(source, str | os.PathLike):
        import yaml
        from omegaconf import OmegaConf

        try:
            node = OmegaConf.load(source)
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"tier config file {str(source)!r} cannot be read: {exc}") from exc
        raw = OmegaConf.to_container(node, resolve=True)
        if not isinstance(raw, dict):
            raise ValueError(f"tier config file {str(source)!r} must hold a mapping, got {type(raw).__name__}")
    elif isinstance(source, Mapping):
        raw = dict(source)
        if type(source).__name__ == "DictConfig":
            from omegaconf import OmegaConf

            raw = OmegaConf.to_container(source, resolve=True)  # type: ignore[assignment]
    else:
        raise ValueError(f"tier config must be a YAML path or a mapping, got {type(source).__name__}")
    raw = {str(k): v for k, v in raw.items()}
    alias_url = _remote_url_from_aliases(raw)
    if alias_url is not None:
        if "remote_url" in raw and raw["remote_url"] != alias_url:
            raise ValueError(f"tier config: remote_url={redact(raw['remote_url'])!r} disagrees with its alias "
                             f"({redact(alias_url)!r})")
        raw["remote_url"] = alias_url
    known = {f.name for f in dataclasses.fields(TierConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"tier config: unknown key(s) {unknown}; known keys are {sorted(known)} "
                         f"(+ aliases {list(_ALIASES)})")
    return raw


def tier_config_to_yaml(config: TierConfig) -> str:
    """YAML text that `load_tier_config` reads back into an equal config."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(config.to_dict()))
