"""Batch selection of two-batch fits and the bad-input errors of the fit."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from _models import loader, tiny_cnn, tiny_mlp, toy_data
from laplace_debiased.two_batch.batches import split_batches
from laplace_debiased.kron.laplace import DebiasedKronLaplace


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
    assert s.n_data == 40 and s.magnitude is not s.direction
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
    assert same.magnitude is same.direction
    with pytest.raises(ValueError, match="must then equal"):
        split_batches(train, magnitude_loader=train, n_magnitude_batches=2)


def test_overlap_and_equal_batches_raise(ds):
    """A separate magnitude_loader sharing samples with B is refused; within one pass of
    train_loader equal bytes are repeated rows at different indices (tests/two_batch/test_repeated_rows.py)."""
    dl = loader(ds, 8)
    with pytest.raises(ValueError, match="also occur in the direction batch"):
        split_batches(dl, magnitude_loader=loader(ds, 8))  # B̃ == B by accident
    shifted = loader(TensorDataset(*[t[4:] for t in ds.tensors]), 8)
    with pytest.raises(ValueError, match="4 sample"):
        split_batches(dl, magnitude_loader=shifted)
    dup = TensorDataset(torch.cat([ds.tensors[0][:8]] * 2), torch.cat([ds.tensors[1][:8]] * 2))
    with pytest.warns(UserWarning, match="8 row"):
        split_batches(loader(dup, 8))


def test_loader_and_batch_errors(ds):
    with pytest.raises(ValueError, match="yields 1 batch"):
        split_batches(loader(ds, 40), n_direction_batches=2)
    with pytest.raises(ValueError, match="yields 5 batch"):
        split_batches(loader(ds, 8), n_direction_batches=3, n_magnitude_batches=3)
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
    prelu = nn.Sequential(nn.Linear(4, 3), nn.PReLU(), nn.Linear(3, 3)).double().eval()
    with pytest.raises(ValueError, match="'1' \\(PReLU\\).*last_layer"):
        DebiasedKronLaplace(prelu, "classification").fit(dl)
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


def test_choice_records_which_batches(ds):
    s = split_batches(loader(ds, 8), n_direction_batches=2)
    c = s.choice
    assert (c.direction, c.magnitude, c.how) == ((0, 1), (2,), "loader order")
    assert (c.direction_size, c.magnitude_size, c.n_data) == (16, 8, 40)
    assert c.magnitude_source == "train_loader" and c.sample_split is None
    assert "loader batches [0, 1]" in c.describe() and "shuffl" in c.describe()
    g = split_batches(loader(ds, 4), generator=torch.Generator().manual_seed(3)).choice
    assert g.how == "random draw" and len(set(g.direction + g.magnitude)) == 2
    assert split_batches(loader(ds, 8), split="halves").choice.magnitude == (3, 4)
    dl = loader(ds, 8)
    assert split_batches(dl, magnitude_loader=dl).choice.how == "same batches (B̃ = B)"
    other = loader(TensorDataset(*[t[20:] for t in ds.tensors]), 5)
    c = split_batches(loader(ds, 5), magnitude_loader=other).choice
    assert c.magnitude_source == "magnitude_loader" and c.magnitude == (0,)


@pytest.mark.parametrize("split", ["batches", "halves"])
def test_one_batch_loader_is_split_into_seeded_halves(ds, split):
    s = split_batches(loader(ds, 40), split=split)
    (B,), (Bt,) = s.direction, s.magnitude
    assert len(B[0]) == len(Bt[0]) == 20 and s.n_data == 40
    assert sorted(_ids(s.direction) + _ids(s.magnitude)) == sorted(ds.tensors[0][:, 0].tolist())
    again = split_batches(loader(ds, 40), split=split)
    assert _ids(again.direction) == _ids(s.direction)  # seeded: reproducible
    assert _ids(s.direction) != ds.tensors[0][:20, 0].tolist()  # a permutation, not a cut
    other = split_batches(loader(ds, 40), split=split, generator=torch.Generator().manual_seed(5))
    assert _ids(other.direction) != _ids(s.direction)
    c = s.choice
    assert c.how == "one-batch split" and (c.direction, c.magnitude) == ((0,), (0,))
    idx_B, idx_Bt = c.sample_split
    assert sorted(idx_B + idx_Bt) == list(range(40))
    assert _ids(s.direction) == ds.tensors[0][list(idx_B), 0].tolist()


def test_one_batch_split_refused_when_a_half_is_too_small():
    with pytest.raises(ValueError, match="one batch of 3 sample"):
        split_batches(loader(toy_data(3, (4,), 3, "classification"), 3))
    s = split_batches(loader(toy_data(5, (4,), 3, "classification"), 5))
    assert (len(s.direction[0][0]), len(s.magnitude[0][0])) == (3, 2)


class _OneDictBatch:
    """A loader-like iterable yielding one dict batch (with a non-tensor entry)."""

    def __init__(self, X, y):
        self.dataset, self.batch = X, {"input_ids": X, "labels": y, "note": "kept"}

    def __iter__(self):
        return iter([self.batch])


def test_one_batch_split_of_dict_batches():
    X, y = toy_data(10, (4,), 3, "classification").tensors
    s = split_batches(_OneDictBatch(X, y))
    (B,), (Bt,) = s.direction, s.magnitude
    assert B["note"] == "kept" and len(B["labels"]) + len(Bt["labels"]) == 10
    idx_B, _ = s.choice.sample_split
    assert torch.equal(B["input_ids"], X[list(idx_B)]) and torch.equal(B["labels"], y[list(idx_B)])


def test_same_batches_stay_one_list_after_the_move(ds):
    dl = loader(ds, 8)
    split = split_batches(dl, magnitude_loader=dl, device=torch.device("cpu"))
    assert split.magnitude is split.direction


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("structure", ["debiased_kron", "debiased_lowrank", "debiased_full", "debiased_ekfac"])
@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_cuda_model_fits_from_a_cpu_loader_like_stock_laplace(ds, structure, subset):
    """laplace-torch moves each batch to the model's device; so must every debiased fit, and the
    GPU posterior gives the CPU one's predictive and log evidence (float64)."""
    from laplace import Laplace

    X_test = ds.tensors[0][:6]
    results = []
    for dev in ("cpu", "cuda"):
        model = tiny_mlp().to(dev)
        kwargs = {"rank": 5} if structure == "debiased_lowrank" else {}
        la = Laplace(model, "classification", subset_of_weights=subset, hessian_structure=structure, **kwargs)
        la.fit(loader(ds, 8))
        results.append((la(X_test.to(dev), link_approx="probit").cpu(), la.log_marginal_likelihood().detach().cpu()))
    for gpu, cpu in zip(results[1], results[0]):
        torch.testing.assert_close(gpu, cpu, rtol=1e-8, atol=1e-10)
