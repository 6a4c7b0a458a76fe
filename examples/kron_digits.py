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
debiased fit: its ``loss`` is rescaled to the full data set) or, with ``--select val``, by
validation NLL over the paper's grid, and prints test NLL and ECE (15 bins, l1) of the
linearized predictive with the probit on the logit-difference subspace
(:class:`laplace_debiased.evaluation.predictive.GridPredictive`).  The last column is laplace-torch's own
diagonal GLM probit for comparison: it is fooled by the softmax-invariant logit direction.
Run: ``python examples/kron_digits.py`` (about 20 s of CPU once the MAP model is cached).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import DataLoader

import laplace_debiased  # noqa: F401  registers 'debiased_kron'
from laplace_debiased.structures.kron import DebiasedKronLaplace
from laplace_debiased.evaluation.metrics import ece, nll
from laplace_debiased.evaluation.predictive import GridPredictive
from laplace_debiased.evaluation.sweep import DEFAULT_PRIOR_PRECISIONS
from laplace_debiased.evaluation.training import default_digits_model


@torch.no_grad()
def laplace_probit(la, loader: DataLoader) -> torch.Tensor:
    """laplace-torch's diagonal GLM probit, in small chunks (it builds per-sample Jacobians)."""
    return torch.cat([la(X, pred_type="glm", link_approx="probit") for X, _ in loader])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=128, help="single-batch size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--select", choices=("marglik", "val"), default="marglik",
                        help="prior precision by marginal likelihood or by validation NLL on the paper's grid")
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    model, splits = default_digits_model(seed=args.seed)
    model.eval()
    test = DataLoader(splits["test"], batch_size=100)
    shuffle = torch.Generator().manual_seed(args.seed)
    single = DataLoader(splits["train"], batch_size=args.batch_size, shuffle=True, generator=shuffle)
    halves = DataLoader(splits["train"], batch_size=args.batch_size // 2, shuffle=True,
                        generator=torch.Generator().manual_seed(args.seed))

    everything = DataLoader(splits["train"], batch_size=len(splits["train"]))
    fits = {
        "kron (single batch)": lambda la: la.fit(single, magnitude_loader=single),
        "debiased_kron": lambda la: la.fit(halves),
        "kron (full batch)": lambda la: la.fit(everything, magnitude_loader=everything),
    }
    print(f"N = {len(splits['train'])}, single batch = {args.batch_size}, "
          f"B = B̃ = {args.batch_size // 2} samples")
    print(f"{'posterior':22s} {'prior prec':>10s} {'test NLL':>9s} {'test ECE':>9s} {'fit s':>6s}"
          f" {'NLL diag. probit':>17s}")
    x_test, y_test = splits["test"].tensors
    x_val, y_val = splits["val"].tensors
    probs = torch.softmax(model(x_test), -1).detach()
    print(f"{'MAP':22s} {'-':>10s} {nll(probs, y_test):9.4f} {ece(probs, y_test):9.4f} {'-':>6s}")
    for name, fit in fits.items():
        la = DebiasedKronLaplace(model, "classification")
        start = time.perf_counter()
        fit(la)
        seconds = time.perf_counter() - start
        predictive = GridPredictive(la)
        if args.select == "val":
            val_probs = predictive.grid(x_val, DEFAULT_PRIOR_PRECISIONS)["probit_projected"]
            best = min(range(len(val_probs)), key=lambda g: nll(val_probs[g], y_val))
            la.prior_precision = DEFAULT_PRIOR_PRECISIONS[best]
        else:
            la.optimize_prior_precision(method="marglik")
        probs = predictive(x_test)
        diag = laplace_probit(la, test)
        print(f"{name:22s} {la.prior_precision.item():10.3g} {nll(probs, y_test):9.4f} "
              f"{ece(probs, y_test):9.4f} {seconds:6.2f} {nll(diag, y_test):17.4f}")


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore", message="By default `link_approx`")
    main()
