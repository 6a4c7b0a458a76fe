"""The grid predictive and the prior-precision grid search on outputs (batch, tokens, classes),
in float64.

The identity tested: for a model that acts on each token separately, the grid predictive of
``n`` sequences of ``T`` tokens is the grid predictive of the ``n·T`` tokens flattened into
inputs, reshaped to ``(G, n, T, C)``; the grid search scores every token as one validation row
(NLL averaged over tokens), so token and flattened validation data score the grid alike.
"""

import pytest
import torch
from laplace import Laplace
from laplace.utils import RunningNLLMetric
from torch import nn
from torch.utils.data import TensorDataset

from _models import loader, tiny_mlp
import laplace_debiased  # noqa: F401  registers the debiased structures
from laplace_debiased.posterior.grid import GridPredictive, grid_validation_scores
from laplace_debiased.posterior.jacobians import _func_jacobians, _layer_jacobians

T, C, N_SEQ, BATCH = 4, 3, 30, 6  # T ≠ C: token and class axes cannot be confused
STRUCTURES = ["debiased_lowrank", "debiased_full", "debiased_ekfac", "debiased_kron"]
CTOR = {"debiased_lowrank": {"rank": 10, "method": "gram"}}
GRID = [1e-3, 0.1, 1.0, 30.0]


def _tokens(n_seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n_seq, T, 4, generator=g, dtype=torch.float64)
    return X, torch.randint(0, C, (n_seq, T), generator=g)


def _fit(structure: str, subset: str):
    """A posterior fitted on token outputs (tiny_mlp acts on each token)."""
    X, y = _tokens(N_SEQ, seed=1)
    la = Laplace(tiny_mlp(), "classification", subset_of_weights=subset,
                 hessian_structure=structure, **CTOR.get(structure, {}), n_direction_batches=2)  # fmt: skip
    la.fit(loader(TensorDataset(X, y), BATCH))
    return la


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("structure", STRUCTURES)
def test_token_grid_equals_flattened_tokens(structure, subset):
    """Deterministic links over several chunks (chunks of sequences vs chunks of tokens), and
    the MC link with the same ε (one chunk each, same generator seed)."""
    la = _fit(structure, subset)
    X, _ = _tokens(5, seed=5)
    flat = X.flatten(0, 1)
    links = ("probit", "probit_projected", "bridge")
    seq = GridPredictive(la, chunk_size=2).grid(X, GRID, links=links)
    ref = GridPredictive(la, chunk_size=4).grid(flat, GRID, links=links)
    assert seq["map"].shape == (5, T, C)
    torch.testing.assert_close(seq["map"], ref["map"].reshape(5, T, C), rtol=1e-12, atol=1e-14)
    for link in links:
        assert seq[link].shape == (len(GRID), 5, T, C)
        torch.testing.assert_close(seq[link], ref[link].reshape(len(GRID), 5, T, C), rtol=1e-9, atol=1e-12)
    mc = {}
    for name, data, chunk in (("seq", X, 5), ("flat", flat, 5 * T)):
        gen = torch.Generator().manual_seed(3)
        mc[name] = GridPredictive(la, chunk_size=chunk).grid(data, GRID, links=("mc",), n_samples=7, generator=gen)["mc"]
    assert mc["seq"].shape == (len(GRID), 5, T, C)
    torch.testing.assert_close(mc["seq"], mc["flat"].reshape(len(GRID), 5, T, C), rtol=1e-9, atol=1e-12)
    # __call__ at one prior precision keeps the token shape
    assert GridPredictive(la)(X, link="probit", prior_precision=0.5).shape == (5, T, C)


