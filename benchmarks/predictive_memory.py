"""Peak memory of ``la(x)`` over many inputs: the quick start's fit and predictive on the
main job's digits CNN and the 1,000 digits test images, and 10,000 CIFAR-10 test images through ``cifar_cnn`` with ``debiased_kron`` over all
weights.

Each case runs in a fresh Python process (:func:`benchmarks._children.run_children`) with
``--threads`` threads.  It records the process's peak resident set (``VmHWM``, all of it: torch,
data, model, fit and predictive), the peak during the predictive alone (``VmHWM`` reset through
``/proc/self/clear_refs`` just before ``la(x)``) and the resident set before it, and the
predictive's wall time.

* ``digits``: the quick start's fit and predictive on the main job's MAP ``digits_cnn`` (trained once,
  then cached), ``Laplace(..., "debiased_kron")``, ``fit`` on a shuffling loader of 32, δ by
  ``gridsearch`` on the validation NLL, then ``probs = la(x, pred_type="glm",
  link_approx="probit")`` on all 1,000 test images in one call.
* ``cifar``: ``cifar_cnn`` (56,714 weights, seeded initialisation: memory does not depend on
  training), ``debiased_kron`` over all weights fitted on two batches of 128 training images,
  δ = 1, then ``la(x, pred_type="glm", link_approx="probit")`` on the 10,000 test images in
  one call.  The match: on the first ``--check`` (16) test images, the chunked ``la(x)`` against the
  same call in one piece (``predictive_chunk_size = n``), and the functional variance from the
  per-example Jacobians the predictive uses against laplace-torch's batch Jacobians
  (``la.backend.jacobians``).

Writes ``benchmarks/results/predictive_memory.{json,md}``.

    OMP_NUM_THREADS=1 python benchmarks/predictive_memory.py --data DIR   # DIR holds cifar-10-batches-bin/
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
MIB = 2**20
TARGET_MIB = 2048


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _measured(predict) -> tuple[object, dict]:
    """``predict()`` with the resident set before it, its peak during it and its wall time."""
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    start = time.perf_counter()
    out = predict()
    seconds = time.perf_counter() - start
    return out, {"rss_before_mib": round(before / 1024, 1),
                 "predictive_peak_mib": round(_status_kib("VmHWM") / 1024, 1),
                 "predictive_s": round(seconds, 2)}


def digits_case() -> dict:
    """The quick start's fit and predictive on the 1,000 digits test images (module docstring)."""
    import torch
    from laplace import Laplace
    from torch.utils.data import DataLoader

    import laplace_debiased  # noqa: F401
    from laplace_debiased.evaluation.training import default_digits_model

    torch.manual_seed(0)
    model, splits = default_digits_model(log=None)
    train_loader = DataLoader(splits["train"], batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
    val_loader = DataLoader(splits["val"], batch_size=256)
    x, _ = splits["test"].tensors
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="debiased_kron")
    la.fit(train_loader)
    la.optimize_prior_precision(method="gridsearch", val_loader=val_loader, pred_type="glm", link_approx="probit")
    probs, row = _measured(lambda: la(x, pred_type="glm", link_approx="probit"))
    assert probs.shape == (len(x), 10) and torch.isfinite(probs).all()
    return {"inputs": len(x), "n_params": la.n_params, "chunk_size": la.chunk_size(), **row}


def cifar_case(data: str, n_check: int) -> dict:
    """10,000 CIFAR-10 test images through ``cifar_cnn`` with ``debiased_kron`` (module docstring)."""
    import torch
    from laplace import Laplace
    import numpy as np
    from torch.utils.data import DataLoader, TensorDataset

    import laplace_debiased  # noqa: F401
    from laplace_debiased.data.cifar import cifar_splits
    from laplace_debiased.evaluation.models import cifar_cnn

    splits = cifar_splits(Path(data), n_val=5000, seed=0, verify="structure")
    train = TensorDataset(*splits["train"].subset(np.arange(256)).tensors())
    x = splits["test"].tensors()[0]
    del splits
    torch.manual_seed(0)
    model = cifar_cnn().eval()
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="debiased_kron",
                 prior_precision=1.0)
    la.fit(DataLoader(train, batch_size=128))
    probs, row = _measured(lambda: la(x, pred_type="glm", link_approx="probit"))
    assert probs.shape == (len(x), 10) and torch.isfinite(probs).all()
    return {"inputs": len(x), "n_params": la.n_params, "chunk_size": la.chunk_size(), **row,
            **_cifar_match(la, x[:n_check], probs[:n_check])}


