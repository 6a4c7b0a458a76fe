"""Attention and GPT-2 ``Conv1D`` over all weights in debiased_kron / debiased_ekfac, against
dense matrices.

Models (float64, eval mode, no dropout): a pre-LN ``nn.TransformerEncoderLayer`` classifier
(d_model 8, 2 heads, 3 tokens, mean pooling) and a GPT-2-style block written with a local
``Conv1D`` of the same shape and semantics as ``transformers``' (``weight`` ``(nx, nf)``,
``x @ weight + bias``). References:

* the K-FAC "expand" definitions ``G = Σ_n Σ_t J_ntᵀ Λ_n J_nt``, ``A = 1/(N T) Σ_n Σ_t a_nt a_ntᵀ``
  with ``J_nt = ∂f_n/∂z_nt`` the Jacobian w.r.t. a projection's output at token ``t``, from
  ``torch.func`` on an explicit twin of the model that adds a perturbation to every projection
  output (the twin reproduces the model's outputs to round-off);
* the brute-force GGN (``_models.exact_ggn``): one sample of one token makes every K-FAC block
  exact, and the LayerNorm blocks are exact dense blocks at any length.

Float64 throughout: tolerances are round-off of sums of a few hundred products (``1e-10``
relative).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from laplace import Laplace
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from _models import exact_ggn, loader
from laplace_debiased.curvature.attention import attention_parts, is_conv1d

RTOL = 1e-10
D_IN, D, HEADS, TOKENS, N_CLASSES = 4, 8, 2, 3, 3
KRON_STRUCTURES = ("debiased_kron", "debiased_ekfac")


class EncoderClassifier(nn.Module):
    """Linear token embedding, one pre-LN ``nn.TransformerEncoderLayer`` (gelu MLP), mean
    pooling, linear head: ``(n, T, 4)`` -> ``(n, 3)``."""

    def __init__(self, seed: int = 0, batch_first: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(D_IN, D)
        self.block = nn.TransformerEncoderLayer(
            D, HEADS, dim_feedforward=16, dropout=0.0, activation="gelu", batch_first=batch_first, norm_first=True
        )
        self.head = nn.Linear(D, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if not self.block.self_attn.batch_first:
            return self.head(self.block(h.transpose(0, 1)).mean(0))
        return self.head(self.block(h).mean(1))


def encoder(seed: int = 0, **kw) -> EncoderClassifier:
    model = EncoderClassifier(seed, **kw).double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-trivial LayerNorm affines
        for norm in (model.block.norm1, model.block.norm2):
            norm.weight.copy_(1 + 0.5 * torch.randn(D, generator=g, dtype=torch.float64))
            norm.bias.copy_(0.5 * torch.randn(D, generator=g, dtype=torch.float64))
    return model.eval()


def _heads(z: torch.Tensor) -> torch.Tensor:
    """``(n, T, E)`` -> ``(n, heads, T, E/heads)``."""
    n, T, E = z.shape
    return z.reshape(n, T, HEADS, E // HEADS).transpose(1, 2)


class ExplicitEncoder(nn.Module):
    """The same function as :class:`EncoderClassifier`, attention written out with ``nn.Linear``
    projections ``qkv`` (= in_proj) and ``proj`` (= out_proj), in the same parameter order;
    ``dz`` ``(n, T, 3D)`` and ``dy`` ``(n, T, D)`` are added to the projections' outputs."""

    def __init__(self, model: EncoderClassifier) -> None:
        super().__init__()
        block, attn = model.block, model.block.self_attn
        self.embed = copy.deepcopy(model.embed)
        self.qkv, self.proj = nn.Linear(D, 3 * D).double(), nn.Linear(D, D).double()
        with torch.no_grad():
            self.qkv.weight.copy_(attn.in_proj_weight), self.qkv.bias.copy_(attn.in_proj_bias)
            self.proj.weight.copy_(attn.out_proj.weight), self.proj.bias.copy_(attn.out_proj.bias)
        self.linear1, self.linear2 = copy.deepcopy(block.linear1), copy.deepcopy(block.linear2)
        self.norm1, self.norm2 = copy.deepcopy(block.norm1), copy.deepcopy(block.norm2)
        self.head = copy.deepcopy(model.head)
        self.inputs: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor, dz: torch.Tensor | float = 0.0, dy: torch.Tensor | float = 0.0) -> torch.Tensor:
        h = self.embed(x)
        a = self.norm1(h)
        q, k, v = (_heads(t) for t in (self.qkv(a) + dz).chunk(3, dim=-1))
        o = (torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D // HEADS), -1) @ v).transpose(1, 2).reshape(h.shape)
        self.inputs = {"in_proj": a.detach(), "out_proj": o.detach()}
        h = h + self.proj(o) + dy
        h = h + self.linear2(F.gelu(self.linear1(self.norm2(h))))
        return self.head(h.mean(1))


def _data(n: int, tokens: int = TOKENS, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, tokens, D_IN, generator=g, dtype=torch.float64)
    return TensorDataset(X, torch.randint(0, N_CLASSES, (n,), generator=g))


def _fit(model: nn.Module, data: TensorDataset, structure: str, batch: int, same: bool) -> object:
    dl = loader(data, batch)
    la = Laplace(model, "classification", "all", structure, **({} if same else _paper(structure)))
    la.fit(dl, magnitude_loader=dl if same else None)
    return la


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    a, b = a.detach(), b.detach()
    torch.testing.assert_close(a, b, rtol=RTOL, atol=RTOL * float(b.abs().max()))


def _slices(model: nn.Module) -> dict[str, slice]:
    """Parameter-vector range of every named parameter."""
    out, start = {}, 0
    for name, p in model.named_parameters():
        out[name] = slice(start, start + p.numel())
        start += p.numel()
    return out


# -------------------------------------------------------------------------- the re-evaluated attention
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize(
    "masks", ["none", "causal_float", "causal_bool+padding", "per_head", "no_weights", "unaveraged"]
)
def test_attention_parts_reproduce_torch_multihead_attention(batch_first, masks):
    """The re-evaluation the K-FAC pass substitutes for ``nn.MultiheadAttention.forward`` returns
    the module's outputs and weights for every mask form (float64 round-off)."""
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(D, HEADS, batch_first=batch_first).double().eval()
    n, T = 4, TOKENS
    x = torch.randn(n, T, D, dtype=torch.float64)
    x = x if batch_first else x.transpose(0, 1)
    causal = nn.Transformer.generate_square_subsequent_mask(T, dtype=torch.float64)
    padding = torch.zeros(n, T, dtype=torch.bool)
    padding[1, -1] = True
    kw = {
        "none": {},
        "causal_float": {"attn_mask": causal},
        "causal_bool+padding": {"attn_mask": causal.isinf(), "key_padding_mask": padding},
        "per_head": {"attn_mask": torch.randn(n * HEADS, T, T, dtype=torch.float64)},
        "no_weights": {"need_weights": False, "key_padding_mask": padding},
        "unaveraged": {"average_attn_weights": False},
    }[masks]
    ref = attn(x, x, x, **kw)
    got = attention_parts(attn, (x, x, x), kw).result
    _close(got[0], ref[0])
    assert (got[1] is None) == (ref[1] is None)
    if ref[1] is not None:
        _close(got[1], ref[1])


def test_attention_parts_reproduce_unbatched_inputs():
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(D, HEADS).double().eval()
    x = torch.randn(TOKENS, D, dtype=torch.float64)
    ref, got = attn(x, x, x), attention_parts(attn, (x, x, x), {}).result
    _close(got[0], ref[0])
    _close(got[1], ref[1])


def test_explicit_twin_reproduces_the_encoder():
    model = encoder()
    X = _data(6).tensors[0]
    _close(ExplicitEncoder(model)(X), model(X))


# -------------------------------------------------------------------------- K-FAC against its definition
def _expand_reference(model: EncoderClassifier, X: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """``[G, A]`` of in_proj and out_proj by the expand definitions (module docstring), from the
    Jacobians of the twin's outputs w.r.t. the perturbations of the projection outputs."""
    twin = ExplicitEncoder(model)
    n = len(X)
    dz = torch.zeros(n, TOKENS, 3 * D, dtype=torch.float64)
    dy = torch.zeros(n, TOKENS, D, dtype=torch.float64)
    f = twin(X, dz, dy).detach()
    p = torch.softmax(f, -1)
    Lam = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
    Jz, Jy = torch.func.jacrev(lambda a, b: twin(X, a, b), argnums=(0, 1))(dz, dy)  # (n, C, n, T, d)
    out = {}
    for part, J in (("in_proj", Jz), ("out_proj", Jy)):
        J = J[torch.arange(n), :, torch.arange(n)]  # (n, C, T, d): sample n's outputs, its own tokens
        G = torch.einsum("nctd,nce,netf->df", J, Lam, J)
        a = twin.inputs[part]
        A = torch.einsum("nti,ntj->ij", a, a) / (n * TOKENS)
        out[part] = [G, A]
    return out


def test_attention_kfac_factors_are_the_expand_definitions():
    """B̃ = B on all N samples (scale 1): in_proj's and out_proj's K-FAC factors (weight blocks
    ``[G, A]``, bias blocks ``[G]``) are the expand definitions computed from dense Jacobians."""
    model = encoder()
    data = _data(6)
    la = _fit(model, data, "debiased_kron", batch=6, same=True)
    ref = _expand_reference(model, data.tensors[0])
    blocks = la.H_facs.kfacs  # embed.w, embed.b, in_proj.w, in_proj.b, out_proj.w, out_proj.b, ...
    for part, first in (("in_proj", 2), ("out_proj", 4)):
        G, A = ref[part]
        _close(blocks[first][0], G)
        _close(blocks[first][1], A)
        _close(blocks[first + 1][0], G)


def test_attention_blocks_equal_the_linear_twin_blocks():
    """The whole K-FAC of the attention model equals, block for block, that of its twin whose
    projections are ``nn.Linear`` layers over the token positions."""
    model = encoder()
    data = _data(8)
    la = _fit(model, data, "debiased_kron", batch=8, same=True)
    twin = _fit(ExplicitEncoder(model), data, "debiased_kron", batch=8, same=True)
    assert len(la.H_facs.kfacs) == len(twin.H_facs.kfacs)
    for ours, theirs in zip(la.H_facs.kfacs, twin.H_facs.kfacs):
        for F1, F2 in zip(ours, theirs, strict=True):
            _close(F1, F2)


@pytest.mark.parametrize("structure", KRON_STRUCTURES)
def test_one_token_one_sample_kfac_is_the_exact_ggn(structure):
    """One sample of one token (twice: a batch needs two rows): every K-FAC block (attention
    projections included) and every LayerNorm block of H is the brute-force GGN block of its
    parameters (with B̃ = B). One token makes the softmax constant, so the query and key rows of
    in_proj get zero curvature in both."""
    model = encoder()
    one = _data(1, tokens=1)
    data = TensorDataset(*(t.repeat(2, *[1] * (t.ndim - 1)) for t in one.tensors))
    la = _fit(model, data, structure, batch=2, same=True)
    ggn = exact_ggn(model, data.tensors[0], "classification")
    H = la.H.to_matrix()
    for name, s in _slices(model).items():
        if "norm" in name:
            continue  # the weight and bias of a LayerNorm share one block: checked below
        _close(H[s, s], ggn[s, s])
    for norm in ("norm1", "norm2"):
        sl = _slices(model)
        s = slice(sl[f"block.{norm}.weight"].start, sl[f"block.{norm}.bias"].stop)
        _close(H[s, s], ggn[s, s])



# -------------------------------------------------------------------------- debiasing and reductions
def _kron_block(F: list[torch.Tensor]) -> torch.Tensor:
    return torch.kron(F[0], F[1]) if len(F) == 2 else F[0]


def _block_range(la, k: int) -> slice:
    start = sum(math.prod(len(Fi) for Fi in F) for F in la.H_facs.kfacs[:k])
    return slice(start, start + math.prod(len(Fi) for Fi in la.H_facs.kfacs[k]))


ATTENTION_BLOCKS = (2, 3, 4, 5)  # in_proj weight, bias; out_proj weight, bias


def test_b_tilde_equal_b_reduces_to_the_single_batch_kfac():
    """B̃ = B: the debiased curvature is B's own K-FAC, block for block."""
    la = _fit(encoder(), _data(16), "debiased_kron", batch=8, same=True)
    _close(la.H.to_matrix(), la.H_facs.to_matrix())


def test_debiased_attention_blocks_equal_the_two_batch_formula():
    """B, B̃ = two halves: each attention block is ``(U_G ⊗ U_A) diag(λ) (U_G ⊗ U_A)ᵀ`` with
    ``U`` the eigenvectors of B's factors and ``λ`` the Rayleigh quotients of B̃'s factors, both
    from single-batch fits on the halves (``N/m = 2``)."""
    data = _data(16)
    la = _fit(encoder(), data, "debiased_kron", batch=8, same=False)
    halves = [TensorDataset(*(t[s] for t in data.tensors)) for s in (slice(0, 8), slice(8, 16))]
    B, Bt = (_fit(encoder(), h, "debiased_kron", batch=8, same=True).H_facs.kfacs for h in halves)
    H = la.H.to_matrix()
    for k in ATTENTION_BLOCKS:
        Us = [torch.linalg.eigh(F)[1] for F in B[k]]
        lams = [((M @ U) * U).sum(0) for M, U in zip(Bt[k], Us)]
        U = _kron_block(Us)
        lam = torch.kron(lams[0], lams[1]) if len(lams) == 2 else lams[0]
        s = _block_range(la, k)
        _close(H[s, s], 2.0 * (U * lam) @ U.T)


def test_ekfac_attention_blocks_are_the_debiased_kfac_blocks():
    """debiased_ekfac gives attention projections (no per-sample EKFAC measurement for them)
    the debiased K-FAC blocks of debiased_kron."""
    data = _data(16)
    kron = _fit(encoder(), data, "debiased_kron", batch=8, same=False)
    ekfac = _fit(encoder(), data, "debiased_ekfac", batch=8, same=False)
    Hk, He = kron.H.to_matrix(), ekfac.H.to_matrix()
    for k in ATTENTION_BLOCKS:
        s = _block_range(kron, k)
        _close(He[s, s], Hk[s, s])


class AttentionOnly(nn.Module):
    """Linear embedding, ``nn.MultiheadAttention`` (tokens first if not ``batch_first``, the
    transposes outside it), mean pooling, linear head."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(D_IN, D).double()
        self.attn = nn.MultiheadAttention(D, HEADS, batch_first=batch_first).double()
        self.head = nn.Linear(D, N_CLASSES).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if self.attn.batch_first:
            return self.head(self.attn(h, h, h)[0].mean(1))
        h = h.transpose(0, 1)
        return self.head(self.attn(h, h, h)[0].mean(0))


@pytest.mark.parametrize("structure", KRON_STRUCTURES)
def test_sequence_first_attention_gives_the_same_posterior(structure):
    """``batch_first=False`` (tokens first) is the same function and the same curvature."""
    data = _data(16)
    a = _fit(AttentionOnly(batch_first=True).eval(), data, structure, batch=8, same=False)
    b = _fit(AttentionOnly(batch_first=False).eval(), data, structure, batch=8, same=False)
    _close(b.H.to_matrix(), a.H.to_matrix())


def test_layers_that_see_tokens_first_are_refused():
    """A sequence-first ``nn.TransformerEncoderLayer`` feeds its MLP ``(T, n, d)`` inputs: the
    per-sample sums cannot be split by sample, and the error says what to change."""
    with pytest.raises(ValueError, match="batch first.*batch_first=True"):
        _fit(encoder(batch_first=False), _data(8, tokens=4), "debiased_kron", batch=4, same=False)


@pytest.mark.parametrize("structure", KRON_STRUCTURES)
def test_whole_model_fits_and_predicts(structure):
    """Over all weights: a finite posterior and a predictive that sums to one and differs from
    the MAP's softmax."""
    model = encoder()
    data = _data(16)
    la = _fit(model, data, structure, batch=8, same=False)
    la.prior_precision = 1.0
    X = data.tensors[0][:4]
    probs = la(X, pred_type="glm", link_approx="probit")
    assert torch.isfinite(probs).all()
    _close(probs.sum(-1), torch.ones(4, dtype=torch.float64))
    with torch.no_grad():
        assert not torch.allclose(probs, torch.softmax(model(X), -1))


@pytest.mark.parametrize("frozen", ["in_proj", "out_proj"])
def test_half_frozen_attention_keeps_the_other_projection(frozen):
    """A frozen projection has no blocks; the other keeps the blocks of the unfrozen fit."""
    data = _data(8)
    full = _fit(encoder(), data, "debiased_kron", batch=8, same=True)
    model = encoder()
    attn = model.block.self_attn
    params = [attn.in_proj_weight, attn.in_proj_bias] if frozen == "in_proj" else list(attn.out_proj.parameters())
    for p in params:
        p.requires_grad_(False)
    la = _fit(model, data, "debiased_kron", batch=8, same=True)
    kept = (4, 5) if frozen == "in_proj" else (2, 3)
    expected = [F for k, F in enumerate(full.H_facs.kfacs) if k not in {2, 3, 4, 5} - set(kept)]
    assert len(la.H_facs.kfacs) == len(expected)
    for ours, theirs in zip(la.H_facs.kfacs, expected):
        for F1, F2 in zip(ours, theirs, strict=True):
            _close(F1, F2)


# -------------------------------------------------------------------------- refusals
class CrossAttention(nn.Module):
    def __init__(self, **kw) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(D_IN, 2, batch_first=True, **kw).double()
        self.head = nn.Linear(D_IN, N_CLASSES).double()
        self.cross = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kv = x.flip(1) if self.cross else x
        if self.attn.kdim != self.attn.embed_dim:
            kv = kv[..., : self.attn.kdim]
        return self.head(self.attn(x, kv, kv, need_weights=False)[0].mean(1))


@pytest.mark.parametrize("structure", KRON_STRUCTURES)
def test_cross_attention_is_refused_with_the_alternative(structure):
    model = CrossAttention().eval()
    model.cross = True
    with pytest.raises(ValueError, match="self-attention only.*debiased_full"):
        _fit(model, _data(8), structure, batch=4, same=False)


@pytest.mark.parametrize("kw, what", [({"kdim": 3, "vdim": 3}, "separate q/k/v"), ({"add_bias_kv": True}, "add_bias_kv"), ({"add_zero_attn": True}, "add_zero_attn")])
def test_unsupported_attention_options_are_named(kw, what):
    model = CrossAttention(**kw).eval()
    with pytest.raises(ValueError, match=f"layer 'attn' \\(MultiheadAttention\\) has {what}.*Freeze"):
        _fit(model, _data(8), "debiased_kron", batch=4, same=False)


def test_frozen_unsupported_attention_is_accepted():
    """An attention layer whose parameters are all frozen needs no blocks, whatever its options."""
    model = CrossAttention(add_bias_kv=True).eval()
    for p in model.attn.parameters():
        p.requires_grad_(False)
    la = _fit(model, _data(8), "debiased_kron", batch=4, same=False)
    assert len(la.H_facs.kfacs) == 2


# -------------------------------------------------------------------------- GPT-2 Conv1D
class Conv1D(nn.Module):
    """Local stand-in for ``transformers.pytorch_utils.Conv1D``: ``weight`` ``(nx, nf)``, ``bias``
    ``(nf,)``, ``y = x @ weight + bias``."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(0.4 * torch.randn(nx, nf))
        self.bias = nn.Parameter(0.1 * torch.randn(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


def _transposed(conv: nn.Module) -> nn.Linear:
    lin = nn.Linear(*conv.weight.shape).double()
    with torch.no_grad():
        lin.weight.copy_(conv.weight.T), lin.bias.copy_(conv.bias)
    return lin


class GPT2Block(nn.Module):
    """Linear embedding, a GPT-2 block (pre-LN causal attention with ``c_attn``/``c_proj``, MLP
    ``c_fc``/``c_out``, all ``Conv1D`` unless ``linear`` twin), last-token linear head."""

    def __init__(self, conv: type = Conv1D, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(D_IN, D)
        self.ln_1, self.c_attn, self.c_proj = nn.LayerNorm(D), conv(3 * D, D), conv(D, D)
        self.ln_2, self.c_fc, self.c_out = nn.LayerNorm(D), conv(16, D), conv(D, 16)
        self.head = nn.Linear(D, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        q, k, v = (_heads(t) for t in self.c_attn(self.ln_1(h)).split(D, dim=-1))
        T = x.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)
        scores = (q @ k.transpose(-2, -1) / math.sqrt(D // HEADS)).masked_fill(causal, -math.inf)
        h = h + self.c_proj((torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(h.shape))
        h = h + self.c_out(F.gelu(self.c_fc(self.ln_2(h))))
        return self.head(h[:, -1])


def gpt2_block(conv: type = Conv1D) -> GPT2Block:
    return GPT2Block(conv).double().eval()


def linear_twin(model: GPT2Block) -> GPT2Block:
    twin = copy.deepcopy(model)
    for name in ("c_attn", "c_proj", "c_fc", "c_out"):
        setattr(twin, name, _transposed(getattr(model, name)))
    return twin


CONV1D_BLOCKS = (3, 5, 8, 10)  # weight blocks of c_attn, c_proj, c_fc, c_out (a LayerNorm is one block)


def test_conv1d_is_recognised_by_class_name_and_shape():
    assert is_conv1d(Conv1D(3, 2))
    assert not is_conv1d(nn.Conv1d(2, 3, 1)) and not is_conv1d(nn.Linear(2, 3))
    transformers = pytest.importorskip("transformers")
    assert is_conv1d(transformers.pytorch_utils.Conv1D(3, 2))


def test_conv1d_blocks_are_the_transposed_linear_blocks():
    """Every ``Conv1D`` weight block ``A ⊗ G`` (input index slow, ``weight.flatten()`` order)
    is the K-FAC block ``G ⊗ A`` of the same layer as ``nn.Linear`` with the index orders
    swapped; biases, LayerNorm and Linear blocks are equal as they are."""
    model = gpt2_block()
    data = _data(8)
    la = _fit(model, data, "debiased_kron", batch=8, same=True)
    ref = _fit(linear_twin(model), data, "debiased_kron", batch=8, same=True)
    assert len(la.H_facs.kfacs) == len(ref.H_facs.kfacs)
    for k, (ours, theirs) in enumerate(zip(la.H_facs.kfacs, ref.H_facs.kfacs)):
        if k in CONV1D_BLOCKS:
            nx, nf = len(ours[0]), len(ours[1])
            conv = torch.kron(ours[0], ours[1]).reshape(nx, nf, nx, nf).permute(1, 0, 3, 2)
            _close(conv, torch.kron(theirs[0], theirs[1]).reshape(nf, nx, nf, nx))
        else:
            for F1, F2 in zip(ours, theirs, strict=True):
                _close(F1, F2)


@pytest.mark.parametrize("structure", KRON_STRUCTURES)
def test_conv1d_posterior_is_the_transposed_linear_posterior(structure):
    """Two batches: the debiased K-FAC of the Conv1D model is that of its Linear twin with each
    Conv1D weight's indices transposed (debiased_ekfac: Conv1D and attention projections get
    debiased K-FAC blocks, so only debiased_kron is compared whole; ekfac's LayerNorm and bias
    blocks match)."""
    model = gpt2_block()
    data = _data(16)
    la = _fit(model, data, structure, batch=8, same=False)
    ref = _fit(linear_twin(model), data, "debiased_kron", batch=8, same=False)
    perm, start = [], 0
    for p in model.parameters():
        idx = torch.arange(start, start + p.numel())
        if p.ndim == 2 and p is not model.embed.weight and p is not model.head.weight:
            idx = idx.reshape(p.shape[1], p.shape[0]).T.reshape(-1)  # Conv1D (i, j) -> Linear's index of W[j, i]
        perm.append(idx)
        start += p.numel()
    perm = torch.cat(perm)
    H, H_ref = la.H.to_matrix(), ref.H.to_matrix()[perm][:, perm]
    if structure == "debiased_kron":
        _close(H, H_ref)
    else:
        for k in CONV1D_BLOCKS:
            s = _block_range(la, k)
            _close(H[s, s], H_ref[s, s])


def test_transformers_conv1d_gives_the_local_conv1d_fit():
    transformers = pytest.importorskip("transformers")
    model = gpt2_block()
    real = gpt2_block(lambda nf, nx: transformers.pytorch_utils.Conv1D(nf, nx))
    real.load_state_dict(model.state_dict())
    data = _data(8)
    a = _fit(model, data, "debiased_kron", batch=4, same=False)
    b = _fit(real, data, "debiased_kron", batch=4, same=False)
    _close(b.H.to_matrix(), a.H.to_matrix())


# -------------------------------------------------------------------------- token outputs
class CausalTokenModel(nn.Module):
    """Linear embedding, causal self-attention (``nn.MultiheadAttention``, or the explicit twin
    with ``nn.Linear`` projections), a linear head on every token: ``(n, T, 4)`` -> ``(n, T, 3)``."""

    def __init__(self, explicit: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(D_IN, D).double()
        self.attn = nn.MultiheadAttention(D, HEADS, batch_first=True).double()
        self.head = nn.Linear(D, N_CLASSES).double()
        if explicit:
            self.qkv, self.proj = nn.Linear(D, 3 * D).double(), nn.Linear(D, D).double()
            with torch.no_grad():
                self.qkv.weight.copy_(self.attn.in_proj_weight), self.qkv.bias.copy_(self.attn.in_proj_bias)
                self.proj.weight.copy_(self.attn.out_proj.weight), self.proj.bias.copy_(self.attn.out_proj.bias)
            del self.attn
            self.head = self._modules.pop("head")  # after the projections, in parameter order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        T = x.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)
        if hasattr(self, "attn"):
            return self.head(self.attn(h, h, h, attn_mask=causal, need_weights=False)[0])
        q, k, v = (_heads(t) for t in self.qkv(h).chunk(3, dim=-1))
        scores = (q @ k.transpose(-2, -1) / math.sqrt(D // HEADS)).masked_fill(causal, -math.inf)
        return self.head(self.proj((torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(h.shape)))


@pytest.mark.parametrize("structure", KRON_STRUCTURES)
def test_token_outputs_with_attention_equal_the_linear_twin(structure):
    """Every token an output (targets ``(n, T)``): the attention model's debiased posterior is
    its ``nn.Linear`` twin's (debiased_ekfac: the attention blocks, which are K-FAC blocks)."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, TOKENS, D_IN, generator=g, dtype=torch.float64),
                         torch.randint(0, N_CLASSES, (16, TOKENS), generator=g))
    model, twin = CausalTokenModel().eval(), CausalTokenModel(explicit=True).eval()
    _close(twin(data.tensors[0]), model(data.tensors[0]))
    la = _fit(model, data, structure, batch=8, same=False)
    ref = _fit(twin, data, "debiased_kron", batch=8, same=False)
    H, H_ref = la.H.to_matrix(), ref.H.to_matrix()
    if structure == "debiased_kron":
        _close(H, H_ref)
    else:
        for k in ATTENTION_BLOCKS:
            s = _block_range(la, k)
            _close(H[s, s], H_ref[s, s])


