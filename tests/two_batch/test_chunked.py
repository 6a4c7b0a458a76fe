"""The predictive over chunks of the inputs equals the one-piece predictive (every structure,
GLM and NN predictive, MC draws with and without a generator), and the per-example Jacobians
give laplace-torch's GLM moments.

Tolerances: float64 models, so round-off of sums over at most a few hundred terms, times the
size of the compared quantity: ``1e-10`` relative is far above that and far below any real change.
"""

from __future__ import annotations

import functools

import pytest
import torch
from laplace import Laplace

import laplace_debiased  # noqa: F401
from laplace_debiased.two_batch.chunked import MAX_AUTO_CHUNK, auto_chunk_size
from tests._models import loader, tiny_cnn, tiny_mlp, toy_data

STRUCTURES = ["debiased_kron", "debiased_ekfac", "debiased_lowrank", "debiased_full"]
N, CHUNK = 23, 4  # 23 inputs in chunks of 4: five full chunks and a short one
RTOL = 1e-10


@functools.cache
def _fitted(structure: str, likelihood: str, subset: str = "all"):
    """A fitted Laplace object and ``N`` test inputs, one per argument triple (shared by the
    tests, which only change ``predictive_chunk_size`` and set it before every call)."""
    model = tiny_cnn() if likelihood == "classification" else tiny_mlp(n_out=2)
    shape = (1, 5, 5) if likelihood == "classification" else (4,)
    n_out = 3 if likelihood == "classification" else 2
    data = toy_data(40, shape, n_out, likelihood)
    kwargs = {"rank": 6} if structure == "debiased_lowrank" else {}
    la = Laplace(model, likelihood, subset_of_weights=subset, hessian_structure=structure,
                 prior_precision=0.5, **kwargs)
    la.fit(loader(data, 10))
    x = toy_data(N, shape, n_out, likelihood, seed=1).tensors[0]
    return la, x


def _both(la, x, call):
    """``call(la, x)`` one piece and in chunks of ``CHUNK``, each from the same global seed."""
    la.predictive_chunk_size = len(x)
    torch.manual_seed(7)
    whole = call(la, x)
    la.predictive_chunk_size = CHUNK
    torch.manual_seed(7)
    chunked = call(la, x)
    return whole, chunked


def _close(a, b):
    pairs = zip(a, b) if isinstance(a, tuple) else [(a, b)]
    for u, v in pairs:
        assert u.shape == v.shape
        torch.testing.assert_close(v, u, rtol=RTOL, atol=RTOL * float(u.abs().max()))


CALLS = {
    "glm probit": lambda la, x: la(x, pred_type="glm", link_approx="probit"),
    "glm bridge": lambda la, x: la(x, pred_type="glm", link_approx="bridge"),
    "glm mc": lambda la, x: la(x, pred_type="glm", link_approx="mc", n_samples=7),
    "nn mc": lambda la, x: la(x, pred_type="nn", link_approx="mc", n_samples=5),
    "glm samples, generator": lambda la, x: la.predictive_samples(
        x, pred_type="glm", n_samples=6, generator=torch.Generator().manual_seed(3)),
    "nn samples, generator": lambda la, x: la.predictive_samples(
        x, pred_type="nn", n_samples=4, generator=torch.Generator().manual_seed(3)),
    "glm functional samples": lambda la, x: la.functional_samples(x, pred_type="glm", n_samples=6),
}


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("call", list(CALLS))
def test_chunked_classification_equals_one_piece(structure, call):
    la, x = _fitted(structure, "classification")
    whole, chunked = _both(la, x, CALLS[call])
    _close(whole, chunked)


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("call", ["glm", "nn", "glm samples, generator"])
def test_chunked_regression_equals_one_piece(structure, call):
    la, x = _fitted(structure, "regression")
    calls = {"glm": lambda la, x: la(x, pred_type="glm"),
             "nn": lambda la, x: la(x, pred_type="nn", link_approx="mc", n_samples=5),
             "glm samples, generator": CALLS["glm samples, generator"]}
    whole, chunked = _both(la, x, calls[call])
    _close(whole, chunked)


@pytest.mark.parametrize("structure", ["debiased_kron", "debiased_lowrank"])
def test_chunked_last_layer_equals_one_piece(structure):
    la, x = _fitted(structure, "classification", subset="last_layer")
    whole, chunked = _both(la, x, CALLS["glm mc"])
    _close(whole, chunked)


