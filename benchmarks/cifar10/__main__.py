"""Headline benchmark (paper Fig. 6): debiased vs single-batch vs full-batch Laplace on CIFAR-10.

    python -m benchmarks.cifar10 [--data DIR] [--out DIR] [--quick] [--threads T] [--fresh]

Steps (each cached under ``~/.cache/laplace-debiased/`` (``$LAPLACE_DEBIASED_CACHE``), so an
interrupted run resumes where it stopped; the same command continues it):

1. the MAP (:mod:`.train`): ``cifar_cnn`` trained to convergence on a seeded training subset;
2. the fits (:mod:`.fits`): single-batch, debiased and full-batch K-FAC over all weights, and
   single-batch, debiased and full-batch rank-k last-layer LAs, ``repeats`` batch draws each;
3. the evaluation sets (:mod:`.data`): validation images, the test set, generated CIFAR-10-C
   (mixed, severities 1-5), a pixel-scrambled OOD set;
4. the grid: the paper's 13 log-spaced δ in [1e-4, 1] plus 10, extended on the validation set
   until every method's optimum (by validation NLL and by marglik) is interior;
5. the predictive on every set (:mod:`.predict`), metrics, selection, tracking error with
   paired bootstrap intervals and the MC noise floor, targets (:mod:`.evaluate`);
6. ``results.json``, ``results.md`` and the PNGs in ``--out`` (``--quick``: ``--out``/quick).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import re
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from laplace_debiased.evaluation import metrics as M
from laplace_debiased.paths import default_cache_dir

from . import evaluate as E
from .config import BASE_GRID, N_DOWN_MAX, N_UP_MAX, Config, extended_grid, grid_index
from .data import eval_sets, load_data
from .fits import FIT_VERSION, Fit, run_fits
from .plots import auroc_figure, reliability_figure, tracking_figures
from .predict import PREDICTIVE_VERSION, fill_from_end, predictions
from .report import markdown
from .train import ALLCNNC, MapConfig, train


@torch.no_grad()
def softmax(model, X: torch.Tensor, chunk: int = 1000) -> torch.Tensor:
    """MAP class probabilities ``(N, C)`` on the CPU, computed in chunks on the model's device."""
    dev = next(model.parameters()).device
    return torch.cat([torch.softmax(model(x.to(dev)), -1).cpu() for x in X.split(chunk)])


def label(fit: Fit, rank: int, n_train: int, null_space: str = "isotropic") -> str:
    b, k = fit.b, fit.magnitude_batches
    part = (b or 0) // (1 + k)
    return {
        "kron": f"K-FAC single-batch b={b}",
        "debiased_kron": f"K-FAC debiased {f'2x{part}' if k == 1 else f'{part}+{k}x{part}'} ({null_space})",
        "corrected_kron": f"K-FAC corrected {f'2x{part}' if k == 1 else f'{part}+{k}x{part}'}",
        "shrunk_kron": f"K-FAC shrunk (default) {f'2x{part}' if k == 1 else f'{part}+{k}x{part}'}",
        "stein_kron": f"K-FAC stein {f'2x{part}' if k == 1 else f'{part}+{k}x{part}'}",
        "kron-full": f"K-FAC full batch (N={n_train:,})",
        "lowrank_ll": f"last-layer rank-{rank} single-batch b={b}",
        "debiased_lowrank_ll": f"last-layer rank-{rank} debiased 2x{(b or 0) // 2}",
        "lowrank_ll-full": f"last-layer rank-{rank} full batch",
    }[fit.method]


