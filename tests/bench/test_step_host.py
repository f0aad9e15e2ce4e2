from gr_plugin.bench import step_host


def test_prepare_of_returning_users_is_timed_and_rolled_back():
    rows = step_host.run(batch_sizes=(2,), history_lens=(256,), new_tokens=64, num_candidates=8, page_size=32,
                         repeats=3, device="cpu")
    (row,) = rows
    assert row["batch"] == 2 and row["history"] == 256 and row["device"] == "cpu"
    assert 0 < row["prepare_us_p50"] <= row["prepare_us_p90"]
