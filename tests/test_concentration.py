"""Per-sample GGN traces and batch coverage against dense matrices and exact enumeration."""

import itertools
import math

import pytest
import torch

from benchmarks.concentration import batch_coverage, softmax_ggn_traces, top_shares


def test_traces_equal_the_dense_ggn_trace():
    g = torch.Generator().manual_seed(0)
    J = torch.randn(5, 4, 7, generator=g, dtype=torch.float64)
    p = torch.softmax(torch.randn(5, 4, generator=g, dtype=torch.float64), -1)
    dense = torch.stack([torch.trace(J[n].T @ (torch.diag(p[n]) - torch.outer(p[n], p[n])) @ J[n]) for n in range(5)])
    gram = J @ J.transpose(1, 2)
    torch.testing.assert_close(softmax_ggn_traces(gram, p), dense, rtol=1e-12, atol=1e-12)
    one_hot = torch.eye(4, dtype=torch.float64)[[0, 1, 2, 3, 0]]
    torch.testing.assert_close(softmax_ggn_traces(gram, one_hot), torch.zeros(5, dtype=torch.float64))
    with pytest.raises(ValueError, match="gram"):
        softmax_ggn_traces(J, p)


def test_top_shares():
    v = torch.tensor([10.0, 0.0, 5.0, 3.0, 2.0])
    assert top_shares(v, [0.2, 0.4, 1.0]) == {0.2: 0.5, 0.4: 0.75, 1.0: 1.0}
    with pytest.raises(ValueError, match="non-negative"):
        top_shares(-v, [0.5])


@pytest.mark.parametrize("n_top,n_data,b", [(2, 7, 3), (0, 5, 2), (5, 5, 1), (3, 6, 4)])
def test_batch_coverage_equals_enumeration(n_top, n_data, b):
    batches = list(itertools.combinations(range(n_data), b))
    hits = [sum(i < n_top for i in batch) for batch in batches]
    cov = batch_coverage(n_top, n_data, b)
    assert cov["expected"] == pytest.approx(sum(hits) / len(batches), rel=1e-12)
    assert cov["p_none"] == pytest.approx(sum(h == 0 for h in hits) / len(batches), rel=1e-12, abs=1e-15)
    assert math.isfinite(cov["p_none"])


def test_benchmark_per_sample_traces_equal_autograd_jacobians():
    """``benchmarks/curvature_concentration.per_sample`` (the predictive's logit Jacobians, chunked) against
    per-sample Jacobians from ``torch.autograd.functional.jacobian`` and the dense formula."""
    from benchmarks.curvature_concentration import per_sample, summarise
    from _models import tiny_cnn

    model = tiny_cnn().double().eval()
    g = torch.Generator().manual_seed(1)
    X = torch.randn(7, 1, 5, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (7,), generator=g)
    params = dict(model.named_parameters())
    names = list(params)
    expected = []
    for x in X:
        def logits(*ps):
            return torch.func.functional_call(model, dict(zip(names, ps)), (x[None],))[0]
        J = torch.cat([j.flatten(1) for j in torch.autograd.functional.jacobian(logits, tuple(params.values()))], 1)
        p = torch.softmax(logits(*params.values()), -1)
        expected.append(torch.trace(J.T @ (torch.diag(p) - torch.outer(p, p)) @ J))
    s = per_sample(model, X, y, chunk=3)
    torch.testing.assert_close(s["trace"], torch.stack(expected).detach(), rtol=1e-10, atol=1e-12)
    r = summarise(s, batch=2)
    assert r["n_train"] == 7 and [row["points"] for row in r["rows"]] == [1, 1, 1, 1]
