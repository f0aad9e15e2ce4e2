"""How long after a host->device copy ends does the compute stream's next work start? (the tail of a
layerwise onboard: the last layer's kernels wait for its pages; docs/BENCHMARKS.md, tiers)

python3 scripts/gpu/probe_wait_latency.py [copy_mb] [repeats]

A copy of ``copy_mb`` MB (pinned host -> device) runs on a side stream; a timing event is recorded
there right after it (E1). The compute stream waits for the copy, then runs a small piece of work
W (five elementwise kernels on 1M elements), then records E2. E2 - E1 - (what runs after the wait,
alone) is the latency from the copy's end to W's start. "Alone" is timed with the host ahead too
(the GPU held by a short sleep while the host queues the replay), so neither side counts the
host's launch. Ways of waiting, side by side, interleaved:
- ``event+graph``: ``wait_event`` of a torch event, then W as a replayed CUDA graph (the engine's
  layer segments today);
- ``event+eager``: the same wait, W launched kernel by kernel;
- ``graph_wait_node``: one graph holding an external event wait node (captured with
  ``cudaEventWaitExternal``) and W; the copy stream records that event before the replay;
- ``chained_graphs``: W split in two graphs with the wait between them (a segment boundary with
  work on both sides, as a layer's projection then its append).
"""

from __future__ import annotations

import ctypes
import statistics
import sys

import torch

from gr_plugin.cache import cudart


def main(copy_mb: float = 4.0, repeats: int = 50) -> None:
    rt = cudart.runtime()
    dev = torch.device("cuda")
    n = int(copy_mb * 2**20) // 2
    host = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    dst = torch.empty(n, dtype=torch.bfloat16, device=dev)
    side = torch.cuda.Stream()
    x = torch.randn(1 << 20, device=dev)

    def work(k: int = 5) -> None:
        for _ in range(k):
            x.mul_(1.0001)

    work()
    torch.cuda.synchronize()
    g_work = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_work):
        work()
    g_a, g_b = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_a):
        work(2)
    with torch.cuda.graph(g_b):
        work(3)
    raw_ev = rt.create_event()
    g_node = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_node):
        s = torch.cuda.current_stream()
        err = rt._wait(ctypes.c_void_p(s.cuda_stream), ctypes.c_void_p(raw_ev), 1)  # 1: cudaEventWaitExternal
        assert err == 0, err
        work()
    torch.cuda.synchronize()

    def alone(graph: torch.cuda.CUDAGraph) -> float:
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000)  # ~0.1 ms of GPU time: the replay is queued before the GPU reaches it
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e3

    def timed(mode: str) -> float:
        torch.cuda.synchronize()
        e1, e2 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        done = torch.cuda.Event()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dst.copy_(host, non_blocking=True)
            e1.record(side)
            if mode == "graph_wait_node":
                assert rt._record(ctypes.c_void_p(raw_ev), ctypes.c_void_p(side.cuda_stream)) == 0
            else:
                done.record(side)
        cur = torch.cuda.current_stream()
        if mode == "event+graph":
            cur.wait_event(done)
            g_work.replay()
        elif mode == "event+eager":
            cur.wait_event(done)
            work()
        elif mode == "graph_wait_node":
            g_node.replay()
        elif mode == "chained_graphs":
            g_a.replay()
            cur.wait_event(done)
            g_b.replay()
        e2.record()
        e2.synchronize()
        return e1.elapsed_time(e2) * 1e3

    modes = ["event+graph", "event+eager", "graph_wait_node", "chained_graphs"]
    res: dict[str, list[float]] = {m: [] for m in [*modes, "alone", "alone_b"]}
    for _ in range(5):
        for m in modes:
            timed(m)
    for _ in range(repeats):
        res["alone"].append(alone(g_work))
        res["alone_b"].append(alone(g_b))
        for m in modes:
            res[m].append(timed(m))
    base, base_b = statistics.median(res["alone"]), statistics.median(res["alone_b"])
    print(f"copy {copy_mb} MB; W alone (graph) {base:.1f} us; its last 3 kernels alone {base_b:.1f} us")
    for m in modes:
        med = statistics.median(res[m])
        after = base_b if m == "chained_graphs" else base  # (chained: 2 kernels run during the copy)
        print(f"{m:16s} E2-E1 median {med:7.1f} us  -> latency {med - after:6.1f} us "
              f"(p10 {sorted(res[m])[len(res[m]) // 10] - after:6.1f})")
    # the event wait node waited for the copy: check the data dependency held (a copy of new bytes)
    host.fill_(3.0)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        dst.copy_(host, non_blocking=True)
        assert rt._record(ctypes.c_void_p(raw_ev), ctypes.c_void_p(side.cuda_stream)) == 0
    g_node.replay()
    y = dst[-1:].clone()  # on the compute stream, after the graph
    print("graph_wait_node ordered the read after the copy:", float(y) == 3.0)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(float(args[0]) if args else 4.0, int(args[1]) if len(args) > 1 else 50)
