"""Wall time of the main job idle vs under a parallel CPU load, for several ``--threads``.

Runs ``python -m laplace_debiased`` (a reduced main job: two K-FAC methods, one batch draw each,
five prior precisions, the projected probit; the MAP model is trained once in a warm-up run and
loaded from the cache after, so the timed part is the fits and the sweep) for each thread count
(``default``: no ``--threads`` flag, so the CLI's default decides) three times: idle, beside
``--busy`` busy-loop processes started in this script's session, and beside as many started in a
session of their own (as a program started from another terminal is).  The two loads differ where
the kernel groups CPU time by session (``/proc/sys/kernel/sched_autogroup_enabled``): loops in
the job's own session share that session's CPU time with the job.  It writes
``benchmarks/results/threads_under_load.{json,md}``.  The ratio loaded/idle is the figure
of merit (target: at most 2).  On a shared machine "idle" means no load added by this script; the
load average at each start is recorded.

    python benchmarks/threads_under_load.py [--threads default 2 1] [--busy 2]

``OMP_NUM_THREADS`` is removed from the job's environment; the OpenMP variables the CLI sets
when absent (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``) are passed through if set here, and recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ["--methods", "kron_single", "kron_debiased", "--repeats", "1", "--links", "probit_projected",
       "--prior-precisions", "1", "10", "100", "1000", "10000", "--quiet"]


def run_job(threads: str, busy: int, cache: Path, own_session: bool = False) -> dict:
    """One main job with ``busy`` busy-loop processes beside it; wall seconds and load average."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=own_session)
             for _ in range(busy)]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, "LAPLACE_DEBIASED_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
            env.pop("OMP_NUM_THREADS", None)
            load = os.getloadavg()[0]
            start = time.perf_counter()
            flag = [] if threads == "default" else ["--threads", threads]
            subprocess.run([sys.executable, "-m", "laplace_debiased", *flag,
                            "--out", str(Path(tmp) / "out"), *JOB], env=env, check=True, capture_output=True)
            seconds = time.perf_counter() - start
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    return {"threads": threads, "busy_processes": busy, "busy_in_own_session": own_session,
            "seconds": round(seconds, 1), "load_average_at_start": load}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", nargs="+", default=["default", "2", "1"],
                        help="thread counts to time ('default': the CLI's own default)")
    parser.add_argument("--busy", type=int, default=2, help="busy-loop processes for the loaded runs")
    args = parser.parse_args()
    rows = []
    cache = Path(tempfile.mkdtemp(prefix="threads-under-load-"))
    run_job("1", 0, cache)  # warm-up: trains the MAP model into the cache
    for threads in args.threads:
        runs = [run_job(threads, 0, cache), run_job(threads, args.busy, cache),
                run_job(threads, args.busy, cache, own_session=True)]
        rows.append(runs)
        idle, same, own = (run["seconds"] for run in runs)
        print(f"threads {threads}: idle {idle} s; {args.busy} busy loops in this session {same} s "
              f"({same / idle:.2f}x), in their own session {own} s ({own / idle:.2f}x)", flush=True)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    openmp = {key: os.environ.get(key) for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    meta = {"cores": os.cpu_count(), "job": ["python -m laplace_debiased", *JOB], "openmp_env": openmp,
            "rows": rows}
    autogroup = Path("/proc/sys/kernel/sched_autogroup_enabled")
    meta["sched_autogroup_enabled"] = autogroup.read_text().strip() if autogroup.exists() else None
    (out / "threads_under_load.json").write_text(json.dumps(meta, indent=2))
    lines = [f"| --threads | idle (s) | {args.busy} busy loops, same session (s) | ratio "
             f"| {args.busy} busy loops, own session (s) | ratio | load avg at start |",
             "|---|---|---|---|---|---|---|"]
    for idle, same, own in rows:
        loads = " / ".join(f"{run['load_average_at_start']:.1f}" for run in (idle, same, own))
        lines.append(f"| {idle['threads']} | {idle['seconds']} | {same['seconds']} | "
                     f"{same['seconds'] / idle['seconds']:.2f} | {own['seconds']} | "
                     f"{own['seconds'] / idle['seconds']:.2f} | {loads} |")
    (out / "threads_under_load.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
