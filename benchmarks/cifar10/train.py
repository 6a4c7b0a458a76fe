"""Train the benchmark's MAP network to convergence, resumable from per-epoch checkpoints.

    python -m benchmarks.cifar10.train [--data DIR] [--n-train N] [--epochs E] [--threads T] [--device D]

Recipes, no augmentation, L2 ``weight_decay`` per data point (``0.5 * wd * ||θ||²`` added to the
*mean* cross-entropy, i.e. prior precision ``wd * N`` on the summed loss):

* ``"adam-cosine"`` (the CPU benchmark, ``cifar_cnn``): Adam, cosine schedule to zero over
  ``epochs``, L2 on every parameter;
* ``"sgd-step"`` (the paper's ALL-CNN-C setting B): SGD with momentum 0.9, learning rate divided
  by 10 at epochs 200, 250 and 300 (of 350), L2 on the weights only (not the biases).

The model is trained until the training loss is near zero, so that the MAP is overconfident (test
NLL well above train NLL) and a Laplace approximation has something to fix.

A checkpoint (model, optimiser, scheduler, history, RNG state) is written after every epoch under
``<cache>/cifar10_map/<tag>/``; a rerun with the same settings resumes from the last one.  The
finished model is ``<cache>/cifar10_map/<tag>/map.pt``.  Progress: one line per epoch on stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from laplace_debiased.paths import default_cache_dir

from .models import MODELS


@dataclass(frozen=True)
class MapConfig:
    """Everything that determines the trained MAP (its cache tag is a hash of this)."""

    n_train: int = 10000
    epochs: int = 60
    lr: float = 2e-3
    weight_decay: float = 1e-4
    batch_size: int = 128
    seed: int = 0
    model: str = "cifar_cnn"
    recipe: str = "adam-cosine"

    def tag(self) -> str:
        """``<model>-<hash>``; ``model`` and ``recipe`` enter the hash only when not at their
        defaults (so the tags of models trained before these fields existed stay valid)."""
        d = asdict(self)
        for k in ("model", "recipe"):
            if d[k] == getattr(MapConfig, k):
                del d[k]
        return f"{self.model}-" + hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:10]


#: The paper's ALL-CNN-C CIFAR-10 training (test problem B): SGD 0.025, momentum 0.9, batch 256,
#: 350 epochs, steps at 200/250/300, weight decay 1e-3 on the weights (40k training images).
ALLCNNC = MapConfig(n_train=40000, epochs=350, lr=0.025, weight_decay=1e-3, batch_size=256,
                    model="allcnnc", recipe="sgd-step")


def map_dir(cfg: MapConfig, cache: Path | None = None) -> Path:
    return (cache or default_cache_dir()) / "cifar10_map" / cfg.tag()


@torch.no_grad()
def nll_acc(model: nn.Module, X: torch.Tensor, y: torch.Tensor, chunk: int = 2000) -> dict[str, float]:
    """Mean NLL and accuracy of ``model`` on ``(X (N,3,32,32), y (N,))`` (on the model's device)."""
    model.eval()
    dev = next(model.parameters()).device
    loss, correct = 0.0, 0
    for xb, yb in zip(X.split(chunk), y.split(chunk)):
        xb, yb = xb.to(dev), yb.to(dev)
        out = model(xb)
        loss += float(nn.functional.cross_entropy(out, yb, reduction="sum"))
        correct += int((out.argmax(-1) == yb).sum())
    return {"nll": loss / len(y), "accuracy": correct / len(y)}


def _optimiser(cfg: MapConfig, params: list[nn.Parameter]):
    if cfg.recipe == "adam-cosine":
        opt = torch.optim.Adam(params, lr=cfg.lr)
        return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs), params
    if cfg.recipe == "sgd-step":
        opt = torch.optim.SGD(params, lr=cfg.lr, momentum=0.9)
        steps = [round(cfg.epochs * f) for f in (200 / 350, 250 / 350, 300 / 350)]
        return opt, torch.optim.lr_scheduler.MultiStepLR(opt, steps, 0.1), [p for p in params if p.ndim > 1]
    raise ValueError(f"recipe must be 'adam-cosine' or 'sgd-step', got {cfg.recipe!r}")


