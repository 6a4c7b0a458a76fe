"""Quick start: the README's lines, run on the embedded digits, next to the MAP network.

The MAP model is the main job's ``digits_cnn`` (trained once on the 300 training digits, then
cached).  A debiased K-FAC Laplace approximation over all weights is fitted from two batches of
32 images (B chooses each layer's eigenvectors, an independent B̃ measures the eigenvalues) and
its prior precision δ is chosen as the quick start says: laplace-torch's grid search on the
validation NLL (log grid 1e-4 ... 1e4).  For comparison the table also shows

* the same fit with δ from the marginal likelihood (``method="marglik"``, no validation data),
  the choice the quick start warns about;
* K-FAC over all training images (B̃ = B = the whole training set, laplace-torch's ``kron``),
  with δ from the same grid search.

Columns: δ, and NLL and ECE on the test split and on the test split with Gaussian pixel noise
(σ = 0.4, clipped to [0, 1]), all with laplace-torch's GLM predictive and probit link.
The committed output is ``docs/tutorials/output/quickstart.txt`` (``make examples`` regenerates it).

Run: ``python examples/quickstart.py``.
"""

from __future__ import annotations

import warnings

import torch
import laplace_debiased  # noqa: F401  registers hessian_structure="debiased_kron"
from laplace import Laplace
from torch.utils.data import DataLoader

from laplace_debiased.evaluation.metrics import ece, nll
from laplace_debiased.evaluation.training import default_digits_model


def fit(model, loader: DataLoader, val_loader: DataLoader, method: str, magnitude_loader=None):
    """The quick start's lines: a debiased K-FAC LA, δ by ``method`` ("gridsearch" or "marglik")."""
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="debiased_kron")
    la.fit(loader, magnitude_loader=magnitude_loader)
    if method == "gridsearch":
        la.optimize_prior_precision(method="gridsearch", val_loader=val_loader, pred_type="glm",
                                    link_approx="probit")
    else:
        la.optimize_prior_precision(method="marglik", pred_type="glm", link_approx="probit")
    return la


def predict(la, x: torch.Tensor) -> torch.Tensor:
    """The quick start's ``la(x, pred_type="glm", link_approx="probit")`` on a whole test set
    (the debiased classes predict in chunks of ``la.predictive_chunk_size`` inputs)."""
    return la(x, pred_type="glm", link_approx="probit")


def main() -> None:
    torch.manual_seed(0)
    model, splits = default_digits_model(log=None)  # MAP digits_cnn and its train/val/test splits
    x_test, y_test = splits["test"].tensors
    x_noisy = (x_test + 0.4 * torch.randn(x_test.shape, generator=torch.Generator().manual_seed(1))).clamp(0, 1)
    train_loader = DataLoader(splits["train"], batch_size=32, shuffle=True,
                              generator=torch.Generator().manual_seed(0))  # B, B̃: its first two batches
    val_loader = DataLoader(splits["val"], batch_size=256)
    everything = DataLoader(splits["train"], batch_size=len(splits["train"]))
    fits = {
        "debiased_kron 32 + 32, δ by val. NLL": fit(model, train_loader, val_loader, "gridsearch"),
        "debiased_kron 32 + 32, δ by marglik": fit(model, train_loader, val_loader, "marglik"),
        f"kron, all {len(everything.dataset)} images, val. NLL": fit(model, everything, val_loader, "gridsearch",
                                                                     magnitude_loader=everything),
    }
    with torch.no_grad():
        rows = {"MAP": (torch.softmax(model(x_test), -1), torch.softmax(model(x_noisy), -1), None)}
    for name, la in fits.items():
        rows[name] = (predict(la, x_test), predict(la, x_noisy), float(la.prior_precision))
    print(f"digits_cnn MAP, N = {len(splits['train'])} training images; test n = {len(y_test)}; "
          f"noisy: test + N(0, 0.4²) pixel noise")
    print(f"{'':38s} {'δ':>8s} {'test NLL':>9s} {'ECE %':>6s} {'noisy NLL':>10s} {'ECE %':>6s}")
    for name, (clean, noisy, delta) in rows.items():
        prior = "-" if delta is None else f"{delta:.3g}"
        print(f"{name:38s} {prior:>8s} {nll(clean, y_test):9.3f} {100 * ece(clean, y_test):6.2f} "
              f"{nll(noisy, y_test):10.3f} {100 * ece(noisy, y_test):6.2f}")


if __name__ == "__main__":
    with warnings.catch_warnings():  # laplace-torch warns about link_approx defaults on every call
        warnings.filterwarnings("ignore", message="By default `link_approx`")
        main()
