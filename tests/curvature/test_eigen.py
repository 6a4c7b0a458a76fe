"""Eigen routines against dense curvature matrices built explicitly on tiny float64 models."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from laplace_debiased.curvature import eigen
from laplace_debiased.curvature.thresholds import above_relative_floor
from laplace_debiased.curvature.factors import curvature_factor, dense_curvature, directional_curvatures, per_sample_factor_columns
from laplace_debiased.curvature.inputs import CURVATURES

LIKELIHOODS = ("classification", "regression")


def tiny_mlp(seed: int = 0, n_out: int = 3) -> nn.Module:
    """4 → 6 → n_out tanh MLP in float64 (51 parameters for 3 outputs)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, n_out)).double()


def make_batch(n: int, likelihood: str, seed: int, n_in: int = 4, n_out: int = 3):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, n_in, generator=g, dtype=torch.float64)
    if likelihood == "classification":
        y = torch.randint(0, n_out, (n,), generator=g)
    else:
        y = torch.randn(n, n_out, generator=g, dtype=torch.float64)
    return X, y


def explicit_curvature(model: nn.Module, batches, likelihood: str, curvature: str = "ggn") -> torch.Tensor:
    """Dense GGN / EF of laplace-torch's summed loss, sample by sample with plain autograd.

    GGN: Σ_n J_nᵀ ∇²_f(factor·ℓ) J_n; EF: factor Σ_n ∇ℓ_n ∇ℓ_nᵀ (ℓ = CE or squared error).
    """
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    shapes = [p.shape for k, p in model.named_parameters() if p.requires_grad]
    theta0 = torch.cat([p.detach().reshape(-1) for k, p in model.named_parameters() if p.requires_grad])
    factor = 1.0 if likelihood == "classification" else 0.5

    def forward(theta, x):
        pieces = torch.split(theta, [s.numel() for s in shapes])
        params = {n: t.reshape(s) for n, t, s in zip(names, pieces, shapes)}
        return functional_call(model, params, (x[None],), strict=False)[0]

    def loss(f, y):
        if likelihood == "classification":
            return nn.functional.cross_entropy(f[None], y[None], reduction="sum")
        return (f - y).square().sum()

    G = torch.zeros(len(theta0), len(theta0), dtype=torch.float64)
    for X, Y in batches:
        for x, y in zip(X, Y):
            if curvature == "ggn":
                J = torch.autograd.functional.jacobian(lambda th: forward(th, x), theta0)
                f = forward(theta0, x).detach()
                L = torch.autograd.functional.hessian(lambda out: factor * loss(out, y), f)
                G += J.T @ L @ J
            else:
                g = torch.autograd.functional.jacobian(lambda th: loss(forward(th, x), y), theta0)
                G += factor * torch.outer(g, g)
    return G


def assert_same_subspace_vectors(U: torch.Tensor, V: torch.Tensor, atol: float = 1e-6) -> None:
    """Columns equal up to sign."""
    signs = torch.sign((U * V).sum(0))
    torch.testing.assert_close(U * signs, V, atol=atol, rtol=0)


