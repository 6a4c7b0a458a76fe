"""What importing the package does to laplace-torch's factory and to logging, each in a fresh
interpreter (the import order is the point)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import laplace_debiased  # noqa: F401  (first, as documented: registers and wraps on laplace's import)

FIT = (
    "import torch\n"
    "from torch.utils.data import DataLoader, TensorDataset\n"
    "m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))\n"
    "data = TensorDataset(torch.randn(16, 3), torch.randint(0, 2, (16,)))\n"
    "la = Laplace(m, 'classification', subset_of_weights='all', hessian_structure='debiased_kron')\n"
    "la.fit(DataLoader(data, batch_size=8))\n"
)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_basicconfig_after_the_imports_shows_the_batch_choice():
    """laplace-torch's import logs with the root logger, which installs a WARNING handler on it;
    a later ``logging.basicConfig(level=INFO)`` must still take effect."""
    setup = "import laplace_debiased\nfrom laplace import Laplace\nimport logging\nlogging.basicConfig(level=logging.INFO)\n"
    res = _run(setup + FIT)
    assert res.returncode == 0, res.stderr
    assert "INFO:laplace_debiased.two_batch.base:DebiasedKronLaplace fit:" in res.stderr, res.stderr


def test_a_mistyped_structure_names_the_valid_keys():
    import laplace
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    with pytest.raises(ValueError) as info:
        laplace.Laplace(model, "classification", subset_of_weights="all", hessian_structure="debiased_kfac")
    message = str(info.value)
    assert "Unsupported Laplace combination" in message
    for key in ("'debiased_kron'", "'debiased_ekfac'", "'debiased_lowrank'", "'debiased_full'", "'kron'", "'full'"):
        assert key in message, message
    assert "Did you mean hessian_structure=" in message and "debiased_kron" in message.split("Did you mean")[1]
    with pytest.raises(ValueError, match="Valid subset_of_weights: .*'all'.*'last_layer'"):
        laplace.Laplace(model, "classification", subset_of_weights="every", hessian_structure="kron")


def test_valid_keys_still_build_the_same_classes():
    import laplace
    import torch
    from laplace import KronLaplace

    from laplace_debiased.kron.laplace import DebiasedKronLaplace

    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    assert type(laplace.Laplace(model, "classification", subset_of_weights="all", hessian_structure="kron")) is KronLaplace
    la = laplace.Laplace(model, "classification", subset_of_weights="all", hessian_structure="debiased_kron")
    assert type(la) is DebiasedKronLaplace


def test_laplace_torch_import_warnings_no_user_can_act_on_are_silenced_and_others_pass():
    """The import hook ignores asdl's ``torch.jit.script`` FutureWarning (torch >= 2.15) while
    laplace-torch's module executes, and lets every other warning through."""
    import types
    import warnings

    from laplace_debiased._register import exec_quietly

    def noisy(module: types.ModuleType) -> None:
        warnings.warn("`torch.jit.script` is deprecated. Please switch to `torch.compile`.", FutureWarning)
        warnings.warn("something the user should see", FutureWarning)
        module.executed = True

    module = types.ModuleType("fake")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec_quietly(noisy, module)
    assert module.executed
    assert [str(w.message) for w in caught] == ["something the user should see"]
