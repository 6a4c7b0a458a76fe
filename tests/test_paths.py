"""Where the package keeps its files (:mod:`laplace_debiased.paths`): the environment variables
override the defaults under the home folder."""

from __future__ import annotations

from pathlib import Path

from laplace_debiased.paths import default_cache_dir, default_data_root


def test_defaults_are_under_the_home_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("LAPLACE_DEBIASED_CACHE", raising=False)
    monkeypatch.delenv("LAPLACE_DEBIASED_DATA", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "laplace-debiased"
    assert default_data_root() == tmp_path / ".cache" / "laplace-debiased" / "data"


def test_the_cache_variable_moves_the_cache_and_the_data_root_with_it(monkeypatch, tmp_path):
    monkeypatch.setenv("LAPLACE_DEBIASED_CACHE", str(tmp_path / "c"))
    monkeypatch.delenv("LAPLACE_DEBIASED_DATA", raising=False)
    assert default_cache_dir() == tmp_path / "c"
    assert default_data_root() == tmp_path / "c" / "data"


def test_the_data_variable_moves_only_the_data_root(monkeypatch, tmp_path):
    monkeypatch.setenv("LAPLACE_DEBIASED_CACHE", str(tmp_path / "c"))
    monkeypatch.setenv("LAPLACE_DEBIASED_DATA", str(tmp_path / "d"))
    assert default_data_root() == tmp_path / "d" and default_cache_dir() == tmp_path / "c"
    monkeypatch.setenv("LAPLACE_DEBIASED_DATA", "")  # empty: as if unset
    assert default_data_root() == Path(tmp_path / "c" / "data")
