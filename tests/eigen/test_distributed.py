"""Debiased eigen-structured fits (``debiased_full``, ``debiased_lowrank``, ``debiased_ekfac``)
under torch.distributed: 2 local gloo processes (127.0.0.1) against the single-process fit in
float64.

Each rank computes the dense curvature of its rows of B and B̃ (``debiased_lowrank``: B̃'s
directional curvatures; ``debiased_ekfac``: K-FAC sums of B and B̃'s EKFAC eigenvalue sums), the
shares are all-reduced, rank 0 decomposes and broadcasts.
One spawn runs every case; each test checks one case.
"""

import sys
from pathlib import Path

import pytest
import torch

import laplace_debiased  # noqa: F401  (registers the debiased structures in spawned processes)
from _env import assert_every_rank_equals, spawn_ranks
from _models import loader, tiny_cnn, tiny_mlp, toy_data
from laplace_debiased.parallel.distributed import broadcast_computed

WORLD = 2
CASES = {
    # name: (model, input shape, n data, batch size, subset, structure, fit kwargs, init kwargs)
    "full_mlp_batches": (tiny_mlp, (4,), 60, 10, "all", "debiased_full", {"n_direction_batches": 2}, {}),
    "full_cnn_halves": (tiny_cnn, (1, 5, 5), 40, 10, "all", "debiased_full", {"split": "halves"}, {}),
    "full_mlp_regression": (tiny_mlp, (4,), 48, 16, "all", "debiased_full", {}, {}),
    "full_last_layer": (tiny_mlp, (4,), 48, 16, "last_layer", "debiased_full", {}, {}),
    "full_same_batches": (tiny_mlp, (4,), 48, 16, "all", "debiased_full", {"magnitude_loader": True}, {}),
    "full_odd_rows": (tiny_mlp, (4,), 21, 7, "all", "debiased_full", {}, {}),
    "lowrank_mlp_batches": (tiny_mlp, (4,), 60, 10, "all", "debiased_lowrank", {"n_direction_batches": 2}, {"rank": 8}),
    "lowrank_cnn": (tiny_cnn, (1, 5, 5), 40, 10, "all", "debiased_lowrank", {}, {"rank": 6}),
    "lowrank_last_layer": (tiny_mlp, (4,), 48, 16, "last_layer", "debiased_lowrank", {}, {"rank": 5}),
    "ekfac_cnn_batches": (tiny_cnn, (1, 5, 5), 60, 12, "all", "debiased_ekfac", {"n_direction_batches": 2}, {}),
    "ekfac_mlp_cross_fit": (tiny_mlp, (4,), 48, 16, "all", "debiased_ekfac", {"cross_fit": True}, {}),
    "ekfac_last_layer": (tiny_mlp, (4,), 48, 16, "last_layer", "debiased_ekfac", {}, {}),
    "ekfac_odd_rows": (tiny_mlp, (4,), 9, 3, "all", "debiased_ekfac", {}, {}),
    "lowrank_lanczos_mlp": (tiny_mlp, (4,), 60, 10, "all", "debiased_lowrank", {"n_direction_batches": 2}, {"rank": 6, "method": "lanczos"}),
    "lowrank_lanczos_regression": (tiny_mlp, (4,), 48, 16, "all", "debiased_lowrank", {}, {"rank": 6, "method": "lanczos"}),
    "lowrank_lanczos_last_layer": (tiny_mlp, (4,), 48, 16, "last_layer", "debiased_lowrank", {}, {"rank": 4, "method": "lanczos"}),
    "lowrank_same_batches": (tiny_mlp, (4,), 48, 16, "all", "debiased_lowrank", {"magnitude_loader": True}, {"rank": 8}),
    "lowrank_corrected_mlp": (tiny_mlp, (4,), 60, 10, "all", "debiased_lowrank", {"n_direction_batches": 2},
                              {"rank": 8, "estimator": "corrected"}),
    "lowrank_corrected_lanczos": (tiny_mlp, (4,), 48, 16, "all", "debiased_lowrank", {},
                                  {"rank": 6, "method": "lanczos", "estimator": "corrected"}),
}


def _fit(name: str):
    from laplace import Laplace

    make, shape, n, bs, subset, structure, kw, init = CASES_ALL[name]
    likelihood = "regression" if "regression" in name else "classification"
    data = loader(toy_data(n, shape, 3, likelihood), bs)
    options = {k: v for k, v in kw.items() if k != "magnitude_loader"}
    la = Laplace(make(), likelihood, subset_of_weights=subset, hessian_structure=structure, **init, **options)
    la.fit(data, magnitude_loader=data if "magnitude_loader" in kw else None)
    return la


def _state(la) -> dict:
    if hasattr(la.H, "to_matrix"):  # debiased_ekfac (cross-fitted: a mixture of two)
        comps = getattr(la.H, "components", (la.H,))
        H = la.H.to_matrix()
        basis = [t.abs() for c in comps for Qs in c.eigenvectors for t in Qs]
        basis += [t for c in comps for t in c.eigenvalues]
    elif isinstance(la.H, tuple):  # debiased_lowrank: (U, λ̃); U's column signs are arbitrary
        U, lam = la.H
        H = (U * lam) @ U.T
        basis = [U.abs(), lam]
    else:
        H, basis = la.H, [la.eigenvalues]
    la.prior_precision = 0.5
    return {
        "H": H,
        "basis": basis,
        "direction_eigenvalues": getattr(la, "direction_eigenvalues", torch.zeros(0)),
        "posterior_covariance": _covariance(la),
        "loss": torch.as_tensor(la.loss),
        "n_data": la.n_data,
    }


