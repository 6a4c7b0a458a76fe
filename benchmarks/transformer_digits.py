"""A small transformer classifier on the digits, all-weights debiased LA vs last-layer LA vs MAP.

    python -m benchmarks.transformer_digits [--threads 1] [--epochs 300] [--out benchmarks/results]

Data: the embedded 8x8 digits (:func:`laplace_debiased.data.digits.digits_splits`: 300 training,
497 validation, 1,000 test images), each image read as a sequence of its 8 rows, 8 tokens of
width 8. Model (float32, eval mode, 9,226 parameters): a linear token embedding to width 32
plus fixed sinusoidal positions, one pre-LN ``nn.TransformerEncoderLayer`` (4 heads, MLP width
64, gelu, no dropout), a final LayerNorm, mean pooling over the tokens and a linear head. The
MAP: full-batch Adam (lr 3e-3, cosine to 0, L2 1e-4 per data point), seeded.

Methods, predicted with the linearized network and the projected probit link on a shared
prior-precision grid, δ chosen by validation NLL:

* ``debiased kron`` / ``debiased ekfac``: all weights (K-FAC blocks for the embedding, the
  attention's in_proj and out_proj, the MLP and the head, one dense block per LayerNorm),
  B and B̃ the two halves of the training set (``fit(loader)`` with batches of 150);
* ``single-batch kron``: the same blocks, B̃ = B = all 300 images (plain K-FAC);
* ``last layer``: laplace-torch's full last-layer LA on all 300 images.

Writes ``transformer_digits.json`` and ``transformer_digits.md`` to ``--out``; fit times are
wall-clock seconds in this one run, with ``--threads`` torch threads.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import laplace_debiased  # noqa: F401  (registers the debiased structures)
from laplace_debiased.data.digits import digits_splits
from laplace_debiased.evaluation.metrics import accuracy, ece, nll
from laplace_debiased.posterior.grid import GridPredictive
from laplace_debiased.prior_grid import PriorGrid

GRID = [float(d) for d in np.logspace(-4, 4, 17)]
LINK = "probit_projected"
METHODS = ("debiased kron", "debiased ekfac", "single-batch kron", "last layer")


class DigitTransformer(nn.Module):
    """Rows of an 8x8 image as 8 tokens -> 10 logits (module docstring)."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d)
        t = torch.arange(8.0).unsqueeze(1)
        freq = torch.exp(-math.log(100.0) * torch.arange(0, d, 2) / d)
        pos = torch.zeros(8, d)
        pos[:, 0::2], pos[:, 1::2] = torch.sin(t * freq), torch.cos(t * freq)
        self.register_buffer("pos", pos)
        self.block = nn.TransformerEncoderLayer(
            d, heads, dim_feedforward=2 * d, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.reshape(len(x), 8, 8)) + self.pos
        return self.head(self.norm(self.block(h)).mean(1))


def train_map(train: TensorDataset, epochs: int, seed: int) -> DigitTransformer:
    torch.manual_seed(seed)
    model = DigitTransformer()
    X, y = train.tensors
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs)
    for _ in range(epochs):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(X), y)
        loss = loss + 0.5e-4 * sum(p.square().sum() for p in model.parameters())
        loss.backward()
        opt.step()
        sched.step()
    return model.eval()


