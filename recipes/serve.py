"""``python -m recipes.serve``: one replica, Triton Inference Server (through PyTriton) with the KV cache.

E.g. ``python -m recipes.serve kvcache=flexkv triton.http_port=8100`` or, for a replica sharing a
Redis tier, ``replica_id=1 kvcache.tiers.enable_3rd_remote=true kvcache.tiers.remote_url=redis://...``.
Runs until SIGTERM / SIGINT, then drains Triton and flushes pending offloads (see docs/SCALING.md).
"""

from __future__ import annotations

import json

import hydra

import gr_plugin.configs.serve  # noqa: F401 - registers the schemas
from gr_plugin.apps.common import config_object, mask_passwords, single_log_lines
from gr_plugin.serving import app


@hydra.main(config_path="../conf", config_name="serve", version_base="1.3")
def main(cfg) -> None:
    single_log_lines()
    final = app.run(config_object(cfg))
    print(json.dumps(final, indent=2, default=str))


if __name__ == "__main__":
    mask_passwords()  # (before Hydra: it prints a failed job's overrides, a URL's password included)
    main()
