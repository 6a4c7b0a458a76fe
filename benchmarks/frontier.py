"""Frontier between fit cost and tracking error: debiased K-FAC vs debiased EKFAC.

Two settings (``--setting``), both over all weights with the exact GGN (Curvlinops backend):

* ``cifar10`` (the headline): the converged ``cifar_cnn`` MAP of ``python -m benchmarks.cifar10``
  (56,714 parameters, trained 60 epochs on its 10,000-image training subset, loaded from that
  benchmark's cache, trained there if missing), |B| = 256 (the headline's debiased 2 × 256),
  the headline's prior-precision grid (:data:`benchmarks.cifar10.config.BASE_GRID`: 13 log-spaced
  δ in [1e-4, 1] plus 10), a seeded random subset of ``--n-test`` test images.  Full-batch
  references over the 10,000 training images, in batches of 500.
* ``digits``: the project's default MAP model ``digits_cnn`` on the embedded 8x8 digits (cached
  by :func:`laplace_debiased.evaluation.training.default_digits_model`), |B| = 32, 13 log-spaced
  δ in [1e-2, 1e4] (with N = 1,000 the prior dominates below δ ≈ 1 and every approximation,
  references included, predicts near-uniformly there).

Methods, each drawn ``--draws`` times (B = one random batch of ``--batch`` training images,
B̃ = ``k`` further random batches, the same B and B̃ for every method of one draw):

* ``debiased K-FAC, B̃ = k batches`` (``debiased_kron``, ``n_magnitude_batches=k``), k = 1, 2, 4, 8;
* ``debiased EKFAC, B̃ = k batches`` (``debiased_ekfac``), k = 1, 2, 4, 8;
* ``EKFAC cross-fit`` (``debiased_ekfac``, ``cross_fit=True``: the mixture of the role-swapped fits), same k;
* ``single-batch K-FAC / EKFAC`` on B alone (B̃ = B, the biased baselines).

References: full-batch K-FAC (laplace-torch ``KronLaplace`` over all N training images) and
full-batch EKFAC (``debiased_ekfac`` with B̃ = B = all N images, i.e. plain EKFAC).

Tracking error: the maximum over the prior-precision grid of the relative test-NLL gap
``|NLL - NLL_ref| / NLL_ref`` of the linearized predictive with the probit link (deterministic: no
Monte-Carlo noise; the headline CIFAR-10 benchmark uses MC sampling), each method against the
reference of its own family (K-FAC methods with full-batch K-FAC, EKFAC methods with full-batch
EKFAC); the other reference is recorded too.  The per-example Jacobians of a test chunk are
computed once and shared by every fit of a draw.  Fit cost: wall-clock seconds of ``fit`` on one
thread (median over draws) and the number of training images the fit touches.

    python benchmarks/frontier.py --setting cifar10 [--draws 5] [--n-test 1000] [--data DIR]
    python benchmarks/frontier.py --setting digits [--draws 20]

Writes ``frontier.{json,md,png}`` (digits) or ``frontier_cifar10.{json,md,png}`` (cifar10) into
``--out``, rewritten after every draw (an interrupted run leaves the draws it finished).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from laplace import KronLaplace
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import laplace_debiased  # noqa: F401  registers the debiased structures
from laplace_debiased.evaluation.metrics import nll
from laplace_debiased.posterior.from_laplace import posterior_structure
from laplace_debiased.posterior.jacobians import logit_jacobians
from laplace_debiased.posterior.links import probit_from_variances
from laplace_debiased.evaluation.tracking import mean_stderr
from laplace_debiased.evaluation.training import default_digits_model
from laplace_debiased.ekfac.laplace import DebiasedEKFACLaplace
from laplace_debiased.kron.laplace import DebiasedKronLaplace

DIGITS_GRID = [float(x) for x in np.logspace(-2, 4, 13)]
KS = (1, 2, 4, 8)
OUTPUT_STEM = {"digits": "frontier", "cifar10": "frontier_cifar10"}


@dataclass
class Setting:
    """A MAP model, its training set (``N = len(train)``), the test images ``X (n, ...)`` /
    labels ``y (n,)``, the prior-precision grid, the batch size of the full-batch references'
    loader, and a JSON-able description."""

    model: nn.Module
    train: Dataset
    X: torch.Tensor
    y: torch.Tensor
    grid: list[float]
    full_batch_size: int
    info: dict


def digits_setting() -> Setting:
    """``digits_cnn`` on the embedded digits, all 1,000 training images in one reference batch."""
    model, splits = default_digits_model(log=None)
    X, y = splits["test"].tensors
    return Setting(model, splits["train"], X, y, DIGITS_GRID, len(splits["train"]), {"model": "digits_cnn"})


def cifar10_setting(data: str | Path | None, n_test: int, epochs: int | None = None, seed: int = 0) -> Setting:
    """The headline CIFAR-10 benchmark's MAP (``python -m benchmarks.cifar10``: ``cifar_cnn`` on the
    first ``min(10000, N)`` images of its seeded training split; loaded from its cache) and the
    first ``n_test`` images of a seeded permutation of the test set.  ``epochs`` overrides the
    MAP's training length (tests only: it changes the cached model's tag)."""
    from benchmarks.cifar10.config import BASE_GRID, Config
    from benchmarks.cifar10.data import load_data
    from benchmarks.cifar10.train import MapConfig, train

    cfg = Config()
    cifar = load_data(data)
    X, y = cifar.train.tensors
    n_train = min(cfg.n_train, len(y))
    map_cfg = replace(MapConfig(), n_train=n_train, epochs=cfg.epochs if epochs is None else epochs, seed=cfg.seed)
    model, _ = train(map_cfg, X[:n_train], y[:n_train], *cifar.val.tensors, log=lambda s: print(s, flush=True))
    Xt, yt = cifar.test.tensors
    idx = torch.from_numpy(np.random.default_rng([seed, 3]).permutation(len(yt))[:n_test])
    info = {"model": "cifar_cnn", "map": map_cfg.tag(), "test_subset": f"first {len(idx)} of a seeded permutation of the test set"}
    return Setting(model, TensorDataset(X[:n_train], y[:n_train]), Xt[idx], yt[idx], list(BASE_GRID),
                   cfg.full_batch_size, info)


@torch.no_grad()
def probit_nlls(model: nn.Module, structures: dict[str, object], X: torch.Tensor, y: torch.Tensor,
                grid: Sequence[float], chunk_size: int = 100) -> dict[str, list[float]]:
    """Test NLL of the probit-linearized predictive of every all-weights posterior structure
    (:func:`~laplace_debiased.posterior.from_laplace.posterior_structure`) at every prior precision:
    ``name -> [NLL(δ) for δ in grid]``.  The logit Jacobians of each chunk of ``X`` are computed
    once and shared by all structures; probabilities in float64."""
    params = list(model.parameters())
    model.eval()
    probs: dict[str, list[torch.Tensor]] = {name: [] for name in structures}
    for x in X.split(chunk_size):
        f, jacs = logit_jacobians(model, params, x)
        for name, s in structures.items():
            probs[name].append(probit_from_variances(f.double(), s.variances(s.rotate(jacs), grid)))
    return {name: [nll(p, y) for p in torch.cat(ps, dim=1)] for name, ps in probs.items()}


def _timed_fit(la, loader: DataLoader, **kw) -> float:
    t0 = time.perf_counter()
    la.fit(loader, **kw)
    return time.perf_counter() - t0


def _methods(batch: int) -> list[dict]:
    out = [
        {"name": "single-batch K-FAC", "family": "kfac", "cls": DebiasedKronLaplace, "k": 0, "kw": {}},
        {"name": "single-batch EKFAC", "family": "ekfac", "cls": DebiasedEKFACLaplace, "k": 0, "kw": {}},
    ]
    for k in KS:
        out += [
            {"name": f"debiased K-FAC, B̃={k}×{batch}", "family": "kfac", "cls": DebiasedKronLaplace, "k": k, "kw": {}},
            {"name": f"debiased EKFAC, B̃={k}×{batch}", "family": "ekfac", "cls": DebiasedEKFACLaplace, "k": k, "kw": {}},
            {"name": f"EKFAC cross-fit, B̃={k}×{batch}", "family": "ekfac", "cls": DebiasedEKFACLaplace, "k": k, "kw": {"cross_fit": True}},
        ]
    return out


def fit_references(s: Setting, log: Callable[[str], None]) -> tuple[dict, dict]:
    """Full-batch K-FAC and full-batch EKFAC over all of ``s.train`` (batches of
    ``s.full_batch_size``): ``(structures, {family: {"seconds", "touched"}})``."""
    full = DataLoader(s.train, batch_size=s.full_batch_size, shuffle=False)
    n_batches, N = len(full), len(s.train)
    ref_kfac = KronLaplace(s.model, "classification")
    costs = {"kfac": {"seconds": _timed_fit(ref_kfac, full), "touched": N}}
    log(f"full-batch K-FAC: {costs['kfac']['seconds']:.1f} s")
    ref_ekfac = DebiasedEKFACLaplace(s.model, "classification", n_direction_batches=n_batches,
                                     n_magnitude_batches=n_batches)
    costs["ekfac"] = {"seconds": _timed_fit(ref_ekfac, full, magnitude_loader=full), "touched": N}
    log(f"full-batch EKFAC: {costs['ekfac']['seconds']:.1f} s")
    return {"kfac": posterior_structure(ref_kfac), "ekfac": posterior_structure(ref_ekfac)}, costs


def fit_draw(s: Setting, batch: int, draw: int, log: Callable[[str], None]) -> tuple[dict, dict]:
    """Every method of :func:`_methods` on draw ``draw`` (generator seed ``1000 + draw``: the same
    B, and nested B̃, for every method): ``(structures, {name: {"seconds", "touched"}})``."""
    loader = DataLoader(s.train, batch_size=batch, shuffle=False, drop_last=True)
    structures, costs = {}, {}
    for m in _methods(batch):
        gen = torch.Generator().manual_seed(1000 + draw)
        if m["k"] == 0:  # B̃ = B: one random batch used twice, scaled to N by the fit
            la = m["cls"](s.model, "classification", generator=gen)
            secs = _timed_fit(la, loader, magnitude_loader=loader)
            touched = batch
        else:
            la = m["cls"](s.model, "classification", n_magnitude_batches=m["k"], generator=gen, **m["kw"])
            secs = _timed_fit(la, loader)
            touched = batch * (1 + m["k"])
        structures[m["name"]] = posterior_structure(la)
        costs[m["name"]] = {"seconds": secs, "touched": touched}
        log(f"  draw {draw}: {m['name']:<28} {secs:6.2f} s")
    return structures, costs


def _gap(nlls: Sequence[float], ref: Sequence[float]) -> float:
    """Max over the grid of the relative NLL gap ``|NLL - NLL_ref| / NLL_ref``."""
    return float(max(abs(a - b) / b for a, b in zip(nlls, ref)))


def run(s: Setting, draws: int, batch: int, log: Callable[[str], None] = print,
        on_draw: Callable[[dict], None] | None = None) -> dict:
    """Fit the references and ``draws`` draws of every method, predict, and summarise; the
    result so far is passed to ``on_draw`` after each draw."""
    torch.set_num_threads(1)
    structures, ref_costs = fit_references(s, log)
    t0 = time.perf_counter()
    ref_nll = probit_nlls(s.model, structures, s.X, s.y, s.grid)
    log(f"references' predictive: {time.perf_counter() - t0:.1f} s")
    refs = {fam: {**ref_costs[fam], "nll": ref_nll[fam]} for fam in structures}
    rows = {m["name"]: {**{k: v for k, v in m.items() if k != "cls"}, "draws": []} for m in _methods(batch)}
    res = {}
    for d in range(draws):
        structures, costs = fit_draw(s, batch, d, log)
        t0 = time.perf_counter()
        nlls = probit_nlls(s.model, structures, s.X, s.y, s.grid)
        log(f"  draw {d}: predictive of {len(structures)} fits: {time.perf_counter() - t0:.1f} s")
        for name, values in nlls.items():
            gaps = {fam: _gap(values, ref["nll"]) for fam, ref in refs.items()}
            rows[name]["draws"].append({**costs[name], "nll": values, "gap": gaps})
        res = {
            "setting": {**s.info, "n_params": sum(p.numel() for p in s.model.parameters()), "n_train": len(s.train),
                        "n_test": len(s.y), "batch": batch, "draws": d + 1, "grid": s.grid, "link": "probit",
                        "reference_batch_size": s.full_batch_size, "threads": 1,
                        "machine": platform.processor() or platform.machine()},
            "references": refs,
            "summary": summarize(rows),
            "rows": rows,
        }
        if on_draw is not None:
            on_draw(res)
    return res


def summarize(rows: dict) -> list[dict]:
    """Per method: images touched, median fit time, mean / worst / s.e. of the tracking error to
    its own family's reference, mean error to the other family's reference."""
    summary = []
    for name, r in rows.items():
        own = [dr["gap"][r["family"]] for dr in r["draws"]]
        other = [dr["gap"]["ekfac" if r["family"] == "kfac" else "kfac"] for dr in r["draws"]]
        summary.append({
            "name": name, "family": r["family"], "k": r["k"], "cross_fit": bool(r["kw"].get("cross_fit")),
            "touched": r["draws"][0]["touched"],
            "seconds_median": float(np.median([dr["seconds"] for dr in r["draws"]])),
            "gap_own_mean": float(np.mean(own)), "gap_own_worst": float(np.max(own)),
            "gap_own_se": float(np.std(own, ddof=1) / np.sqrt(len(own))) if len(own) > 1 else float("nan"),
            "gap_other_mean": float(np.mean(other)),
        })
    return summary
def _paired(res: dict) -> list[tuple[int, tuple[float, float], tuple[float, float]]]:
    """Per k: mean ± s.e. (points) of EKFAC − K-FAC and cross-fit − EKFAC tracking errors, paired
    over the draws (each draw has the same B and B̃ for all methods)."""

    def gaps(kind: str, k: int) -> np.ndarray:
        for r in res["rows"].values():
            if r["k"] == k and r["family"] == ("kfac" if kind == "kfac" else "ekfac") and bool(r["kw"].get("cross_fit")) == (kind == "cross"):
                return 100 * np.array([d["gap"][r["family"]] for d in r["draws"]])
        raise KeyError((kind, k))

    return [(k, mean_stderr(gaps("ekfac", k) - gaps("kfac", k)), mean_stderr(gaps("cross", k) - gaps("ekfac", k)))
            for k in KS]


def _command(s: dict) -> str:
    """The command line that reproduces a result with setting ``s``."""
    if s["model"] == "cifar_cnn":
        return (f"python benchmarks/frontier.py --setting cifar10 --draws {s['draws']} --batch {s['batch']} "
                f"--n-test {s['n_test']}")
    return f"python benchmarks/frontier.py --setting digits --draws {s['draws']} --batch {s['batch']}"


def _gap_by_delta(res: dict) -> dict[str, np.ndarray]:
    """Per method: the relative NLL gap to its own family's reference at every grid point,
    ``(G,)``, averaged over the draws."""
    out = {}
    for name, r in res["rows"].items():
        ref = np.array(res["references"][r["family"]]["nll"])
        out[name] = np.mean([np.abs(np.array(d["nll"]) - ref) / ref for d in r["draws"]], axis=0)
    return out


def _argmax_delta(res: dict) -> dict[str, str]:
    """Per method: the grid point where its gap to its own reference is largest, the most frequent
    over the draws, formatted ``"δ (count/draws)"``."""
    grid, out = res["setting"]["grid"], {}
    for name, r in res["rows"].items():
        ref = np.array(res["references"][r["family"]]["nll"])
        hits = [int(np.argmax(np.abs(np.array(d["nll"]) - ref) / ref)) for d in r["draws"]]
        mode = max(set(hits), key=hits.count)
        out[name] = f"{grid[mode]:.3g} ({hits.count(mode)}/{len(hits)})"
    return out


def markdown(res: dict) -> str:
    s = res["setting"]
    L = [
        f"# Frontier: fit cost vs tracking error ({s['model']}, all weights, exact GGN)", "",
        f"{s['n_params']:,} parameters, N = {s['n_train']:,} training / {s['n_test']:,} test images, |B| = {s['batch']}, "
        f"{s['draws']} draws per method; tracking error = max over the {len(s['grid'])}-point prior grid of the "
        "relative test-NLL gap of the probit-linearized predictive to the full-batch reference of the same family "
        "(K-FAC or EKFAC); fit time = median wall-clock seconds of `fit`, one thread, on a shared loaded CPU.", "",
        f"Made by `{_command(s)}`.", "",
        "| method | images touched | fit time (s) | tracking error, mean ± s.e. (worst) | δ of the max | vs the other family's reference |",
        "|---|---|---|---|---|---|",
    ]
    where = _argmax_delta(res)
    front = {r["name"] for r in _pareto(res["summary"])}
    for r in res["summary"]:
        name = f"**{r['name']}**" if r["name"] in front else r["name"]
        L.append(
            f"| {name} | {r['touched']} | {r['seconds_median']:.3f} | {100 * r['gap_own_mean']:.2f} ± "
            f"{100 * r['gap_own_se']:.2f} % ({100 * r['gap_own_worst']:.2f} %) | {where[r['name']]} | "
            f"{100 * r['gap_other_mean']:.2f} % |"
        )
    L += ["", "Paired differences over the same draws (percentage points of tracking error, mean ± s.e.; "
          "negative = the first method tracks its reference better):", "",
          "| B̃ | debiased EKFAC − debiased K-FAC | EKFAC cross-fit − debiased EKFAC |", "|---|---|---|"]
    for k, a, b in _paired(res):
        L.append(f"| {k} × {s['batch']} | {a[0]:+.2f} ± {a[1]:.2f} | {b[0]:+.2f} ± {b[1]:.2f} |")
    L += ["", "Mean over the draws of the relative test-NLL gap to the own family's reference at each prior "
          "precision (%):", "", "| method | " + " | ".join(f"{d:.3g}" for d in s["grid"]) + " |",
          "|---|" + "---|" * len(s["grid"])]
    for name, gaps in _gap_by_delta(res).items():
        L.append(f"| {name} | " + " | ".join(f"{100 * g:.2f}" for g in gaps) + " |")
    refs = res["references"]
    L += ["", "Bold: on the Pareto front (no other method has both a lower median fit time and a lower mean "
          "tracking error). δ of the max: the prior precision where the tracking error is attained, the most "
          "frequent over the draws (their count in brackets).", "", f"References: full-batch K-FAC fit {refs['kfac']['seconds']:.2f} s, full-batch EKFAC fit "
          f"{refs['ekfac']['seconds']:.2f} s (all {s['n_train']:,} images). Their mutual max relative NLL gap: "
          f"{100 * max(abs(a - b) / b for a, b in zip(refs['ekfac']['nll'], refs['kfac']['nll'])):.2f} %. "
          "Full-batch K-FAC test NLL over the grid: "
          + ", ".join(f"{d:.3g}: {v:.3f}" for d, v in zip(s["grid"], refs["kfac"]["nll"])) + ".", ""]
    return "\n".join(L)


def _pareto(summary: list[dict]) -> list[dict]:
    """Methods no other method beats on both median fit time and mean tracking error, by time."""
    rows = sorted(summary, key=lambda r: (r["seconds_median"], r["gap_own_mean"]))
    front, best = [], float("inf")
    for r in rows:
        if r["gap_own_mean"] < best:
            front.append(r)
            best = r["gap_own_mean"]
    return front


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    styles = {("kfac", False): ("tab:blue", "o", "debiased K-FAC"), ("ekfac", False): ("tab:red", "s", "debiased EKFAC"),
              ("ekfac", True): ("tab:green", "^", "EKFAC cross-fit")}
    for key, (color, marker, label) in styles.items():
        pts = [r for r in res["summary"] if (r["family"], r["cross_fit"]) == key and r["k"] > 0]
        xs, ys = [r["seconds_median"] for r in pts], [100 * r["gap_own_mean"] for r in pts]
        ax.plot(xs, ys, marker=marker, color=color, label=label + " (B̃ = 1, 2, 4, 8 batches)")
        for r, x_, y_ in zip(pts, xs, ys):
            ax.annotate(f"{r['k']}", (x_, y_), textcoords="offset points", xytext=(4, 4), fontsize=8, color=color)
    for r in res["summary"]:
        if r["k"] == 0:
            color = "tab:blue" if r["family"] == "kfac" else "tab:red"
            ax.scatter([r["seconds_median"]], [100 * r["gap_own_mean"]], marker="x", color=color, label=r["name"] + " (B̃ = B)")
    for fam, color in (("kfac", "tab:blue"), ("ekfac", "tab:red")):
        ax.axvline(res["references"][fam]["seconds"], color=color, linestyle=":", linewidth=1.2,
                   label=f"full-batch {'K-FAC' if fam == 'kfac' else 'EKFAC'} fit (reference: error 0)")
    front = _pareto(res["summary"])
    ax.step([r["seconds_median"] for r in front], [100 * r["gap_own_mean"] for r in front], where="post",
            color="black", linestyle="--", linewidth=1, label="Pareto front (all methods)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("fit time (s, median over draws, 1 thread)")
    ax.set_ylabel("tracking error: max rel. test-NLL gap to own full-batch reference (%)")
    s = res["setting"]
    ax.set_title(f"{s['model']}, N = {s['n_train']:,}, |B| = {s['batch']}, mean over {s['draws']} draws")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(res: dict, out: Path, stem: str) -> None:
    """``<stem>.json``, ``<stem>.md`` and ``<stem>.png`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    (out / f"{stem}.md").write_text(markdown(res))
    plot(res, out / f"{stem}.png")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setting", choices=tuple(OUTPUT_STEM), default="digits")
    ap.add_argument("--draws", type=int, default=5, help="draws per method")
    ap.add_argument("--batch", type=int, default=None, help="|B| (default: digits 32, cifar10 256)")
    ap.add_argument("--n-test", type=int, default=1000, help="cifar10: test images (default 1000)")
    ap.add_argument("--data", default=None, help="cifar10: CIFAR-10 root (as python -m benchmarks.cifar10 --data)")
    ap.add_argument("--epochs", type=int, default=None, help=argparse.SUPPRESS)  # tests: a short MAP
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--replot", action="store_true", help="rewrite .md/.png from the existing .json")
    args = ap.parse_args(argv)
    stem = OUTPUT_STEM[args.setting]
    if args.replot:
        res = json.loads((args.out / f"{stem}.json").read_text())
    else:
        torch.set_num_threads(1)
        cifar = args.setting == "cifar10"
        setting = cifar10_setting(args.data, args.n_test, args.epochs) if cifar else digits_setting()
        batch = args.batch or (256 if cifar else 32)
        log = lambda m: print(f"[{time.strftime('%H:%M:%S')}] {m}", flush=True)  # noqa: E731
        res = run(setting, args.draws, batch, log, on_draw=lambda r: write(r, args.out, stem))
    write(res, args.out, stem)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
