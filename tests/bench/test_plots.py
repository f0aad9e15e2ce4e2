"""The benchmark plots: Markdown tables read by section, cells reduced to numbers, PNGs drawn, and
every plot of conf/plot.yaml drawable from the tables recorded in docs/BENCHMARKS.md."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gr_plugin.bench.plots import PlotSpec, cell_value, plot_table, read_tables, select

ROOT = Path(__file__).resolve().parents[2]

DOC = """# Results
intro | not a table

## Block
| size | full ms (eager / graph) | cached ms (eager / graph) |
|---|---|---|
| 128 | 2.47 / 1.76 | 5.90 / 0.60 |
| 256 | **9.99** / 9.75 | 3.97 / 1.91 |

Re-run:

| size | full ms (eager / graph) | cached ms (eager / graph) |
|:---|---:|---|
| 128 | 2.0 / 1.5 | 1.0 / 0.5 |

### Other
| a | b |
|---|---|
| x | 89% |
"""


def test_tables_are_read_by_section_in_order():
    tables = read_tables(DOC)
    assert list(tables) == ["Block", "Other"]
    first, rerun = tables["Block"]
    assert first.header == ["size", "full ms (eager / graph)", "cached ms (eager / graph)"]
    assert first.rows[1] == ["256", "**9.99** / 9.75", "3.97 / 1.91"] and rerun.rows == [["128", "2.0 / 1.5",
                                                                                           "1.0 / 0.5"]]
    assert tables["Other"][0].column("b") == ["89%"]
    with pytest.raises(ValueError, match="no column 'c'"):
        tables["Other"][0].column("c")


@pytest.mark.parametrize(("cell", "pick", "want"), [
    ("2.47 / 1.76", "min", 1.76), ("2.47 / 1.76", "first", 2.47), ("1.62x / 0.50x", "last", 0.5),
    ("**5.02x**", "first", 5.02), ("2.48 (2.48)", "max", 2.48), ("89%", "first", 89.0), ("4096 (64 MB)", "first", 4096),
    ("6.0e-07", "first", 6e-7), ("-3", "min", -3.0)])
def test_cell_value(cell, pick, want):
    assert cell_value(cell, pick) == pytest.approx(want)


def test_bad_cells_and_picks_name_the_value():
    with pytest.raises(ValueError, match="cell 'n/a' holds no number"):
        cell_value("n/a")
    with pytest.raises(ValueError, match="got 'median'"):
        cell_value("1 / 2", "median")


def test_plot_is_a_png_of_the_chosen_table(tmp_path):
    tables = read_tables(DOC)
    spec = PlotSpec(name="b", section="Block", x=["size"], pick="last", labels=["full", "cached"], log=True,
                    y=["full ms (eager / graph)@min", "cached ms (eager / graph)"])
    assert select(tables, spec).rows[0][0] == "128" and len(select(tables, spec).rows) == 1  # the last table
    path = plot_table(select(tables, spec), spec, tmp_path / "p" / "b.png", source="DOC")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no table under a heading 'Nope'"):
        select(tables, PlotSpec(name="n", section="Nope", x=["a"], y=["b"]))
    with pytest.raises(ValueError, match="table 2 of 2 under 'Block'"):
        select(tables, PlotSpec(name="n", section="Block", x=["size"], y=["a"], table=2))
    with pytest.raises(ValueError, match="1 labels for 2 bars"):
        plot_table(select(tables, spec), PlotSpec(**{**spec.__dict__, "labels": ["x"]}), tmp_path / "x.png")


def test_every_configured_plot_draws_from_the_recorded_tables(tmp_path):
    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "plot.yaml"))
    tables = read_tables((ROOT / cfg["source"]).read_text())
    names = set()
    for raw in cfg["plots"]:
        spec = PlotSpec(**raw)
        names.add(spec.name)
        assert plot_table(select(tables, spec), spec, tmp_path / f"{spec.name}.png").stat().st_size > 1000
    # the committed PNGs are the configured ones, and the results document shows each of them
    assert {p.stem for p in (ROOT / cfg["out_dir"]).glob("*.png")} == names
    doc = (ROOT / cfg["source"]).read_text()
    assert all(f"plots/{n}.png" in doc for n in names)
