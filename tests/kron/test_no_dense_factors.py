"""A K-FAC factor with fewer rows than its width is never formed as a ``d × d`` matrix in a fit: the
shared pass keeps its rows instead of its sum, the decompositions, estimates and records read the
rows (or their Gram matrix), and the result equals the dense route to float64 round-off."""

from __future__ import annotations

import copy

import pytest
import torch
from laplace import KronLaplace
from laplace.curvature import CurvlinopsGGN
from laplace.utils.matrix import Kron
from torch import nn
from torch.nn.utils import parameters_to_vector
from torch.utils._python_dispatch import TorchDispatchMode

from _models import loader, toy_data
from laplace_debiased.curvature.kfac import factor_rows_of, group_kfac_sums
from laplace_debiased.curvature.layer_blocks import curvature_modules
from laplace_debiased.curvature.linalg import RowFactor, roundoff_tolerance
from laplace_debiased.ekfac.laplace import DebiasedEKFACLaplace
from laplace_debiased.kron.laplace import DebiasedKronLaplace
from laplace_debiased.kron.passes import single_pass_kfacs
from laplace_debiased.parallel.reducer import Reducer

F64 = dict(rtol=1e-10, atol=1e-12)
D_IN, HIDDEN, CLASSES = 57, 61, 3  # widths that appear nowhere else, squared


def _wide_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES)).double()


def _data(n: int):
    return toy_data(n, (D_IN,), CLASSES, "classification", seed=3)


def _sums(keep_rows: bool):
    model = _wide_model()
    X, y = _data(40).tensors
    return group_kfac_sums(
        model, [model[0], model[2]], X, y, [(0, 10, 0), (10, 40, 1)], 2, likelihood="classification",
        lossfunc=nn.CrossEntropyLoss(reduction="sum"), factor=1.0, keep_rows=keep_rows,
    )


def test_pass_keeps_rows_instead_of_the_sum_of_a_factor_wider_than_them():
    """First layer's input side: 10 and 30 rows against 57 inputs, kept as rows, no sum; its output
    side: 2 × 30 rows ≥ 61 in group 1, so the sum, formed from the rows kept until then, equals a pass
    without rows to round-off; second layer: 30 < 61 inputs (rows), 2 × 30 ≥ 3 outputs (the sum)."""
    rows, dense = _sums(True), _sums(False)
    assert rows.input[0] is None and rows.input_rows[0] is not None
    assert rows.input[1] is None and rows.input_rows[1] is not None
    assert rows.output[0] is None and rows.output_rows[0] is not None  # 2 × 10 and 2 × 30 rows < 61
    assert rows.output_rows[1] is None
    torch.testing.assert_close(rows.output[1], dense.output[1], **F64)
    for i in (0, 1):
        for g in (0, 1):
            X = factor_rows_of(rows.input_rows[i][g])
            torch.testing.assert_close(X.T @ X, dense.input[i][g], **F64)
            Y = factor_rows_of(rows.output_rows[0][g])
            torch.testing.assert_close(Y.T @ Y, dense.output[0][g], **F64)
    assert all(torch.equal(a, b) for a, b in zip(rows.terms, dense.terms))
    assert all(torch.equal(a, b) for a, b in zip(rows.input_weight, dense.input_weight))


def test_pass_forms_the_sum_once_the_rows_reach_the_width():
    """Group 1 with 61 samples: the first layer's sides reach their widths within the pass and continue
    densely; the sums equal a pass without rows to round-off (same products, same order). Group 0 with 9 samples
    keeps its rows beside them (18 < 61 outputs, 9 < 57 and 9 < 61 inputs)."""
    model = _wide_model()
    X, y = _data(70).tensors
    out = []
    for keep in (True, False):
        out.append(group_kfac_sums(
            model, [model[0], model[2]], X, y, [(0, 9, 0), (9, 70, 1)], 2, likelihood="classification",
            lossfunc=nn.CrossEntropyLoss(reduction="sum"), factor=1.0, keep_rows=keep,
        ))
    rows, dense = out
    assert rows.output[0] is None and rows.input[0] is None and rows.input[1] is None
    for kept, want in ((rows.output_rows[0], dense.output[0]), (rows.input_rows[0], dense.input[0]),
                       (rows.input_rows[1], dense.input[1])):
        torch.testing.assert_close(kept[1], want[1], **F64)
        X = factor_rows_of(kept[0])
        assert X.shape[0] < X.shape[1]
        torch.testing.assert_close(X.T @ X, want[0], **F64)
    assert rows.output_rows[1] is None
    torch.testing.assert_close(rows.output[1], dense.output[1], **F64)


