"""Request streams for the C++ runner: a replayable sequence of scored batches, written by Python.

Owns the stream format (version 1), its writer (`record_stream`: replays batches with eager cached
inference and saves the requests with the scores, the cached lengths and, optionally, the package
inputs Python built) and a reader (`read_stream`). It does not score anything itself: the model and
the cache do; the C++ runner (``gr_plugin/csrc/runner``) replays a stream and compares.

Format: a directory holding ``header.txt`` and one raw little-endian file per array, no pickle.
``header.txt`` is ASCII lines ``key value``; the first line is ``gr_plugin_stream 1``; an array
line is ``array <name> <int64|float32> <dim0> [<dim1>]`` and its bytes are ``<name>.bin``
(row-major, exactly ``prod(dims) * itemsize`` bytes). ``U`` user visits in total, ``E`` history
events, ``C`` candidates, ``T`` batches:

- ``batch_offsets [T+1]``: batch ``t`` is user visits ``batch_offsets[t] .. batch_offsets[t+1]-1``;
- ``user_ids [U]``, ``history_lengths [U]``, ``candidate_lengths [U]``;
- ``history_events [E, 3]``: item, action, time bucket of every event, the whole history each visit
  (oldest first), visits one after another (as the engine receives them);
- ``candidate_items [C]``; ``scores [C, num_tasks]`` (float32): eager cached inference's logits;
- ``cached_lengths [U]``: the history events the Python cache reused per visit;
- with ``has_inputs 1``: ``input_sizes [T, 9]`` and ``input_values [sum]``: the nine int64 package
  inputs Python built for each batch (docs/EXPORT.md, inputs 0-8), flattened, batch after batch.

The header also names the cache (``namespace``, ``page_size``, ``num_pages``, and ``host_slots``
when it had a pinned host tier: the runner then keeps one of that many pages, with the same policy)
and the model's id ranges. A stream without ``host_slots`` is a device-only cache's.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterable
from pathlib import Path

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gr_plugin.cache import HostTier
from gr_plugin.export.model import INPUT_NAMES, full_pass_inputs, program_inputs
from gr_plugin.modules import HSTURanker, KVCacheModule, cache_token_keys

logger = logging.getLogger(__name__)

FORMAT = "gr_plugin_stream"
VERSION = 1
HEADER = "header.txt"
INT_INPUTS = INPUT_NAMES[:-1]  # every input but kv_table
_DTYPES = {"int64": torch.int64, "float32": torch.float32}
_HEADER_INTS = ("page_size", "num_pages", "max_positions", "num_layers", "num_heads", "head_dim", "num_tasks",
                "num_items", "num_actions", "num_time_buckets", "num_batches", "has_inputs", "host_slots")


@dataclasses.dataclass
class StreamBatch:
    """One request: ``user_ids [B]``, ``history`` (keys item/action/time, full histories) and
    ``candidates`` (key item), CPU KJTs."""

    user_ids: list[int]
    history: KeyedJaggedTensor
    candidates: KeyedJaggedTensor


@dataclasses.dataclass
class Stream:
    """A stream read back: the header's values and the arrays as CPU tensors."""

    header: dict[str, str | int]
    arrays: dict[str, torch.Tensor]

    @property
    def num_batches(self) -> int:
        return int(self.header["num_batches"])

    def batch(self, t: int) -> StreamBatch:
        """Batch ``t`` as KJTs (for replaying it in Python)."""
        a = self.arrays
        lo, hi = int(a["batch_offsets"][t]), int(a["batch_offsets"][t + 1])
        hist_off = torch.cat([torch.zeros(1, dtype=torch.int64), a["history_lengths"].cumsum(0)])
        cand_off = torch.cat([torch.zeros(1, dtype=torch.int64), a["candidate_lengths"].cumsum(0)])
        lengths = a["history_lengths"][lo:hi]
        events = a["history_events"][int(hist_off[lo]) : int(hist_off[hi])]
        history = KeyedJaggedTensor(keys=["item", "action", "time"], values=events.t().reshape(-1),
                                    lengths=lengths.repeat(3))
        items = a["candidate_items"][int(cand_off[lo]) : int(cand_off[hi])]
        candidates = KeyedJaggedTensor(keys=["item"], values=items, lengths=a["candidate_lengths"][lo:hi])
        return StreamBatch(a["user_ids"][lo:hi].tolist(), history, candidates)

    def scores(self, t: int) -> torch.Tensor:
        a = self.arrays
        lo, hi = int(a["batch_offsets"][t]), int(a["batch_offsets"][t + 1])
        c0, c1 = int(a["candidate_lengths"][:lo].sum()), int(a["candidate_lengths"][:hi].sum())
        return a["scores"][c0:c1]


