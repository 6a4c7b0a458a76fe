"""The main job's ``kron_corrected`` method: described as what it is, and compared with the single
batch of the same samples in the report's verdict."""

from laplace_debiased.evaluation.pipeline import describe_method


def test_corrected_method_is_described_as_two_halves():
    d = describe_method("kron_corrected", {"batch_size": 64, "rank": 30}, 300)
    assert d["label"] == "K-FAC, corrected 32 + 32" and d["samples"] == 64
    assert "estimator='corrected'" in d["description"]
    assert describe_method("kron_debiased", {"batch_size": 64, "rank": 30}, 300)["samples"] == 64
