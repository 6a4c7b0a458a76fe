"""Normalisation layers and embeddings over all weights, against dense matrices.

Two tiny float64 models in eval mode: a conv net with BatchNorm (a ``bias=False`` conv and a
grouped conv) and a one-block pre-LN transformer with token and position embeddings.  The
reference GGN is built by brute force (``torch.func`` Jacobians of every output w.r.t. every
parameter, :func:`_models.exact_ggn`); float64 throughout, so the tolerances are round-off of
sums of a few hundred products (``1e-10`` relative).
"""

from __future__ import annotations

import io

import pytest
import torch
from laplace import Laplace
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from _models import exact_ggn, loader
from laplace_debiased.curvature.dense_blocks import embedding_input_sums, norm_sample_grads, normalised_input
from laplace_debiased.posterior.grid import GridPredictive
from laplace_debiased.posterior.links import probit
from laplace_debiased.kron.spanned import SpannedStructure

RTOL = 1e-10
STRUCTURES = ("debiased_kron", "debiased_ekfac", "debiased_full", "debiased_lowrank")
N_CLASSES, VOCAB, TOKENS = 3, 7, 5


def conv_bn_net(seed: int = 0) -> nn.Module:
    """Conv(bias=False)-BN-Tanh-grouped Conv-BN-Tanh-pool-Linear on 2x5x5 images, eval mode,
    random affines and running statistics."""
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.Tanh(),
        nn.Conv2d(4, 4, 3, padding=1, groups=2), nn.BatchNorm2d(4), nn.Tanh(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, N_CLASSES),
    ).double()
    _randomise_norms(net)
    return net.eval()


class PreLNBlock(nn.Module):
    """Token + position embeddings, one pre-LN transformer block (single-head attention and a
    tanh MLP, residuals), final LayerNorm, mean pooling, linear head: ``(n, T)`` tokens ->
    ``(n, C)`` logits."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(TOKENS, d)
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.mlp = nn.LayerNorm(d), nn.Linear(d, d)
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        q, k, v = self.qkv(self.ln1(h)).chunk(3, dim=-1)
        h = h + self.proj(torch.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, -1) @ v)
        h = h + torch.tanh(self.mlp(self.ln2(h)))
        return self.head(self.ln_f(h).mean(1))


def transformer(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    net = PreLNBlock().double()
    _randomise_norms(net)
    return net.eval()


def _randomise_norms(net: nn.Module) -> None:
    g = torch.Generator().manual_seed(1)
    for m in net.modules():
        if isinstance(m, (nn.BatchNorm2d, nn.LayerNorm)):
            with torch.no_grad():
                m.weight.copy_(1 + 0.5 * torch.randn(m.weight.shape, generator=g, dtype=m.weight.dtype))
                m.bias.copy_(0.5 * torch.randn(m.bias.shape, generator=g, dtype=m.bias.dtype))
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(0.3 * torch.randn(m.num_features, generator=g, dtype=m.running_mean.dtype))
            m.running_var.copy_(0.5 + torch.rand(m.num_features, generator=g, dtype=m.running_var.dtype))


def _data(name: str, n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    if name == "conv_bn":
        X = torch.randn(n, 2, 5, 5, generator=g, dtype=torch.float64)
    else:
        X = torch.randint(0, VOCAB, (n, TOKENS), generator=g)
    return TensorDataset(X, torch.randint(0, N_CLASSES, (n,), generator=g))


MODELS = {"conv_bn": conv_bn_net, "transformer": transformer}
NORM = (nn.BatchNorm2d, nn.LayerNorm)


def _norm_slices(model: nn.Module) -> list[slice]:
    """Parameter-vector ranges of every normalisation layer's trainable affine (weight, bias)."""
    offsets, start = {}, 0
    for p in (q for q in model.parameters() if q.requires_grad):
        offsets[id(p)] = (start, start + p.numel())
        start += p.numel()
    out = []
    for m in model.modules():
        owned = [offsets[id(p)] for p in m.parameters(recurse=False) if p.requires_grad]
        if isinstance(m, NORM) and owned:
            out.append(slice(owned[0][0], owned[-1][1]))
    return out


def _trainable_ggn(model: nn.Module, X: torch.Tensor) -> torch.Tensor:
    """Brute-force GGN restricted to the trainable parameters (``model.parameters()`` order)."""
    mask = torch.cat([torch.full((p.numel(),), p.requires_grad) for p in model.parameters()])
    return exact_ggn(model, X, "classification")[mask][:, mask]


def _fit(name: str, structure: str, n: int, batch: int, same: bool, **kw):
    model = MODELS[name]()
    data = _data(name, n)
    dl = loader(data, batch)
    la = Laplace(model, "classification", "all", structure, **kw, **({} if same else _paper(structure)))
    la.fit(dl, magnitude_loader=dl if same else None)
    return la, model, data


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=RTOL, atol=RTOL * float(b.abs().max()))