def _write_arrays(path: Path, header: dict[str, str | int], arrays: dict[str, torch.Tensor]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    lines = [f"{FORMAT} {VERSION}"] + [f"{k} {v}" for k, v in header.items()]
    for name, t in arrays.items():
        dtype = {v: k for k, v in _DTYPES.items()}[t.dtype]
        lines.append(f"array {name} {dtype} " + " ".join(str(d) for d in t.shape))
        # NOTE: numpy's tofile writes the host's byte order; torch only runs little-endian hosts here.
        t.contiguous().numpy().tofile(path / f"{name}.bin")
    (path / HEADER).write_text("\n".join(lines) + "\n")


def read_stream(path: str | Path) -> Stream:
    """Read a stream directory; ``ValueError`` naming the problem for a bad header or array file."""
    path = Path(path)
    head = path / HEADER
    if not head.is_file():
        raise ValueError(f"{path} is not a stream: {head} is missing")
    lines = head.read_text().splitlines()
    if not lines or lines[0] != f"{FORMAT} {VERSION}":
        raise ValueError(f"{head}: first line must be {FORMAT!r} {VERSION}, got {lines[0] if lines else ''!r}")
    header: dict[str, str | int] = {}
    arrays: dict[str, torch.Tensor] = {}
    for line in lines[1:]:
        parts = line.split()
        if parts and parts[0] == "array":
            if len(parts) < 4 or parts[2] not in _DTYPES:
                raise ValueError(f"{head}: bad array line {line!r}")
            name, dtype, shape = parts[1], _DTYPES[parts[2]], [int(d) for d in parts[3:]]
            if not re.fullmatch(r"[A-Za-z0-9_]+", name) or any(d < 0 for d in shape):
                raise ValueError(f"{head}: bad array line {line!r} (names: letters, digits, _; dims >= 0)")
            data = (path / f"{name}.bin").read_bytes()
            want = dtype.itemsize
            for d in shape:
                want *= d
            if len(data) != want:
                raise ValueError(f"{path / (name + '.bin')} has {len(data)} bytes, the header says {want} ({shape})")
            arrays[name] = torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape) if want else \
                torch.zeros(shape, dtype=dtype)
        elif len(parts) == 2:
            header[parts[0]] = int(parts[1]) if parts[0] in _HEADER_INTS else parts[1]
        else:
            raise ValueError(f"{head}: bad line {line!r}")
    return Stream(header, arrays)


