"""`suite=train` on the CPU at tiny sizes: both paths run, their gradients agree with the fp64 oracle, and sizes
whose scores cannot fit are refused before anything is allocated."""

import pytest

from gr_plugin.bench import train


def test_cpu_rows_time_both_paths_and_check_their_gradients():
    rows = train.run(device="cpu", head_dims=[16], batch_sizes=[3], histories=[20], stack_histories=[20],
                     candidates=4, heads=2, layers=2, hidden=32, repeats=2)
    assert [r["part"] for r in rows] == ["attention", "stack"]
    for r in rows:
        assert r["device"] == "cpu" and r["dtype"] == "float32" and r["reference_ms"] > 0 and r["kernels_ms"] > 0
        assert r["speedup"] == pytest.approx(r["reference_ms"] / r["kernels_ms"], rel=0.02)
    assert rows[0]["reference_grad_err"] < 1e-5 and rows[0]["kernels_grad_err"] < 1e-5


def test_cpu_sizes_that_cannot_fit_are_refused():
    with pytest.raises(ValueError, match=r"batch 8, 4 heads and 4352 tokens a user needs 4\.5 GiB"):
        train.run(device="cpu")
    with pytest.raises(ValueError, match=r"train\.device must be cuda or cpu, got 'tpu'"):
        train.run(device="tpu")
    with pytest.raises(ValueError, match=r"train\.dtype on cpu must be one of \['float32'\] or null, got 'bfloat16'"):
        train.run(device="cpu", dtype="bfloat16")
