"""All-weights Laplace on a BatchNorm ResNet-20 on CIFAR-10.

    python -m benchmarks.normalisation [--data DIR] [--threads 1] [--b 512] [--n-full 10000]
        [--n-val 500] [--n-test 1000] [--n-corrupt 500] [--partial] [--out benchmarks/results]

The MAP is ``resnet20_w8`` (ResNet-20 with BatchNorm after every convolution, ``bias=False``
convolutions, 1x1-conv shortcuts, channels 8/16/32, 68,786 parameters) trained by
``python -m benchmarks.cifar10.train --model resnet20_w8 --n-train 10000 --epochs 30 --threads 1``
(Adam 2e-3, cosine to 0, L2 1e-4 per data point, no augmentation; resumable per-epoch checkpoints
under ``~/.cache/laplace-debiased/cifar10_map/``).  ``--map-epochs`` selects another trained MAP
of the same recipe (12: the earlier, under-trained one).  ``--partial`` uses the last checkpoint
if training has not finished (the epoch is recorded in the results).

Methods, all over every weight except the last row (K-FAC blocks for the convolutions and the
linear head, one exact dense GGN block per BatchNorm layer, ``Laplace(..., "all",
"debiased_kron")``), predicted with the linearized network and a shared prior-precision grid:

* ``shrunk``: the same two halves, ``estimator="shrunk"`` (the package's default when these
  results were written: the corrected estimate with each factor's correction shrunk by its noise);
* ``stein``: the same two halves, ``estimator="stein"`` (the corrected estimate with each
  factor's correction weighted by its minimum-mean-squared-error weight);
* ``corrected``: the same two halves, ``estimator="corrected"`` (the eigenvectors of B ∪ B̃,
  eigenvalues less the regression-to-the-mean bias the halves measure);
* ``debiased``: B, B̃ two disjoint halves of ``b`` random training images (directions from B,
  magnitudes on B̃);
* ``single batch``: the same ``b`` images, B̃ = B (plain K-FAC + dense blocks on one batch);
* ``full batch``: B̃ = B = the first ``n_full`` training images (the reference; ``n_full`` below
  N = 10,000 makes it a large-batch reference, stated in the results);
* ``last layer``: laplace-torch's full last-layer LA (``"last_layer", "full"``) on the same
  ``n_full`` images (what a user of a BatchNorm ResNet falls back to today).

Sets: validation images (δ selection by NLL), test images, generated CIFAR-10-C (each test image
corrupted by one of the 15 corruptions drawn uniformly, severities 1-5).  Metrics at each
method's validation-chosen δ: NLL, ECE, accuracy with the projected probit link (the MC link's
``(n, C, C)`` covariances over 68k parameters cost 10x more on the shared CPU);
tracking error: the maximum over the grid of ``|NLL - NLL_full| / NLL_full`` on the test set.
Writes ``normalisation.json`` and ``normalisation.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from laplace import Laplace
from torch.utils.data import DataLoader, TensorDataset

import laplace_debiased  # noqa: F401  (registers the debiased structures)
from benchmarks.cifar10.data import SEVERITIES, load_data
from benchmarks.cifar10.models import MODELS
from benchmarks.cifar10.train import MapConfig, map_dir
from laplace_debiased.data.eval_sets import resolve_eval_set
from laplace_debiased.evaluation.metrics import accuracy, ece, nll
from laplace_debiased.evaluation.tracking import largest_gap
from laplace_debiased.posterior.grid import GridPredictive
from laplace_debiased.posterior.jacobians import logit_jacobians, logit_rows
from laplace_debiased.prior_grid import PriorGrid

#: The converged MAP: 30 epochs of the cosine schedule on 10,000 images (``--map-epochs`` overrides).
MAP = MapConfig(n_train=10000, epochs=30, model="resnet20_w8")
#: Half-decade steps from the paper's smallest δ (1e-4, where a mini-batch LA's bias shows) to 1e6.
GRID = [float(d) for d in np.logspace(-4, 6, 21)]
ALL_WEIGHTS = ("shrunk", "stein", "corrected", "debiased", "single batch", "full batch")
LINKS = ("probit_projected",)


def load_map(cfg: MapConfig, partial: bool) -> tuple[torch.nn.Module, dict]:
    """The trained MAP (or, with ``partial``, the last checkpoint) in eval mode, and its history."""
    folder = map_dir(cfg)
    model = MODELS[cfg.model]()
    final, last = folder / "map.pt", folder / "last.pt"
    if final.is_file():
        blob = torch.load(final, weights_only=False)
        model.load_state_dict(blob["state_dict"])
        history = blob["history"]
    elif partial and last.is_file():
        blob = torch.load(last, weights_only=False)
        model.load_state_dict(blob["model"])
        history = blob["history"]
    else:
        raise FileNotFoundError(f"no trained MAP under {folder}; train it first (module docstring) or pass --partial")
    return model.eval(), {"epochs_done": len(history), "epochs_planned": cfg.epochs, "history": history}


def index_loader(train: TensorDataset, idx: np.ndarray, batch: int) -> DataLoader:
    """Loader over ``idx`` (in order); ``len(dataset)`` = N, so every fit scales to N."""
    return DataLoader(train, batch_size=batch, sampler=idx.tolist(), shuffle=False)


def kron_fit(model, loader: DataLoader, magnitude_loader: DataLoader | None = None, **options):
    """``Laplace(model, "classification", "all", "debiased_kron", **options)`` fitted on ``loader``."""
    la = Laplace(model, "classification", "all", "debiased_kron", **options)
    la.fit(loader, magnitude_loader=magnitude_loader)
    return la


def draw(n: int, b: int, seed: int) -> np.ndarray:
    """The ``b`` image indices of batch draw ``seed``, without replacement from ``n``."""
    return np.random.default_rng(seed).choice(n, size=b, replace=False)


def single_fit(model, train: TensorDataset, idx: np.ndarray):
    """The single batch of the images ``idx`` (B̃ = B)."""
    loader = index_loader(train, idx, len(idx))
    return kron_fit(model, loader, magnitude_loader=loader)


def full_loader(train: TensorDataset, n_full: int) -> DataLoader:
    """The first ``n_full`` training images in batches of 250 (the full-batch reference's data)."""
    return index_loader(train, np.arange(n_full), 250)


def full_batch_fit(model, train: TensorDataset, n_full: int):
    """The full-batch reference: K-FAC with B̃ = B = the first ``n_full`` training images."""
    full = full_loader(train, n_full)
    k = len(full)
    return kron_fit(model, full, magnitude_loader=full, n_direction_batches=k, n_magnitude_batches=k)


def fit_all(model, train: TensorDataset, b: int, n_full: int, seed: int, log) -> dict:
    """The four fits, timed: ``name -> (la, seconds)``."""
    idx = draw(len(train), b, seed)
    out = {}

    def timed(name, make):
        start = time.perf_counter()
        la = make()
        out[name] = (la, time.perf_counter() - start)
        log(f"  fit {name}: {out[name][1]:.1f} s")

    timed("debiased", lambda: kron_fit(model, index_loader(train, idx, b // 2), estimator="paper"))
    timed("corrected", lambda: kron_fit(model, index_loader(train, idx, b // 2), estimator="corrected"))
    timed("shrunk", lambda: kron_fit(model, index_loader(train, idx, b // 2), estimator="shrunk"))
    timed("stein", lambda: kron_fit(model, index_loader(train, idx, b // 2), estimator="stein"))
    timed("single batch", lambda: single_fit(model, train, idx))
    timed("full batch", lambda: full_batch_fit(model, train, n_full))

    def last_layer():
        la = Laplace(model, "classification", "last_layer", "full")
        la.fit(full_loader(train, n_full))
        return la

    timed("last layer", last_layer)
    return out


def shared_jacobian_grid(model, predictives: dict[str, GridPredictive], X: torch.Tensor, chunk: int,
                         ) -> dict[str, dict[str, torch.Tensor]]:
    """``name -> link -> (G, n, C)`` probabilities on :data:`GRID` of all-weights predictives of
    one network: each chunk's Jacobians are computed once and shared; each predictive's MC draws
    come from its own generator seeded 0."""
    params = next(iter(predictives.values())).params
    gens = {name: torch.Generator().manual_seed(0) for name in predictives}
    parts: dict = {name: {link: [] for link in LINKS} for name in predictives}
    with torch.no_grad():
        for x in X.split(chunk):
            f, jacs = logit_jacobians(model, params, x)
            for name, pred in predictives.items():
                probs = pred._chunk(logit_rows(f), jacs, GRID, LINKS, 100, gens[name])  # noqa: SLF001
                for link in LINKS:
                    parts[name][link].append(probs[link].float())
    return {name: {link: torch.cat(v, dim=1) for link, v in per.items()} for name, per in parts.items()}


def predict_sets(model, fits: dict, sets: dict, chunk: int, log) -> dict:
    """``method -> set -> link -> (G, n, C)`` probabilities on :data:`GRID`; the all-weights
    methods share each chunk's Jacobians, MC draws use the same seed for every method."""
    preds = {name: GridPredictive(la, chunk_size=chunk) for name, (la, _) in fits.items()}
    out: dict = {name: {} for name in fits}
    for set_name, (X, _) in sets.items():
        start = time.perf_counter()
        for name, probs in shared_jacobian_grid(model, {n: preds[n] for n in ALL_WEIGHTS}, X, chunk).items():
            out[name][set_name] = probs
        ll = preds["last layer"].grid(X, GRID, links=LINKS, generator=torch.Generator().manual_seed(0))
        out["last layer"][set_name] = {link: ll[link].float() for link in LINKS}
        out.setdefault("map", {})[set_name] = torch.softmax(_logits(model, X, chunk), -1)
        log(f"  predicted {set_name} ({len(X)} images): {time.perf_counter() - start:.0f} s")
    return out


@torch.no_grad()
def _logits(model, X: torch.Tensor, chunk: int) -> torch.Tensor:
    return torch.cat([model(x) for x in X.split(chunk)])


def evaluate(preds: dict, sets: dict, link: str = "probit_projected") -> dict:
    """Metrics per method and set on the grid, the validation-chosen δ, the tracking errors."""
    res: dict = {"grid": GRID, "link": link, "methods": {}}
    for name, per_set in preds.items():
        if name == "map":
            res["map"] = {s: _metrics(p, sets[s][1]) for s, p in per_set.items()}
            continue
        grid = {s: [_metrics(p[link][g], sets[s][1]) for g in range(len(GRID))] for s, p in per_set.items()}
        best = GRID.index(PriorGrid(tuple(GRID)).choose([m["nll"] for m in grid["val"]]))
        res["methods"][name] = {"delta": GRID[best], "interior": 0 < best < len(GRID) - 1, "grid": grid,
                                "chosen": {s: grid[s][best] for s in grid}}
    ref = res["methods"]["full batch"]["grid"]["test"]
    for name in ("shrunk", "stein", "corrected", "debiased", "single batch"):
        mine = res["methods"][name]["grid"]["test"]
        res["methods"][name]["tracking"] = {
            "nll_rel_pct": 100 * largest_gap([a["nll"] for a in mine], [r["nll"] for r in ref]),
            "ece_abs_pp": 100 * largest_gap([a["ece"] for a in mine], [r["ece"] for r in ref], relative=False),
        }
    return res


def _metrics(p: torch.Tensor, y: torch.Tensor) -> dict:
    return {"nll": nll(p, y), "ece": ece(p, y), "accuracy": accuracy(p, y)}


def eval_sets(data, n_val: int, n_test: int, n_corrupt: int, seed: int, severities=SEVERITIES) -> dict:
    rng = np.random.default_rng([seed, 1])
    Xv, yv = data.val.tensors
    Xt, yt = data.test.tensors
    vi, ti = rng.permutation(len(yv))[:n_val], rng.permutation(len(yt))[:n_test]
    sets = {"val": (Xv[vi], yv[vi]), "test": (Xt[ti], yt[ti])}
    ci = ti[:n_corrupt]
    for s in severities:
        Xc, yc = resolve_eval_set(f"cifar10-c-mixed:{s}", data.root, seed=0, verify=data.verify).subset(ci).tensors()
        sets[f"c{s}"] = (Xc, yc)
    return sets


ROWS = ("map", "last layer", "single batch", "debiased", "corrected", "shrunk", "stein", "full batch")


def markdown(res: dict, info: dict, cmd: str) -> str:
    """The results tables (test set and tracking; CIFAR-10-C by severity)."""
    sev = [k for k in res["map"] if k.startswith("c")]
    hist = info["history"][-1] if info["history"] else {}
    lines = [
        "# ResNet-20 (BatchNorm) on CIFAR-10, all weights", "",
        f"Command: `{cmd}`", "",
        f"MAP: `{MAP.model}` ({info['n_params']:,} parameters), {info['epochs_done']} of "
        f"{info['epochs_planned']} epochs on {MAP.n_train:,} training images; train NLL {info['map_train_nll']:.4f} "
        f"(eval mode, all {MAP.n_train:,} images); last epoch: running train NLL "
        f"{hist.get('train_nll_running', float('nan')):.3f}, train acc {hist.get('train_acc_running', float('nan')):.3f}, "
        f"val NLL {hist.get('val_nll', float('nan')):.3f}, val acc {hist.get('val_accuracy', float('nan')):.3f}.",
        f"Fits: b = {info['b']} (debiased, the paper's estimate, corrected, shrunk and stein: 2 x {info['b'] // 2}), full batch over {info['n_full']:,} images; "
        f"sets: {info['sizes']}; link: {res['link']}; δ grid {len(GRID)} points in "
        f"[{GRID[0]:g}, {GRID[-1]:g}]; {info['threads']} torch thread(s), wall {info['wall_min']:.0f} min.", "",
        "| method | δ (val) | fit s | test NLL | test ECE | test acc | NLL tracking err. (max over grid, %) | ECE tracking err. (pp) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in ROWS:
        if name == "map":
            m = res["map"]["test"]
            lines.append(f"| MAP | - | - | {m['nll']:.4f} | {m['ece']:.4f} | {m['accuracy']:.4f} | - | - |")
            continue
        r = res["methods"][name]
        m, t = r["chosen"]["test"], r.get("tracking")
        track = f"{t['nll_rel_pct']:.2f} | {t['ece_abs_pp']:.2f}" if t else "(reference) | -" if name == "full batch" else "- | -"
        edge = "" if r["interior"] else " (grid edge)"
        lines.append(f"| {name} | {r['delta']:g}{edge} | {info['fit_seconds'][name]:.0f} | {m['nll']:.4f} | {m['ece']:.4f} | "
                     f"{m['accuracy']:.4f} | {track} |")
    lines += ["", "CIFAR-10-C (generated, mixed corruptions), NLL / ECE at the validation-chosen δ:", "",
              "| method | " + " | ".join(f"severity {s[1:]}" for s in sev) + " |",
              "|---|" + "---|" * len(sev)]
    for name in ROWS:
        per = res["map"] if name == "map" else res["methods"][name]["chosen"]
        lines.append(f"| {'MAP' if name == 'map' else name} | " + " | ".join(f"{per[s]['nll']:.3f} / {per[s]['ece']:.3f}" for s in sev) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--b", type=int, default=512)
    p.add_argument("--n-full", type=int, default=10000)
    p.add_argument("--n-val", type=int, default=500)
    p.add_argument("--n-test", type=int, default=1000)
    p.add_argument("--n-corrupt", type=int, default=500)
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--severities", type=int, nargs="*", default=list(SEVERITIES))
    p.add_argument("--map-epochs", type=int, default=MAP.epochs, help="the trained MAP's epochs (default: the converged 30)")
    p.add_argument("--partial", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    log = lambda s: print(s, flush=True)  # noqa: E731
    start = time.perf_counter()
    data = load_data(a.data, n_train=MAP.n_train)
    model, info = load_map(replace(MAP, epochs=a.map_epochs), a.partial)
    X, y = data.train.tensors
    info["map_train_nll"] = nll(torch.softmax(_logits(model, X, 500), -1), y)
    log(f"MAP: {info['epochs_done']}/{info['epochs_planned']} epochs")
    fits = fit_all(model, data.train, a.b, a.n_full, a.seed, log)
    sets = eval_sets(data, a.n_val, a.n_test, a.n_corrupt, a.seed, a.severities)
    preds = predict_sets(model, fits, sets, a.chunk, log)
    res = evaluate(preds, sets)
    info.update(n_params=sum(q.numel() for q in model.parameters()), b=a.b, n_full=a.n_full, threads=a.threads,
                sizes={k: len(v[1]) for k, v in sets.items()}, wall_min=(time.perf_counter() - start) / 60,
                fit_seconds={k: v[1] for k, v in fits.items()})
    cmd = "python -m benchmarks.normalisation " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "normalisation.json").write_text(json.dumps({"command": cmd, "info": info, "results": res}, indent=1))
    (out / "normalisation.md").write_text(markdown(res, info, cmd))
    log((out / "normalisation.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
