"""``n_magnitude_batches="auto"`` on a model (:mod:`laplace_debiased.two_batch.auto_magnitude`):
the factor rows B gives each K-FAC factor of convolutions, attention projections and GPT-2
``Conv1D`` layers, and the refusal for a last layer; the functions on their own."""

from __future__ import annotations

import pytest
import torch
from laplace import Laplace
from laplace.curvature import CurvlinopsEF, CurvlinopsGGN
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace_debiased.two_batch.auto_magnitude import auto_magnitude_rule, factor_row_counts, output_columns
from tests.two_batch.test_magnitude_rule import N_OUT, _data, _fit, _input_factor, _loader, _mlp


def _cnn(size: int, padding: int) -> nn.Module:
    """Conv2d(3, 4, 3) (input factor of dimension 27) - ReLU - global average pool - Linear(4, 3)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=padding), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, N_OUT)
    ).double()


@pytest.mark.parametrize("size,padding,positions,k", [(8, 1, 64, 1), (4, 0, 4, 1), (3, 0, 1, 6)])
def test_conv_rows_count_spatial_positions(size, padding, positions, k):
    """A conv's rows are samples × output positions. Batches of 4 images: 8×8 with padding 1 give
    4 · 64 rows, more than the 27 inputs of a patch (no limiting factor); 4×4 without padding
    4 · 4 = 16 rows, so 16 + k · 16 >= 27 holds for k = 1 (counting samples alone would ask for
    6); 3×3 without padding one position, 4 + k · 4 >= 27 needs k = 6."""
    train_loader = DataLoader(_data(40, (3, size, size)), batch_size=4)
    la = _fit(_cnn(size, padding), train_loader, n_magnitude_batches="auto")
    auto = la.fit_batches[-1].auto
    assert auto.used == k
    if positions * 4 >= 27:
        assert auto.limiting is None
    else:
        assert (auto.limiting.layer, auto.limiting.dimension, auto.limiting.rows_direction) == ("0", 27, 4 * positions)
    assert _input_factor(la).rank_union == min(27, (1 + k) * 4 * positions)


def test_auto_is_refused_for_last_layer_kron():
    la = Laplace(_mlp(4), "classification", subset_of_weights="last_layer", hessian_structure="debiased_kron", n_magnitude_batches="auto")
    with pytest.raises(ValueError, match="integer n_magnitude_batches"):
        la.fit(_loader(4, 4, 4))


class _TokenAttention(nn.Module):
    """``nn.MultiheadAttention`` (width 16, 2 heads) on ``(n, T, 16)`` tokens, a linear head on
    every token: outputs ``(n, T, 3)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, N_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, x, x)[0])


def test_attention_projections_are_counted():
    """Batches of n = 2 sequences of T = 3 tokens, C = 3: every factor gets n·T = 6 rows per
    batch on its input side, 6·(C - 1) = 12 on its output side. The widest factor is the input
    projection's output side (d = 3·16 = 48, 12 rows per batch: 12 + k·12 >= 48 needs k = 3); the
    head's input factor (16, 6 rows) would need only k = 2."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(20, 3, 16, generator=g, dtype=torch.float64)
    data = TensorDataset(X, torch.randint(0, N_OUT, (20, 3), generator=g))
    la = _fit(_TokenAttention().double().eval(), DataLoader(data, batch_size=2), n_magnitude_batches="auto")
    auto = la.fit_batches[-1].auto
    limiting = auto.limiting
    assert (limiting.layer, limiting.factor, limiting.dimension, limiting.rows_direction) == ("attn.in_proj", "output", 48, 12)
    assert auto.used == 3


class Conv1D(nn.Module):
    """GPT-2's ``Conv1D`` (``transformers.pytorch_utils``; recognised by its class name):
    ``weight`` ``(nx, nf)``, ``x @ weight + bias``."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(0.4 * torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


def test_conv1d_layers_are_counted():
    """``_mlp(20)`` with its first layer a ``Conv1D`` (nx = 20 inputs): its input factor (d = 20,
    4 rows per batch of 4) needs 4 + k·4 >= 20, k = 4, as the ``nn.Linear`` layer does; every
    other factor has at most 3 dimensions."""
    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(3, 20), nn.ReLU(), nn.Linear(3, N_OUT)).double()
    la = _fit(model, _loader(20, 4, 8), n_magnitude_batches="auto")
    auto = la.fit_batches[-1].auto
    limiting = auto.limiting
    assert (limiting.layer, limiting.factor, limiting.dimension, limiting.rows_direction) == ("0", "input", 20, 4)
    assert auto.used == 4
    # B ∪ B̃ spans it (la.coverage lists a Conv1D block's factors in Kron order, input first)
    block = next(b for b in la.coverage.blocks if b.layer == "0" and b.parameter == "weight")
    assert [(f.dimension, f.rank_union) for f in block.factors if f.dimension == 20] == [(20, 20)]


@pytest.mark.parametrize(
    "backend,likelihood,kwargs,columns",
    [
        (CurvlinopsGGN, "classification", {}, 4),  # C - 1: the softmax GGN has rank C - 1
        (CurvlinopsGGN, "regression", {}, 5),  # C
        (CurvlinopsGGN, "classification", {"stochastic": True}, 1),  # one MC sample by default
        (CurvlinopsEF, "classification", {}, 1),  # one gradient per sample
    ],
)
def test_output_columns_per_curvature(backend, likelihood, kwargs, columns):
    model = nn.Linear(4, 5).double()
    assert output_columns(backend(model, likelihood, **kwargs), likelihood, 5, {}) == columns
    if kwargs.get("stochastic"):
        assert output_columns(backend(model, likelihood, **kwargs), likelihood, 5, {"mc_samples": 3}) == 3


def test_factor_row_counts_of_an_mlp():
    """Three batches of 4 samples: each Linear's input factor gets 4 rows per batch, its output
    factor 4 · columns(C) rows; dimensions are the layer's in- and out-widths."""
    model = _mlp(6, hidden=5)
    batches = list(_loader(6, 4, 3))
    counts = factor_row_counts(
        model, model, batches, lambda C: C - 1, dtype=torch.float64, likelihood="classification",
        dict_key_x="input_ids", dict_key_y="labels",
    )
    got = [(c.layer, c.factor, c.dimension, c.rows_direction, c.n_direction_batches) for c in counts]
    assert got == [
        ("0", "output", 5, 3 * 4 * 2, 3), ("0", "input", 6, 3 * 4, 3),
        ("2", "output", 3, 3 * 4 * 2, 3), ("2", "input", 5, 3 * 4, 3),
    ]


def test_auto_magnitude_rule_counts_the_direction_batches_and_refuses_a_last_layer():
    model = _mlp(20)
    backend = CurvlinopsGGN(model, "classification")
    keys = {"likelihood": "classification", "dtype": torch.float64, "asdl_fisher_kwargs": {},
            "dict_key_x": "input_ids", "dict_key_y": "labels"}
    rule = auto_magnitude_rule(model, lambda: backend, last_layer=False, owner="X", **keys)
    auto = rule(list(_loader(20, 4, 2)))  # input factor of layer "0": 8 + k · 4 >= 20 needs k = 3
    assert (auto.limiting.layer, auto.limiting.factor, auto.limiting.dimension, auto.wanted) == ("0", "input", 20, 3)
    with pytest.raises(ValueError, match="not for the last-layer MyLaplace"):
        auto_magnitude_rule(model, lambda: backend, last_layer=True, owner="MyLaplace", **keys)
