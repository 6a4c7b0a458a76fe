"""The two-batch estimates of ``debiased_full`` and ``debiased_lowrank`` at equal samples, a small tanh
MLP on scikit-learn's digits (no download): paired draws, each draw cached so that an interrupted run
resumes (``benchmarks/PROTOCOL_STRUCTURES.md``).

    OMP_NUM_THREADS=1 python benchmarks/digits_structure_estimates.py --seeds 30000 30016 \\
        --cache ~/.cache/laplace-debiased-study/structures [--batch-sizes 32 64 128 256]
    python benchmarks/digits_structure_estimates.py --summary \\
        --cache ~/.cache/laplace-debiased-study/structures

The MAP: ``Linear(64, 32) - Tanh - Linear(32, 10)`` (P = 2,410 weights, so that the dense GGN's float64
eigendecomposition is fast) trained on N = 1,000 of the 1,797 digits (pixels / 16; a permutation
seeded by 0 splits them), the other 797 the test set; full-batch Adam (lr 1e-2, weight decay 1e-4, 500
steps, torch seed 0), the same MAP for every draw. The GGN of a sample is ``V_nᵀ V_n`` with
``V_n = Lᵀ J_n`` (``J_n`` the ``(10, P)`` Jacobian of the logits, ``L Lᵀ = diag(p) - ppᵀ`` the softmax
Hessian, ``Lᵀ = diag(√p) - √p pᵀ``); a batch S's estimate is ``G_S = Σ_{n∈S} V_nᵀ V_n / |S|`` and its
curvature ``H = N · G_S`` (laplace-torch's scaling). Each draw ``s`` permutes the training set
(``torch.Generator().manual_seed(s)``) and reads its first ``b`` samples: the single batch is all ``b``,
the two-batch estimates read the same ``b`` as B (first ``b/2``) and B̃ (next ``b/2``).

``debiased_full`` candidates (posterior precision ``H + δI``), reference: the full batch ``N · G_N``:

* ``single``: ``G`` of all ``b`` (stock ``FullLaplace`` on ``b`` samples);
* ``paper``: ``debiased_full``'s estimate, :func:`laplace_debiased.eigen.decompose.decompose_debiased_full`
  (B's range eigenvectors, B̃'s Rayleigh quotients, B̃'s compression on B's null space; B̃ through its
  factor, as the class computes it in one process);
* ``corrected``, ``shrunk``, ``stein``: :func:`laplace_debiased.kron.corrected.corrected_factor_rows`
  with that rule on B's and B̃'s rows (``n_data = N``), the dense route where it declines.

``debiased_lowrank`` candidates, rank ``k = 50`` (posterior precision ``N · U diag(λ) Uᵀ + δI``),
reference: the top-50 eigenpairs of ``G_N``:

* ``lr-single``: the top-``k`` eigenpairs of the ``b`` samples' ``G``;
* ``lr-paper``: ``debiased_lowrank``'s estimate, B's top-``k`` eigenvectors, B̃'s Rayleigh quotients;
* ``lr-corrected``: the pooled top-``k`` eigenvectors, their eigenvalues less the correction measured by
  the two orders' top-``k`` gaps (``benchmarks/structure_estimates.py``), clamped at 0.

For each fit and prior precision δ in 15 log-spaced values over 1e-4 … 1e3: the test NLL of the GLM
predictive with laplace-torch's probit link (``κ = (1 + π/8 · diag Σ_f)^(-1/2)``, softmax of ``κ f``,
``Σ_f = J (H + δI)⁻¹ Jᵀ`` in the fit's eigenbasis). Per draw the results are written to
``CACHE/b<b>/seed<s>.json`` (skipped when present). ``--summary`` writes
``results/structures_protocol.{json,md}`` (the metrics and decision of the protocol).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap

from laplace_debiased.curvature.linalg import gram_eigenpairs
from laplace_debiased.curvature.thresholds import EigenPairs
from laplace_debiased.curvature.linalg import order_weights
from laplace_debiased.eigen.decompose import decompose_debiased_full
from laplace_debiased.evaluation.tracking import largest_gap, mean_stderr
from laplace_debiased.kron.corrected import corrected_factor, corrected_factor_rows

HERE = Path(__file__).resolve().parent
FULL = ("single", "paper", "corrected", "shrunk", "stein")
LOWRANK = ("lr-single", "lr-paper", "lr-corrected")
CANDIDATES = FULL + LOWRANK
DELTAS = tuple(float(d) for d in np.logspace(-4, 3, 15))
N_TRAIN, RANK = 1000, 50
#: an eigenbasis ``(Q (P, r), h (r,), c)``: ``G = Q diag(h) Qᵀ + c (I - QQᵀ)``
Basis = tuple[torch.Tensor, torch.Tensor, float]


def data() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Training (1,000) and test (797) digits, flattened ``(n, 64)`` in [0, 1], and their labels."""
    from laplace_debiased.data.digits import load_digits_tensors

    X, y = load_digits_tensors()
    X = X.reshape(len(X), -1)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, test = perm[:N_TRAIN], perm[N_TRAIN:]
    return (X[train], y[train]), (X[test], y[test])


