"""Tiny test models, data and dense reference curvature (float64, explicit matrices).

Other engineers' tests may import these.  Nothing here subclasses ``BaseLaplace``.

Reference conventions (laplace-torch's summed loss; ``Λ_n`` = Hessian of the per-sample loss
w.r.t. the network output: ``diag(p) - ppᵀ`` for cross-entropy, ``I`` for ``½‖f - y‖²``):

* exact GGN ``Σ_n J_nᵀ Λ_n J_n`` with ``J_n`` the ``(outputs, params)`` Jacobian;
* K-FAC of a Linear / Conv2d layer with pre-activation ``s`` and (unfolded) input ``a``:
  ``G = Σ_n Σ_t (∂f_n/∂s_nt)ᵀ Λ_n (∂f_n/∂s_nt)`` (output side, ``t`` over spatial positions)
  and ``A = 1/(M T) Σ_n Σ_t a_nt a_ntᵀ`` (``M`` samples, ``T`` output positions, Grosse &
  Martens' KFC "expand" convention, which Curvlinops and ASDL follow); a weight block is
  ``kron(G, A)``, a bias block ``G``.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset


def tiny_mlp(n_in: int = 4, hidden: int = 3, n_out: int = 3, seed: int = 0) -> nn.Module:
    """Linear(n_in, hidden) - Tanh - Linear(hidden, n_out), float64 (27 params by default)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, n_out)).double()


def tiny_cnn(n_out: int = 3, seed: int = 0) -> nn.Module:
    """Conv2d(1, 2, 3) on 1x5x5 images - Tanh - Flatten - Linear(18, n_out), float64."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 3 * 3, n_out)
    ).double()


def toy_data(
    n: int, input_shape: tuple[int, ...], n_out: int, likelihood: str, seed: int = 0
) -> TensorDataset:
    """``n`` Gaussian inputs (float64) with class labels or regression targets ``(n, n_out)``."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, *input_shape, generator=g, dtype=torch.float64)
    if likelihood == "classification":
        y = torch.randint(0, n_out, (n,), generator=g)
    else:
        y = torch.randn(n, n_out, generator=g, dtype=torch.float64)
    return TensorDataset(X, y)


def loader(dataset: TensorDataset, batch_size: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False)


def _output_hessians(f: torch.Tensor, likelihood: str) -> torch.Tensor:
    """``Λ_n`` ``(n, outputs, outputs)`` of laplace-torch's per-sample loss."""
    if likelihood == "classification":
        p = torch.softmax(f, dim=-1)
        return torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
    return torch.eye(f.shape[-1], dtype=f.dtype).expand(f.shape[0], -1, -1)


def exact_ggn(model: nn.Module, X: torch.Tensor, likelihood: str) -> torch.Tensor:
    """Dense GGN ``Σ_n J_nᵀ Λ_n J_n`` ``(params, params)`` of the summed loss on ``X``."""
    params = dict(model.named_parameters())

    def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(model, p, (X,))

    J = torch.func.jacrev(f)(params)
    J = torch.cat([j.flatten(start_dim=2) for j in J.values()], dim=2)  # (n, out, P)
    Lam = _output_hessians(f(params).detach(), likelihood)
    return torch.einsum("nop,noq,nqr->pr", J, Lam, J).detach()


