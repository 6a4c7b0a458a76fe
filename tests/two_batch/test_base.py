"""Trust items of the shared two-batch fit (every debiased class): model mode, input
validation, which batches are used, one-batch loaders."""

import logging

import pytest
import torch
from laplace import KronLLLaplace, Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from _models import loader, tiny_mlp, toy_data
import laplace_debiased  # noqa: F401  registers the debiased structures

STRUCTURES = ["debiased_kron", "debiased_lowrank", "debiased_full"]


def _net_with(layer: nn.Module, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 5), layer, nn.Tanh(), nn.Linear(5, 3)).double()


def _bn_trained(model: nn.Module) -> nn.Module:
    """Give BatchNorm non-trivial running statistics, then switch to eval mode."""
    model.train()
    with torch.no_grad():
        for s in range(3):
            model(3 * toy_data(16, (4,), 3, "classification", seed=50 + s).tensors[0] + 1)
    return model.eval()


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("layer", ["batchnorm", "dropout"])
def test_last_layer_fits_eval_mode_model_with_batchnorm_or_dropout(structure, layer):
    make = (lambda: nn.BatchNorm1d(5)) if layer == "batchnorm" else (lambda: nn.Dropout(0.5))
    model = _bn_trained(_net_with(make()))
    dl = loader(toy_data(16, (4,), 3, "classification"), 8)
    la = Laplace(model, "classification", hessian_structure=structure)
    la.fit(dl)
    assert not any(m.training for m in model.modules())
    X = toy_data(3, (4,), 3, "classification", seed=9).tensors[0]
    p1, p2 = la(X), la(X)
    torch.testing.assert_close(p1.sum(-1), torch.ones(3, dtype=p1.dtype))
    assert torch.equal(p1, p2)  # deterministic: eval-mode layers stay in eval mode


