"""The xdist scheduling of tests/conftest.py: module groups, per-test modules, slow units first,
and the torch threads of a worker (an equal share, restored after each test)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import conftest


class _Item:
    """The parts of a ``pytest.Item`` that the collection hook reads and writes."""

    def __init__(self, module: SimpleNamespace | None, name: str, slow: bool = False) -> None:
        self.module = module
        self.nodeid = f"{module.__name__ if module else 'doc'}.py::{name}"
        self.markers = {"slow": pytest.mark.slow.mark} if slow else {}

    def get_closest_marker(self, name: str):
        return self.markers.get(name)

    def add_marker(self, mark) -> None:
        self.markers[mark.name] = mark.mark


def _group(item: _Item) -> str | None:
    mark = item.markers.get("xdist_group")
    return None if mark is None else mark.args[0]


def test_modules_are_units_and_slow_units_come_first_in_their_order():
    fast, slow_a, slow_b = (SimpleNamespace(__name__=n) for n in ("fast", "slow_a", "slow_b"))
    per_test = SimpleNamespace(__name__="examples", XDIST_PER_TEST=True)
    items = [_Item(fast, "t1"), _Item(slow_a, "t1"), _Item(slow_a, "t2", slow=True),
             _Item(per_test, "quick"), _Item(per_test, "long", slow=True), _Item(fast, "t2"),
             _Item(slow_b, "t1", slow=True), _Item(None, "doctest")]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == [
        "slow_a.py::t1", "slow_a.py::t2", "examples.py::long", "slow_b.py::t1",  # slow units, in order
        "fast.py::t1", "examples.py::quick", "fast.py::t2", "doc.py::doctest",  # then the rest, in order
    ]
    assert [_group(i) for i in items] == ["slow_a", "slow_a", None, "slow_b", "fast", None, "fast", None]


def test_an_explicit_xdist_group_is_kept():
    item = _Item(SimpleNamespace(__name__="mod"), "t")
    item.add_marker(pytest.mark.xdist_group("mine"))
    conftest.pytest_collection_modifyitems(None, [item])
    assert _group(item) == "mine"


@pytest.mark.parametrize(("cores", "workers", "threads"), [(2, 2, 1), (16, 2, 8), (1, 2, 1), (7, 2, 3)])
def test_worker_threads_share_the_cores(cores, workers, threads):
    assert conftest.worker_threads(cores, workers) == threads


def test_threads_a_test_changes_are_restored():
    before = torch.get_num_threads()
    with conftest.kept_torch_threads():
        torch.set_num_threads(before + 1)
        assert torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), conftest.kept_torch_threads():
        torch.set_num_threads(before + 2)
        raise RuntimeError("a failing test")
    assert torch.get_num_threads() == before
