"""The flat import paths of 0.1 still work after the layout move, as the same module objects."""

import importlib
import pickle

import pytest

from laplace_debiased._moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_is_new_module(old):
    assert importlib.import_module(f"laplace_debiased.{old}") is importlib.import_module(
        f"laplace_debiased.{MOVED[old]}"
    )


def test_from_imports_of_old_paths():
    from laplace_debiased.kron import DebiasedKronLaplace
    from laplace_debiased.optim import NewtonCG
    from laplace_debiased import metrics
    from laplace_debiased.structures.kron import DebiasedKronLaplace as New
    from laplace_debiased.optim.newton_cg import NewtonCG as NewNewtonCG

    assert DebiasedKronLaplace is New and NewtonCG is NewNewtonCG
    assert metrics is importlib.import_module("laplace_debiased.evaluation.metrics")


def test_pickle_naming_an_old_path_loads():
    from laplace_debiased.optim.cg import CGResult

    payload = pickle.dumps(CGResult, protocol=0).replace(b"laplace_debiased.optim.cg", b"laplace_debiased.cg")
    assert b"laplace_debiased.cg" in payload
    assert pickle.loads(payload) is CGResult


@pytest.mark.parametrize(
    "old, new, names",
    [
        ("evaluation.predictive", "posterior.grid", ["GridPredictive", "grid_validation_scores", "UnsupportedBatches"]),
        ("evaluation.predictive", "posterior.kron", ["KronStructure"]),
        ("evaluation.predictive", "posterior.eigen", ["EigenStructure", "orthonormal_eigenpairs"]),
        ("evaluation.predictive", "posterior.jacobians", ["LayerJacobian", "logit_jacobians", "logit_rows"]),
        ("evaluation.predictive", "posterior.links", ["LINKS", "apply_link", "normal_samples", "project_logits"]),
        ("evaluation.predictive", "posterior.lowrank", ["dense_posterior_scale", "lowrank_functional_covariance"]),
        ("evaluation.predictive", "posterior.from_laplace", ["posterior_structure", "laplace_params"]),
        ("evaluation.training", "paths", ["default_cache_dir"]),
        ("data.cifar", "paths", ["default_data_root"]),
        ("curvature.eigen", "curvature.lanczos", ["lanczos_top_k", "summed_curvature_product"]),
        ("curvature.eigen", "curvature.factors", ["directional_curvatures", "per_sample_factor_columns"]),
        ("curvature.eigen", "curvature.inputs", ["trainable_parameters", "target_rows", "CURVATURES"]),
        ("curvature.eigen", "curvature.thresholds", ["EigenPairs", "threshold_eigenpairs", "above_relative_floor"]),
    ],
)
def test_names_moved_out_of_a_module_are_re_exported(old, new, names):
    """Issue 22 moved names into new modules; the old module still has each, the same object."""
    old_mod = importlib.import_module(f"laplace_debiased.{old}")
    new_mod = importlib.import_module(f"laplace_debiased.{new}")
    for name in names:
        assert getattr(old_mod, name) is getattr(new_mod, name), name


def test_two_batch_mixin_keeps_every_concern():
    from laplace_debiased.structures.fit_checks import FitChecksMixin
    from laplace_debiased.structures.gridsearch import GridSearchMixin
    from laplace_debiased.structures.token_outputs import TokenOutputsMixin
    from laplace_debiased.structures.two_batch import TwoBatchLaplaceMixin

    assert issubclass(TwoBatchLaplaceMixin, (FitChecksMixin, GridSearchMixin, TokenOutputsMixin))
    for name in ("fit", "_check_model_mode", "_gridsearch", "_glm_predictive_distribution", "_summed_loss"):
        assert callable(getattr(TwoBatchLaplaceMixin, name)), name
