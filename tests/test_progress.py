"""Progress bars (:mod:`laplace_debiased._progress`): shown on a terminal only, never when quiet."""

from __future__ import annotations

import sys

from laplace_debiased import _progress


def test_progress_bars_only_on_a_terminal_and_never_when_quiet(monkeypatch):
    class Tty:
        def __init__(self, tty: bool):
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

        def write(self, text: str) -> int:
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stderr", Tty(False))
    assert not _progress.progress_enabled() and _progress.progress_bar(range(3), desc="x").disable
    monkeypatch.setattr(sys, "stderr", Tty(True))
    assert _progress.progress_enabled() and not _progress.progress_enabled(quiet=True)
    assert list(_progress.progress_bar(range(3), desc="x")) == [0, 1, 2]
