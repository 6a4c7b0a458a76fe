"""Which blocks, and which order of the halves, make the paper's split closer to the full batch
than one batch on ResNet-20?

    python -m benchmarks.block_swap [--data DIR] [--threads 1] [--seeds 0 1] [--b 512]
        [--n-test 1000] [--out benchmarks/results]

On the BatchNorm ResNet-20 of :mod:`benchmarks.normalisation` (its trained MAP, its batch draws
and test images per seed), the single batch of ``b`` images (B̃ = B), the paper's split of the
same images (B: the first ``b/2``, B̃: the second; ``estimator="paper"``), the same split
with the halves' roles swapped, its cross-fit (``cross_fit=True``: the mean of both orders'
predictive covariances) and the shrunk default are compared with *hybrids*: the single batch's
posterior with one kind of block (the BatchNorm blocks, the convolutions' K-FAC blocks, or the
linear head) replaced by the paper's decomposition of that block. Each posterior's tracking error
is the maximum over :data:`~benchmarks.normalisation.GRID` of the relative test-NLL gap to the
full batch of all 10,000 training images (projected probit link, the normalisation benchmark's).

Two oracles (:mod:`benchmarks.eigenvalue_oracles`), which know the full batch's K-FAC factors,
show what an estimate on the single batch's eigenvectors can reach: the single batch less its exact
mean eigenvalue bias at this ``b`` (the bias oracle; the bias estimated over ``--bias-draws``
further draws of ``b`` images, seeds from :data:`~benchmarks.eigenvalue_oracles.BIAS_SEED_OFFSET`
on), and the full batch's curvature along the single batch's eigenvectors (the eigenvalue oracle).

It also reports, per convolution, the trace of each K-FAC factor (output side ``G``, input side
``A``) of the single batch, of each half alone and of the paper's fit (B's directions, B̃'s
Rayleigh quotients, so its trace is B̃'s) relative to the full batch's: how far each estimate's
scale is off, and from which half the paper's fit takes it.

Writes ``block_swap.json`` and ``block_swap.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

import laplace_debiased  # noqa: F401  (registers the debiased structures)
from benchmarks.cifar10.data import load_data
from benchmarks.eigenvalue_oracles import BIAS_SEED_OFFSET, mean_bias, oracle_eigenpairs, with_eigenpairs
from benchmarks.normalisation import (GRID, LINKS, MAP, draw, eval_sets, full_batch_fit, index_loader, kron_fit, load_map,
                                      shared_jacobian_grid, single_fit)
from laplace_debiased.evaluation.metrics import nll
from laplace_debiased.evaluation.tracking import largest_gap
from laplace_debiased.posterior.from_laplace import posterior_structure
from laplace_debiased.posterior.grid import GridPredictive

LINK = LINKS[0]
KINDS = ("BatchNorm", "convolutions", "head")


def block_kinds(la) -> dict[str, set[int]]:
    """Block indices per kind: BatchNorm (one dense block over weight and bias), the linear head
    (the last layer's blocks), the convolutions (the rest)."""
    names = la.correction.names
    bn = {i for i, (_, param) in enumerate(names) if param == "weight+bias"}
    head = {i for i, (layer, _) in enumerate(names) if layer == names[-1][0]}
    return {"BatchNorm": bn, "head": head, "convolutions": set(range(len(names))) - bn - head}


def swapped(base, other, blocks: set[int]):
    """``base``'s grid structure with the decompositions of ``blocks`` taken from ``other``."""
    st, ot = posterior_structure(base), posterior_structure(other)
    st.Qs = [ot.Qs[i] if i in blocks else q for i, q in enumerate(st.Qs)]
    st.ls = [ot.ls[i] if i in blocks else v for i, v in enumerate(st.ls)]
    return st


def factor_traces(structure, reference, blocks: list[int]) -> dict[str, list[float]]:
    """Per block in ``blocks`` (two-factor K-FAC blocks): ``tr G / tr G_ref`` (with the data
    scale ``s``, which the output factor carries) and ``tr A / tr A_ref``."""
    g = [float(structure.ls[i][0].sum() * structure.s / (reference.ls[i][0].sum() * reference.s)) for i in blocks]
    a = [float(structure.ls[i][1].sum() / reference.ls[i][1].sum()) for i in blocks]
    return {"G": g, "A": a}


def test_curves(model, predictives: dict, X: torch.Tensor, y: torch.Tensor, chunk: int = 32) -> dict[str, list[float]]:
    """Test NLL on the grid per posterior (:func:`~benchmarks.normalisation.shared_jacobian_grid`)."""
    probs = shared_jacobian_grid(model, predictives, X, chunk)
    return {k: [nll(p[LINK][g], y) for g in range(len(GRID))] for k, p in probs.items()}


def one_seed(model, data, full_la, bias, b: int, n_test: int, seed: int, log) -> dict:
    """Fits, hybrids, oracles, tracking errors and factor traces of one batch draw (``seed``);
    ``full_la`` the full batch's fit, ``bias`` the mean bias of the single batch's factors
    (:func:`~benchmarks.eigenvalue_oracles.mean_bias`)."""
    idx = draw(len(data.train), b, seed)  # the normalisation benchmark's draw of this seed
    halves = index_loader(data.train, idx, b // 2)
    swapped_halves = index_loader(data.train, np.concatenate([idx[b // 2:], idx[: b // 2]]), b // 2)
    fits = {"single batch": single_fit(model, data.train, idx),
            "paper": kron_fit(model, halves, estimator="paper"),
            "paper, halves swapped": kron_fit(model, swapped_halves, estimator="paper"),
            "paper, cross-fit (both orders)": kron_fit(model, halves, estimator="paper", cross_fit=True),
            "shrunk": kron_fit(model, halves, estimator="shrunk")}
    kinds = block_kinds(fits["shrunk"])
    base = fits["single batch"]
    predictives = {k: GridPredictive(la) for k, la in fits.items()}
    for kind in KINDS:
        predictives[f"single batch, paper's {kind}"] = GridPredictive(base, structure=swapped(base, fits["paper"], kinds[kind]))
    truth = full_la.H_facs.kfacs
    for name, beta in (("bias oracle", bias), ("eigenvalue oracle", None)):
        predictives[name] = GridPredictive(with_eigenpairs(base, *oracle_eigenpairs(base.H_facs.kfacs, truth, beta,
                                                                                    len(data.train))))
    full = posterior_structure(full_la)
    predictives["full batch"] = GridPredictive(base, structure=full)
    X, y = eval_sets(data, 1, n_test, 0, seed, severities=())["test"]
    start = time.perf_counter()
    curves = test_curves(model, predictives, X, y)
    log(f"  seed {seed}: predicted {len(y)} test images for {len(predictives)} posteriors, {time.perf_counter() - start:.0f} s")
    ref = curves.pop("full batch")
    tracking = {k: 100 * largest_gap(c, ref) for k, c in curves.items()}
    convs = sorted(kinds["convolutions"])
    alone = {}
    for name, part in (("first half (B)", idx[: b // 2]), ("second half (B̃)", idx[b // 2:])):
        alone[name] = posterior_structure(single_fit(model, data.train, part))
    traces = {k: factor_traces(st, full, convs) for k, st in
              {"single batch": posterior_structure(base), **alone, "paper": posterior_structure(fits["paper"])}.items()}
    return {"tracking_nll_pct": tracking, "traces": traces, "n_conv_blocks": len(convs),
            "blocks": {k: len(v) for k, v in kinds.items()}}


def markdown(res: dict, cmd: str) -> str:
    """The tracking table (one column per seed) and the factor-trace summary."""
    seeds = list(res["seeds"])
    lines = ["# Block swap on ResNet-20: where the paper's split gains", "", f"Command: `{cmd}`", "",
             f"{res['info']}", "",
             "Largest relative test-NLL gap to the full batch over the grid [%] (projected probit link):", "",
             "| posterior | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---|" + "---|" * len(seeds)]
    for k in res["seeds"][seeds[0]]["tracking_nll_pct"]:
        lines.append(f"| {k} | " + " | ".join(f"{res['seeds'][s]['tracking_nll_pct'][k]:.2f}" for s in seeds) + " |")
    lines += ["", "Trace of the convolutions' K-FAC factors relative to the full batch's (mean [min, max] over "
              "the convolution blocks; `G` output side with the data scale, `A` input side):", "",
              "| estimate | " + " | ".join(f"seed {s}: tr G / tr G_full | seed {s}: tr A / tr A_full" for s in seeds) + " |",
              "|---|" + "---|---|" * len(seeds)]
    for k in res["seeds"][seeds[0]]["traces"]:
        cells = []
        for s in seeds:
            for f in ("G", "A"):
                v = res["seeds"][s]["traces"][k][f]
                cells.append(f"{np.mean(v):.3f} [{min(v):.3f}, {max(v):.3f}]")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--b", type=int, default=512)
    p.add_argument("--n-test", type=int, default=1000)
    p.add_argument("--bias-draws", type=int, default=32, help="further draws of b images that estimate the mean bias")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    log = lambda s: print(s, flush=True)  # noqa: E731
    start = time.perf_counter()
    data = load_data(a.data, n_train=MAP.n_train)
    model, _ = load_map(MAP, False)
    full_la = full_batch_fit(model, data.train, len(data.train))
    log(f"full batch ({len(data.train):,} images): {time.perf_counter() - start:.0f} s")
    draws = [single_fit(model, data.train, draw(len(data.train), a.b, BIAS_SEED_OFFSET + r)).H_facs.kfacs
             for r in range(a.bias_draws)]
    bias = mean_bias(draws, full_la.H_facs.kfacs, len(data.train))
    del draws
    log(f"mean bias from {a.bias_draws} draws of {a.b}: {time.perf_counter() - start:.0f} s")
    seeds = {s: one_seed(model, data, full_la, bias, a.b, a.n_test, s, log) for s in a.seeds}
    info = (f"MAP `{MAP.model}` of `benchmarks.normalisation`; b = {a.b} (paper and shrunk: 2 x {a.b // 2}); "
            f"full batch over {len(data.train):,} images; oracles' mean bias over {a.bias_draws} further draws; {a.n_test} test images; {len(GRID)} prior precisions "
            f"in [{GRID[0]:g}, {GRID[-1]:g}]; {a.threads} torch thread(s); wall {(time.perf_counter() - start) / 60:.0f} min.")
    cmd = "python -m benchmarks.block_swap " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    res = {"command": cmd, "info": info, "seeds": seeds}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "block_swap.json").write_text(json.dumps(res, indent=1))
    (out / "block_swap.md").write_text(markdown(res, cmd))
    log((out / "block_swap.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