class TokenMixer(nn.Module):
    """Per-token Linear, a Linear across the token axis (tokens interact), Tanh, per-token
    Linear output: the closed-form Jacobians must chain through the mixing layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.mix, self.out = nn.Linear(4, 2), nn.Linear(T, T), nn.Linear(2, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mix(self.embed(x).transpose(1, 2)).transpose(1, 2)
        return self.out(torch.tanh(h))


def test_closed_form_token_jacobians_equal_torch_func():
    """Per-token-row Jacobians ``(n·T, C, numel)`` of the hooks path equal ``torch.func``'s,
    for a model whose tokens interact (inner layers) and its per-token output layer."""
    model = TokenMixer().double()
    X, _ = _tokens(4, seed=2)
    params = list(model.parameters())
    f, jacs = _layer_jacobians(model, params, X)
    f_ref, ref = _func_jacobians(model, params, X)
    assert f.shape == (4, T, C)
    torch.testing.assert_close(f, f_ref)
    for jac, jac_ref in zip(jacs, ref, strict=True):
        full = jac.full().expand(4 * T, -1, -1)
        assert full.shape == jac_ref.full().shape
        torch.testing.assert_close(full, jac_ref.full(), rtol=1e-10, atol=1e-12)


def _val_loaders(batch: int = 4):
    X, y = _tokens(12, seed=7)
    return (
        loader(TensorDataset(X, y), batch),
        loader(TensorDataset(X.flatten(0, 1), y.flatten(0, 1)), batch * T),
    )


@pytest.mark.parametrize("structure", STRUCTURES)
def test_gridsearch_scores_token_rows_like_flattened_tokens(structure):
    """Every token is one validation row: the scores of the whole grid (running NLL metric,
    and an offline callable) and the chosen prior precision equal those of the flattened
    tokens; la.optimize_prior_precision(method="gridsearch") runs on token validation data."""
    la = _fit(structure, "all")
    seq_loader, flat_loader = _val_loaders()
    grid = torch.logspace(-3, 3, 9, dtype=torch.float64)

    def nll(probs, y):
        return torch.nn.functional.nll_loss(probs.log(), y)

    for loss in (RunningNLLMetric(), nll):
        seq = grid_validation_scores(la, loss, grid, seq_loader, "probit")
        flat = grid_validation_scores(la, loss, grid, flat_loader, "probit")
        torch.testing.assert_close(torch.tensor(seq), torch.tensor(flat), rtol=1e-9, atol=1e-12)
    chosen = {}
    for name, val in (("seq", seq_loader), ("flat", flat_loader)):
        la.optimize_prior_precision(pred_type="glm", method="gridsearch", val_loader=val,
                                    link_approx="probit", grid_size=9, log_prior_prec_min=-3,
                                    log_prior_prec_max=3)  # fmt: skip
        chosen[name] = la.prior_precision.clone()
    torch.testing.assert_close(chosen["seq"], chosen["flat"], rtol=0, atol=0)


def test_gridsearch_token_targets_of_the_wrong_shape_get_a_clear_error():
    la = _fit("debiased_kron", "all")
    X, y = _tokens(8, seed=7)
    grid = torch.tensor([0.1, 1.0], dtype=torch.float64)
    for bad in (y[:, 0], y[:, :2]):  # one label per sequence; too few tokens
        with pytest.raises(ValueError, match=r"targets .*shape"):
            grid_validation_scores(la, RunningNLLMetric(), grid, loader(TensorDataset(X, bad), 4), "probit")


def test_sweep_on_token_outputs_equals_the_sweep_on_flattened_tokens(tmp_path):
    """``run_sweep`` scores every token as one row: the metrics of a sweep over sequences equal
    those of the same posterior swept over the tokens flattened into inputs (deterministic link;
    the MAP rows too)."""
    from laplace_debiased.evaluation.sweep import EvalSet, SweepJob, run_sweep

    la = _fit("debiased_kron", "all")
    X, y = _tokens(6, seed=7)
    Xo, _ = _tokens(4, seed=8)
    methods = [SweepJob("kron", lambda repeat: la, links=["probit"])]

    def sweep(x, labels, x_ood, name):
        sets = [EvalSet("test", x, labels), EvalSet("ood", x_ood, kind="ood")]
        return run_sweep(methods, sets, tmp_path / name / "r.jsonl", prior_precisions=GRID,
                         links=["probit"], progress=False, map_model=la.model)

    rows = sweep(X, y, Xo, "tokens")
    flat = sweep(X.flatten(0, 1), y.flatten(), Xo.flatten(0, 1), "flat")
    assert len(rows) == len(flat) > 0
    assert any("auroc" in r for r in rows) and any("nll" in r for r in rows)  # both kinds compared
    for a, b in zip(rows, flat):
        assert a["method"] == b["method"] and a["eval_set"] == b["eval_set"]
        for key in ("nll", "accuracy", "ece", "brier", "auroc"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-9, abs=1e-12), key