# -------------------------------------------------------------------------- block maths
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("structure", ["debiased_kron", "debiased_ekfac"])
def test_single_batch_norm_blocks_equal_dense_ggn_blocks(name, structure):
    """B̃ = B on all N samples (scale 1): every normalisation block of H is the brute-force
    GGN's block of that layer's weight and bias (cross terms included)."""
    la, model, data = _fit(name, structure, n=12, batch=12, same=True)
    ggn = _trainable_ggn(model, data.tensors[0])
    H = la.H.to_matrix()
    for s in _norm_slices(model):
        _close(H[s, s], ggn[s, s])


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("structure", ["debiased_kron", "debiased_ekfac"])
def test_debiased_norm_blocks_equal_dense_two_batch_formula(name, structure):
    """B, B̃ = two halves (N = 2m): each normalisation block is ``U diag(Uᵀ G_B̃ U) Uᵀ`` with
    ``U`` the eigenvectors of ``G_B`` and ``G_S = N/m ×`` the brute-force GGN block on ``S``."""
    la, model, data = _fit(name, structure, n=16, batch=8, same=False)
    X = data.tensors[0]
    G_B, G_Bt = (2.0 * _trainable_ggn(model, Xs) for Xs in (X[:8], X[8:]))
    H = la.H.to_matrix()
    for s in _norm_slices(model):
        _, U = torch.linalg.eigh(G_B[s, s])
        lam = ((G_Bt[s, s] @ U) * U).sum(0)
        _close(H[s, s], (U * lam) @ U.T)


@pytest.mark.parametrize("name", MODELS)
def test_two_batch_kron_and_ekfac_share_the_dense_blocks(name):
    """A dense block's EKFAC eigenvalues along its own eigenbasis are its debiased eigenvalues."""
    kron, model, _ = _fit(name, "debiased_kron", n=16, batch=8, same=False)
    ekfac, _, _ = _fit(name, "debiased_ekfac", n=16, batch=8, same=False)
    Hk, He = kron.H.to_matrix(), ekfac.H.to_matrix()
    for s in _norm_slices(model):
        _close(He[s, s], Hk[s, s])


@pytest.mark.parametrize("name", MODELS)
def test_b_tilde_equal_b_reduces_to_the_single_batch_blocks(name):
    """B̃ = B: the debiased curvature is B's own curvature, block for block (K-FAC, embedding
    and dense blocks alike)."""
    la, _, _ = _fit(name, "debiased_kron", n=16, batch=8, same=True)
    _close(la.H.to_matrix(), la.H_facs.to_matrix())


class OneHotLinear(nn.Module):
    """An embedding written as a bias-free ``nn.Linear`` on one-hot inputs."""

    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        self.lin = nn.Linear(emb.num_embeddings, emb.embedding_dim, bias=False).double()
        with torch.no_grad():
            self.lin.weight.copy_(emb.weight.T)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(F.one_hot(x, self.lin.in_features).to(self.lin.weight.dtype))


def test_embedding_block_is_the_kfac_of_a_linear_layer_on_one_hot_inputs():
    """The token embedding's block ``A ⊗ G`` (vocabulary index slow) equals the K-FAC block
    ``G ⊗ A`` of the same layer written as ``Linear`` on one-hot inputs, with the two index
    orders swapped; ``A`` is diagonal."""
    la, model, data = _fit("transformer", "debiased_kron", n=12, batch=12, same=True)
    twin = transformer()
    twin.tok = OneHotLinear(model.tok)
    dl = loader(data, 12)
    ref = Laplace(twin, "classification", "all", "debiased_kron")
    ref.fit(dl, magnitude_loader=dl)
    A, G = la.H_facs.kfacs[0]
    G_lin, A_lin = ref.H_facs.kfacs[0]
    assert torch.equal(A, torch.diag(A.diagonal()))
    V, D = A.shape[0], G.shape[0]
    emb = torch.kron(A, G).reshape(V, D, V, D).permute(1, 0, 3, 2)
    _close(emb, torch.kron(G_lin, A_lin).reshape(D, V, D, V))


def test_embedding_input_sums_count_tokens_and_skip_padding():
    emb = nn.Embedding(4, 2, padding_idx=0)
    idx = torch.tensor([[1, 1, 0, 3], [2, 0, 0, 0]])
    out = torch.zeros(2, 4, 4)
    embedding_input_sums(emb, idx, [(0, 1, 0), (1, 2, 1)], out)
    torch.testing.assert_close(out[0], torch.diag(torch.tensor([0.0, 0.5, 0.0, 0.25])))
    torch.testing.assert_close(out[1], torch.diag(torch.tensor([0.0, 0.0, 0.25, 0.0])))