@pytest.mark.parametrize("likelihood", LIKELIHOODS)
@pytest.mark.parametrize("curvature", CURVATURES)
def test_dense_curvature_matches_explicit(likelihood, curvature):
    model = tiny_mlp()
    batches = [make_batch(5, likelihood, 1), make_batch(4, likelihood, 2)]
    G = dense_curvature(model, batches, likelihood, curvature)
    torch.testing.assert_close(G, explicit_curvature(model, batches, likelihood, curvature), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("likelihood", LIKELIHOODS)
@pytest.mark.parametrize("curvature", CURVATURES)
def test_linear_features_route_matches_explicit(bias, likelihood, curvature):
    torch.manual_seed(3)
    layer = nn.Linear(5, 3, bias=bias).double()
    batches = [make_batch(7, likelihood, 4, n_in=5), make_batch(6, likelihood, 5, n_in=5)]
    G = dense_curvature(layer, batches, likelihood, curvature)
    torch.testing.assert_close(G, explicit_curvature(layer, batches, likelihood, curvature), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("likelihood", LIKELIHOODS)
@pytest.mark.parametrize("curvature", CURVATURES)
def test_curvature_factor_reproduces_dense(likelihood, curvature):
    model = tiny_mlp()
    batches = [make_batch(6, likelihood, 6)]
    V = curvature_factor(model, batches, likelihood, curvature, max_chunk_elements=200)  # chunked
    n_out = 3 if curvature == "ggn" else 1
    assert V.shape == (51, 6 * n_out)
    torch.testing.assert_close(V @ V.T, explicit_curvature(model, batches, likelihood, curvature), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("n_samples", [8, 40])  # VᵀV (24 < P=51) and V Vᵀ (120 > 51) branches
@pytest.mark.parametrize("method", ["gram", "lanczos"])
@pytest.mark.parametrize("likelihood", LIKELIHOODS)
def test_top_eigenpairs_match_dense_top_k(n_samples, method, likelihood):
    model = tiny_mlp()
    batches = [make_batch(n_samples, likelihood, 7)]
    G = explicit_curvature(model, batches, likelihood)
    values, vectors = torch.linalg.eigh(G)
    values, vectors = values.flip(0)[:5], vectors.flip(1)[:, :5]
    assert (values[:-1] - values[1:]).min() > 1e-6 * values[0]  # distinct: vectors are unique up to sign
    pairs = eigen.top_eigenpairs(model, batches, likelihood, rank=5, method=method)
    assert pairs.method == method
    torch.testing.assert_close(pairs.values, values, atol=1e-9 * float(values[0]), rtol=1e-9)
    assert_same_subspace_vectors(pairs.vectors, vectors)


@pytest.mark.parametrize("curvature", CURVATURES)
@pytest.mark.parametrize("likelihood", LIKELIHOODS)  # regression: MSELoss(mean) → summed-loss scale n·C/2
def test_lanczos_and_gram_routes_agree(curvature, likelihood):
    model = tiny_mlp(seed=1)
    batches = [make_batch(6, likelihood, 8), make_batch(5, likelihood, 9)]
    gram = eigen.top_eigenpairs(model, batches, likelihood, rank=4, curvature=curvature, method="gram")
    lanczos = eigen.top_eigenpairs(model, batches, likelihood, rank=4, curvature=curvature, method="lanczos")
    torch.testing.assert_close(gram.values, lanczos.values, atol=1e-9 * float(gram.values[0]), rtol=1e-9)
    assert_same_subspace_vectors(gram.vectors, lanczos.vectors)
    torch.testing.assert_close(gram.vectors.T @ gram.vectors, torch.eye(4, dtype=torch.float64), atol=1e-10, rtol=0)


def test_linear_layer_top_eigenpairs_use_features_route():
    torch.manual_seed(0)
    layer = nn.Linear(4, 3).double()
    batches = [make_batch(30, "regression", 10, n_in=4)]
    G = explicit_curvature(layer, batches, "regression")  # full rank 15 (softmax would have a null space)
    pairs = eigen.top_eigenpairs(layer, batches, "regression", rank=15)  # rank ≥ P−1 ⇒ gram
    assert pairs.method == "gram"
    values = torch.linalg.eigvalsh(G).flip(0)[:15]
    torch.testing.assert_close(pairs.values, values, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(pairs.vectors @ torch.diag(pairs.values) @ pairs.vectors.T, G, atol=1e-9, rtol=0)


@pytest.mark.parametrize("likelihood", LIKELIHOODS)
@pytest.mark.parametrize("curvature", CURVATURES)
def test_directional_curvatures_equal_dense_rayleigh_quotients(likelihood, curvature):
    model = tiny_mlp()
    batches = [make_batch(5, likelihood, 11), make_batch(7, likelihood, 12)]
    G = explicit_curvature(model, batches, likelihood, curvature)
    U = torch.randn(51, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    lam = directional_curvatures(model, batches, U, likelihood, curvature, chunk_size=3)
    torch.testing.assert_close(lam, torch.einsum("pk,pq,qk->k", U, G, U), atol=1e-10, rtol=1e-10)


def test_remeasured_top_eigenvectors_on_same_batch_give_eigenvalues():
    """Reduction B̃ = B: uᵀ G_B u of B's own eigenvectors are its eigenvalues."""
    model = tiny_mlp()
    batches = [make_batch(10, "classification", 13)]
    pairs = eigen.top_eigenpairs(model, batches, "classification", rank=6, method="gram")
    lam = directional_curvatures(model, batches, pairs.vectors, "classification")
    torch.testing.assert_close(lam, pairs.values, atol=1e-10, rtol=1e-10)


def test_directional_curvatures_rejects_wrong_shape():
    with pytest.raises(ValueError, match="shape"):
        directional_curvatures(tiny_mlp(), [make_batch(3, "classification", 0)], torch.zeros(50, 2), "classification")


def test_relative_threshold_drops_small_eigenvalues():
    model = tiny_mlp()
    batches = [make_batch(2, "classification", 14)]  # rank of G_B ≤ 2 · (C − 1) = 4
    full = eigen.top_eigenpairs(model, batches, "classification", rank=10, method="gram")
    assert len(full.values) == 4  # the numerical null space of VᵀV never yields directions
    cut = eigen.top_eigenpairs(model, batches, "classification", rank=10, method="gram", rtol=0.5)
    assert torch.all(cut.values > 0.5 * full.values[0])
    assert len(cut.values) == int((full.values > 0.5 * full.values[0]).sum())


def test_above_relative_floor_removes_nonpositive_and_tiny():
    lam = torch.tensor([2.0, 0.0, -1e-17, 1e-12, 1e-9], dtype=torch.float64)
    assert above_relative_floor(lam, rtol=1e-10).tolist() == [True, False, False, False, True]
    assert above_relative_floor(lam, rtol=0.0).tolist() == [True, False, False, True, True]
    assert not above_relative_floor(torch.zeros(4, dtype=torch.float64), rtol=0.0).any()
    assert not above_relative_floor(-torch.ones(3, dtype=torch.float64), rtol=0.5).any()
    assert above_relative_floor(torch.zeros(0), rtol=0.1).shape == (0,)


def test_choose_method_cost_rules():
    assert eigen.choose_method(n_params=100, n_samples=10, n_columns=100, rank=99) == "gram"  # eigsh needs k < P−1
    assert eigen.choose_method(n_params=10**6, n_samples=1000, n_columns=10**4, rank=5) == "lanczos"  # V too big
    assert eigen.choose_method(n_params=5000, n_samples=4, n_columns=40, rank=10) == "gram"  # tiny Gram matrix
    assert eigen.choose_method(n_params=5000, n_samples=2000, n_columns=20000, rank=2, max_gram_bytes=1e12) == "lanczos"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rank=0), "rank"),
        (dict(rank=2, method="power"), "method"),
        (dict(rank=2, curvature="hessian"), "curvature"),
        (dict(rank=2, rtol=-1.0), "rtol"),
        (dict(rank=51, method="lanczos"), "Lanczos"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        eigen.top_eigenpairs(tiny_mlp(), [make_batch(4, "classification", 0)], "classification", **kwargs)


@pytest.mark.parametrize("n_samples", [6, 40])  # M = 18 < P (VᵀV) and M = 120 ≥ P (dense)
def test_range_eigenpairs_reconstruct_curvature(n_samples):
    model = tiny_mlp()
    batches = [make_batch(n_samples, "classification", 15)]
    G = explicit_curvature(model, batches, "classification")
    pairs = eigen.range_eigenpairs(model, batches, "classification")
    assert len(pairs.values) == int((torch.linalg.eigvalsh(G) > 1e-10 * torch.linalg.eigvalsh(G).max()).sum())
    torch.testing.assert_close((pairs.vectors * pairs.values) @ pairs.vectors.T, G, atol=1e-10, rtol=0)


def test_eigenbasis_debiased_curvature_reductions():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(6, 3, dtype=torch.float64, generator=g)
    G_B = A @ A.T  # rank 3
    B = torch.randn(6, 6, dtype=torch.float64, generator=g)
    G_Bt = B @ B.T
    values, vectors = torch.linalg.eigh(G_B)
    U = vectors[:, 3:]
    torch.testing.assert_close(eigen.eigenbasis_debiased_curvature(U, values[3:], G_B), G_B, atol=1e-12, rtol=0)
    Q = torch.linalg.qr(torch.randn(6, 6, dtype=torch.float64, generator=g))[0]
    full = eigen.eigenbasis_debiased_curvature(Q, torch.diag(Q.T @ G_Bt @ Q), G_Bt)
    torch.testing.assert_close(full, Q @ torch.diag(torch.diag(Q.T @ G_Bt @ Q)) @ Q.T, atol=1e-12, rtol=0)


class DictMLP(nn.Module):
    """``tiny_mlp`` that reads its input from a mapping (laplace-torch's ``dict_key_x``)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.net = tiny_mlp(seed)

    def forward(self, batch):
        return self.net(batch["input_ids"])


def as_mapping(batches, kind=dict):
    return [(kind({"input_ids": X, "attention_mask": torch.ones(len(X), 2)}), y) for X, y in batches]


class BatchLike(dict):
    """A dict subclass standing in for Hugging Face's ``BatchEncoding`` (a ``UserDict``)."""


@pytest.mark.parametrize("kind", [dict, BatchLike])
@pytest.mark.parametrize("curvature", CURVATURES)
def test_mapping_inputs_give_the_tensor_curvature(kind, curvature):
    """Gram, Lanczos, dense and forward-mode routes on mapping inputs equal the tensor routes."""
    batches = [make_batch(5, "classification", 21), make_batch(4, "classification", 22)]
    mapped = as_mapping(batches, kind)
    model, dict_model = tiny_mlp(), DictMLP()
    G = explicit_curvature(model, batches, "classification", curvature)
    torch.testing.assert_close(dense_curvature(dict_model, mapped, "classification", curvature), G, atol=1e-10, rtol=0)
    for method in ("gram", "lanczos"):
        ref = eigen.top_eigenpairs(model, batches, "classification", 4, curvature, method=method)
        got = eigen.top_eigenpairs(dict_model, mapped, "classification", 4, curvature, method=method)
        assert got.method == method
        torch.testing.assert_close(got.values, ref.values, atol=1e-9 * float(ref.values[0]), rtol=1e-9)
        assert_same_subspace_vectors(got.vectors, ref.vectors)
    U = torch.randn(51, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    lam = directional_curvatures(dict_model, mapped, U, "classification", curvature)
    torch.testing.assert_close(lam, torch.einsum("pk,pq,qk->k", U, G, U), atol=1e-10, rtol=1e-10)
    assert torch.equal(mapped[0][0]["input_ids"], batches[0][0])  # inputs untouched


def test_reverse_mode_columns_equal_functorch_factor():
    model = tiny_mlp()
    X, y = make_batch(6, "regression", 23)
    V = curvature_factor(model, [(X, y)], "regression")
    blocks = list(per_sample_factor_columns(model, X, y, "regression"))
    torch.testing.assert_close(torch.cat(blocks, dim=1), V, atol=1e-12, rtol=0)


def test_only_trainable_parameters_are_weights():
    """Frozen parameters are constants (LoRA-style): the curvature is the trainable block."""
    model = tiny_mlp()
    batches = [make_batch(6, "classification", 24)]
    full = explicit_curvature(model, batches, "classification")
    model[0].weight.requires_grad_(False)
    idx = torch.arange(24, 51)  # first weight (6×4) frozen
    sub = dense_curvature(model, batches, "classification")
    torch.testing.assert_close(sub, full[idx][:, idx], atol=1e-10, rtol=0)
    mapped_model = DictMLP()
    mapped_model.net[0].weight.requires_grad_(False)
    U = torch.randn(27, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    lam = directional_curvatures(mapped_model, as_mapping(batches), U, "classification")
    torch.testing.assert_close(lam, torch.einsum("pk,pq,qk->k", U, sub, U), atol=1e-10, rtol=1e-10)


class AttentionClassifier(nn.Module):
    """MultiheadAttention over 3 tokens of width 4, mean-pooled, then a linear head (float64)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True).double()
        self.head = nn.Linear(4, 3).double()

    def forward(self, x):
        x = x.reshape(len(x), 3, 4)
        return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))


def test_multihead_attention_model_works_on_every_route():
    """Its eval fast path has no forward-mode AD: re-measurement and Lanczos fall back to
    reverse mode / the Gram route and still give the explicit curvature."""
    model = AttentionClassifier().eval()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(5, 12, dtype=torch.float64, generator=g), torch.randint(0, 3, (5,), generator=g))]
    G = explicit_curvature(model, batches, "classification")
    P = G.shape[0]
    U = torch.linalg.qr(torch.randn(P, 4, dtype=torch.float64, generator=g))[0]
    lam = directional_curvatures(model, batches, U, "classification")
    torch.testing.assert_close(lam, torch.einsum("pk,pq,qk->k", U, G, U), atol=1e-10, rtol=1e-8)
    pairs = eigen.top_eigenpairs(model, batches, "classification", rank=3, method="auto")
    torch.testing.assert_close(pairs.values, torch.linalg.eigvalsh(G).flip(0)[:3], atol=1e-9, rtol=1e-8)


def test_backward_hooks_are_detached_and_restored():
    """BackPACK's extend installs full backward hooks that torch.func cannot trace."""
    from backpack import extend

    model = extend(tiny_mlp())
    batches = [make_batch(5, "classification", 25)]
    hooks_before = [dict(m._backward_hooks) for m in model.modules()]
    assert any(hooks_before)
    G = explicit_curvature(tiny_mlp(), batches, "classification")
    V = curvature_factor(model, batches, "classification")
    torch.testing.assert_close(V @ V.T, G, atol=1e-10, rtol=0)
    U = torch.eye(51, dtype=torch.float64)[:, :4]
    torch.testing.assert_close(
        directional_curvatures(model, batches, U, "classification"), torch.diag(G)[:4], atol=1e-10, rtol=1e-10
    )
    assert [dict(m._backward_hooks) for m in model.modules()] == hooks_before


def test_nan_outputs_raise_clear_error():
    model = tiny_mlp()
    with torch.no_grad():
        model[2].weight[0, 0] = float("nan")
    batches = [make_batch(5, "classification", 26)]
    with pytest.raises(ValueError, match="NaN"):
        eigen.top_eigenpairs(model, batches, "classification", rank=3, method="gram")
    features = torch.full((5, 4), float("nan"), dtype=torch.float64)
    with pytest.raises(ValueError, match="NaN"):
        eigen.top_eigenpairs(nn.Linear(4, 3).double(), [(features, batches[0][1])], "classification", rank=2, method="gram")


def test_huge_rank_is_capped_or_refused_clearly():
    batches = [make_batch(4, "classification", 27)]
    pairs = eigen.top_eigenpairs(tiny_mlp(), batches, "classification", rank=10**9)
    assert pairs.vectors.shape[0] == 51 and len(pairs.values) <= 4 * 3  # capped at rank G_B
    with pytest.raises(ValueError, match="Lanczos"):
        eigen.top_eigenpairs(tiny_mlp(), batches, "classification", rank=10**9, method="lanczos")