def choose_grid(model, fits, sets, cfg, cache, log) -> tuple[list[float], bool]:
    """Extend the paper's grid on the validation set until every optimum is interior."""
    n_down = n_up = 0
    y = sets["val"][1]
    while True:
        grid = extended_grid(n_down, n_up)
        probs, _ = predictions(model, fits, sets, grid, cfg, cache, names=["val"], log=log)
        val_nll = {f.key: E.stats(E.per_image(probs["val"][f.key], y))["nll"] for f in fits}
        low, high = E.extension_needed(val_nll, fits, grid)
        grow_low, grow_high = low and n_down < N_DOWN_MAX, high and n_up < N_UP_MAX
        if not (grow_low or grow_high):
            return grid, not (low or high)
        # predict every δ the extension may still reach in one pass: the Jacobians and their
        # rotation, not the number of δ, set the cost of a pass
        reach = extended_grid(N_DOWN_MAX if grow_low else n_down, N_UP_MAX if grow_high else n_up)
        predictions(model, fits, sets, reach, cfg, cache, names=["val"], log=log)
        n_down += 3 * grow_low  # one decade at the paper's spacing
        n_up += grow_high
        log(f"  validation optimum on the grid edge ({'low' if low else ''}{' high' if high else ''}): "
            f"extending the grid to {extended_grid(n_down, n_up)[0]:.3g} ... {extended_grid(n_down, n_up)[-1]:.3g}")


