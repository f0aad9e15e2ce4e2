"""The request checks and cache keys of a step, C++ against numpy, in one process (CPU only).

python3 scripts/probe_step_checks.py [batch_size ...] -> per batch size (history 4096, 256
candidates each), the median µs of `validate_ids` and `cache_token_keys` through the core's C++ ops
and through their numpy references (``native=False`` / `_numpy_validate`), the forms taking turns
call by call, so a host whose speed drifts (a shared VM) shifts both alike.
"""

import statistics
import sys

import torch

from gr_plugin.bench.common import interleaved_us
from gr_plugin.csrc.core import build as core_build
from gr_plugin.modules.tokens import _numpy_validate, cache_token_keys, validate_ids

TABLES = dict(num_items=50_000, num_actions=5, num_time_buckets=32)


def main(batch_sizes, repeats=2000):
    core_build.load()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    for bs in batch_sizes:
        n = bs * 4096
        cols = (torch.randint(1, 50_000, (n,), generator=g), torch.randint(0, 5, (n,), generator=g),
                torch.randint(0, 32, (n,), generator=g))
        hl, cl = torch.full((bs,), 4096), torch.full((bs,), 256)
        cand = torch.randint(1, 50_000, (bs * 256,), generator=g)
        forms = {
            "validate C++": lambda: validate_ids(hl, cols, cl, cand, **TABLES),
            "validate numpy": lambda: _numpy_validate(hl, cols, cl, cand, *TABLES.values()),
            "keys C++": lambda: cache_token_keys(*cols),
            "keys numpy": lambda: cache_token_keys(*cols, native=False),
        }
        assert torch.equal(forms["keys C++"](), forms["keys numpy"]())
        times = interleaved_us(forms, repeats)
        print(f"bs {bs} x 4096: " + ", ".join(f"{name} {statistics.median(t):.1f} µs" for name, t in times.items()),
              flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 8])