def record_stream(model: HSTURanker, cache: KVCacheModule, batches: Iterable[StreamBatch], path: str | Path, *,
                  with_inputs: bool = True) -> Path:
    """Score ``batches`` in order with eager cached inference on ``cache`` (CPU; device pages only, or
    with the pinned host tier of the ``native`` option: what the C++ runner keeps) and write the
    stream to directory ``path``. Every copy to and from the host tier is flushed after each batch,
    so the host tier the next batch sees does not depend on copy timing (the runner copies
    synchronously). ``with_inputs`` also
    saves the package inputs Python builds for each batch (the runner compares its own to them).
    A batch that does not fit in the cache is scored by full recomputation (its cached lengths 0,
    its inputs those of a full pass through a scratch table, `full_pass_inputs`), as the engine
    and the runner do."""
    cfg, mcfg = cache.config, model.config
    backend = cache.manager.backend
    if backend is not None and type(backend) is not HostTier:
        raise ValueError(f"record the stream with a device-only cache (backend 'gpu') or the host tier ('native'), "
                         f"got {type(backend).__name__}: the C++ runner has no SSD or remote tier")
    if backend is not None and not cache.manager.write_through:
        raise ValueError("record the stream with write_through=True: the C++ runner's host tier writes "
                         "every committed full page through")
    if cfg.torch_device.type != "cpu" or cfg.dtype != "float32":
        raise ValueError(f"streams are recorded on the CPU in float32, got {cfg.device} {cfg.dtype}")
    if not re.fullmatch(r"[A-Za-z0-9_.:/-]+", cfg.namespace):
        raise ValueError(f"namespace {cfg.namespace!r} cannot go in a stream header (letters, digits, _.:/- only)")
    cols: dict[str, list[torch.Tensor]] = {k: [] for k in (
        "user_ids", "history_lengths", "candidate_lengths", "history_events", "candidate_items", "scores",
        "cached_lengths", "input_sizes", "input_values")}
    batch_offsets = [0]
    for t, batch in enumerate(batches):
        history, candidates = batch.history, batch.candidates
        lengths = history.lengths()[: history.stride()]
        events = history.values().view(3, -1)
        keys = cache_token_keys(events[0], events[1], events[2])
        plan = cache.begin(list(batch.user_ids), lengths.tolist(), keys)
        if plan is None:
            logger.info("batch %d (%d users, %d events) does not fit in a cache of %d pages: full pass", t,
                        len(batch.user_ids), int(lengths.sum()), cfg.num_pages)
        try:
            if with_inputs:
                inputs = (program_inputs(model, cache.kv_table, history, candidates, plan) if plan is not None
                          else full_pass_inputs(model, cache.kv_table, history, candidates))
                ints = [getattr(inputs, n).reshape(-1) for n in INT_INPUTS]
                cols["input_sizes"].append(torch.tensor([x.numel() for x in ints], dtype=torch.int64))
                cols["input_values"].append(torch.cat(ints).to(torch.int64))
            with torch.no_grad():
                logits = (model.forward_cached(history, candidates, cache, plan) if plan is not None
                          else model(history, candidates))
        except BaseException:
            if plan is not None:
                cache.abort(plan)
            raise
        if plan is not None:
            cache.commit(plan)
        if backend is not None:
            cache.manager.offload_flush()
        cols["user_ids"].append(torch.tensor(batch.user_ids, dtype=torch.int64))
        cols["history_lengths"].append(lengths.to(torch.int64))
        cols["candidate_lengths"].append(candidates.lengths().to(torch.int64))
        cols["history_events"].append(events.t().to(torch.int64))
        cols["candidate_items"].append(candidates.values().to(torch.int64))
        cols["scores"].append(logits.detach().float().cpu())
        cached = plan.cached_lengths if plan is not None else [0] * len(batch.user_ids)
        cols["cached_lengths"].append(torch.tensor(cached, dtype=torch.int64))
        batch_offsets.append(batch_offsets[-1] + len(batch.user_ids))
    if len(batch_offsets) == 1:
        raise ValueError("no batches to record")
    header: dict[str, str | int] = {
        "namespace": cfg.namespace, "page_size": cfg.page_size, "num_pages": cfg.num_pages,
        "max_positions": mcfg.max_positions, "num_layers": cfg.num_layers, "num_heads": cfg.num_heads,
        "head_dim": cfg.head_dim, "num_tasks": mcfg.num_tasks, "num_items": mcfg.num_items,
        "num_actions": mcfg.num_actions, "num_time_buckets": mcfg.num_time_buckets,
        "num_batches": len(batch_offsets) - 1, "has_inputs": int(with_inputs)}
    if backend is not None:
        header["host_slots"] = cfg.num_host_slots
    arrays = {"batch_offsets": torch.tensor(batch_offsets, dtype=torch.int64)}
    arrays.update({k: torch.cat(v) for k, v in cols.items() if v and not k.startswith("input")})
    if with_inputs:
        arrays["input_sizes"] = torch.stack(cols["input_sizes"])
        arrays["input_values"] = torch.cat(cols["input_values"])
    path = Path(path)
    _write_arrays(path, header, arrays)
    logger.info("wrote stream %s: %d batches, %d user visits, %d candidates", path, header["num_batches"],
                arrays["user_ids"].numel(), arrays["candidate_items"].numel())
    return path
