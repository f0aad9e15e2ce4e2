"""``python -m recipes.serve_client``: replay MovieLens-1M visits against running replicas.

E.g. ``python -m recipes.serve_client 'urls=[127.0.0.1:8000,127.0.0.1:8100]'
'metrics_urls=[http://127.0.0.1:8003/metrics,http://127.0.0.1:8103/metrics]' num_threads=8``;
prints latency p50/p99, throughput and the cache's hit rate per tier.
"""

from __future__ import annotations

import hydra

import gr_plugin.configs.serve  # noqa: F401 - registers the schemas
from gr_plugin.configs.checked import to_object
from gr_plugin.serving import client_app


@hydra.main(config_path="../conf", config_name="serve_client", version_base="1.3")
def main(cfg) -> None:
    summary = client_app.run(to_object(cfg))
    print(client_app.format_table(summary))
    if summary["errors"]:
        raise SystemExit(f"{summary['errors']} request(s) failed (see the log)")


if __name__ == "__main__":
    main()
