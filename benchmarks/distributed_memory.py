"""Per-rank memory of the main job under ``torchrun`` against the world size, before and after
per-rank data sharding.

Runs a reduced CIFAR-10 main job (all 50,000 training images; ``kron_single`` and
``kron_debiased``, 2 repeats each, so 4 (method, repeat) jobs; last layer; 500 test images; the
projected probit at two prior precisions) with world size 1 (a plain process), 2 and 4 (``python
-m torch.distributed.run --standalone``, gloo on 127.0.0.1), one thread per rank
(``OMP_NUM_THREADS=1``). Each rank records its peak resident set size (``VmHWM``), its resident set
after importing torch and the package (``VmRSS`` before the job, the baseline), and the bytes of
training data its fits' data set holds (images and labels of the rows it holds). "after" is this
checkout; "before" is ``--before DIR``, a checkout of the code before sharding (its commit is
recorded), run with the same options and the same model cache. The MAP model is trained once by a
warm-up run (``--epochs``) and loaded from the cache by every measured run, so no measured rank
trains. Writes ``benchmarks/results/distributed_memory.{json,md}``.

    nice -n 10 python benchmarks/distributed_memory.py --before BEFORE_CHECKOUT --worlds 1 2 4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ["--data", "cifar10", "--eval", "cifar10-test", "--eval-size", "500", "--subset", "last_layer",
       "--methods", "kron_single", "kron_debiased", "--repeats", "2", "--links", "probit_projected",
       "--prior-precisions", "1", "100", "--n-samples", "8", "--quiet"]
MIB = 2**20


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _data_bytes(ds: object) -> int:
    """Bytes of the training rows a data set holds (a ``Subset``: its data set's)."""
    from torch.utils.data import Subset

    if isinstance(ds, Subset):
        return _data_bytes(ds.dataset)
    try:
        from laplace_debiased.data.shards import held_bytes
    except ImportError:  # the code before sharding: a whole ImageDataset
        return ds.images.nbytes + ds.labels.nbytes
    return held_bytes(ds)


def child(record: Path, argv: list[str]) -> None:
    """One rank: run the CLI, record peak RSS, baseline RSS and the fits' data bytes."""
    import laplace_debiased.evaluation.pipeline as pipeline
    from laplace_debiased import cli

    baseline = _status_kib("VmRSS")
    seen: list[int] = []
    method = pipeline._method

    def spy(name, model, train, opts):  # the data set the fits read
        seen.append(_data_bytes(train))
        return method(name, model, train, opts)

    pipeline._method = spy
    status = cli.main(argv)
    rank = int(os.environ.get("RANK", "0"))
    record.mkdir(parents=True, exist_ok=True)
    (record / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "status": status, "peak_rss_mib": round(_status_kib("VmHWM") / 1024, 1),
        "baseline_rss_mib": round(baseline / 1024, 1),
        "data_mib": round(max(seen, default=0) / MIB, 1)}))


def run(code: Path, world: int, cache: Path, extra: list[str]) -> list[dict]:
    """The reduced job on ``world`` ranks with the package of ``code``; each rank's record."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(PYTHONPATH=str(code), OMP_NUM_THREADS="1", LAPLACE_DEBIASED_CACHE=str(cache))
        launch = [sys.executable]
        if world > 1:
            launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
        cmd = [*launch, str(Path(__file__).resolve()), "--child", str(Path(tmp) / "record"), "--",
               *JOB, *extra, "--out", str(Path(tmp) / "out")]
        proc = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"world {world} ({code}) failed:\n{proc.stderr[-3000:]}")
        return [json.loads((Path(tmp) / "record" / f"rank{r}.json").read_text()) for r in range(world)]


def _commit(code: Path) -> str:
    out = subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def table(rows: list[dict]) -> str:
    """Markdown: one line per (code, world, rank)."""
    lines = ["| code | world | rank | training data held [MiB] | peak RSS [MiB] | RSS after imports [MiB] "
             "| peak − imports [MiB] |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        for r in row["ranks"]:
            lines.append(f"| {row['code']} | {row['world']} | {r['rank']} | {r['data_mib']} | {r['peak_rss_mib']} "
                         f"| {r['baseline_rss_mib']} | {r['peak_rss_mib'] - r['baseline_rss_mib']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--before", type=Path, help="checkout of the code before sharding (optional)")
    parser.add_argument("--data-root", default=os.environ.get("LAPLACE_DEBIASED_DATA",
                                                              str(Path.home() / ".cache/laplace-debiased/data")))
    parser.add_argument("--epochs", type=int, default=1, help="MAP training epochs (warm-up run only)")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "ld-distributed-memory-cache")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "distributed_memory")
    parser.add_argument("--note", default="", help="recorded with the results (e.g. the machine's load)")
    args = parser.parse_args()
    extra = ["--data-root", args.data_root, "--epochs", str(args.epochs)]
    run(ROOT, 1, args.cache, extra)  # warm-up: trains (or loads) the MAP model into the cache
    codes = [("after", ROOT)] + ([("before", args.before.resolve())] if args.before else [])
    rows = []
    for label, code in codes:
        for world in args.worlds:
            rows.append({"code": label, "commit": _commit(code), "world": world,
                         "ranks": run(code, world, args.cache, extra)})
            print(json.dumps(rows[-1]), flush=True)
    command = shlex.join(["python", "benchmarks/distributed_memory.py", *sys.argv[1:]])
    meta = {"command": command, "job": JOB + extra, "threads_per_rank": 1, "note": args.note,
            "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "load_average": os.getloadavg()}
    args.out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    args.out.with_suffix(".md").write_text(
        f"# Per-rank memory under torchrun\n\nCommand: `{command}`\n\n"
        f"Job: `laplace-debiased {' '.join(JOB + extra)}` (MAP model from the cache), one thread per rank, "
        f"gloo on 127.0.0.1. {args.note}\n\n{table(rows)}\n")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(Path(sys.argv[2]), sys.argv[4:])
    else:
        main()
