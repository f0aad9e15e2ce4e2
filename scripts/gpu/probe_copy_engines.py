"""Do host->device copies split over two streams (two copy engines), or grouped into fewer 2-D
copies, move the same bytes faster than one copy per layer? (the transfer floor of the tiers bench is
one raw pinned copy; docs/BENCHMARKS.md, tiers)

python3 scripts/gpu/probe_copy_engines.py [total_mb] [layers] [repeats]

The bytes of a layerwise onboard at 2K tokens (8 layers of ~3.9 MB) in a pinned table and a device
table laid out as the cache's are (``[layers, pages]``: each layer's run of pages is one byte range,
a layer's whole table (twice the run here) apart), copied with raw ``cudaMemcpyAsync`` and
``cudaMemcpy2DAsync`` (`gr_plugin.cache.cudart`), timed by CUDA events
from a start event that every stream waits on to the last stream's end (the host queues all copies
first behind a short sleep kernel, so no host time is counted). Ways, interleaved, medians (and,
for the per-layer ways, when each layer's bytes were all in, median µs from the start):
- ``one``: one copy of as many contiguous bytes on one stream (the tiers bench's floor);
- ``layers``: one copy per layer on one stream, an event after each (the onboard's copies);
- ``bare``: the same copies without the events;
- ``groups``: 2-D copies of layer groups 0 | 1 2 | 3 4 | 5 6 | 7 (the last layer alone: it is what
  the step's tail waits for), an event after each;
- ``all2d``: one 2-D copy of every layer;
- ``halves``: each layer in two copies, one on each of two streams (a layer is in when both are);
- ``alternate``: whole layers alternating between the two streams.
"""

from __future__ import annotations

import statistics
import sys

import torch

from gr_plugin.cache import cudart


def main(total_mb: float = 31.5, layers: int = 8, repeats: int = 30) -> None:
    rt = cudart.runtime()
    n = int(total_mb * 2**20) // layers * layers
    per = n // layers
    pitch = 2 * per  # a layer's table: the copied run is half of it
    host = torch.empty(layers * pitch, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 255)
    dev = torch.empty(layers * pitch, dtype=torch.uint8, device="cuda")
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    hp, dp = host.data_ptr(), dev.data_ptr()

    def copy(off: int, size: int, s: torch.cuda.Stream) -> None:
        rt.memcpy_async(dp + off, hp + off, size, cudart.H2D, s)

    def layer(i: int, s: torch.cuda.Stream, part: int = 0, parts: int = 1) -> None:
        a, e = per * part // parts, per * (part + 1) // parts
        copy(i * pitch + a, e - a, s)

    def way_one(marks):
        copy(0, n, streams[0])

    def way_layers(marks):
        for i in range(layers):
            layer(i, streams[0])
            marks[i][0].record(streams[0])

    def way_bare(marks):
        for i in range(layers):
            layer(i, streams[0])

    def grouped(marks, groups):
        for g in groups:
            rt.memcpy2d_async(dp + g[0] * pitch, pitch, hp + g[0] * pitch, pitch, per, len(g), cudart.H2D, streams[0])
            for i in g:
                marks[i][0].record(streams[0])

    def way_groups(marks):
        grouped(marks, [[0]] + [list(range(i, min(i + 2, layers - 1))) for i in range(1, layers - 1, 2)]
                + [[layers - 1]])

    def way_all2d(marks):
        grouped(marks, [list(range(layers))])

    def way_halves(marks):
        for i in range(layers):
            for j, s in enumerate(streams):
                layer(i, s, j, 2)
                marks[i][j].record(s)

    def way_alternate(marks):
        for i in range(layers):
            s = streams[i % 2]
            layer(i, s)
            marks[i][0].record(s)

    ways = {"one": way_one, "layers": way_layers, "bare": way_bare, "groups": way_groups, "all2d": way_all2d,
            "halves": way_halves, "alternate": way_alternate}
    landing = {"layers", "groups", "all2d", "halves", "alternate"}
    times = {w: [] for w in ways}
    landed = {w: [[] for _ in range(layers)] for w in ways}
    for r in range(repeats + 2):
        for name, fn in ways.items():
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            marks = [[torch.cuda.Event(enable_timing=True) for _ in streams] for _ in range(layers)]
            torch.cuda._sleep(200_000)  # the host queues everything behind this
            start.record()
            for s in streams:
                s.wait_event(start)
            fn(marks)
            for s in streams:
                torch.cuda.current_stream().wait_stream(s)
            end.record()
            torch.cuda.synchronize()
            if r < 2:
                continue
            times[name].append(start.elapsed_time(end) * 1e3)
            if name in landing:
                for i in range(layers):
                    used = marks[i] if name == "halves" else marks[i][:1]  # (the events recorded)
                    landed[name][i].append(max(start.elapsed_time(m) for m in used) * 1e3)
    for name, fn in ways.items():  # each way copies the layers' runs, and only them
        if name == "one":
            continue
        dev.zero_()
        fn([[torch.cuda.Event() for _ in streams] for _ in range(layers)])
        torch.cuda.synchronize()
        got, want = dev.view(layers, pitch).cpu(), host.view(layers, pitch)
        assert torch.equal(got[:, :per], want[:, :per]) and not got[:, per:].any(), name
    mb = n / 2**20
    for name in ways:
        us = statistics.median(times[name])
        line = f"{name:>9}: {us:8.1f} us  {n / us / 1e3:6.2f} GB/s ({mb:.1f} MB)"
        if name in landing:
            line += "  layers in at " + " ".join(f"{statistics.median(t):.0f}" for t in landed[name])
        print(line)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(float(args[0]) if args else 31.5, int(args[1]) if len(args) > 1 else 8,
         int(args[2]) if len(args) > 2 else 30)