@pytest.mark.parametrize("layer", [nn.BatchNorm1d(3), nn.LayerNorm(3), nn.GroupNorm(1, 3)])
def test_norm_sample_grads_are_per_sample_autograd_gradients(layer):
    """Closed-form per-sample affine gradients against autograd, sample by sample."""
    layer = layer.double().eval()
    if isinstance(layer, nn.BatchNorm1d):
        layer.running_mean.fill_(0.2), layer.running_var.fill_(1.7)
    x = torch.randn(4, 3, 5, dtype=torch.float64) if not isinstance(layer, nn.LayerNorm) else torch.randn(4, 5, 3, dtype=torch.float64)
    w = torch.randn_like(x)
    rows = norm_sample_grads(layer, normalised_input(layer, x), w)
    for n in range(len(x)):
        grads = torch.autograd.grad((layer(x[n : n + 1]) * w[n : n + 1]).sum(), [layer.weight, layer.bias])
        _close(rows[n], torch.cat([g.reshape(-1) for g in grads]))


# -------------------------------------------------------------------------- plumbing
def _dense_precision(la, delta: float) -> torch.Tensor:
    """The posterior precision at ``delta`` as a dense matrix, from the Laplace object."""
    la.prior_precision = delta
    P = la.posterior_precision
    if isinstance(P, torch.Tensor):
        return P
    if isinstance(P, tuple):  # low rank: ((U, s·λ), prior diagonal)
        (U, lam), prior = P
        return (U * lam) @ U.T + torch.diag(prior)
    return P.to_matrix()


def _jacobians(model: nn.Module, X: torch.Tensor) -> torch.Tensor:
    params = {k: v.detach() for k, v in model.named_parameters()}
    J = torch.func.jacrev(lambda p: torch.func.functional_call(model, p, (X,)))(params)
    return torch.cat([j.flatten(2) for j in J.values()], 2)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("structure", STRUCTURES)
