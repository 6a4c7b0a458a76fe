"""Batch selection of two-batch fits and the bad-input errors of the fit."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from _models import loader, tiny_cnn, tiny_mlp, toy_data
from laplace_debiased.structures.batches import split_batches
from laplace_debiased.structures.kron import DebiasedKronLaplace


def _ids(batches):
    """Sample ids: the toy inputs' first coordinate identifies a sample."""
    return [float(x) for b in batches for x in b[0][:, 0]]


@pytest.fixture
def ds():
    return toy_data(40, (4,), 3, "classification")


def test_default_first_then_next_batches(ds):
    s = split_batches(loader(ds, 8))
    X = ds.tensors[0][:, 0].tolist()
    assert _ids(s.direction) == X[:8] and _ids(s.magnitude) == X[8:16]
    assert s.n_data == 40 and not s.same_batches
    s = split_batches(loader(ds, 8), n_direction_batches=2, n_magnitude_batches=3)
    assert _ids(s.direction) == X[:16] and _ids(s.magnitude) == X[16:40]


def test_halves_use_every_batch_once(ds):
    s = split_batches(loader(ds, 8), split="halves")
    X = ds.tensors[0][:, 0].tolist()
    assert _ids(s.direction) == X[:24] and _ids(s.magnitude) == X[24:]
    g = split_batches(loader(ds, 8), split="halves", generator=torch.Generator().manual_seed(1))
    assert sorted(_ids(g.direction) + _ids(g.magnitude)) == sorted(X)
    assert len(g.direction) == 3 and len(g.magnitude) == 2


def test_generator_is_reproducible_and_random(ds):
    def pick(seed):
        s = split_batches(loader(ds, 4), generator=torch.Generator().manual_seed(seed))
        return _ids(s.direction), _ids(s.magnitude)

    assert pick(0) == pick(0)
    assert len({tuple(pick(seed)[0]) for seed in range(6)}) > 1
    d, m = pick(3)
    assert not set(d) & set(m)


def test_explicit_magnitude_loader_and_same_batch_opt_in(ds):
    train = loader(TensorDataset(*[t[:20] for t in ds.tensors]), 5)
    other = loader(TensorDataset(*[t[20:] for t in ds.tensors]), 5)
    s = split_batches(train, magnitude_loader=other)
    assert _ids(s.magnitude) == ds.tensors[0][20:25, 0].tolist() and s.n_data == 20
    same = split_batches(train, magnitude_loader=train)
    assert same.same_batches and same.magnitude is same.direction
    with pytest.raises(ValueError, match="must then equal"):
        split_batches(train, magnitude_loader=train, n_magnitude_batches=2)


def test_overlap_and_equal_batches_raise(ds):
    dl = loader(ds, 8)
    with pytest.raises(ValueError, match="also occur in the direction batch"):
        split_batches(dl, magnitude_loader=loader(ds, 8))  # B̃ == B by accident
    shifted = loader(TensorDataset(*[t[4:] for t in ds.tensors]), 8)
    with pytest.raises(ValueError, match="4 sample"):
        split_batches(dl, magnitude_loader=shifted)
    dup = TensorDataset(torch.cat([ds.tensors[0][:8]] * 2), torch.cat([ds.tensors[1][:8]] * 2))
    with pytest.raises(ValueError, match="independent"):
        split_batches(loader(dup, 8))


def test_loader_and_batch_errors(ds):
    with pytest.raises(ValueError, match="yields 1 batch"):
        split_batches(loader(ds, 40))
    with pytest.raises(ValueError, match="yields 5 batch"):
        split_batches(loader(ds, 8), n_direction_batches=3, n_magnitude_batches=3)
    with pytest.raises(ValueError, match="at least 2 loader batches"):
        split_batches(loader(ds, 40), split="halves")
    with pytest.raises(ValueError, match="do not pass n_"):
        split_batches(loader(ds, 8), split="halves", n_direction_batches=1)
    with pytest.raises(ValueError, match="at least two samples"):
        split_batches(loader(TensorDataset(*[t[:9] for t in ds.tensors]), 8))
    X = ds.tensors[0].clone()
    X[10, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        split_batches(loader(TensorDataset(X, ds.tensors[1]), 8))
    with pytest.raises(ValueError, match="'batches' or 'halves'"):
        split_batches(loader(ds, 8), split="thirds")


def test_fit_errors_name_the_problem(ds):
    dl = loader(ds, 8)
    model = nn.Sequential(nn.Linear(4, 3), nn.Dropout(0.5), nn.Linear(3, 3)).double().train()
    with pytest.raises(ValueError, match="model.eval"):
        DebiasedKronLaplace(model, "classification").fit(dl)
    with pytest.raises(ValueError, match="dtype"):
        DebiasedKronLaplace(tiny_mlp().float(), "classification").fit(dl)
    meta = TensorDataset(torch.empty(16, 4, device="meta", dtype=torch.float64),
                         torch.zeros(16, dtype=torch.long, device="meta"))
    with pytest.raises(ValueError, match="meta"):
        DebiasedKronLaplace(tiny_mlp(), "classification").fit(DataLoader(meta, batch_size=8))
    bn = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 3)).double().eval()
    with pytest.raises(ValueError, match="'1' \\(BatchNorm1d\\).*last_layer"):
        DebiasedKronLaplace(bn, "classification").fit(dl)
    broken = tiny_mlp()
    with torch.no_grad():
        broken[0].weight[0, 0] = float("inf")  # tanh saturates: finite curvature, bad MAP
    with pytest.raises(ValueError, match="parameters .*NaN or Inf"):
        DebiasedKronLaplace(broken, "classification").fit(dl)
    linear = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 3)).double()
    with torch.no_grad():
        linear[0].weight.fill_(1e200)  # finite parameters, overflowing curvature a aᵀ
    with pytest.raises(ValueError, match="factor.*NaN or Inf"):
        DebiasedKronLaplace(linear, "classification").fit(dl)


def test_backpack_conv_refused_but_linear_matches_curvlinops():
    from backpack import extend
    from laplace.curvature import BackPackGGN

    img = loader(toy_data(16, (1, 5, 5), 3, "classification"), 8)
    with pytest.raises(ValueError, match="BackPACK.*spatial"):
        DebiasedKronLaplace(extend(tiny_cnn()), "classification", backend=BackPackGGN).fit(img)
    dl = loader(toy_data(16, (4,), 3, "classification"), 8)
    bp = DebiasedKronLaplace(extend(tiny_mlp()), "classification", backend=BackPackGGN)
    bp.fit(dl)
    cl = DebiasedKronLaplace(tiny_mlp(), "classification")
    cl.fit(dl)
    torch.testing.assert_close(bp.H.to_matrix(), cl.H.to_matrix(), atol=1e-10, rtol=1e-8)