def fit_all(model: nn.Module, train: TensorDataset) -> dict:
    """``name -> (la, seconds)`` for :data:`METHODS`."""
    halves = DataLoader(train, batch_size=len(train) // 2, shuffle=False)
    whole = DataLoader(train, batch_size=len(train), shuffle=False)
    makers = {
        "debiased kron": lambda: _fit(model, "all", "debiased_kron", halves),
        "debiased ekfac": lambda: _fit(model, "all", "debiased_ekfac", halves),
        "single-batch kron": lambda: _fit(model, "all", "debiased_kron", whole, magnitude_loader=whole),
        "last layer": lambda: _fit(model, "last_layer", "full", whole),
    }
    out = {}
    for name, make in makers.items():
        start = time.perf_counter()
        la = make()
        out[name] = (la, time.perf_counter() - start)
    return out


def _fit(model, subset: str, structure: str, loader: DataLoader, **kw):
    la = Laplace(model, "classification", subset, structure)
    la.fit(loader, **kw)
    return la


def evaluate(model: nn.Module, fits: dict, sets: dict) -> dict:
    """Per method: the validation-chosen δ, test metrics there, fit seconds; and the MAP's."""
    with torch.no_grad():
        res = {"map": {s: _metrics(torch.softmax(model(X), -1), y) for s, (X, y) in sets.items()}}
    for name, (la, seconds) in fits.items():
        pred = GridPredictive(la, chunk_size=250)
        probs = {s: pred.grid(X, GRID, links=(LINK,))[LINK] for s, (X, _) in sets.items()}
        val = [nll(p, sets["val"][1]) for p in probs["val"]]
        best = GRID.index(PriorGrid(tuple(GRID)).choose(val))
        res[name] = {
            "delta": GRID[best], "interior": 0 < best < len(GRID) - 1, "fit_s": seconds,
            "val_nll_grid": val, "test": _metrics(probs["test"][best], sets["test"][1]),
        }
    return res


def _metrics(p: torch.Tensor, y: torch.Tensor) -> dict:
    return {"nll": nll(p, y), "ece": ece(p, y), "accuracy": accuracy(p, y)}


def markdown(res: dict, info: dict) -> str:
    lines = [
        "# Transformer classifier on the digits (rows as tokens), all weights vs last layer", "",
        f"Command: `{info['command']}`", "",
        f"MAP: {info['n_params']:,} parameters, {info['epochs']} full-batch Adam epochs on 300 images; "
        f"train NLL {info['train_nll']:.4f}. Sets: val {info['sizes']['val']}, test {info['sizes']['test']}; "
        f"link {LINK}; δ grid {len(GRID)} points in [{GRID[0]:g}, {GRID[-1]:g}] chosen by val NLL; "
        f"{info['threads']} torch thread(s), total wall {info['wall_s']:.0f} s.", "",
        "| method | δ (val) | fit s | test NLL | test ECE | test acc |",
        "|---|---|---|---|---|---|",
    ]
    m = res["map"]["test"]
    lines.append(f"| MAP | - | - | {m['nll']:.4f} | {m['ece']:.4f} | {m['accuracy']:.4f} |")
    for name in METHODS:
        r = res[name]
        edge = "" if r["interior"] else " (grid edge)"
        t = r["test"]
        lines.append(f"| {name} | {r['delta']:g}{edge} | {r['fit_s']:.2f} | {t['nll']:.4f} | {t['ece']:.4f} | {t['accuracy']:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    start = time.perf_counter()
    splits = digits_splits()
    train, val, test = (splits[k] for k in ("train", "val", "test"))
    model = train_map(train, a.epochs, a.seed)
    fits = fit_all(model, train)
    sets = {"val": val.tensors, "test": test.tensors}
    res = evaluate(model, fits, sets)
    with torch.no_grad():
        train_nll = nll(torch.softmax(model(train.tensors[0]), -1), train.tensors[1])
    cmd = "python -m benchmarks.transformer_digits " + " ".join(argv if argv is not None else sys.argv[1:])
    info = {"command": cmd.strip(), "n_params": sum(q.numel() for q in model.parameters()), "epochs": a.epochs,
            "train_nll": train_nll, "sizes": {k: len(v[1]) for k, v in sets.items()}, "threads": a.threads,
            "wall_s": time.perf_counter() - start, "grid": GRID}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "transformer_digits.json").write_text(json.dumps({"info": info, "results": res}, indent=1))
    (out / "transformer_digits.md").write_text(markdown(res, info))
    print((out / "transformer_digits.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