@pytest.mark.parametrize("layer", ["batchnorm", "dropout"])
def test_eval_mode_last_layer_kron_same_batch_equals_stock(layer):
    make = (lambda: nn.BatchNorm1d(5)) if layer == "batchnorm" else (lambda: nn.Dropout(0.5))
    model = _bn_trained(_net_with(make()))
    dl = loader(toy_data(8, (4,), 3, "classification"), 8)
    la = Laplace(model, "classification", hessian_structure="debiased_kron")
    la.fit(dl, magnitude_loader=dl)
    ref = KronLLLaplace(model, "classification")
    ref.fit(dl)
    torch.testing.assert_close(la.H.to_matrix(), ref.H.to_matrix(), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("structure", STRUCTURES)
def test_train_mode_model_with_dropout_is_refused(structure):
    model = _net_with(nn.Dropout(0.5)).train()
    la = Laplace(model, "classification", hessian_structure=structure)
    with pytest.raises(ValueError, match=r"model.eval\(\)"):
        la.fit(loader(toy_data(16, (4,), 3, "classification"), 8))


SUBSETS = ["all", "last_layer"]


def _curvature(la) -> torch.Tensor:
    """The fitted curvature as one tensor (low-rank: the re-measured eigenvalues)."""
    H = la.H
    if isinstance(H, tuple):
        return H[1]
    return H if isinstance(H, torch.Tensor) else H.to_matrix()


def _la(structure, subset, model=None, likelihood="classification", **options):
    return Laplace(model if model is not None else tiny_mlp(), likelihood, subset, structure, **options)


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("subset", SUBSETS)
def test_regression_output_target_shape_mismatch_refused(structure, subset):
    X = torch.randn(16, 4, dtype=torch.float64)
    y = torch.randn(16, 1, dtype=torch.float64)
    la = _la(structure, subset, tiny_mlp(n_out=2), "regression")
    with pytest.raises(ValueError, match=r"\(2,\).*\(1,\)"):
        la.fit(loader(TensorDataset(X, y), 8))


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("subset", SUBSETS)
@pytest.mark.parametrize("label", [-3, 3])
def test_label_outside_classes_refused(structure, subset, label):
    """Labels outside ``[0, C)`` are refused; -100, CrossEntropyLoss's ignore_index, marks a
    padded position, which the fit leaves out (tests/two_batch/test_padding.py)."""
    X, y = toy_data(16, (4,), 3, "classification").tensors
    y = y.clone()
    y[3] = label
    with pytest.raises(ValueError, match="range"):
        _la(structure, subset).fit(loader(TensorDataset(X, y), 8))


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("subset", SUBSETS)
def test_inputs_whose_squares_overflow_refused(structure, subset):
    X, y = toy_data(16, (4,), 3, "classification").tensors
    la = _la(structure, subset, tiny_mlp().float())
    with pytest.raises(ValueError, match="overflow"):
        la.fit(loader(TensorDataset(X.float() * 1e38, y), 8))


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("subset", SUBSETS)
def test_infinite_loss_refused(structure, subset):
    X, y = toy_data(16, (4,), 3, "regression").tensors
    la = _la(structure, subset, tiny_mlp().float(), "regression")
    with pytest.raises(ValueError, match="loss"):
        la.fit(loader(TensorDataset(X.float(), y.float() * 1e30), 8))


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("subset", SUBSETS)
def test_all_parameters_frozen_refused(structure, subset):
    model = tiny_mlp()
    for p in model.parameters():
        p.requires_grad_(False)
    la = _la(structure, subset, model)
    with pytest.raises(ValueError, match="requires_grad"):
        la.fit(loader(toy_data(16, (4,), 3, "classification"), 8))


@pytest.mark.parametrize("structure", STRUCTURES)
def test_fit_logs_and_records_which_batches(structure, caplog):
    ds = toy_data(24, (4,), 3, "classification")
    la = _la(structure, "all")
    with caplog.at_level(logging.INFO, logger="laplace_debiased"):
        la.fit(loader(ds, 8))
    (choice,) = la.fit_batches
    assert (choice.direction, choice.magnitude, choice.how) == ((0,), (1,), "loader order")
    assert (choice.direction_size, choice.magnitude_size, choice.n_data) == (8, 8, 24)
    assert any(choice.describe() in r.getMessage() for r in caplog.records)
    la = _la(structure, "all", generator=torch.Generator().manual_seed(0))
    la.fit(loader(ds, 8))
    assert la.fit_batches[0].how == "random draw" and len(la.fit_batches) == 1


def test_online_fits_record_every_fit():
    ds = toy_data(24, (4,), 3, "classification")
    la = _la("debiased_kron", "all")
    la.fit(loader(ds, 8))
    la.fit(loader(ds, 8), override=False)
    assert len(la.fit_batches) == 2


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("subset", SUBSETS)
def test_one_batch_loader_fits_on_disjoint_halves(structure, subset, caplog):
    ds = toy_data(20, (4,), 3, "classification")
    la = _la(structure, subset)
    with caplog.at_level(logging.INFO, logger="laplace_debiased"):
        la.fit(loader(ds, 20))
    (choice,) = la.fit_batches
    assert choice.how == "one-batch split" and la.n_data == 20
    assert any("one-batch split" in r.getMessage() for r in caplog.records)
    idx_B, idx_Bt = choice.sample_split
    same = _la(structure, subset)
    X, y = ds.tensors
    order = list(idx_B) + list(idx_Bt)
    same.fit(loader(TensorDataset(X[order], y[order]), 10))  # B, B̃ as two explicit batches
    torch.testing.assert_close(_curvature(la), _curvature(same))
    torch.testing.assert_close(la.loss, same.loss)


def test_marglik_training_with_one_batch_loader():
    from laplace.marglik_training import marglik_training

    torch.manual_seed(0)
    X = torch.linspace(-2, 2, 30, dtype=torch.float64).unsqueeze(-1)
    y = torch.sin(2 * X) + 0.1 * torch.randn_like(X)
    model = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    la, model, margliks, _ = marglik_training(
        model, DataLoader(TensorDataset(X, y), batch_size=30), "regression",
        hessian_structure="debiased_kron", n_epochs=6,  # laplace-torch's default backend
        n_epochs_burnin=2, n_hypersteps=3,
    )
    assert la.fit_batches[0].how == "one-batch split"
    assert all(torch.isfinite(torch.as_tensor(m)) for m in margliks) and len(margliks) > 0


class _Squeezed(nn.Module):
    """Regression model with one scalar output per sample, shape (n,)."""

    def __init__(self):
        super().__init__()
        self.net = tiny_mlp(n_out=1)

    def forward(self, x):
        return self.net(x).squeeze(-1)


def test_scalar_regression_output_against_column_targets_refused():
    X = torch.randn(16, 4, dtype=torch.float64)
    la = _la("debiased_kron", "all", _Squeezed(), "regression")
    with pytest.raises(ValueError, match=r"\(\).*\(1,\)"):
        la.fit(loader(TensorDataset(X, torch.randn(16, 1, dtype=torch.float64)), 8))


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("structure", [*STRUCTURES, "debiased_ekfac"])
@pytest.mark.parametrize("pred_type", ["glm", "nn"])
def test_mc_predictive_draws_from_the_generator_passed(structure, subset, pred_type):
    """``la(x, link_approx="mc", generator=g)`` draws from ``g`` only (laplace-torch 0.3 ignores it
    and draws from the global generator): the same seed gives the same result whatever the global
    generator holds, another seed another result."""
    la = Laplace(tiny_mlp(), "classification", subset_of_weights=subset, hessian_structure=structure)
    la.fit(loader(toy_data(16, (4,), 3, "classification"), 8))
    X = toy_data(5, (4,), 3, "classification", seed=3).tensors[0]

    def draw(seed: int, global_seed: int) -> torch.Tensor:
        torch.manual_seed(global_seed)
        return la(X, pred_type=pred_type, link_approx="mc", n_samples=6, generator=torch.Generator().manual_seed(seed))

    assert torch.equal(draw(0, global_seed=1), draw(0, global_seed=2))
    assert not torch.allclose(draw(0, global_seed=1), draw(1, global_seed=1))


# ---------------------------------------------------------------- options in the constructor
OPTION_CASES = [
    ("all", "debiased_kron", {"estimator": "paper"}),
    ("all", "debiased_kron", {"estimator": "corrected", "n_direction_batches": 2, "n_magnitude_batches": 2}),
    ("all", "debiased_kron", {"null_space": "aligned", "cross_fit": True}),
    ("last_layer", "debiased_kron", {"split": "halves", "estimator": "paper"}),
    ("all", "debiased_ekfac", {"cross_fit": True, "n_magnitude_batches": "auto"}),
    ("all", "debiased_lowrank", {"n_direction_batches": 2}),
    ("last_layer", "debiased_full", {"n_magnitude_batches": 3}),
]


def _precision(la) -> torch.Tensor:
    P = la.posterior_precision
    if isinstance(P, tuple):  # low rank: ((U, λ), prior)
        (U, lam), prior = P
        return U @ torch.diag(lam) @ U.T + torch.diag(prior.expand(U.shape[0]))
    return P if isinstance(P, torch.Tensor) else P.to_matrix()


@pytest.mark.parametrize("subset,structure,options", OPTION_CASES)
def test_constructor_options_equal_the_deprecated_fit_keywords(subset, structure, options):
    """The same options through the constructor and through the old ``fit`` keywords give the
    bit-identical fit; each old keyword warns, naming the constructor keyword; the options stay set."""
    data = loader(toy_data(48, (4,), 3, "classification"), 8)
    new = Laplace(tiny_mlp(), "classification", subset, structure, **options)
    new.fit(data)
    old = Laplace(tiny_mlp(), "classification", subset, structure)
    with pytest.warns(DeprecationWarning) as caught:
        old.fit(data, **options)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(messages) == len(options)
    for name, message in zip(options, messages):
        assert message.startswith(f"fit({name}=...) is deprecated") and f", {name}=...)" in message
    assert torch.equal(_precision(new), _precision(old))
    assert new.fit_batches == old.fit_batches
    old.fit(data)  # the keywords stay set, as constructor options
    assert torch.equal(_precision(new), _precision(old))


def test_factory_passes_the_estimate_to_the_constructor():
    """``Laplace(..., hessian_structure="debiased_kron", estimator="paper")`` (last layer, the
    factory's default) fits the paper's estimate: B's eigenvectors, B̃'s Rayleigh quotients, which
    differs from the default (corrected) estimate."""
    data = loader(toy_data(32, (4,), 3, "classification"), 8)
    paper = Laplace(tiny_mlp(), "classification", hessian_structure="debiased_kron", estimator="paper")
    default = Laplace(tiny_mlp(), "classification", hessian_structure="debiased_kron")
    for la in (paper, default):
        la.fit(data)
    assert (paper._estimator, default._estimator) == ("paper", "corrected")
    (G, A), (D, C) = paper.H_facs.kfacs[0], paper.H_facs_magnitude.kfacs[0]
    for B_factor, M_factor, eigenvalues in zip((G, A), (D, C), paper.H.eigenvalues[0]):
        U = torch.linalg.eigh(B_factor.double())[1]
        rayleigh = torch.diagonal(U.T @ M_factor.double() @ U)
        torch.testing.assert_close(eigenvalues.double().sort().values, rayleigh.sort().values, atol=1e-10, rtol=1e-8)
    assert not torch.allclose(paper.H.to_matrix(), default.H.to_matrix())


@pytest.mark.parametrize(
    "structure,options,error,message",
    [
        ("debiased_kron", {"n_direction_batches": 0}, ValueError, "n_direction_batches must be a positive integer"),
        ("debiased_kron", {"n_magnitude_batches": 1.5}, ValueError, "positive integer or 'auto'"),
        ("debiased_kron", {"n_direction_batches": True}, ValueError, "positive integer"),
        ("debiased_kron", {"split": "thirds"}, ValueError, "split must be 'batches' or 'halves'"),
        ("debiased_kron", {"split": "halves", "n_direction_batches": 2}, ValueError, "do not pass n_\\*_batches"),
        ("debiased_kron", {"generator": 0}, TypeError, "generator must be a torch.Generator"),
        ("debiased_kron", {"estimator": "median"}, ValueError, "offers estimator in"),
        ("debiased_kron", {"null_space": "zero"}, ValueError, "null_space must be one of"),
        ("debiased_kron", {"cross_fit": 1}, TypeError, "cross_fit must be a bool"),
        ("debiased_ekfac", {"estimator": "shrunk"}, ValueError, "debiased_ekfac offers estimator in"),
        ("debiased_ekfac", {"null_space": "aligned"}, TypeError, "null_space"),
        ("debiased_full", {"n_magnitude_batches": "auto"}, ValueError, "has no K-FAC factors"),
        ("debiased_lowrank", {"estimator": "stein"}, ValueError, "debiased_lowrank offers estimator in"),
        ("debiased_full", {"estimator": "corrected"}, TypeError, "estimator"),
    ],
)
def test_options_are_checked_at_construction(structure, options, error, message):
    with pytest.raises(error, match=message):
        Laplace(tiny_mlp(), "classification", "all", structure, **options)


def test_deprecated_fit_keywords_are_checked_and_unknown_ones_refused():
    data = loader(toy_data(32, (4,), 3, "classification"), 8)
    la = Laplace(tiny_mlp(), "classification", "all", "debiased_kron")
    with pytest.deprecated_call(), pytest.raises(ValueError, match="offers estimator in"):
        la.fit(data, estimator="median")
    assert la._estimator == "corrected"  # a refused keyword leaves the options as they were
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['rank'\]"):
        la.fit(data, rank=3)
    ekfac = Laplace(tiny_mlp(), "classification", "all", "debiased_ekfac")
    with pytest.warns(DeprecationWarning, match=r"fit\(null_space=...\) has no effect on debiased_ekfac"):
        ekfac.fit(data, null_space="aligned")


@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_a_state_is_loaded_only_with_the_options_it_was_fitted_with(subset):
    """The estimate's options saved in the state must equal the constructor's: an online fit after
    loading continues with the object's options, so a state of another estimate is refused."""
    data = loader(toy_data(32, (4,), 3, "classification"), 8)
    model = tiny_mlp()
    la = Laplace(model, "classification", subset, "debiased_kron", estimator="paper", cross_fit=True)
    la.fit(data)
    state = la.state_dict()
    with pytest.raises(ValueError, match=r"fitted with \{'estimator': 'paper'.*'cross_fit': True\}.*construct it"):
        Laplace(model, "classification", subset, "debiased_kron").load_state_dict(state)
    same = Laplace(model, "classification", subset, "debiased_kron", estimator="paper", cross_fit=True)
    same.load_state_dict(state)
    assert torch.equal(_precision(same), _precision(la))


def test_marglik_training_uses_a_non_default_estimate():
    """laplace-torch 0.3's ``marglik_training`` builds ``Laplace(model, ..., hessian_structure=...)``
    and calls ``fit(train_loader)`` without passing on options; a structure key whose class sets
    the option in its constructor chooses the estimate there. Its final fit is the paper's estimate
    at the trained parameters, not the default one."""
    import gc

    from laplace.curvature import CurvlinopsGGN
    from laplace.marglik_training import marglik_training

    from laplace_debiased.kron.laplace import DebiasedKronLaplace

    class PaperKron(DebiasedKronLaplace):
        _key = ("all", "debiased_kron_paper_test")

        def __init__(self, model, likelihood, *args, **kwargs):
            super().__init__(model, likelihood, *args, estimator="paper", **kwargs)

    torch.manual_seed(0)
    data = loader(toy_data(48, (4,), 3, "classification"), 16)
    try:
        la, model, margliks, _ = marglik_training(
            tiny_mlp(), data, "classification", hessian_structure="debiased_kron_paper_test",
            backend=CurvlinopsGGN, n_epochs=3, n_hypersteps=2, prior_structure="scalar",
        )
        assert type(la) is PaperKron and la._estimator == "paper"
        assert all(torch.isfinite(torch.as_tensor(m)) for m in margliks)
        paper = DebiasedKronLaplace(model, "classification", estimator="paper")
        default = DebiasedKronLaplace(model, "classification")
        for ref in (paper, default):
            ref.fit(data)
        assert torch.equal(la.H.to_matrix(), paper.H.to_matrix())
        assert not torch.allclose(la.H.to_matrix(), default.H.to_matrix())
    finally:
        del PaperKron
        la = None
        gc.collect()  # the test's structure key leaves the factory's registry


def test_no_package_example_or_benchmark_code_passes_options_to_fit():
    """No ``.fit(...)`` call of the package, the examples and the benchmarks names a structure option
    (a deprecated keyword); calls the suite runs are caught at run time too (pytest turns the
    package's deprecations into errors)."""
    import ast
    from pathlib import Path

    from laplace_debiased.ekfac.laplace import DebiasedEKFACLaplace
    from laplace_debiased.kron.laplace import DebiasedKronLaplace

    options = {*DebiasedKronLaplace._options, *DebiasedEKFACLaplace._options, "null_space"}
    root = Path(__file__).resolve().parents[2]
    offenders = []
    for folder in ("laplace_debiased", "examples", "benchmarks"):
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "fit":
                    if {k.arg for k in node.keywords} & options:
                        offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not offenders, offenders


def test_optimize_prior_precision_takes_laplace_torchs_arguments_by_position_or_keyword():
    """The override passes laplace-torch's arguments on by name: a positional call and a keyword
    call tune to the same prior precision, and an unknown argument is refused as laplace-torch's."""
    data = loader(toy_data(32, (4,), 3, "classification"), 8)
    tuned = []
    for positional in (True, False):
        la = Laplace(tiny_mlp(), "classification", "all", "debiased_kron")
        la.fit(data)
        if positional:
            la.optimize_prior_precision("glm", "marglik", 20, 0.1, 2.0, "layerwise")
        else:
            la.optimize_prior_precision(method="marglik", n_steps=20, lr=0.1, init_prior_prec=2.0,
                                        prior_structure="layerwise")
        tuned.append(la.prior_precision)
    assert tuned[0].shape == (4,) and torch.equal(tuned[0], tuned[1])
    with pytest.raises(TypeError, match="n_step"):
        la.optimize_prior_precision(n_step=3)