def dense_kfac(
    model: nn.Module, X: torch.Tensor, likelihood: str
) -> list[list[torch.Tensor]]:
    """Reference K-FAC blocks ``[[G, A], [G_bias], ...]`` of the summed GGN on ``X`` built
    from explicit per-sample Jacobians (Curvlinops "expand" convention):
    ``G = Σ_n Σ_t J_ntᵀ Λ_n J_nt`` with ``J_nt = ∂f_n/∂s_nt`` ``(outputs, d_out)`` and
    ``A = 1/(M T) Σ_n Σ_t a_nt a_ntᵀ`` (``M`` samples, ``t`` over the ``T`` output positions;
    ``T = 1`` for Linear). For a single sample and ``T = 1`` each block is the exact GGN
    block of that parameter tensor."""
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    inputs: dict[nn.Module, torch.Tensor] = {}
    outputs: dict[nn.Module, torch.Tensor] = {}

    def hook(module, inp, out):
        inputs[module] = inp[0].detach()
        out.retain_grad()
        outputs[module] = out

    handles = [m.register_forward_hook(hook) for m in layers]
    f = model(X)
    for h in handles:
        h.remove()
    M, C = f.shape
    Lam = _output_hessians(f.detach(), likelihood)
    # Jacobians of every output w.r.t. every layer's pre-activation (samples independent)
    jac = {m: [] for m in layers}
    for c in range(C):
        for m in layers:
            outputs[m].grad = None
        f[:, c].sum().backward(retain_graph=True)
        for m in layers:
            jac[m].append(outputs[m].grad.clone())
    blocks = []
    for m in layers:
        Jc = torch.stack(jac[m], dim=1)  # (M, C, d_out, *spatial)
        a = inputs[m]
        if isinstance(m, nn.Conv2d):
            a = nn.functional.unfold(a, m.kernel_size, m.dilation, m.padding, m.stride)
            a = a.transpose(1, 2)  # (M, T, d_in)
            Jc = Jc.flatten(start_dim=3).permute(0, 3, 1, 2)  # (M, T, C, d_out)
        else:
            a = a.unsqueeze(1)  # (M, 1, d_in)
            Jc = Jc.unsqueeze(1)  # (M, 1, C, d_out)
        G = torch.einsum("ntci,ncd,ntdj->ij", Jc, Lam, Jc)
        A = torch.einsum("nti,ntj->ij", a, a) / (M * a.shape[1])
        blocks.append([G, A])
        if m.bias is not None:
            blocks.append([G])
    return blocks


def kfac_to_dense(blocks: list[list[torch.Tensor]]) -> torch.Tensor:
    """Block-diagonal dense matrix of K-FAC blocks (``kron(G, A)`` or ``G``)."""
    mats = [torch.kron(F[0].contiguous(), F[1].contiguous()) if len(F) == 2 else F[0] for F in blocks]
    return torch.block_diag(*mats)


def diagonal_blocks(M: torch.Tensor, model: nn.Module) -> list[torch.Tensor]:
    """The diagonal blocks of a dense ``(P, P)`` matrix, one per parameter tensor."""
    blocks, start = [], 0
    for p in model.parameters():
        blocks.append(M[start : start + p.numel(), start : start + p.numel()])
        start += p.numel()
    return blocks


class DictData(Dataset):
    """``toy_data`` as mapping batches ``{key_x: x, "labels": y}`` (Hugging Face style)."""

    def __init__(self, X: torch.Tensor, y: torch.Tensor, key_x: str = "input_ids") -> None:
        self.X, self.y, self.key_x = X, y, key_x

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {self.key_x: self.X[i], "labels": self.y[i]}


class DictModel(nn.Module):
    """``tiny_mlp`` that reads ``data["input_ids"]`` from a mapping (or takes a tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_mlp()

    def forward(self, data) -> torch.Tensor:
        return self.net(data["input_ids"] if isinstance(data, MutableMapping) else data)


def tiny_conv_classifier() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A float64 Conv2d-ReLU-Linear-Tanh-Linear classifier (4 classes, torch seed 0) and 30
    inputs ``(30, 1, 4, 4)`` with labels ``(30,)``."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Flatten(),
        nn.Linear(2 * 16, 5), nn.Tanh(), nn.Linear(5, 4),
    ).double()
    X = torch.randn(30, 1, 4, 4, dtype=torch.float64)
    y = torch.randint(0, 4, (30,))
    return model, X, y


def fit_tiny_conv(structure: str, subset: str):
    """laplace-torch's ``Laplace`` of :func:`tiny_conv_classifier` fitted on its 30 inputs
    (batches of 10); returns ``(la, X)``."""
    from laplace import Laplace

    model, X, y = tiny_conv_classifier()
    la = Laplace(model, "classification", subset_of_weights=subset, hessian_structure=structure)
    la.fit(DataLoader(TensorDataset(X, y), batch_size=10))
    return la, X
