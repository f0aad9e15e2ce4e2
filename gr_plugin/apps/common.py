"""Shared pieces of the apps: building the datamodule, the model, the cache, checkpoints.

Owns the mapping from the config schemas to objects, and the checkpoint compatibility check (a
checkpoint of another model shape is a clear error, not a shape mismatch deep in torch).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

from gr_plugin.cache import KVCacheConfig
from gr_plugin.cache.config import DTYPE_NAMES, DTYPES
from gr_plugin.cache.hashing import module_namespace
from gr_plugin.cache.tiers.flexkv_config import TierConfig, load_tier_config, redact, tier_keys
from gr_plugin.configs.checked import to_object
from gr_plugin.configs.kvcache import BACKENDS, KVCacheOptions
from gr_plugin.configs.schema import DataOptions, TrainerOptions
from gr_plugin.data import RecDataModule
from gr_plugin.lightning import HSTURankingModule, KVCacheCallback
from gr_plugin.modules import HSTUConfig, KVCacheModule

logger = logging.getLogger(__name__)


def single_log_lines() -> None:
    """Lightning gives its loggers (``lightning.pytorch``, ``lightning.fabric``) a console handler of their
    own and lets their records propagate: under a Hydra run, whose root logger prints (and writes the
    run's ``.log`` file), every Lightning line printed twice. Drops Lightning's console handlers where the
    root logger has a handler, so each record prints once, in Hydra's format, and reaches the file."""
    if not logging.getLogger().handlers:
        return
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        log = logging.getLogger(name)
        for handler in list(log.handlers):
            if type(handler) is logging.StreamHandler:
                log.removeHandler(handler)


class _MaskedStream:
    """A text stream whose writes show every URL's credentials as ``***@`` (`redact`)."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text):
        self._stream.write(redact(text) if isinstance(text, str) else text)
        return len(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def mask_passwords() -> None:
    """No password of a URL is printed by a recipe's process. Hydra prints a failed job's overrides
    (``Error executing job with overrides: [...]``) with ``sys.stderr.write``, ``--cfg`` prints the
    config with ``print``, and a sweep logs each job's overrides: the recipes' own lines already
    `redact`, these did not. Wraps ``sys.stdout`` / ``sys.stderr`` (Hydra's console handler writes to
    the stream it finds at set-up) and makes every log record's message `redact`ed (so the run's .log
    file too). Called by each recipe before Hydra starts (its ``__main__``), not on import. Not covered:
    bytes written to the file descriptors directly (``sys.stderr.buffer``, C code), and Hydra's own
    files under the run's ``.hydra/`` directory, which hold the overrides as given."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _MaskedStream):
            setattr(sys, name, _MaskedStream(stream))
    factory = logging.getLogRecordFactory()
    if getattr(factory, "masks_passwords", False):
        return

    def masked_record(*args, **kwargs):
        record = factory(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # (a malformed record: its handler reports it, as before)
            return record
        shown = redact(message)
        if shown != message:
            record.msg, record.args = shown, ()
        return record

    masked_record.masks_passwords = True
    logging.setLogRecordFactory(masked_record)


def refuse_cache_keys_without_cache(argv: list[str]) -> None:
    """A recipe whose config has no ``kvcache`` (infer, train) given ``kvcache.<key>=...`` overrides but no
    ``+kvcache=<option>``: Hydra fails composing with 'AssertionError: Unexpected type for root: NoneType'
    and a traceback. Exits with a message saying to choose a cache first. ``argv``: the command line's
    arguments; only its overrides (``key=value``, not ``-`` flags) are read."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # (Hydra says what is wrong with an override it cannot parse)
        return
    if any(o.key_or_group == "kvcache" and not o.is_delete() for o in parsed):
        return
    keys = [o.input_line for o in parsed if o.key_or_group.startswith("kvcache.")]
    if keys:
        raise SystemExit(f"{redact(', '.join(keys))}: no cache is chosen to take "
                         f"{'these' if len(keys) > 1 else 'this'}; choose a cache first with "
                         f"+kvcache=<none|gpu|native|flexkv> (e.g. +kvcache=native {redact(keys[0])})")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"device {name!r} is not a torch device") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available here")
    # (torch puts ``cpu:N`` tensors on ``cpu``, and ``cpu != cpu:0``: one spelling, or every ``.to`` copies)
    return torch.device("cpu") if device.type == "cpu" else device


def make_datamodule(opts: DataOptions) -> RecDataModule:
    kwargs = dataclasses.asdict(opts)
    source = kwargs.pop("source")
    return RecDataModule(source, **kwargs)


def make_trainer(opts: TrainerOptions, callbacks: list, **overrides) -> L.Trainer:
    kwargs = dataclasses.asdict(opts) | overrides
    return L.Trainer(callbacks=callbacks, **kwargs)


_HOST_GB_DEFAULT = KVCacheOptions().host_cache_gb  # (what flexkv's YAML inherits from the schema)


def _check_backend(opts: KVCacheOptions) -> None:
    """A known ``kvcache.backend``, and ``native``'s ``host_cache_gb`` >= 0."""
    if opts.backend not in BACKENDS:
        raise ValueError(f"kvcache.backend must be one of {list(BACKENDS)}, got {opts.backend!r}")
    if opts.backend == "native" and not opts.host_cache_gb >= 0:
        raise ValueError(f"kvcache.host_cache_gb must be >= 0, got {opts.host_cache_gb!r}")


def resolve_backend(opts: KVCacheOptions) -> str | None:
    """Engine that serves a ``kvcache`` option (None: no cache). Options the backend does not read are
    warned about: only ``flexkv`` reads ``kvcache.tiers`` and ``kvcache.tier_config``; ``flexkv`` sizes
    its host tier by ``tiers.cpu_cache_gb``, not ``host_cache_gb``; ``gpu`` has no host tier."""
    _check_backend(opts)
    if opts.backend != "flexkv" and (opts.tier_config or opts.tiers != TierConfig()):
        warnings.warn(f"kvcache.tiers / kvcache.tier_config apply to the flexkv backend (+kvcache=flexkv); "
                      f"backend {opts.backend!r} ignores them", UserWarning, stacklevel=2)
    if opts.backend == "flexkv" and opts.host_cache_gb != _HOST_GB_DEFAULT:
        warnings.warn(f"kvcache.host_cache_gb={opts.host_cache_gb!r} is not read by the flexkv backend: its host "
                      f"tier is kvcache.tiers.cpu_cache_gb (FlexKV's name; {opts.tiers.cpu_cache_gb!r} GB here)",
                      UserWarning, stacklevel=2)
    if opts.backend == "gpu" and opts.host_cache_gb not in (0, _HOST_GB_DEFAULT):  # (the schema's default: unset)
        warnings.warn(f"kvcache.host_cache_gb={opts.host_cache_gb!r} is not read by the gpu backend (device pages "
                      "only): +kvcache=native adds a host tier", UserWarning, stacklevel=2)
    if opts.backend == "none":
        return None
    return opts.backend


def command_line_tier_keys() -> set[str]:
    """The ``kvcache.tiers`` keys this Hydra run's command line sets (``kvcache.tiers={...}`` or
    ``kvcache={tiers:{...}}``: the keys the mapping names; a deletion sets nothing; none outside a Hydra
    run)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not HydraConfig.initialized():
        return set()
    keys: set[str] = set()
    for override in OverridesParser.create().parse_overrides(list(HydraConfig.get().overrides.task)):
        path = override.key_or_group.split(".")
        if path == ["kvcache"] and not override.is_delete() and not override.is_sweep_override():
            value = override.value()  # (kvcache={tiers:{...}}: the keys its tiers mapping names)
            if isinstance(value, dict) and isinstance(value.get("tiers"), dict):
                keys.update(str(k) for k in value["tiers"])
            continue
        if path[:2] != ["kvcache", "tiers"] or override.is_delete():
            continue
        if len(path) > 2:
            keys.add(path[2])
        elif not override.is_sweep_override() and isinstance(override.value(), dict):
            keys.update(str(k) for k in override.value())
        else:  # (a value that is no mapping: the schema refuses it)
            keys.update(f.name for f in dataclasses.fields(TierConfig))
    return keys


#: the option that sizes each backend's host tier, as errors name it
_HOST_OPTION = {"native": "kvcache.host_cache_gb", "flexkv": "kvcache.tiers.cpu_cache_gb"}
#: torch's messages for a host allocation that failed (its CPU and pinned allocators)
_HOST_ALLOC_ERRORS = ("can't allocate memory", "DefaultCPUAllocator", "CachingHostAllocator", "cudaHostAlloc")


def _physical_memory() -> int | None:
    """Bytes of this machine's memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _check_host_memory(option: str, gb: float) -> None:
    """A host tier of ``gb`` GiB (``option``) is allocated whole when the cache is built: one larger than
    the machine's memory is refused here, by the option's name, not by torch's allocator later."""
    total = _physical_memory()
    if total is not None and gb * (1 << 30) > total:
        raise ValueError(f"{option}={gb!r} asks for {gb:g} GiB of host memory; this machine has "
                         f"{total / (1 << 30):.1f} GiB")


def _option_names(message: str) -> str:
    """A library error as the recipes' options name it: ``TierConfig.x`` -> ``kvcache.tiers.x``,
    ``KVCacheConfig.x`` / ``KVCacheOptions.x`` -> ``kvcache.x``."""
    for lib, option in (("TierConfig.", "kvcache.tiers."), ("KVCacheConfig.", "kvcache."),
                        ("KVCacheOptions.", "kvcache.")):
        message = message.replace(lib, option)
    return message


def config_object(cfg: Any) -> Any:
    """A recipe's composed config as its dataclass (`to_object`: unknown keys refused); the tiers'
    own checks, which run as the dataclasses are made, name the key the user set
    (``kvcache.tiers.cpu_cache_gb``), not the library's class (``TierConfig.cpu_cache_gb``)."""
    try:
        return to_object(cfg)
    except ValueError as exc:
        named = _option_names(str(exc))
        if named == str(exc):
            raise
        # (from None: Hydra would print both, the library's names, then these)
        raise ValueError(named) from None


def _check_ssd_size(tiers: TierConfig, page_bytes: int) -> None:
    """``kvcache.tiers.ssd_cache_gb`` holds at least one page (with its header, aligned) of this cache."""
    from gr_plugin.cache.tiers.ssd import ALIGN, MAX_HEADER_BYTES, slot_count

    try:
        slot_count(tiers.ssd_cache_bytes, page_bytes)
    except ValueError:  # (was: 'SSDPageStore.capacity_bytes=... holds no slot', when the cache was built)
        slot = -(-(page_bytes + MAX_HEADER_BYTES) // ALIGN) * ALIGN
        least = math.ceil(slot / (1 << 30) * 1e6) / 1e6
        raise ValueError(f"kvcache.tiers.ssd_cache_gb={tiers.ssd_cache_gb!r} holds no page: one takes {slot} bytes "
                         f"on SSD at this model and kvcache.page_size; set it to 0 (no SSD tier) or to at least "
                         f"{least:g} GiB") from None


def check_cache_options(opts: KVCacheOptions | None, model: HSTUConfig, dtype: str) -> None:
    """Refuse bad ``kvcache`` values before any data, weights or training: the device cache's shape and
    capacity, ``host_cache_gb``, the tiers (a FlexKV YAML included) and an SSD directory that cannot be
    created or written. Errors name the option (``kvcache.page_size``, ``kvcache.tiers.ssd_cache_dir``)
    and the value; nothing is built (the SSD directory is created, as the run would)."""
    if opts is None:
        return
    _check_backend(opts)
    if opts.backend == "none":
        return
    try:
        cfg = KVCacheConfig(num_layers=model.num_layers, num_heads=model.num_heads, head_dim=model.head_dim,
                      page_size=opts.page_size, num_pages=opts.num_pages,
                      # (a bad model dtype: model_dtype's error, named dtype)
                      dtype=opts.dtype or (dtype if dtype in DTYPES else "float32"),
                      namespace=opts.namespace)
        tiers = _merged_tiers(opts)[0] if opts.backend == "flexkv" else None
    except ValueError as exc:  # (the library's names for the options: KVCacheConfig.x, TierConfig.x)
        raise ValueError(_option_names(str(exc))) from None  # (not the library's names too)
    if opts.backend in _HOST_OPTION:
        option, gb = _HOST_OPTION[opts.backend], tiers.cpu_cache_gb if tiers else opts.host_cache_gb
        if not gb > 0:  # (was: 'a lower-tier backend needs host_cache_bytes > 0', when the cache was built)
            raise ValueError(f"{option}={gb!r}: the {opts.backend} backend needs a host tier (> 0 GiB; "
                             "+kvcache=gpu is the device pages alone)")
        _check_host_memory(option, gb)
    if tiers is not None and tiers.ssd_cache_gb > 0:
        _check_ssd_size(tiers, cfg.page_bytes)
        for d in tiers.ssd_cache_dirs:
            try:
                Path(d).mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ValueError(f"kvcache.tiers.ssd_cache_dir={d!r} cannot be created: {exc.strerror or exc}") from exc
            if not os.access(d, os.W_OK | os.X_OK):
                raise ValueError(f"kvcache.tiers.ssd_cache_dir={d!r} is not writable by this process")


def _merged_tiers(opts: KVCacheOptions, command_line: set[str] | None = None) -> tuple[TierConfig, list[str]]:
    """`tier_config`'s merge, without its log lines: the tiers, and the keys the command line kept."""
    base, kept = dataclasses.asdict(opts.tiers), []
    if opts.tier_config:
        named = tier_keys(opts.tier_config)
        kept = sorted(set(named) & (command_line_tier_keys() if command_line is None else command_line))
        base.update({k: v for k, v in named.items() if k not in kept})
    return load_tier_config(base), kept


def tier_config(opts: KVCacheOptions, command_line: set[str] | None = None) -> TierConfig:
    """The ``flexkv`` tiers: ``kvcache.tiers``, where the FlexKV YAML ``tier_config`` names a key its value,
    unless the command line set that key too (``command_line``, None: `command_line_tier_keys`): as in
    Hydra, the command line wins, then the file, then the config group's values (the keys the file does not
    name keep ``kvcache.tiers``'s, e.g. our ``remote_ttl_s``)."""
    tiers, kept = _merged_tiers(opts, command_line)
    if kept:
        logger.info("kvcache.tiers.%s set on the command line: kept over %s's", ", ".join(kept), opts.tier_config)
    found = importlib.util.find_spec("flexkv") is not None
    remote = "off"
    if tiers.enable_3rd_remote:
        remote = redact(tiers.remote_url)
        if tiers.remote_ttl_s:
            remote += f", pages expire {tiers.remote_ttl_s} s after their last write, read or renewal there"
    logger.info("kvcache=flexkv: %s; gr_plugin's built-in tiered engine serves (host %.2f GB, SSD %.2f GB at %r, "
                "remote %s)", "the FlexKV library is importable but has no adapter here" if found
                else "the FlexKV library is not installed", tiers.cpu_cache_gb, tiers.ssd_cache_gb,
                tiers.ssd_cache_dir, remote)
    return tiers


def model_dtype(name: str, kvcache: KVCacheOptions | None, owner: str = "dtype") -> torch.dtype:
    """The torch dtype a recipe runs its model in (``owner``: how its messages name the option); a
    ``kvcache.dtype`` must be unset or equal (the cache holds the model's K/V)."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    if kvcache is not None and kvcache.dtype not in (None, name):
        raise ValueError(f"kvcache.dtype={kvcache.dtype!r} differs from {owner}={name!r}: the cache holds "
                         "the model's K/V, so leave kvcache.dtype unset or equal")
    return DTYPES[name]


def make_cache(opts: KVCacheOptions, model: HSTUConfig, device: torch.device,
               dtype: torch.dtype) -> KVCacheModule | None:
    backend = resolve_backend(opts)
    if backend is None:
        return None
    tiers = tier_config(opts) if backend == "flexkv" else None
    host_gb = {"gpu": 0.0, "native": opts.host_cache_gb}.get(backend, tiers.cpu_cache_gb if tiers else 0.0)
    cfg = KVCacheConfig(num_layers=model.num_layers, num_heads=model.num_heads, head_dim=model.head_dim,
                        page_size=opts.page_size, num_pages=opts.num_pages, dtype=opts.dtype or DTYPE_NAMES[dtype],
                        device=str(device), namespace=opts.namespace, host_cache_bytes=int(host_gb * (1 << 30)))
    try:
        return KVCacheModule(cfg, backend, write_through=opts.write_through, tiers=tiers)
    except ValueError as exc:  # (another run's SSD store holds the directory: say what to change)
        if "in use by another store" not in str(exc):
            raise
        raise ValueError(f"{exc}; set kvcache.tiers.ssd_cache_dir to a directory of its own for this run "
                         f"(kvcache.tiers.ssd_cache_dir={tiers.ssd_cache_dir!r} now), or wait for the other "
                         "run to end") from None
    except (RuntimeError, MemoryError) as exc:  # (below the machine's memory: others may hold it)
        if backend not in _HOST_OPTION or not (isinstance(exc, MemoryError)
                                               or any(m in str(exc) for m in _HOST_ALLOC_ERRORS)):
            raise
        raise ValueError(f"{_HOST_OPTION[backend]}={host_gb!r}: {host_gb:g} GiB of host memory could not be "
                         f"allocated ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                         f"this machine has {(_physical_memory() or 0) / (1 << 30):.1f} GiB") from exc


def cache_namespace(salt: str, module: HSTURankingModule) -> str:
    """The cache namespace of ``module``'s weights: ``salt`` (``kvcache.namespace``) and a fingerprint
    of the weights and model config, so K/V that other weights computed are never read, even from a
    tier shared across processes (SSD, Redis). Logged."""
    t0 = time.perf_counter()
    model = module.model
    namespace = module_namespace(salt, model, dataclasses.asdict(model.config))
    logger.info("kvcache namespace %r (kvcache.namespace %r + the weights' fingerprint, %.1f ms)", namespace, salt,
                (time.perf_counter() - t0) * 1e3)
    return namespace


def make_callback(opts: KVCacheOptions | None) -> KVCacheCallback | None:
    if opts is None:
        return None
    backend = resolve_backend(opts)
    if backend is None:
        return None
    tiers = tier_config(opts) if backend == "flexkv" else None
    return KVCacheCallback(backend, page_size=opts.page_size, num_pages=opts.num_pages,
                           host_cache_gb=tiers.cpu_cache_gb if tiers else opts.host_cache_gb, dtype=opts.dtype,
                           namespace=opts.namespace, write_through=opts.write_through, tiers=tiers,
                           cuda_graphs=opts.cuda_graphs)


def load_module(path: str | Path, expected: HSTUConfig) -> HSTURankingModule:
    """Load a checkpoint written by ``recipes.train``; its model config must equal ``expected``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    saved = (ckpt.get("hyper_parameters") or {}).get("model")
    if saved is None:
        raise ValueError(f"checkpoint {str(path)!r} has no model config (not written by recipes.train?)")
    want = dataclasses.asdict(expected)
    diff = {k: (saved.get(k), v) for k, v in want.items() if saved.get(k) != v and k != "dropout"}
    if diff:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in sorted(diff.items()))
        raise ValueError(f"checkpoint {str(path)!r} is for another model config ({detail})")
    module = HSTURankingModule(HSTUConfig(**saved))
    module.load_state_dict(ckpt["state_dict"])
    return module