def method_table(fits: list[Fit], cfg: Config) -> tuple[dict, dict, dict]:
    """``groups`` (mini-batch method name -> draws), ``fulls`` (method -> full-batch fit),
    ``methods`` (name -> JSON-able summary: label, reference, keys, cost)."""
    groups: dict[str, list[Fit]] = {}
    fulls: dict[str, Fit] = {}
    for f in fits:
        if f.repeat is None:
            fulls[f.method] = f
        else:
            groups.setdefault(f.name, []).append(f)
    methods = {}
    for name, fs in [*groups.items(), *((f.name, [f]) for f in fulls.values())]:
        fam = re.sub(r"^(debiased|corrected|shrunk|stein)_|-full$", "", fs[0].method)
        ref = fulls.get(f"{fam}-full")
        entry = {"method": fs[0].method, "b": fs[0].b, "label": fs[0].extra["label"], "keys": [f.key for f in fs],
                 "reference": None if fs[0].repeat is None or ref is None else ref.key,
                 "seconds_mean": float(np.mean([f.seconds for f in fs])),
                 "peak_mib_mean": float(np.mean([f.peak_mib for f in fs])),
                 "coverage": fs[0].extra.get("coverage")}
        two_batch = ("debiased_", "corrected_", "shrunk_", "stein_")
        single = groups.get(re.sub(r"^(debiased|corrected|shrunk|stein)_", "", name)) if name.startswith(two_batch) else None
        if single:
            by_rep = {f.repeat: f.seconds for f in single}
            entry["time_ratio_vs_single"] = float(np.median([f.seconds / by_rep[f.repeat] for f in fs]))
        methods[name] = entry
    return groups, fulls, methods


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cifar10", description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=None, help="CIFAR-10 root (else $LAPLACE_DEBIASED_DATA, else ~/.cache/laplace-debiased/data)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"), help="output folder")
    parser.add_argument("--quick", action="store_true", help="short training, small sets, 2 draws: exercises every step")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default cpu)")
    parser.add_argument("--setting", choices=("cpu", "allcnnc"), default="cpu",
                        help="cpu: cifar_cnn on a 10k subset (default); allcnnc: the paper's ALL-CNN-C "
                             "setting on 40k images, for a GPU (--device cuda)")
    for f in ("epochs", "repeats", "n_test", "n_corrupt", "n_val", "n_ood", "mc_samples", "n_boot", "chunk_size"):
        parser.add_argument("--" + f.replace("_", "-"), type=int, default=None)
    parser.add_argument("--only-sets", nargs="+", default=None, metavar="SET",
                        help="helper mode: predict (and cache) only these evaluation sets, in this order, then exit "
                             "without a report; run beside the main run of the same configuration, once it has "
                             "chosen the grid, to use a second core (sets: val test c1 .. c5 ood)")
    parser.add_argument("--from-end", action="store_true",
                        help="with --only-sets: predict the sets' missing checkpoint blocks from the last one "
                             "backwards and stop at the first that exists, without assembling the set: a second "
                             "process beside the main run (which goes forwards) shares one set's predictive")
    parser.add_argument("--skip-methods", nargs="+", default=[], metavar="NAME",
                        help="fit (and cache) but do not evaluate these mini-batch methods, e.g. kron-2304 "
                             "debiased_kron-2304: a shorter run whose cached fits a later run without the flag reuses")
    parser.add_argument("--estimators", nargs="+", default=None, choices=("paper", "corrected", "shrunk", "stein"),
                        help="debiased K-FAC rows by estimator=...: 'paper' is always fitted; "
                             "'corrected', 'shrunk' and 'stein' add those estimates of the same samples (default: all four)")
    parser.add_argument("--fresh", action="store_true", help="discard the cached fits and predictions of this configuration")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    if args.from_end and not args.only_sets:
        parser.error("--from-end needs --only-sets (the sets whose blocks a second process predicts)")
    if args.quick and args.setting == "allcnnc":
        parser.error("--quick is for the cpu setting")
    cfg = Config.quick_config() if args.quick else Config.allcnnc_config() if args.setting == "allcnnc" else Config()
    for f in ("epochs", "repeats", "n_test", "n_corrupt", "n_val", "n_ood", "mc_samples", "n_boot", "chunk_size"):
        if getattr(args, f) is not None:
            setattr(cfg, f, getattr(args, f))
    if args.estimators is not None:
        cfg.estimators = tuple(dict.fromkeys(("paper", *args.estimators)))
    out = Path(args.out) / ("quick" if cfg.quick else "allcnnc" if cfg.model == "allcnnc" else "")
    out.mkdir(parents=True, exist_ok=True)
    log = lambda s: print(s, flush=True)  # noqa: E731
    t0 = time.perf_counter()

    data = load_data(args.data)
    X, y = data.train.tensors
    n_train = min(cfg.n_train, len(y))
    cfg.n_test, cfg.n_val = min(cfg.n_test, len(data.test)), min(cfg.n_val, len(data.val))
    cfg.n_corrupt, cfg.n_ood = min(cfg.n_corrupt, cfg.n_test), min(cfg.n_ood, cfg.n_test)
    train_set = torch.utils.data.TensorDataset(X[:n_train], y[:n_train])
    base = ALLCNNC if cfg.model == "allcnnc" else MapConfig()
    map_cfg = replace(base, n_train=n_train, epochs=cfg.epochs, seed=cfg.seed)
    model, history = train(map_cfg, X[:n_train], y[:n_train], *data.val.tensors, device=args.device, log=log)
    map_train = M.classification_metrics(softmax(model, X[:n_train]), y[:n_train])
    map_test = M.classification_metrics(softmax(model, data.test.tensors[0]), data.test.tensors[1])
    log(f"MAP: train NLL {map_train['nll']:.4f} ECE {map_train['ece']:.4f}; test NLL {map_test['nll']:.4f} "
        f"ECE {map_test['ece']:.4f} acc {map_test['accuracy']:.4f}")

    model_id = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()[:12]
    root = default_cache_dir() / "cifar10_laplace"
    fit_key = cfg.key("seed", "full_batch_size", "lowrank_rank", "batch_sizes", "magnitude_batches", "null_space",
                      "lowrank_batch_sizes")
    fit_key = f"v{FIT_VERSION}-{fit_key}"
    fit_cache = root / f"fits-{model_id}-{fit_key}"
    pred_cache = root / f"probs-v{PREDICTIVE_VERSION}-{model_id}-{fit_key}-{cfg.key('seed', 'n_val', 'n_test', 'n_corrupt', 'n_ood', 'mc_samples', 'chunk_size')}"
    if args.fresh:
        shutil.rmtree(fit_cache, ignore_errors=True)
        shutil.rmtree(pred_cache, ignore_errors=True)
    fit_cache.mkdir(parents=True, exist_ok=True)
    pred_cache.mkdir(parents=True, exist_ok=True)

    log("fitting ...")
    fits = run_fits(model, train_set, cfg, fit_cache, log)
    fits = [f for f in fits if f.name not in args.skip_methods]
    for f in fits:
        f.extra["label"] = label(f, cfg.lowrank_rank, n_train, cfg.null_space)
    log("evaluation sets ...")
    sets = eval_sets(data, cfg.n_val, cfg.n_test, cfg.n_corrupt, cfg.n_ood, cfg.seed, log)
    log("prior-precision grid (validation set) ...")
    grid, interior = choose_grid(model, fits, sets, cfg, pred_cache, log)
    log(f"predictive on {len(grid)} prior precisions ...")
    if args.only_sets:
        (fill_from_end if args.from_end else predictions)(model, fits, sets, grid, cfg, pred_cache,
                                                          names=args.only_sets, log=log)
        return 0
    probs, maps = predictions(model, fits, sets, grid, cfg, pred_cache, log=log)

    res = E.curves(probs, maps, sets)
    groups, fulls, methods = method_table(fits, cfg)
    full_key = fulls["kron-full"].key
    ref_of = {n: m["reference"] for n, m in methods.items() if m["reference"]}
    tracked = {n: fs for n, fs in groups.items() if n in ref_of}
    paper = np.zeros(len(grid), dtype=bool)
    paper[[grid_index(grid, d) for d in BASE_GRID]] = True
    summary = {
        "selected": {f.key: E.select(res[f.key], f, grid) for f in fits},
        "tracking_paper_grid": E.tracking(probs, sets, tracked, full_key, ref_of, paper, cfg.n_boot, cfg.seed),
        "tracking_full_grid": E.tracking(probs, sets, tracked, full_key, ref_of, np.ones(len(grid), bool), cfg.n_boot, cfg.seed),
    }
    tgt = E.targets(summary, res, groups, full_key, max(cfg.batch_sizes))
    tgt += E.equal_sample_targets(summary["tracking_full_grid"], methods, fulls["kron-full"].seconds)

    figures = tracking_figures(groups, {m: f for m, f in fulls.items()}, res, grid, out)
    chosen, auroc_rows = {}, {}
    order = ("kron", "debiased_kron", "corrected_kron", "shrunk_kron", "stein_kron", "kron-full", "lowrank_ll", "debiased_lowrank_ll", "lowrank_ll-full")
    every = sorted([*groups.values(), *([f] for f in fulls.values())], key=lambda fs: (order.index(fs[0].method), fs[0].b or 0))
    for fs in every:
        sels = [summary["selected"][f.key]["val_nll"] for f in fs]
        first = fs[0]
        chosen[first.extra["label"]] = (probs["test"][first.key][sels[0]["index"]], sels[0]["prior_precision"])
        auroc_rows[f"{first.extra['label']} (δ={sels[0]['prior_precision']:.3g})"] = [
            float(np.mean([res[f.key][s]["auroc"][sel["index"]] for f, sel in zip(fs, sels)]))
            for s in (*E.CORRUPTED, "ood")]
    figures.append(reliability_figure(chosen, maps["test"], sets["test"][1], out))
    figures.append(auroc_figure(auroc_rows, [res["map"][s]["auroc"] for s in (*E.CORRUPTED, "ood")], out))

    meta = {
        "config": asdict(cfg), "grid": grid, "grid_interior": interior, "n_params": sum(p.numel() for p in model.parameters()),
        "n_train": n_train, "n_test_all": len(data.test), "map_train": map_train, "map_test": map_test,
        "train_epochs": len(history), "train_history": history,
        "set_sizes": ", ".join(f"{k} {len(v[1]):,}" for k, v in sets.items()),
        "device": (f"CPU ({platform.processor() or platform.machine()}), {args.threads} torch threads on a shared 2-core "
                   "machine; no GPU (the ALL-CNN-C setting: --setting allcnnc --device cuda)") if args.device == "cpu"
                  else f"{args.device} ({torch.cuda.get_device_name() if args.device.startswith('cuda') else args.device})",
        "fits_loaded_from_cache": [f.key for f in fits if f.extra.get("cached")],
        "wall_seconds": time.perf_counter() - t0, "figures": figures,
    }
    (out / "results.json").write_text(json.dumps(
        {"meta": meta, "methods": methods, "targets": tgt, "summary": summary, "curves": res}, default=float))
    (out / "results.md").write_text(markdown(meta, methods, summary, res, tgt))
    log(f"wrote {out / 'results.md'} and results.json ({meta['wall_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
