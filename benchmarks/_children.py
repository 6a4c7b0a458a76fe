"""Run each side of a comparison in a fresh Python process, so that each has its own peak-memory
counter (``ru_maxrss``) and its own memory limit."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence


def run_children(script: str, whiches: Sequence[str], argv: Sequence[str]) -> list[dict]:
    """``python script --child W *argv`` for each ``W`` in ``whiches``, one after the other.

    Each child prints its result as a JSON object on a line of its own (the last such line counts).
    A child that prints none (it failed, or ran out of its memory limit) gives
    ``{"which": W, "failed": <the last 500 characters of its stderr>}``.  Each result is printed
    as it arrives.
    """
    results = []
    for which in whiches:
        proc = subprocess.run([sys.executable, script, "--child", which, *argv], capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        results.append(json.loads(lines[-1]) if lines else {"which": which, "failed": proc.stderr[-500:]})
        print(results[-1], flush=True)
    return results