def _covariance(la) -> torch.Tensor:
    if hasattr(la.H, "to_matrix"):
        return la.posterior_precision.to_matrix(exponent=-1)
    if isinstance(la.H, tuple):
        U, lam = la.H
        return torch.linalg.inv((U * lam) @ U.T + torch.diag(la.prior_precision_diag))
    return la.posterior_covariance


#: 3 ranks on batches of 2 rows: rank 2 gets no rows and adds nothing (3 batches each for B
#: and B̃, so that B's K-FAC input factors have full rank and EKFAC's basis is determined)
_THREE = {"n_direction_batches": 3, "n_magnitude_batches": 3}
EMPTY_RANK_CASES = {
    "full_empty_rank": (tiny_mlp, (4,), 16, 2, "all", "debiased_full", _THREE, {}),
    "lowrank_empty_rank": (tiny_mlp, (4,), 16, 2, "all", "debiased_lowrank", _THREE, {"rank": 4}),
    "lowrank_lanczos_empty_rank": (tiny_mlp, (4,), 16, 2, "all", "debiased_lowrank", _THREE, {"rank": 4, "method": "lanczos"}),
    "ekfac_empty_rank": (tiny_mlp, (4,), 16, 2, "all", "debiased_ekfac", _THREE, {}),
}
CASES_ALL = {**CASES, **EMPTY_RANK_CASES}


def _empty_rank_job(rank: int, out: Path) -> dict:
    return {name: _state(_fit(name)) for name in EMPTY_RANK_CASES}


def _job(rank: int, out: Path) -> dict:
    results = {name: _state(_fit(name)) for name in CASES}
    from laplace import Laplace

    try:  # k = P: Lanczos cannot, rank 0 raises inside the iteration
        la = Laplace(tiny_mlp(), "classification", subset_of_weights="all",
                     hessian_structure="debiased_lowrank", method="lanczos", rank=27)
        la.fit(loader(toy_data(32, (4,), 3, "classification"), 8))
    except Exception as err:
        results["lanczos_error"] = (type(err).__name__, str(err))

    def fail() -> list:
        raise ValueError("decomposition failed")

    try:
        broadcast_computed(fail, "cpu")
    except Exception as err:
        results["broadcast_error"] = (type(err).__name__, str(err))
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("distributed_eigen")
    return spawn_ranks(_job, out, WORLD)


@pytest.fixture(scope="module")
def empty_rank(tmp_path_factory):
    out = tmp_path_factory.mktemp("distributed_eigen_empty_rank")
    return spawn_ranks(_empty_rank_job, out, 3)


def _flat(state: dict) -> list:
    return [
        ("H", state["H"]),
        *[("basis", t) for t in state["basis"]],
        ("direction_eigenvalues", state["direction_eigenvalues"]),
        ("posterior_covariance", state["posterior_covariance"]),
        ("loss", state["loss"]),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_distributed_eigen_fit_equals_single_process(ranks, name):
    torch.set_num_threads(1)
    assert_every_rank_equals([ranks[r][name] for r in range(WORLD)], _state(_fit(name)), _flat, same=("n_data",),
                             atol=lambda want: 1e-6 * float(want.abs().max()) if want.numel() else 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_distributed_eigen_ranks_hold_identical_posteriors(ranks, name):
    """The decomposition is computed on rank 0 and broadcast, so every rank's curvature is
    bitwise rank 0's."""
    for (key, a), (_, b) in zip(_flat(ranks[0][name])[:-2], _flat(ranks[1][name])[:-2]):
        assert torch.equal(a, b), key


@pytest.mark.slow
def test_distributed_eigen_lowrank_lanczos_error_reaches_every_rank(ranks):
    assert ranks[0]["lanczos_error"][0] == "ValueError"
    assert "Lanczos needs 0 < k < dim" in ranks[0]["lanczos_error"][1]
    assert ranks[1]["lanczos_error"][0] == "PeerRankError"
    assert "Lanczos needs 0 < k < dim" in ranks[1]["lanczos_error"][1]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EMPTY_RANK_CASES))
def test_distributed_eigen_rank_without_rows(empty_rank, name):
    """3 ranks, batches of 2 rows: the third rank has no rows of any batch, contributes zeros
    and still ends with rank 0's posterior, equal to the single-process one."""
    torch.set_num_threads(1)
    single = _state(_fit(name))
    for r in range(3):
        for (key, got), (_, want) in zip(_flat(empty_rank[r][name]), _flat(single)):
            assert got.shape == want.shape, f"rank {r} {key}"
            atol = 1e-6 * float(want.abs().max()) if want.numel() else 0.0
            torch.testing.assert_close(got, want, rtol=1e-6, atol=atol, msg=f"rank {r} {key}")
    for (key, a), (_, b) in zip(_flat(empty_rank[0][name])[:-2], _flat(empty_rank[2][name])[:-2]):
        assert torch.equal(a, b), key


@pytest.mark.slow
def test_distributed_broadcast_computed_raises_on_every_rank(ranks):
    """An error on rank 0, the only rank that computes, reaches every rank instead of leaving
    the others waiting for tensors."""
    assert ranks[0]["broadcast_error"] == ("ValueError", "decomposition failed")
    name, message = ranks[1]["broadcast_error"]
    assert name == "PeerRankError" and "rank 0 failed" in message and "decomposition failed" in message


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
