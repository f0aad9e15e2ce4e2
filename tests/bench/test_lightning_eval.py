from gr_plugin.bench import lightning_eval


def test_the_three_ways_agree_and_the_callback_reuses_the_history_on_cpu():
    (row,) = lightning_eval.run(batch_sizes=(2,), num_users=3, min_len=32, max_len=96, stride=32, num_candidates=8,
                                hidden=32, layers=2, heads=2, head_dim=16, page_size=16)
    assert row["requests"] == 9 and row["batches"] == 6  # 3 users x 3 visits, at most 2 users a batch
    assert row["eager_max_abs_diff"] <= 1e-5 and row["graph_max_abs_diff"] <= 1e-5
    # visits of 32, 64 and 96 events: 0, 32 and 64 of them come from the cache
    assert row["hit_rate"] == (0 + 32 + 64) / (32 + 64 + 96) and row["fallbacks"] == 0
    assert row["graph_replays"] == 0 and row["captures_measured"] == 0  # no CUDA here: the eager step
    for way in ("full", "eager", "graph"):
        assert row[f"{way}_req_s"] > 0 and row[f"{way}_ms_p50"] > 0
    assert set(row) <= set(lightning_eval.COLUMNS)
