"""report_tables: the table cells of the report."""

from __future__ import annotations

import pytest

from laplace_debiased.evaluation.report_tables import mean_stderr_text


@pytest.mark.parametrize("values, digits, expected", [
    ([1.0, 3.0], 2, "+2.00 ± 1.00"),  # sd √2, s.e. √2 / √2 = 1
    ([-0.5, -0.5, -0.5], 1, "-0.5 ± 0.0"),
])
def test_mean_stderr_text_signs_the_mean_and_gives_the_standard_error(values, digits, expected):
    assert mean_stderr_text(values, digits) == expected