def test_single_pass_returns_wide_factors_as_rows_equal_to_stock_kfac():
    model = _wide_model()
    batches = list(loader(_data(32), 8))
    N = 300
    _, kfacs, rows, _ = single_pass_kfacs(
        model, curvature_modules(model), [batches[:2], batches[2:]], N, likelihood="classification",
        backend=CurvlinopsGGN(model, "classification"), fisher="type2", keys=("input_ids", "labels"),
        mean=parameters_to_vector(model.parameters()), reducer=Reducer(),
    )
    for got, got_rows, batch_set in zip(kfacs, rows, (batches[:2], batches[2:])):
        la = KronLaplace(model, "classification")
        data = torch.utils.data.TensorDataset(*(torch.cat([b[i] for b in batch_set]) for i in (0, 1)))
        la.fit(loader(data, len(data)))
        want = [[F[0] * (N / 16), *F[1:]] for F in la.H_facs.kfacs]
        kinds = [[isinstance(F, RowFactor) for F in block] for block in got]
        assert kinds == [[True, True], [True], [False, True], [False]]  # 32 < 61 outputs, 16 < 57, 61 inputs
        for block, block_rows, w_block in zip(got, got_rows, want):
            for F, X, W in zip(block, block_rows, w_block):
                dense = F.dense() if isinstance(F, RowFactor) else F
                torch.testing.assert_close(dense, W, rtol=1e-10, atol=1e-12 * float(W.abs().max()))
                assert (X is F.rows) if isinstance(F, RowFactor) else X is None


class _SquareRecorder(TorchDispatchMode):
    """Records the shape of every tensor an operator returns whose last two dimensions are ``(d, d)``
    for a width ``d`` in ``widths``."""

    def __init__(self, widths: tuple[int, ...]) -> None:
        super().__init__()
        self.widths, self.seen = widths, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.ndim >= 2 and t.shape[-1] == t.shape[-2] in self.widths:
                self.seen.append((str(func), tuple(t.shape)))
        return out


def _recorded_fit(la, data, monkeypatch) -> list:
    """Fit ``la`` at 2 × 8 samples, recording the ``(57, 57)`` and ``(61, 61)`` tensors of the
    curvature fit (the pass, the decompositions, the records)."""
    recorder = _SquareRecorder((D_IN, HIDDEN))
    fit_two_batch = type(la)._fit_two_batch

    def recorded(self, *args, **kwargs):
        with recorder:
            return fit_two_batch(self, *args, **kwargs)

    monkeypatch.setattr(type(la), "_fit_two_batch", recorded)
    la.fit(loader(data, 8))
    return recorder.seen


@pytest.mark.parametrize("options", [{"estimator": "paper"}, {"estimator": "paper", "null_space": "aligned"},
                                     {"estimator": "paper", "cross_fit": True}, {}, {"estimator": "corrected"},
                                     {"estimator": "stein"}])
def test_debiased_kron_fit_forms_no_square_matrix_of_a_wide_factor(options, monkeypatch):
    """Every estimate: no ``d × d`` tensor of the 57- and 61-wide factors (16 rows of B ∪ B̃ on the input
    side, 32 on the hidden output side), and the curvature equals the dense route's to 1e-10."""
    la = DebiasedKronLaplace(_wide_model(), "classification", **options)
    assert _recorded_fit(la, _data(16), monkeypatch) == []
    ref = copy.copy(la)
    ref._factor_rows = None
    ref._decompose()
    for obj in (la, ref):
        obj.prior_precision = 1e-2
    cov = ref.posterior_precision.to_matrix(-1)
    torch.testing.assert_close(la.posterior_precision.to_matrix(-1), cov, rtol=1e-10,
                               atol=1e-10 * float(cov.abs().max()))


@pytest.mark.parametrize("cross_fit", [False, True])
def test_debiased_ekfac_fit_forms_no_square_matrix_of_a_wide_factor(cross_fit, monkeypatch):
    la = DebiasedEKFACLaplace(_wide_model(), "classification", cross_fit=cross_fit)
    assert _recorded_fit(la, _data(16), monkeypatch) == []


