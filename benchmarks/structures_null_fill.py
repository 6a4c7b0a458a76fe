"""Exploratory, after the pre-registered run (``benchmarks/PROTOCOL_STRUCTURES.md``) and not part of its
decision: is the pooled null-space fill why ``debiased_full``'s corrected estimates lose to ``"paper"``?

    OMP_NUM_THREADS=1 python benchmarks/structures_null_fill.py [--seeds 31000 31008] [--b 64]

The setting, candidates and metric M of ``benchmarks/digits_structure_estimates.py`` (same MAP and
data), on seeds outside the protocol's range. ``corrected`` and ``stein`` as offered to the run
(the pooled null space filled with the two orders' null-run gap), and each with its pooled null space
left empty (``-nofill``: only the range's corrected eigenvalues). Writes
``results/structures_null_fill.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.digits_structure_estimates import N_TRAIN, candidates, data, ggn_rows, jacobians, test_nll, train_map
from laplace_debiased.evaluation.tracking import largest_gap, mean_stderr

HERE = Path(__file__).resolve().parent
SHOWN = ("single", "paper", "corrected", "corrected-nofill", "stein", "stein-nofill")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs=2, default=[31000, 31008], metavar=("FIRST", "STOP"))
    parser.add_argument("--b", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    (Xtr, ytr), (Xte, yte) = data()
    model = train_map(Xtr, ytr)
    V = ggn_rows(*jacobians(model, Xtr))
    J, f_mu = jacobians(model, Xte)
    flat = V.reshape(-1, V.shape[-1])
    L, Q = torch.linalg.eigh(flat.T @ flat / N_TRAIN)
    ref = test_nll((Q, L.clamp(min=0), 0.0), J, f_mu, yte)
    rows = []
    for seed in range(*args.seeds):
        perm = torch.randperm(N_TRAIN, generator=torch.Generator().manual_seed(seed))
        ests, _ = candidates(V[perm[:args.b // 2]], V[perm[args.b // 2:args.b]])
        for rule in ("corrected", "stein"):
            ests[rule + "-nofill"] = (*ests[rule][:2], 0.0)
        rows.append({"seed": seed, **{c: 100 * largest_gap(test_nll(ests[c], J, f_mu, yte), ref) for c in SHOWN}})
        print(rows[-1], flush=True)
    paired = {f"{c} − paper": mean_stderr([r[c] - r["paper"] for r in rows]) for c in SHOWN[2:]}
    paired.update({f"{r} − {r}-nofill": mean_stderr([x[r] - x[r + "-nofill"] for x in rows]) for r in ("corrected", "stein")})
    (HERE / "results" / "structures_null_fill.json").write_text(
        json.dumps({"b": args.b, "seeds": list(range(*args.seeds)), "draws": rows, "paired": paired}, indent=1) + "\n")
    cmd = "OMP_NUM_THREADS=1 python benchmarks/structures_null_fill.py" + (
        "" if (args.seeds, args.b) == ([31000, 31008], 64) else f" --seeds {args.seeds[0]} {args.seeds[1]} --b {args.b}")
    lines = ["# Exploratory: debiased_full's corrected estimates with and without the pooled null-space fill", "",
             f"Written by `{cmd}` (module docstring). Not part of the pre-registered run: {len(rows)} draws only, "
             f"b = {args.b}, seeds {args.seeds[0]} … {args.seeds[1] - 1}. M: largest relative test-NLL gap over δ to "
             "the full batch (points).", "",
             "| " + " | ".join(SHOWN) + " |", "|" + "---|" * len(SHOWN),
             "| " + " | ".join("{:.2f} ± {:.2f}".format(*mean_stderr([r[c] for r in rows])) for c in SHOWN) + " |", "",
             "| paired difference (points) | mean ± s.e. |", "|---|---|"]
    lines += [f"| {k} | {m:+.2f} ± {se:.2f} |" for k, (m, se) in paired.items()]
    (HERE / "results" / "structures_null_fill.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
