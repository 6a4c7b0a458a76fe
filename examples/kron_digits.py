"""Single-batch vs debiased (two-batch) K-FAC Laplace on the sklearn digits.

Trains (or loads from the cache) a MAP ``digits_cnn``, then fits over all weights

* ``kron (single batch)``: K-FAC of one mini-batch of ``--batch-size`` samples, scaled to N:
  ``DebiasedKronLaplace`` with ``magnitude_loader=train_loader`` (B̃ = B), which is
  laplace-torch's ``KronLaplace`` fitted on that batch times N / batch size (tested in
  ``tests/test_kron_math.py``), so its prior precision lives on the same scale;
* ``debiased_kron``: two disjoint batches of half that size, B chooses the eigenvectors,
  B̃ measures the eigenvalues (Tatzel et al., ICLR 2025, same number of samples);
* ``kron (full batch)``: K-FAC over all N training points (one batch, B̃ = B: exactly
  ``KronLaplace.fit`` on that loader),

tunes each (scalar) prior precision by the Laplace marginal likelihood (meaningful for the
debiased fit: its ``loss`` is rescaled to the full data set) and prints test NLL and ECE
(15 bins, l1) of the GLM probit predictive.  ``--gridsearch`` instead picks it by validation
NLL on an 9-point grid (slower: laplace-torch recomputes Jacobians for every grid point).
Run: ``python examples/kron_digits.py`` (about 20 s of CPU once the MAP model is cached).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import DataLoader

import laplace_debiased  # noqa: F401  registers 'debiased_kron'
from laplace_debiased.data.digits import digits_splits
from laplace_debiased.kron import DebiasedKronLaplace
from laplace_debiased.metrics import ece, nll
from laplace_debiased.models import digits_cnn
from laplace_debiased.training import TrainConfig, train_map


@torch.no_grad()
def predict(la, loader: DataLoader) -> tuple[torch.Tensor, torch.Tensor]:
    probs, ys = [], []
    for X, y in loader:  # small chunks: the GLM predictive builds per-sample Jacobians
        probs.append(la(X, pred_type="glm", link_approx="probit"))
        ys.append(y)
    return torch.cat(probs), torch.cat(ys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=128, help="single-batch size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gridsearch", action="store_true", help="tune by validation NLL")
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    splits = digits_splits(seed=args.seed)
    model, _ = train_map(digits_cnn(), splits["train"], TrainConfig(seed=args.seed), tag="digits_cnn")
    model.eval()
    test = DataLoader(splits["test"], batch_size=100)
    shuffle = torch.Generator().manual_seed(args.seed)
    single = DataLoader(splits["train"], batch_size=args.batch_size, shuffle=True, generator=shuffle)
    halves = DataLoader(splits["train"], batch_size=args.batch_size // 2, shuffle=True,
                        generator=torch.Generator().manual_seed(args.seed))

    everything = DataLoader(splits["train"], batch_size=len(splits["train"]))
    val = DataLoader(splits["val"], batch_size=300)
    fits = {
        "kron (single batch)": lambda la: la.fit(single, magnitude_loader=single),
        "debiased_kron": lambda la: la.fit(halves),
        "kron (full batch)": lambda la: la.fit(everything, magnitude_loader=everything),
    }
    print(f"N = {len(splits['train'])}, single batch = {args.batch_size}, "
          f"B = B̃ = {args.batch_size // 2} samples")
    print(f"{'posterior':22s} {'prior prec':>10s} {'test NLL':>9s} {'test ECE':>9s} {'fit s':>6s}")
    probs, y = predict_map(model, test)
    print(f"{'MAP':22s} {'-':>10s} {nll(probs, y):9.4f} {ece(probs, y):9.4f} {'-':>6s}")
    for name, fit in fits.items():
        la = DebiasedKronLaplace(model, "classification")
        start = time.perf_counter()
        fit(la)
        seconds = time.perf_counter() - start
        if args.gridsearch:
            la.optimize_prior_precision(
                method="gridsearch", val_loader=val, link_approx="probit",
                log_prior_prec_min=-1, log_prior_prec_max=3, grid_size=9,
            )
        else:
            la.optimize_prior_precision(method="marglik")
        probs, y = predict(la, test)
        print(f"{name:22s} {la.prior_precision.item():10.3g} {nll(probs, y):9.4f} "
              f"{ece(probs, y):9.4f} {seconds:6.2f}")


@torch.no_grad()
def predict_map(model: torch.nn.Module, loader: DataLoader) -> tuple[torch.Tensor, torch.Tensor]:
    out = [(torch.softmax(model(X), -1), y) for X, y in loader]
    return torch.cat([p for p, _ in out]), torch.cat([y for _, y in out])


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore", message="By default `link_approx`")
    main()