def train_map(X: torch.Tensor, y: torch.Tensor) -> nn.Module:
    """The MAP (module docstring)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-4)
    for _ in range(500):
        opt.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        opt.step()
    return model.eval()


def jacobians(model: nn.Module, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(J (n, C, P) float64, logits (n, C) float64)``, parameters in ``model.parameters()`` order."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def f(p: dict, x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (x[None],))[0]

    jac = vmap(jacrev(f), in_dims=(None, 0))(params, X)
    J = torch.cat([jac[k].reshape(len(X), jac[k].shape[1], -1) for k in params], dim=2)
    with torch.no_grad():
        logits = model(X)
    return J.double(), logits.double()


def ggn_rows(J: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``V (n, C, P)`` with ``V_nᵀ V_n`` the GGN of sample n (module docstring)."""
    p = logits.softmax(-1)
    root = p.sqrt()
    Lt = torch.diag_embed(root) - root[:, :, None] * p[:, None, :]
    return Lt @ J


def range_basis(X: torch.Tensor) -> Basis:
    """The eigenbasis of ``XᵀX`` on its range, through the Gram matrix."""
    L, Q = gram_eigenpairs(X)
    return Q, L, 0.0


def top(basis: Basis, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-``k`` eigenpairs ``(Q (P, k), h (k,))`` of a basis (descending)."""
    Q, h, _ = basis
    order = torch.argsort(h, descending=True)[:k]
    return Q[:, order], h[order]


def candidates(VB: torch.Tensor, VM: torch.Tensor) -> tuple[dict[str, Basis], dict[str, float]]:
    """Each candidate's eigenbasis of ``G`` (per-sample mean; module docstring) from B's and B̃'s
    rows ``(m, C, P)``, and the weights ``shrunk`` and ``stein`` kept."""
    mb, mm = len(VB), len(VM)
    n, P = mb + mm, VB.shape[-1]
    XB, XM = VB.reshape(-1, P) / mb**0.5, VM.reshape(-1, P) / mm**0.5
    out: dict[str, Basis] = {"single": range_basis(torch.cat([VB, VM]).reshape(-1, P) / n**0.5)}
    B = range_basis(XB)
    paper = decompose_debiased_full(EigenPairs(B[1], B[0], "gram"), XM.T, 1.0)
    out["paper"] = (*paper.eigenpairs, 0.0)
    kept = {}
    for rule in ("corrected", "shrunk", "stein"):
        result = corrected_factor_rows(XB, XM, mb, mm, torch.float64, n_data=N_TRAIN, rule=rule)
        if result is None:
            U, lam, record = corrected_factor(XB.T @ XB, XM.T @ XM, mb, mm, n_data=N_TRAIN, rule=rule)
            out[rule] = (U, lam, 0.0)
        else:
            Q, lam, record = result
            out[rule] = (Q, lam[:Q.shape[1]], float(lam[-1]) if Q.shape[1] < P else 0.0)
        kept[rule] = record.kept
    out["lr-single"] = (*top(out["single"], RANK), 0.0)
    UB, hB = top(B, RANK)
    out["lr-paper"] = (UB, (XM @ UB).square().sum(0), 0.0)
    UM, hM = top(range_basis(XM), RANK)
    gap_b, gap_m = hB - (XM @ UB).square().sum(0), hM - (XB @ UM).square().sum(0)
    UP, hP = top(out["single"], RANK)
    k = min(len(hP), len(gap_b), len(gap_m))
    kb, km = order_weights(mb, mm, N_TRAIN)
    out["lr-corrected"] = (UP[:, :k], (hP[:k] - kb * gap_b[:k] - km * gap_m[:k]).clamp(min=0), 0.0)
    return out, kept


def test_nll(basis: Basis, J: torch.Tensor, f_mu: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Test NLL of the probit GLM predictive at each δ of :data:`DELTAS` for ``H = N · G``."""
    Q, h, c = basis
    JQ = (J @ Q).square()  # (n, C, r)
    rest = (J.square().sum(-1) - JQ.sum(-1)).clamp(min=0)
    out = []
    for delta in DELTAS:
        f_var = JQ @ (1 / (N_TRAIN * h.clamp(min=0) + delta)) + rest / (N_TRAIN * c + delta)
        kappa = 1 / torch.sqrt(1 + math.pi / 8 * f_var)
        logp = torch.log_softmax(kappa * f_mu, dim=-1)
        out.append(float(-logp[torch.arange(len(y)), y].mean()))
    return out


def run(seeds: list[int], batch_sizes: list[int], cache: Path) -> None:
    torch.set_num_threads(1)
    (Xtr, ytr), (Xte, yte) = data()
    model = train_map(Xtr, ytr)
    V = ggn_rows(*jacobians(model, Xtr))
    J, f_mu = jacobians(model, Xte)
    P = V.shape[-1]
    flat = V.reshape(-1, P)
    L, Q = torch.linalg.eigh(flat.T @ flat / N_TRAIN)
    full = (Q, L.clamp(min=0), 0.0)
    ref = {"full": test_nll(full, J, f_mu, yte), "lowrank": test_nll((*top(full, RANK), 0.0), J, f_mu, yte)}
    for b in batch_sizes:
        for seed in seeds:
            path = cache / f"b{b}" / f"seed{seed}.json"
            if path.exists():
                continue
            start = time.perf_counter()
            perm = torch.randperm(N_TRAIN, generator=torch.Generator().manual_seed(seed))
            ests, kept = candidates(V[perm[:b // 2]], V[perm[b // 2:b]])
            record = {"b": b, "seed": seed, "P": P, "rank": RANK, "deltas": DELTAS, "reference": ref, "kept": kept,
                      "nll": {c: test_nll(basis, J, f_mu, yte) for c, basis in ests.items()}}
            path.parent.mkdir(parents=True, exist_ok=True)
            path.with_suffix(".tmp").write_text(json.dumps(record) + "\n")
            path.with_suffix(".tmp").replace(path)
            print(f"structures b={b} seed={seed} done ({time.perf_counter() - start:.1f} s)", flush=True)


# ---- the protocol's metrics and decision (benchmarks/PROTOCOL_STRUCTURES.md) ----

T15, MARGIN, FLOOR = 1.753, 1.0, 2.0


STRUCTURES = {  # structure: (its candidates, the present estimate, the single batch, the reference)
    "debiased_full": (FULL, "paper", "single", "full"),
    "debiased_lowrank": (LOWRANK, "lr-paper", "lr-single", "lowrank"),
}


def summary(cache: Path) -> dict:
    """The protocol's metrics per structure, b and candidate, and its decision."""
    out: dict = {}
    for name, (group, present, single, ref_key) in STRUCTURES.items():
        cells = {}
        for folder in sorted(cache.glob("b*"), key=lambda p: int(p.name[1:])):
            records = [json.loads(p.read_text()) for p in sorted(folder.glob("seed*.json"))]
            if not records:
                continue
            M = {c: [100 * largest_gap(r["nll"][c], r["reference"][ref_key]) for r in records] for c in group}
            cell = {"draws": len(records), "seeds": [r["seed"] for r in records], "M_draws": M,
                    "M": {c: mean_stderr(v) for c, v in M.items()}, "D_present": {}, "D_single": {},
                    "worse_than_present": {}, "worse_than_single": {}}
            for c in group:
                for key, against in (("present", present), ("single", single)):
                    d = [a - b for a, b in zip(M[c], M[against])]
                    cell[f"D_{key}"][c] = mean_stderr(d)
                    cell[f"worse_than_{key}"][c] = sum(x > 0 for x in d)
            cell["kept"] = {k: mean_stderr([r["kept"][k] for r in records])[0] for k in ("shrunk", "stein")}
            cells[int(folder.name[1:])] = cell
        decision = {}
        for c in group:
            if c in (present, single) or not cells:
                continue
            ok_ni = all(cell["D_present"][c][0] + T15 * cell["D_present"][c][1] < MARGIN for cell in cells.values())
            better = [b for b, cell in cells.items() if cell["D_present"][c][0] + T15 * cell["D_present"][c][1] < 0]
            ok_single = all(cell["D_single"][c][0] + T15 * cell["D_single"][c][1] < MARGIN for cell in cells.values())
            decision[c] = {"non_inferior_to_present": ok_ni, "better_than_present_at": better,
                           "non_inferior_to_single": ok_single,
                           "improves": ok_ni and bool(better) and ok_single,
                           "W": max(cell["D_present"][c][0] for cell in cells.values())}
        improving = [c for c, d in decision.items() if d["improves"]]
        offered = min(improving, key=lambda c: decision[c]["W"]) if improving else None
        if offered and "stein" in improving and offered != "stein":
            worst_b = max(cells, key=lambda b: cells[b]["D_present"]["stein"][0])
            paired = [a - b for a, b in zip(cells[worst_b]["M_draws"]["stein"], cells[worst_b]["M_draws"][offered])]
            if decision["stein"]["W"] - decision[offered]["W"] <= 2 * mean_stderr(paired)[1]:
                offered = "stein"
        out[name] = {"cells": cells, "decision": decision, "offered": offered, "present": present, "single": single}
    return out


def write_summary(cache: Path) -> str:
    result = summary(cache)
    (HERE / "results" / "structures_protocol.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# Pre-registered check of the two-batch estimates for debiased_full and debiased_lowrank "
             "(benchmarks/PROTOCOL_STRUCTURES.md)", "",
             "Written by `python benchmarks/digits_structure_estimates.py --summary --cache "
             "~/.cache/laplace-debiased-study/structures` from the run's cache. Digits MLP 64-32-10 (P = 2,410), "
             "N = 1,000 / 797 test, probit GLM predictive. M: largest relative test-NLL gap over δ to the same "
             "structure fitted on the full batch (points, mean ± s.e. over draws). D: M − M(reference estimate) on "
             "the same draw, against the structure's present estimate (`paper`) and against the single batch "
             "(mean ± s.e.; worse: draws with D > 0).", ""]
    done = {b: cell["draws"] for b, cell in result["debiased_full"]["cells"].items()}
    if sorted(done) != [32, 64, 128, 256] or min(done.values()) < 16:
        lines += [f"**Partial: the run is in progress** (draws per b: {done}); the decision below is provisional.", ""]
    for name, res in result.items():
        group = STRUCTURES[name][0]
        lines += [f"## {name}", "",
                  "| b | draws | " + " | ".join(f"{c}: M" for c in group) + " |", "|---|---|" + "---|" * len(group)]
        for b, cell in res["cells"].items():
            lines.append(f"| {b} | {cell['draws']} | " + " | ".join(
                f"{cell['M'][c][0]:.2f} ± {cell['M'][c][1]:.2f}" for c in group) + " |")
        for key, label in (("present", res["present"]), ("single", res["single"])):
            others = [c for c in group if c != label]
            lines += ["", f"Paired against `{label}`: D (points) and draws worse", "",
                      "| b | " + " | ".join(others) + " |", "|---|" + "---|" * len(others)]
            for b, cell in res["cells"].items():
                lines.append(f"| {b} | " + " | ".join(
                    f"{cell[f'D_{key}'][c][0]:+.2f} ± {cell[f'D_{key}'][c][1]:.2f} ({cell[f'worse_than_{key}'][c]} of "
                    f"{cell['draws']})" for c in others) + " |")
        if name == "debiased_full":
            lines += ["", "Mean weight kept on the range: " + "; ".join(
                f"b = {b}: shrunk {cell['kept']['shrunk']:.2f}, stein {cell['kept']['stein']:.2f}"
                for b, cell in res["cells"].items())]
        lines += ["", "Decision (protocol): " + "; ".join(
            f"`{c}`: non-inferior to `{res['present']}` {'yes' if d['non_inferior_to_present'] else 'no'}, "
            f"better at b = {d['better_than_present_at'] or 'none'}, non-inferior to `{res['single']}` "
            f"{'yes' if d['non_inferior_to_single'] else 'no'}, W = {d['W']:+.2f}"
            for c, d in res["decision"].items()),
            "", f"**Offered for {name}: {('`' + res['offered'] + '`') if res['offered'] else 'none'}**", ""]
    text = "\n".join(lines)
    (HERE / "results" / "structures_protocol.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs=2, metavar=("FIRST", "STOP"), help="the draws' seeds, range(FIRST, STOP)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--cache", type=Path, required=True, help="one JSON per draw (resumes)")
    parser.add_argument("--summary", action="store_true", help="write results/structures_protocol.{json,md}")
    args = parser.parse_args(argv)
    if args.summary:
        print(write_summary(args.cache.expanduser()))
        return 0
    if args.seeds is None:
        parser.error("--seeds is required for a run")
    run(list(range(*args.seeds)), args.batch_sizes, args.cache.expanduser())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