def test_grid_predictive_and_marglik_match_dense_algebra(name, structure):
    """End to end on the mixed blocks: the grid predictive's probit equals the probit of
    ``J P⁻¹ Jᵀ`` with the dense posterior precision ``P``, and the log determinant in the
    marginal likelihood equals ``log det P``, at two prior precisions."""
    kw = {"rank": 10} if structure == "debiased_lowrank" else {}
    la, model, data = _fit(name, structure, n=16, batch=8, same=False, **kw)
    X = _data(name, 6, seed=3).tensors[0]
    J = _jacobians(model, X)
    f = model(X).detach()
    probs = GridPredictive(la).grid(X, [0.3, 2.0], links=("probit",))["probit"]
    for g, delta in enumerate((0.3, 2.0)):
        P = _dense_precision(la, delta)
        cov = torch.einsum("ncp,pq,nkq->nck", J, torch.linalg.inv(P), J)
        torch.testing.assert_close(probs[g], probit(f, cov), rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(la.log_det_posterior_precision, torch.linalg.slogdet(P)[1], rtol=1e-9, atol=1e-9)
        assert torch.isfinite(la.log_marginal_likelihood(torch.tensor(delta)))


def test_grid_structure_concatenates_the_tensors_of_a_dense_block():
    la, _, _ = _fit("conv_bn", "debiased_kron", n=16, batch=8, same=False)
    structure = GridPredictive(la).structure
    assert isinstance(structure, SpannedStructure)
    assert sum(structure.spans) == len(list(la.params)) > len(structure.spans)


def test_state_dict_round_trip_keeps_the_mixed_blocks():
    la, model, data = _fit("conv_bn", "debiased_kron", n=16, batch=8, same=False)
    buf = io.BytesIO()
    torch.save(la.state_dict(), buf)
    buf.seek(0)
    other = Laplace(model, "classification", "all", "debiased_kron", **_paper("debiased_kron"))
    other.load_state_dict(torch.load(buf, weights_only=False))
    X = data.tensors[0][:4]
    _close(GridPredictive(other).grid(X, [1.0])["probit_projected"], GridPredictive(la).grid(X, [1.0])["probit_projected"])


def test_layerwise_prior_precision_per_tensor():
    """One prior precision per parameter tensor: equal values for a normalisation layer's weight
    and bias map onto its block; different values raise, naming what to do."""
    la, _, _ = _fit("conv_bn", "debiased_kron", n=16, batch=8, same=False)
    n_tensors = len(list(la.params))
    la.prior_precision = torch.full((n_tensors,), 0.5, dtype=torch.float64)
    scalar = la.log_det_posterior_precision
    la.prior_precision = 0.5
    _close(scalar, la.log_det_posterior_precision)
    deltas = torch.full((n_tensors,), 0.5, dtype=torch.float64)
    deltas[1] = 0.7  # the first BatchNorm's weight, not its bias
    la.prior_precision = deltas
    with pytest.raises(ValueError, match="same value"):
        la.log_det_posterior_precision


# -------------------------------------------------------------------------- semantics
@pytest.mark.parametrize("structure", STRUCTURES)
def test_batchnorm_in_train_mode_is_refused(structure):
    model = conv_bn_net().train()
    la = Laplace(model, "classification", "all", structure)
    with pytest.raises(ValueError, match=r"model\.eval\(\)"):
        la.fit(loader(_data("conv_bn", 8), 4))


@pytest.mark.parametrize("structure", ["debiased_kron", "debiased_ekfac"])
def test_frozen_and_half_frozen_normalisation_layers(structure):
    """A frozen BatchNorm gets no block; one with only its bias trainable gets a ``C``-block
    equal to the brute-force GGN block of that bias."""
    model = conv_bn_net()
    model[1].requires_grad_(False)
    model[4].weight.requires_grad_(False)
    data = _data("conv_bn", 12)
    dl = loader(data, 12)
    la = Laplace(model, "classification", "all", structure)
    la.fit(dl, magnitude_loader=dl)
    ggn = _trainable_ggn(model, data.tensors[0])
    (s,) = _norm_slices(model)
    assert s.stop - s.start == 4
    _close(la.H.to_matrix()[s, s], ggn[s, s])


def test_token_outputs_with_layernorm_are_refused_with_the_alternative():
    class TokenModel(PreLNBlock):
        def forward(self, x):
            return self.head(self.ln_f(self.tok(x)))

    model = TokenModel().double().eval()
    X = torch.randint(0, VOCAB, (8, TOKENS))
    y = torch.randint(0, N_CLASSES, (8, TOKENS))
    for m in (model.pos, model.ln1, model.qkv, model.proj, model.ln2, model.mlp):
        m.requires_grad_(False)
    la = Laplace(model, "classification", "all", "debiased_kron")
    with pytest.raises(ValueError, match="debiased_full"):
        la.fit(loader(TensorDataset(X, y), 4))


def test_unsupported_layer_is_named():
    model = nn.Sequential(nn.Linear(3, 4), nn.PReLU(), nn.Linear(4, 2)).double()
    data = TensorDataset(torch.randn(8, 3, dtype=torch.float64), torch.randint(0, 2, (8,)))
    la = Laplace(model, "classification", "all", "debiased_kron")
    with pytest.raises(ValueError, match="'1' \\(PReLU\\)"):
        la.fit(loader(data, 4))


def wide_head_bn_net(seed: int = 0) -> nn.Module:
    """Conv-BN-Tanh-Flatten-Linear(100, C) on 2x5x5 images: the head's input factor (dimension
    100) is wider than a batch of 8, so the debiased fit keeps its null space implicit."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Tanh(), nn.Flatten(),
                        nn.Linear(100, N_CLASSES)).double()
    _randomise_norms(net)
    return net.eval()


@pytest.mark.parametrize("null_space", ["isotropic", "aligned"])
def test_grid_predictive_with_an_implicit_wide_factor_and_a_dense_norm_block(null_space):
    """A BatchNorm block (dense, spanning weight and bias) beside an implicit K-FAC input factor
    (Gram route): the grid predictive equals the probit of ``J P⁻¹ Jᵀ`` with the dense precision."""
    model, data = wide_head_bn_net(), _data("conv_bn", 16)
    la = Laplace(model, "classification", "all", "debiased_kron", null_space=null_space)
    la.fit(loader(data, 8))
    assert any(Q.shape[1] < Q.shape[0] for Qs in la.H.eigenvectors for Q in Qs)  # the head is implicit
    X = _data("conv_bn", 6, seed=3).tensors[0]
    J, f = _jacobians(model, X), model(X).detach()
    probs = GridPredictive(la).grid(X, [0.3, 2.0], links=("probit",))["probit"]
    for g, delta in enumerate((0.3, 2.0)):
        cov = torch.einsum("ncp,pq,nkq->nck", J, torch.linalg.inv(_dense_precision(la, delta)), J)
        torch.testing.assert_close(probs[g], probit(f, cov), rtol=1e-8, atol=1e-10)


def _paper(structure: str) -> dict:
    """Constructor options for the paper's two-batch estimate (B's eigenvectors, B̃'s Rayleigh
    quotients), whose dense formula these tests check, where the structure offers a choice."""
    return {"estimator": "paper"} if structure in ("debiased_kron", "debiased_ekfac") else {}