def test_generators_end_where_the_one_piece_call_leaves_them():
    la, x = _fitted("debiased_kron", "classification")
    ends = []
    for size in (len(x), CHUNK):
        la.predictive_chunk_size = size
        torch.manual_seed(7)
        g = torch.Generator().manual_seed(3)
        la.predictive_samples(x, pred_type="nn", n_samples=4, generator=g)
        la(x, link_approx="mc", n_samples=3)
        ends.append((torch.rand(3), torch.rand(3, generator=g)))
    torch.testing.assert_close(ends[0], ends[1], rtol=0, atol=0)


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("likelihood", ["classification", "regression"])
def test_per_example_jacobians_give_laplace_torch_moments(structure, likelihood):
    """The GLM mean and covariance from the per-example Jacobians equal laplace-torch's, computed
    from its batch Jacobians (``backend.jacobians``) and the structure's ``functional_variance``."""
    la, x = _fitted(structure, likelihood)
    Js, f = la.backend.jacobians(x)
    reference = la.functional_variance(Js)
    f_mu, f_var = la._glm_predictive_distribution(x)
    _close((f, reference), (f_mu, f_var))
    joint_mu, joint_cov = la._glm_predictive_distribution(x[:5], joint=True)
    _close(la.functional_covariance(la.backend.jacobians(x[:5])[0]), joint_cov)


def test_joint_regression_is_one_piece():
    la, x = _fitted("debiased_kron", "regression")
    la.predictive_chunk_size = CHUNK
    mean, cov = la(x, pred_type="glm", joint=True)
    assert mean.shape == (N * 2,) and cov.shape == (N * 2, N * 2)


def test_default_chunk_size_follows_the_jacobian_memory():
    assert type(_fitted("debiased_kron", "classification")[0]).predictive_chunk_size is None
    assert auto_chunk_size(10, 56714, 4) == 2**28 // (4 * 10 * 56714 * 4)
    assert auto_chunk_size(10, 100, 4) == MAX_AUTO_CHUNK
    assert auto_chunk_size(1000, 10**9, 8) == 1
    la, _ = _fitted("debiased_kron", "classification")
    la.predictive_chunk_size = None  # the default
    assert la.chunk_size() == auto_chunk_size(3, la.n_params, 8)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "64"])
def test_bad_chunk_size_is_refused(bad):
    la, x = _fitted("debiased_kron", "classification")
    la.predictive_chunk_size = bad
    with pytest.raises(ValueError, match="predictive_chunk_size must be a positive integer or None"):
        la(x)


@pytest.mark.parametrize("structure", ["debiased_kron", "debiased_full"])
def test_chunked_dict_inputs_equal_one_piece(structure):
    """Mapping inputs (Hugging Face style): the tensors of the batch's leading size are split,
    other entries are passed whole to every chunk."""
    from torch.utils.data import DataLoader

    from tests._models import DictData, DictModel

    data = toy_data(40, (4,), 3, "classification")
    la = Laplace(DictModel().double(), "classification", subset_of_weights="all", hessian_structure=structure)
    la.fit(DataLoader(DictData(*data.tensors), batch_size=10))
    X = toy_data(N, (4,), 3, "classification", seed=1).tensors[0]
    x = {"input_ids": X, "labels": torch.zeros(N, dtype=torch.long), "note": torch.tensor(1.0)}
    whole, chunked = _both(la, x, CALLS["glm mc"])
    _close(whole, chunked)
    torch.testing.assert_close(chunked, _both(la, X, CALLS["glm mc"])[1], rtol=RTOL, atol=RTOL)


def test_input_chunks_split_only_batch_sized_tensors():
    from laplace_debiased.two_batch.chunked import input_chunks

    x = {"input_ids": torch.arange(10), "mask": torch.ones(10, 3), "scale": torch.ones(3), "name": "a"}
    chunks = input_chunks(x, 4, "input_ids")
    assert [len(c["input_ids"]) for c in chunks] == [4, 4, 2]
    assert [c["mask"].shape[0] for c in chunks] == [4, 4, 2]
    assert all(c["scale"] is x["scale"] and c["name"] == "a" for c in chunks)
    assert torch.equal(torch.cat([c["input_ids"] for c in chunks]), x["input_ids"])
    assert input_chunks(x, 10, "input_ids") == [x] and input_chunks("text", 1, "input_ids") == ["text"]


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
def test_chunked_token_outputs_equal_one_piece(likelihood):
    """Outputs ``(n, tokens, C)``: chunks of sequences, results back in the token shape."""
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(1)
    X = torch.randn(24, 3, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (24, 3), generator=g) if likelihood == "classification" else torch.randn(
        24, 3, 3, generator=g, dtype=torch.float64)
    la = Laplace(tiny_mlp(), likelihood, subset_of_weights="all", hessian_structure="debiased_kron")
    la.fit(loader(TensorDataset(X, y), 8))
    x = torch.randn(N, 3, 4, generator=g, dtype=torch.float64)
    calls = [lambda la, x: la(x, pred_type="glm", link_approx="probit"),
             lambda la, x: la.predictive_samples(x, pred_type="glm", n_samples=5,
                                                 generator=torch.Generator().manual_seed(3))]
    for call in calls:
        whole, chunked = _both(la, x, call)
        _close(whole, chunked)
    assert _both(la, x, calls[1])[1].shape == (5, N, 3, 3)
