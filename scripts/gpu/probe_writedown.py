"""Where the write-down's read of the host pages runs: on the tier's worker (as shipped) or on the commit's thread.

    python3 scripts/gpu/probe_writedown.py worker|caller <kvcache option> [hydra overrides ...]

``caller`` restores the read before 4d231ca for this run: `TieredBackend._on_published` gathers the published host
slots on the caller's thread and hands the worker staged pages (no slot generations compared); ``worker`` changes
nothing. Then runs `profile_infer.py` (its stage table). Run the two interleaved in one device call to compare them.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import profile_infer

from gr_plugin.cache import tiered


def _on_published_caller(self, key, first_page, slots, hashes, from_lower_tier):
    targets = self._write_targets(from_lower_tier)
    if targets:
        self._write_down(key, first_page, hashes, self._stage(torch.tensor(slots, dtype=torch.int64)), targets)


if __name__ == "__main__":
    variant = sys.argv.pop(1)
    if variant not in ("worker", "caller"):
        raise SystemExit(f"variant must be worker or caller, got {variant!r}")
    if variant == "caller":
        tiered.TieredBackend._on_published = _on_published_caller
    print(f"== write-down read on the {variant}")
    profile_infer.main()