def _cifar_match(la, x, chunked_probs) -> dict:
    """How far the chunked predictive is from the one-piece call and from laplace-torch's Jacobians."""
    import torch

    chunk = la.predictive_chunk_size
    la.predictive_chunk_size = len(x)
    whole = la(x, pred_type="glm", link_approx="probit")
    la.predictive_chunk_size = chunk
    _, f_var = la._glm_predictive_distribution(x)
    Js, _ = la.backend.jacobians(x)
    reference = la.functional_variance(Js)
    return {"check_inputs": len(x),
            "max_abs_diff_probs_vs_one_piece": float((whole - chunked_probs).abs().max()),
            "max_rel_diff_fvar_vs_laplace_torch_jacobians":
                float((f_var - reference).abs().max() / reference.abs().max()),
            "float32_eps": float(torch.finfo(torch.float32).eps)}


def child(which: str, args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    row = digits_case() if which == "digits" else cifar_case(args.data, args.check)
    row.update({"which": which, "process_peak_mib": round(_status_kib("VmHWM") / 1024, 1)})
    print(json.dumps(row), flush=True)


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "# Peak memory of `la(x)` over many inputs",
        "",
        f"`python benchmarks/predictive_memory.py` ({meta['threads']} thread(s), {meta['machine']}). "
        f"Target: under {TARGET_MIB} MiB. The process peak counts everything (torch, data, model, "
        "fit, predictive); the predictive peak is the peak during `la(x)` alone.",
        "",
        "| case | inputs | P | chunk | RSS before `la(x)` MiB | peak during `la(x)` MiB | process peak MiB | `la(x)` s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['which']} | failed: {r['failed'][-200:]!r} |||||||")
            continue
        lines.append(f"| {r['which']} | {r['inputs']} | {r['n_params']} | {r['chunk_size']} | {r['rss_before_mib']} | "
                     f"{r['predictive_peak_mib']} | {r['process_peak_mib']} | {r['predictive_s']} |")
    for r in rows:
        if "check_inputs" in r:
            lines += ["", f"Match ({r['which']}, first {r['check_inputs']} test images): max |Δp| against the "
                      f"one-piece call {r['max_abs_diff_probs_vs_one_piece']:.2e}; functional variance from the "
                      f"per-example Jacobians against laplace-torch's batch Jacobians: max relative difference "
                      f"{r['max_rel_diff_fvar_vs_laplace_torch_jacobians']:.2e} (float32 eps "
                      f"{r['float32_eps']:.2e})."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=["digits", "cifar"])
    parser.add_argument("--cases", nargs="+", default=["digits", "cifar"], choices=["digits", "cifar"])
    parser.add_argument("--data", help="folder holding cifar-10-batches-bin/ (the cifar case)")
    parser.add_argument("--check", type=int, default=16,
                        help="test images of the cifar match check (laplace-torch's batch Jacobians need memory quadratic in it)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.child:
        child(args.child, args)
        return
    if "cifar" in args.cases and not args.data:
        parser.error("the cifar case needs --data DIR (a folder holding cifar-10-batches-bin/)")
    from benchmarks._children import run_children

    argv = ["--threads", str(args.threads), "--check", str(args.check)] + (["--data", args.data] if args.data else [])
    rows = run_children(__file__, args.cases, argv)
    meta = {"threads": args.threads, "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
            "python": platform.python_version()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "predictive_memory.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (RESULTS / "predictive_memory.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