def train(cfg: MapConfig, X: torch.Tensor, y: torch.Tensor, Xv: torch.Tensor, yv: torch.Tensor,
          cache: Path | None = None, device: str = "cpu", log=print) -> tuple[nn.Module, list[dict]]:
    """Train ``cfg.model`` on ``(X, y)`` (normalised float32, CPU) or resume / load it; the
    returned model is on ``device``."""
    folder = map_dir(cfg, cache)
    final = folder / "map.pt"
    model = MODELS[cfg.model]().to(device)
    if final.is_file():
        blob = torch.load(final, map_location=device, weights_only=False)
        model.load_state_dict(blob["state_dict"])
        model.eval()
        log(f"loaded trained MAP {final}")
        return model, blob["history"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(asdict(cfg)))
    torch.manual_seed(cfg.seed)
    params = list(model.parameters())
    opt, sched, decayed = _optimiser(cfg, params)
    gen = torch.Generator().manual_seed(cfg.seed)
    history: list[dict] = []
    ckpt = folder / "last.pt"
    if ckpt.is_file():
        blob = torch.load(ckpt, map_location=device, weights_only=False)
        model.load_state_dict(blob["model"])
        opt.load_state_dict(blob["opt"])
        sched.load_state_dict(blob["sched"])
        gen.set_state(blob["gen"])
        history = blob["history"]
        log(f"resumed from epoch {len(history)} ({ckpt})")
    n = len(y)
    if device != "cpu":  # one copy on the accelerator instead of one per step
        X, y = X.to(device), y.to(device)
        torch.backends.cudnn.benchmark = True
    for epoch in range(len(history), cfg.epochs):
        start = time.perf_counter()
        model.train()
        perm = torch.randperm(n, generator=gen)
        run_loss, run_correct = 0.0, 0
        for idx in perm.split(cfg.batch_size):
            xb, yb = X[idx.to(X.device)], y[idx.to(y.device)]
            out = model(xb)
            ce = nn.functional.cross_entropy(out, yb)
            loss = ce + 0.5 * cfg.weight_decay * sum(p.square().sum() for p in decayed)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"training diverged at epoch {epoch + 1}; lower --lr")
            opt.zero_grad()
            loss.backward()
            opt.step()
            run_loss += float(ce.detach()) * len(idx)
            run_correct += int((out.argmax(-1) == yb).sum())
        sched.step()
        row = {"epoch": epoch + 1, "train_nll_running": run_loss / n, "train_acc_running": run_correct / n,
               **{f"val_{k}": v for k, v in nll_acc(model, Xv, yv).items()},
               "seconds": time.perf_counter() - start}
        history.append(row)
        tmp = ckpt.with_name(f"last.{os.getpid()}.part")  # its own: another job may train the same model
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                    "gen": gen.get_state(), "history": history}, tmp)
        tmp.replace(ckpt)
        log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    model.eval()
    tmp = final.with_name(f"map.{os.getpid()}.part")
    torch.save({"state_dict": model.state_dict(), "history": history, "config": asdict(cfg)}, tmp)
    tmp.replace(final)
    return model, history


def main(argv: list[str] | None = None) -> int:
    from benchmarks.cifar10.data import load_data

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None)
    for f, v in asdict(MapConfig()).items():
        p.add_argument("--" + f.replace("_", "-"), type=type(v), default=v)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = MapConfig(**{f: getattr(a, f) for f in asdict(MapConfig())})
    data = load_data(a.data)
    X, y = data.train.tensors
    log = lambda s: print(s, flush=True)  # noqa: E731
    log(f"training {cfg} -> {map_dir(cfg)}")
    model, hist = train(cfg, X[: cfg.n_train], y[: cfg.n_train], *data.val.tensors, device=a.device, log=log)
    log(f"final train {nll_acc(model, X[: cfg.n_train], y[: cfg.n_train])}")
    log(f"final test {nll_acc(model, *data.test.tensors)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
