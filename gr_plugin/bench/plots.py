"""PNG plots of the benchmark tables recorded in docs/BENCHMARKS.md.

Owns reading the Markdown tables of a results document (`read_tables`: tables by section heading)
and drawing one of them as a grouped bar chart (`plot_table`) from a `PlotSpec`: which columns name
a group (x), which columns are bars (y), how a cell holding several figures (``"2.47 / 1.76"``,
``"1.62x / 0.50x"``, ``"2.48 (2.48)"``) becomes one number. ``python -m recipes.plot`` draws every
plot of ``conf/plot.yaml``; the figures are the recorded ones, so a plot changes only with its table.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


@dataclasses.dataclass
class Table:
    header: list[str]
    rows: list[list[str]]

    def column(self, name: str) -> list[str]:
        if name not in self.header:
            raise ValueError(f"no column {name!r} in the table; its columns: {self.header}")
        i = self.header.index(name)
        return [r[i] for r in self.rows]


@dataclasses.dataclass
class PlotSpec:
    """One plot: table ``table`` (index among the tables of section ``section``; -1 the last) of the
    document, groups named by the ``x`` columns, one bar per ``y`` column; a cell's figures reduced
    by ``pick`` (``first``, ``last``, ``min``, ``max``), or by the pick a ``y`` entry names after an
    ``@`` (``"pipelined req/s graphs / full@last"``); ``labels``: the bars' legend names."""

    name: str
    section: str
    x: list[str]
    y: list[str]
    table: int = -1
    pick: str = "first"
    ylabel: str = ""
    title: str = ""
    log: bool = False
    labels: list[str] | None = None
    rows: list[int] | None = None  # keep only these rows (indices into the table), in this order


def read_tables(text: str) -> dict[str, list[Table]]:
    """Every Markdown table of ``text`` under the nearest heading above it (``#`` text, no hashes)."""
    out: dict[str, list[Table]] = {}
    heading, lines = "", text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif line.startswith("|") and i + 1 < len(lines) and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+",
                                                                           lines[i + 1].strip()):
            header = _cells(line)
            rows, i = [], i + 2
            while i < len(lines) and lines[i].strip().startswith("|"):
                rows.append(_cells(lines[i].strip()))
                i += 1
            bad = [r for r in rows if len(r) != len(header)]
            if bad:
                raise ValueError(f"a row of a table under {heading!r} has {len(bad[0])} cells, its header "
                                 f"{len(header)}: {bad[0]}")
            out.setdefault(heading, []).append(Table(header, rows))
            continue
        i += 1
    return out


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def cell_value(cell: str, pick: str = "first") -> float:
    """The number a cell stands for: its figures (``**`` emphasis, ``x``, ``%`` and units ignored)
    reduced by ``pick``."""
    figures = [float(m) for m in _NUMBER.findall(cell.replace("**", ""))]
    if not figures:
        raise ValueError(f"cell {cell!r} holds no number")
    if pick == "first":
        return figures[0]
    if pick == "last":
        return figures[-1]
    if pick in ("min", "max"):
        return min(figures) if pick == "min" else max(figures)
    raise ValueError(f"pick must be first, last, min or max, got {pick!r}")


def select(tables: dict[str, list[Table]], spec: PlotSpec) -> Table:
    if spec.section not in tables:
        raise ValueError(f"plot {spec.name!r}: no table under a heading {spec.section!r}; headings with "
                         f"tables: {sorted(tables)}")
    found = tables[spec.section]
    if not -len(found) <= spec.table < len(found):
        raise ValueError(f"plot {spec.name!r}: table {spec.table} of {len(found)} under {spec.section!r}")
    t = found[spec.table]
    if spec.rows is not None:
        t = Table(t.header, [t.rows[i] for i in spec.rows])
    return t


def plot_table(table: Table, spec: PlotSpec, path: str | Path, source: str = "") -> Path:
    """A grouped bar chart of ``table`` as ``spec`` says, written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [" · ".join(parts) for parts in zip(*(table.column(c) for c in spec.x))]
    if spec.labels is not None and len(spec.labels) != len(spec.y):
        raise ValueError(f"plot {spec.name!r}: {len(spec.labels)} labels for {len(spec.y)} bars")
    bars = {}
    for k, entry in enumerate(spec.y):
        column, _, pick = entry.partition("@")
        label = spec.labels[k] if spec.labels else entry
        bars[label] = [cell_value(v, pick or spec.pick) for v in table.column(column)]
    width = 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(groups) * len(bars) ** 0.5 + 2), 4.2))
    for k, (name, values) in enumerate(bars.items()):
        xs = [g + (k - (len(bars) - 1) / 2) * width for g in range(len(groups))]
        drawn = ax.bar(xs, values, width, label=name)
        ax.bar_label(drawn, labels=[f"{v:.0f}" if abs(v) >= 1000 else f"{v:.3g}" for v in values], fontsize=7,
                     padding=1)
    ax.set_xticks(range(len(groups)), groups, rotation=30 if len(groups) > 4 else 0, ha="right" if
                  len(groups) > 4 else "center", fontsize=8)
    ax.set_xlabel(" · ".join(spec.x))
    ax.set_ylabel(spec.ylabel)
    if spec.log:
        ax.set_yscale("log")
    ax.set_title(spec.title or spec.section, fontsize=10)
    ax.legend(fontsize=8)
    if source:
        fig.text(0.01, 0.01, source, fontsize=6, color="gray")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
