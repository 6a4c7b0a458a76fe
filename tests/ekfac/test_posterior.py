"""The debiased EKFAC posterior (:mod:`laplace_debiased.ekfac.posterior`) against dense matrices."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from _models import loader, tiny_mlp, toy_data
from laplace_debiased.ekfac.posterior import EKFACDecomposed, EKFACStructure, SpannedEKFACDecomposed, SpannedEKFACStructure
from laplace_debiased.posterior.grid import GridPredictive
from laplace_debiased.posterior.jacobians import LayerJacobian
from laplace_debiased.ekfac.laplace import DebiasedEKFACLaplace, DebiasedEKFACLLLaplace

CLASSES = {"all": DebiasedEKFACLaplace, "last_layer": DebiasedEKFACLLLaplace}


def _basis(H: EKFACDecomposed) -> torch.Tensor:
    """The dense block-diagonal eigenbasis ``Q`` (columns in eigenvalue order)."""
    return torch.block_diag(*[torch.kron(*Qs) if len(Qs) == 2 else Qs[0] for Qs in H.eigenvectors])


def _eigenvalues(H: EKFACDecomposed) -> torch.Tensor:
    return torch.cat([lam.reshape(-1) for lam in H.eigenvalues])


def test_posterior_precision_is_diagonal_plus_prior_in_the_basis():
    model = tiny_mlp()
    la = DebiasedEKFACLaplace(model, "classification", temperature=0.5)
    la.fit(loader(toy_data(32, (4,), 3, "classification"), 8))
    delta = torch.tensor([0.3, 1.0, 2.0, 5.0], dtype=torch.float64)
    la.prior_precision = delta
    Q, lam = _basis(la.H), _eigenvalues(la.H)
    sizes = [p.numel() for p in model.parameters()]
    prior = torch.repeat_interleave(delta, torch.tensor(sizes))
    dense = Q @ torch.diag(lam / 0.5 + prior) @ Q.T
    P = la.posterior_precision
    torch.testing.assert_close(P.to_matrix(), dense, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(P.to_matrix(-1), torch.linalg.inv(dense), atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(P.diag(-1), torch.linalg.inv(dense).diagonal(), atol=1e-12, rtol=1e-8)
    torch.testing.assert_close(la.log_det_posterior_precision, torch.logdet(dense), atol=1e-10, rtol=1e-10)
    W = torch.randn(5, 3, sum(sizes), dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(la.functional_variance(W), W @ torch.linalg.inv(dense) @ W.transpose(1, 2))
    v = la.mean + 0.1
    torch.testing.assert_close(la.square_norm(v), (v - la.mean) @ dense @ (v - la.mean))


@pytest.mark.parametrize("cross_fit", [False, True])
@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_grid_predictive_of_a_float32_model_matches_float64(subset, cross_fit):
    """The grid structure holds the float32 eigenbasis in float64 (it used to mix dtypes)."""
    ds = toy_data(32, (4,), 3, "classification")
    X = toy_data(5, (4,), 3, "classification", seed=7).tensors[0]
    grid = [1e-3, 0.5, 10.0]
    out = {}
    for dtype in (torch.float32, torch.float64):
        data = TensorDataset(ds.tensors[0].to(dtype), ds.tensors[1])
        la = CLASSES[subset](tiny_mlp().to(dtype), "classification", cross_fit=cross_fit)
        la.fit(loader(data, 8))
        out[dtype] = GridPredictive(la, chunk_size=4).grid(X.to(dtype), grid, links=("probit",))["probit"]
    assert torch.isfinite(out[torch.float32]).all()
    torch.testing.assert_close(out[torch.float32].double(), out[torch.float64], atol=1e-4, rtol=1e-4)


def _random_ekfac(out: int = 3, inp: int = 4, seed: int = 0) -> tuple[list, list]:
    """A weight block ``[Q_G, Q_A]`` with a full ``(out, inp)`` eigenvalue array (not an outer
    product) and a bias block ``[Q_G]``, float64."""
    g = torch.Generator().manual_seed(seed)

    def orth(n: int) -> torch.Tensor:
        return torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))[0]

    Q_G = orth(out)
    vectors = [[Q_G, orth(inp)], [Q_G]]
    values = [torch.rand(out, inp, generator=g, dtype=torch.float64) * 5, torch.rand(out, generator=g, dtype=torch.float64)]
    return vectors, values


def _dense(vectors: list, values: list, deltas: torch.Tensor) -> torch.Tensor:
    """``blockdiag_k Q_k diag(vec Λ_k + δ_k) Q_kᵀ`` written out."""
    blocks = []
    for Qs, lam, d in zip(vectors, values, deltas):
        Q = torch.kron(*Qs) if len(Qs) == 2 else Qs[0]
        blocks.append(Q @ torch.diag(lam.reshape(-1) + d) @ Q.T)
    return torch.block_diag(*blocks)


def test_operations_equal_the_dense_block_diagonal_matrix():
    vectors, values = _random_ekfac()
    deltas = torch.tensor([0.3, 2.0], dtype=torch.float64)
    H = EKFACDecomposed(vectors, values) * 0.5 + deltas
    dense = _dense(vectors, [0.5 * lam for lam in values], deltas)
    inverse = torch.linalg.inv(dense)
    P = len(dense)
    torch.testing.assert_close(H.to_matrix(), dense, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(H.to_matrix(-1), inverse, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(H.logdet(), torch.logdet(dense), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(H.diag(), dense.diagonal(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(H.diag(-1), inverse.diagonal(), rtol=1e-10, atol=1e-12)
    W = torch.randn(5, 2, P, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(H.bmm(W), W @ inverse, rtol=1e-10, atol=1e-12)  # (batch, classes, params)
    torch.testing.assert_close(H.bmm(W[:, 0], exponent=1), W[:, 0] @ dense, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(H.bmm(W[0, 0]), inverse @ W[0, 0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(H.inv_square_form(W), W @ inverse @ W.transpose(1, 2), rtol=1e-10, atol=1e-12)
    # a scalar prior is one δ for every block; the operations return new objects
    torch.testing.assert_close((EKFACDecomposed(vectors, values) + torch.tensor(0.3, dtype=torch.float64)).to_matrix(),
                               _dense(vectors, values, torch.tensor([0.3, 0.3], dtype=torch.float64)))
    assert torch.equal(EKFACDecomposed(vectors, values).deltas, torch.zeros(2, dtype=torch.float64))


def test_mismatched_shapes_and_priors_raise():
    vectors, values = _random_ekfac()
    with pytest.raises(ValueError, match="2 eigenvector blocks but 1 eigenvalue blocks"):
        EKFACDecomposed(vectors, values[:1])
    with pytest.raises(ValueError, match="block 0: eigenvalues of shape"):
        EKFACDecomposed(vectors, [values[0].T, values[1]])
    H = EKFACDecomposed(vectors, values)
    with pytest.raises(ValueError, match="scalar or one value per parameter block"):
        H + torch.ones(3, dtype=torch.float64)
    with pytest.raises(ValueError, match="torch.Tensor"):
        H + 1.0
    with pytest.raises(ValueError, match="W has 20 parameters but the blocks have 15"):
        H.bmm(torch.ones(1, 1, 20, dtype=torch.float64))


def test_grid_structure_covariances_equal_the_dense_inverse():
    """``Σ(δ) = J (s·H + δ)⁻¹ Jᵀ`` of :class:`EKFACStructure` for a grid of prior precisions."""
    vectors, values = _random_ekfac()
    H = EKFACDecomposed(vectors, values)
    s = 0.7
    struct = H.grid_structure(s, [12, 3])
    assert type(struct) is EKFACStructure
    g = torch.Generator().manual_seed(2)
    jacs = [LayerJacobian(g=torch.randn(4, 2, 3, generator=g, dtype=torch.float64),
                          a=torch.randn(4, 4, generator=g, dtype=torch.float64)),
            LayerJacobian(dense=torch.randn(4, 2, 3, generator=g, dtype=torch.float64))]
    J = torch.cat([j.full() for j in jacs], -1)
    grid = [1e-3, 0.5, torch.tensor([2.0, 0.1], dtype=torch.float64)]
    cov = struct.covariances(struct.rotate(jacs), grid)
    for k, delta in enumerate(grid):
        P = _dense(vectors, [s * lam for lam in values], torch.as_tensor(delta, dtype=torch.float64).expand(2))
        torch.testing.assert_close(cov[k], J @ torch.linalg.inv(P) @ J.transpose(1, 2), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="the posterior and the model do not match"):
        H.grid_structure(s, [3, 12])


def test_spanned_blocks_take_one_prior_per_parameter_tensor():
    """A block spanning two tensors (a normalisation layer's weight and bias) takes its tensors'
    equal prior precisions as one δ; the operations keep the spans and the spanned grid structure."""
    vectors, values = _random_ekfac()
    merged = [[vectors[0][0]], values[0][:, 0]]  # one dense (3, 3) block over two tensors
    H = SpannedEKFACDecomposed([vectors[0], merged[0]], [values[0], merged[1]], spans=[1, 2])
    Hd = H * 2.0 + torch.tensor([0.3, 1.5, 1.5], dtype=torch.float64)
    assert type(Hd) is SpannedEKFACDecomposed and Hd.spans == [1, 2]
    ref = _dense([vectors[0], merged[0]], [2.0 * values[0], 2.0 * merged[1]], torch.tensor([0.3, 1.5], dtype=torch.float64))
    torch.testing.assert_close(Hd.to_matrix(), ref, rtol=1e-12, atol=1e-12)
    assert isinstance(H.grid_structure(1.0, [12, 2, 1]), SpannedEKFACStructure)
