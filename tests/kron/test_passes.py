"""K-FAC factors of several batch sets from shared passes, against laplace-torch's own K-FAC."""

import torch
from laplace import KronLaplace
from laplace.curvature import CurvlinopsGGN
from torch.nn.utils import parameters_to_vector

from tests._models import loader, tiny_mlp, toy_data
from laplace_debiased.kron.passes import single_pass_kfacs
from laplace_debiased.curvature.layer_blocks import curvature_modules
from laplace_debiased.parallel.reducer import Reducer

EPS64 = torch.finfo(torch.float64).eps


def _passes(model, groups, N):
    backend = CurvlinopsGGN(model, "classification")
    return single_pass_kfacs(
        model, curvature_modules(model), groups, N, likelihood="classification", backend=backend,
        fisher="type2", keys=("input_ids", "labels"), mean=parameters_to_vector(model.parameters()),
        reducer=Reducer(),
    )


def _stock(model, batches, N):
    """laplace-torch's K-FAC of ``batches`` (one loader), scaled to ``N`` points as a fit over
    ``N`` data: ``G · N/m``, ``A`` the mean."""
    la = KronLaplace(model, "classification")
    data = torch.utils.data.TensorDataset(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    la.fit(loader(data, len(data)))
    m = len(data)
    return [[F[0] * (N / m), *F[1:]] for F in la.H_facs.kfacs]


def test_each_batch_set_equals_stock_kfac_of_its_own_samples():
    model = tiny_mlp()
    batches = list(loader(toy_data(24, (4,), 3, "classification"), 6))
    B, Bt = batches[:2], batches[2:]
    N = 500
    loss, kfacs, rows, _ = _passes(model, [B, Bt], N)
    for got, batch_set in zip(kfacs, (B, Bt)):
        want = _stock(model, batch_set, N)
        for g_block, w_block in zip(got, want):
            assert len(g_block) == len(w_block)
            for g, w in zip(g_block, w_block):
                assert torch.allclose(g, w, rtol=1e-10, atol=1e3 * EPS64 * float(w.abs().max()))
    # the summed loss over every sample of B ∪ B̃, and input rows with XᵀX = A for weight blocks
    X = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    want_loss = torch.nn.functional.cross_entropy(model(X), y, reduction="sum")
    assert torch.allclose(loss, want_loss, rtol=1e-12)
    for block, F in zip(rows[0], kfacs[0]):
        if len(block) == 2 and block[1] is not None:
            assert torch.allclose(block[1].T @ block[1], F[1], atol=1e3 * EPS64 * float(F[1].abs().max()))
