"""Which build directory each C++ builder uses (`gr_plugin.csrc.build`, `gr_plugin.csrc.core.build`): one per
source content and per checkout, so two checkouts with the same sources keep their own builds.

cpp_extension writes the sources' absolute paths into ``build.ninja``: two checkouts sharing a directory
rebuilt each other's library on every switch. Nothing is compiled here: the builders' sources are pointed
at copies in temporary directories and only the directories they would build in are compared.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gr_plugin.csrc import build as ops_build
from gr_plugin.csrc.core import build as core_build


def _checkout(root: Path, files: list[Path]) -> Path:
    root.mkdir(parents=True)
    for f in files:
        shutil.copy2(f, root / f.name)
    return root


@pytest.fixture
def ops_in(monkeypatch, tmp_path):
    """Point the gr_kv ops builder at a copy of its sources in ``directory``; returns its build directory."""
    monkeypatch.setenv("GR_PLUGIN_BUILD_DIR", str(tmp_path / "builds"))

    def build_directory(directory: Path) -> Path:
        monkeypatch.setattr(ops_build, "SOURCES", tuple(directory / s.name for s in ops_build.SOURCES))
        return ops_build.build_directory()

    return build_directory


@pytest.fixture
def core_in(monkeypatch, tmp_path):
    """Point the core builder at a copy of its sources in ``directory``; returns its build directory."""
    monkeypatch.setenv("GR_KV_CORE_BUILD_DIR", str(tmp_path / "builds"))

    def build_directory(directory: Path, with_xxhash: bool = True) -> Path:
        monkeypatch.setattr(core_build, "SOURCE_DIR", directory)
        return core_build.build_directory(with_xxhash)

    return build_directory


def test_ops_checkouts_with_the_same_sources_build_in_their_own_directories(ops_in, tmp_path):
    a = _checkout(tmp_path / "a", list(ops_build.SOURCES))
    b = _checkout(tmp_path / "b", list(ops_build.SOURCES))
    assert ops_in(a) != ops_in(b)  # before: the same directory, and each load rebuilt the other's library
    assert ops_in(a) == ops_in(a)  # a checkout keeps its build
    assert ops_in(a).parent == ops_in(b).parent == tmp_path / "builds"  # GR_PLUGIN_BUILD_DIR: the root
    (b / "gr_kv_ops.cpp").write_text((b / "gr_kv_ops.cpp").read_text() + "\n// edited\n")
    edited = ops_in(b)
    assert edited != ops_in(a)
    (b / "gr_kv_ops.cpp").write_text((a / "gr_kv_ops.cpp").read_text())
    assert ops_in(b) != edited  # the content is part of the key: an edit builds in another directory


def test_core_checkouts_with_the_same_sources_build_in_their_own_directories(core_in, tmp_path):
    files = sorted(core_build.SOURCE_DIR.glob("*.[ch]*"))
    a = _checkout(tmp_path / "a", files)
    b = _checkout(tmp_path / "b", files)
    assert core_in(a) != core_in(b)
    assert core_in(a) == core_in(a)
    assert core_in(a, with_xxhash=False) not in (core_in(a), core_in(b, with_xxhash=False))
    assert core_in(a).parent == core_in(b).parent == tmp_path / "builds"  # GR_KV_CORE_BUILD_DIR: the root
    before = core_in(b)
    (b / "kv_core.h").write_text((b / "kv_core.h").read_text() + "\n// edited\n")  # a header is content too
    assert core_in(b) != before


def test_a_symlinked_spelling_of_a_checkout_is_the_same_checkout(ops_in, tmp_path):
    a = _checkout(tmp_path / "a", list(ops_build.SOURCES))
    (tmp_path / "link").symlink_to(a)
    assert ops_in(tmp_path / "link") == ops_in(a)
