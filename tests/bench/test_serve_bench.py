"""The serving bench end to end on the CPU (slow: two real replicas): a warm pass for other users,
then the timed replay, one row per cache option, no errors, hits only with the cache."""

import pytest

from gr_plugin.bench import serve


@pytest.mark.slow
def test_serve_bench_rows_with_a_warm_pass(tmp_path):
    rows = serve.run(workloads=("long",), kvcache=("none", "flexkv"), num_requests=24, num_threads=2, max_users=6,
                     model="hstu_tiny", warmup_requests=2, server_overrides=("device=cpu", "kvcache.num_pages=512"),
                     log_dir=str(tmp_path / "logs"))
    assert [r["kvcache"] for r in rows] == ["none", "flexkv"]
    for row in rows:
        assert row["errors"] == 0 and row["first_error"] is None, row
        assert row["requests"] == 24 and row["device"] == "cpu" and row["dtype"] == "float32"
        assert row["engine_ms_per_step"] > 0 and row["users_per_step"] >= 1
    assert rows[0]["hit_rate"] == 0 and rows[1]["hit_rate"] > 0.3  # the warm pass's users share nothing with these
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["bench-long-flexkv.log", "bench-long-none.log"]