# -------------------------------------------------------------------------- shared position embeddings
class PositionEmbedded(nn.Module):
    """Token and position embeddings, causal self-attention, last-token head: ``(n, T)`` token
    ids -> ``(n, 3)``. ``positions``: how the position ids are passed, ``"1d"`` ``(T,)``,
    ``"row"`` ``(1, T)`` (as GPT-2 does) or ``"per_sample"`` ``(n, T)``."""

    def __init__(self, positions: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok, self.pos = nn.Embedding(7, D).double(), nn.Embedding(TOKENS, D).double()
        self.attn = nn.MultiheadAttention(D, HEADS, batch_first=True).double()
        self.head = nn.Linear(D, N_CLASSES).double()
        self.positions = positions

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = torch.arange(x.shape[1])
        ids = {"1d": ids, "row": ids.unsqueeze(0), "per_sample": ids.expand(len(x), -1)}[self.positions]
        h = self.tok(x) + self.pos(ids)
        return self.head(self.attn(h, h, h, need_weights=False)[0][:, -1])


@pytest.mark.parametrize("structure", KRON_STRUCTURES)
@pytest.mark.parametrize("positions", ["1d", "row"])
def test_shared_position_ids_give_the_per_sample_posterior(structure, positions):
    """Position ids shared by the batch (no batch dimension, or one of size 1) are, per sample,
    the same ids: the posterior equals that of the model that passes them per sample."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(0, 7, (16, TOKENS), generator=g), torch.randint(0, N_CLASSES, (16,), generator=g))
    shared = _fit(PositionEmbedded(positions).eval(), data, structure, batch=8, same=False)
    ref = _fit(PositionEmbedded("per_sample").eval(), data, structure, batch=8, same=False)
    _close(shared.H.to_matrix(), ref.H.to_matrix())


@pytest.mark.parametrize("structure", KRON_STRUCTURES)
def test_transformers_gpt2_fits_over_all_weights(structure):
    """A tiny ``transformers`` GPT-2 sequence classifier (token and position embeddings, Conv1D
    projections, LayerNorms, left-padded ``BatchEncoding`` batches) over all 1,144 weights: one
    block per parameter tensor, a finite marginal likelihood and a predictive that sums to one."""
    pytest.importorskip("transformers")
    from tests.two_batch.test_parity import SequenceClassifier, hf_loaders, tiny_gpt2

    model = SequenceClassifier(tiny_gpt2()).eval()
    train, x_test = hf_loaders()
    la = Laplace(model, "classification", "all", structure)
    la.fit(train)
    assert la.n_params == sum(p.numel() for p in model.parameters())
    assert torch.isfinite(la.log_marginal_likelihood())
    probs = la(x_test, link_approx="probit")
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(probs)), atol=1e-5, rtol=0)


def test_trainable_extra_attention_parameters_are_refused_with_frozen_projections():
    """``bias_k``/``bias_v`` trainable while both projections are frozen: still named."""
    model = CrossAttention(add_bias_kv=True).eval()
    for p in (model.attn.in_proj_weight, model.attn.in_proj_bias, *model.attn.out_proj.parameters()):
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="add_bias_kv"):
        _fit(model, _data(8), "debiased_kron", batch=4, same=False)


def _paper(structure: str) -> dict:
    """Constructor options for the paper's two-batch estimate (B's eigenvectors, B̃'s Rayleigh
    quotients), whose dense formula these tests check, where the structure offers a choice."""
    return {"estimator": "paper"} if structure in ("debiased_kron", "debiased_ekfac") else {}