def test_dense_factors_are_formed_where_read():
    """``H_facs.kfacs`` (laplace-torch's attribute, also what ``state_dict`` saves) forms a factor held
    as rows densely where it is read, once, in its place (so laplace-torch's in-place edits hold); the
    fit keeps the rows."""
    la = DebiasedKronLaplace(_wide_model(), "classification", estimator="paper")
    la.fit(loader(_data(16), 8))
    F = la.H_facs.factors[0][1]
    assert isinstance(F, RowFactor) and tuple(F.rows.shape) == (8, D_IN)
    torch.testing.assert_close(la.H_facs.kfacs[0][1], F.rows.T @ F.rows, rtol=0, atol=0)
    assert la.H_facs.factors[0][1] is la.H_facs.kfacs[0][1]
    assert la.H_facs.kfacs[0][0] is la.H_facs.kfacs[1][0]  # the weight's and the bias's output factor (c = 1)
    assert tuple(la.state_dict()["H"][0][1].shape) == (D_IN, D_IN)


def test_row_factor_operations_equal_those_of_the_dense_factor():
    X = torch.randn(5, 9, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    F, dense = RowFactor(X), X.T @ X
    assert F.shape == dense.shape and F.dtype == torch.float64
    torch.testing.assert_close((F * 4.0).dense(), 4.0 * dense, **F64)
    torch.testing.assert_close((0.5 * F).dense(), 0.5 * dense, **F64)
    torch.testing.assert_close((F / 3.0).dense(), dense / 3.0, **F64)
    assert F.frobenius() == pytest.approx(float(torch.linalg.matrix_norm(dense)), rel=1e-12)
    assert F.trace() == pytest.approx(float(dense.trace()), rel=1e-12)
    assert roundoff_tolerance(F, 7) == pytest.approx(roundoff_tolerance(dense, 7), rel=1e-12)
    assert F.isfinite() and not RowFactor(X.where(X > 0, torch.nan)).isfinite()
    with pytest.raises(ValueError, match="s >= 0"):
        F * -1.0


@pytest.mark.parametrize("n, d_in, hidden", [(8, 40, 45), (12, 20, 26)])
def test_same_batch_through_the_rows_is_stock_kron_without_square_matrices(n, d_in, hidden, monkeypatch):
    """B̃ = B (one loader object) with ``n`` samples narrower than every wide factor (``d_in`` inputs, ``hidden``
    hidden units, ``2n`` hidden output rows): no ``d × d`` tensor of those factors in the fit, and the posterior
    precision equals laplace-torch's ``KronLaplace`` to float64 round-off. At 12 samples the input factor
    (``12 < 20 ≤ 2 · 12``) and the hidden output factor (``24 < 26 ≤ 48``) are narrower than their width only
    if the rows are counted once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, CLASSES)).double()
    dl = loader(toy_data(n, (d_in,), CLASSES, "classification", seed=4), n)
    la = DebiasedKronLaplace(copy.deepcopy(model), "classification", prior_precision=0.7)
    recorder = _SquareRecorder((d_in, hidden))
    fit_two_batch = DebiasedKronLaplace._fit_two_batch

    def recorded(self, *args, **kwargs):
        with recorder:
            return fit_two_batch(self, *args, **kwargs)

    monkeypatch.setattr(DebiasedKronLaplace, "_fit_two_batch", recorded)
    la.fit(dl, magnitude_loader=dl)
    assert recorder.seen == []
    assert isinstance(la.H_facs.factors[0][1], RowFactor)
    ref = KronLaplace(model, "classification", prior_precision=0.7)
    ref.fit(dl)
    want = ref.posterior_precision.to_matrix()
    torch.testing.assert_close(la.posterior_precision.to_matrix(), want, rtol=1e-10,
                               atol=1e-10 * float(want.abs().max()))


def _unequal_fit(options: dict, batches: tuple[int, int]) -> DebiasedKronLaplace:
    """``batches`` loader batches of 8 samples in B and B̃: a batch set of 8 is narrower than every wide factor
    (8 < 57 inputs, 2 × 8 < 61 hidden outputs, 8 < 61 hidden inputs), one of 64 as wide as each of them."""
    la = DebiasedKronLaplace(_wide_model(), "classification", n_direction_batches=batches[0],
                             n_magnitude_batches=batches[1], **options)
    la.fit(loader(_data(72), 8))
    return la


def _dense_refit(la: DebiasedKronLaplace) -> DebiasedKronLaplace:
    """``la`` decomposed again from its factors formed densely (the dense route)."""
    ref = copy.copy(la)
    ref.H_facs, ref.H_facs_magnitude = (
        Kron([[F.dense() if isinstance(F, RowFactor) else F.clone() for F in block] for block in kron.factors])
        for kron in (la.H_facs, la.H_facs_magnitude))
    ref._factor_rows = None
    ref._decompose()
    return ref


ESTIMATES = [{"estimator": "paper"}, {"estimator": "paper", "null_space": "aligned"},
             {"estimator": "paper", "cross_fit": True}, {"estimator": "corrected"}, {"estimator": "shrunk"},
             {"estimator": "stein"}]
#: B's and B̃'s loader batches: B narrower than the wide factors and B̃ not, and the reverse
UNEQUAL = [(1, 8), (8, 1)]


@pytest.mark.parametrize("batches", UNEQUAL)
@pytest.mark.parametrize("options", ESTIMATES)
def test_unequal_batches_keep_the_narrow_batch_as_rows_and_equal_the_dense_route(options, batches):
    """|B| = 8, |B̃| = 64 (and the reverse): the narrow batch's wide factors stay rows while the other's are formed
    (as wide as their rows), and every estimate of the mixed pairs equals the dense route to float64 round-off (the
    curvature and the coverage record)."""
    la = _unequal_fit(options, batches)
    narrow, wide = (la.H_facs, la.H_facs_magnitude) if batches[0] < batches[1] else (la.H_facs_magnitude, la.H_facs)
    kinds = [[isinstance(F, RowFactor) for F in block] for block in narrow.factors]
    assert kinds == [[True, True], [True], [False, True], [False]]
    assert not any(isinstance(F, RowFactor) for block in wide.factors for F in block)
    ref = _dense_refit(la)
    for obj in (la, ref):
        obj.prior_precision = 1e-2
    want = ref.posterior_precision.to_matrix(-1)
    torch.testing.assert_close(la.posterior_precision.to_matrix(-1), want, rtol=1e-10,
                               atol=1e-10 * float(want.abs().max()))
    assert la.coverage == ref.coverage


class _EighRecorder(TorchDispatchMode):
    """Records the input shape of every ``linalg_eigh`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten._linalg_eigh:
            self.shapes.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


#: per wide factor, the ``d × d`` eigendecompositions a mixed pair needs, for a narrow B beside a wide B̃ and the
#: reverse: the paper's estimate decomposes a wide B only (a narrow B's eigenvectors come from its Gram matrix, B̃
#: only measures); the aligned null space of a narrow B compresses B̃'s factor onto it; the role swap decomposes the
#: other batch likewise; the corrected estimates decompose the pooled factor and the wide batch (its order's gaps)
MIXED_EIGHS = {"paper": (0, 1), "aligned": (1, 1), "cross_fit": (1, 1), "corrected": (2, 2), "shrunk": (2, 2),
               "stein": (2, 2)}


@pytest.mark.parametrize("batches", UNEQUAL)
@pytest.mark.parametrize("options", ESTIMATES)
def test_unequal_batches_never_form_or_decompose_the_narrow_factor(options, batches, monkeypatch):
    """|B| = 8, |B̃| = 64 (and the reverse): the narrow batch's factors held as rows are never formed
    (``RowFactor.dense``), and each wide factor (57 and 61, three of them) gets only the ``d × d``
    eigendecompositions the wide batch and the pooled factor need (``MIXED_EIGHS``), none of the narrow batch's."""
    la = DebiasedKronLaplace(_wide_model(), "classification", n_direction_batches=batches[0],
                             n_magnitude_batches=batches[1], **options)
    recorder = _EighRecorder()
    fit_two_batch = DebiasedKronLaplace._fit_two_batch

    def recorded(self, *args, **kwargs):
        with recorder:
            return fit_two_batch(self, *args, **kwargs)

    def refused(self):
        raise AssertionError(f"a factor held as rows {tuple(self.rows.shape)} was formed densely")

    monkeypatch.setattr(DebiasedKronLaplace, "_fit_two_batch", recorded)
    monkeypatch.setattr(RowFactor, "dense", refused)
    la.fit(loader(_data(72), 8))
    key = "aligned" if "null_space" in options else "cross_fit" if "cross_fit" in options else options["estimator"]
    wide = [s for s in recorder.shapes if s in ((D_IN, D_IN), (HIDDEN, HIDDEN))]
    assert len(wide) == 3 * MIXED_EIGHS[key][batches[0] > batches[1]]
