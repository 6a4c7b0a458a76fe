"""Bias diagnostics for mini-batch quadratics (Tatzel et al., ICLR 2025, Sec. 3, Figs. 1-4, 17).

Pure formulas live in [`directional`][laplace_debiased.diagnostics.directional] (slopes, curvatures, relative
bias, Eq. 5 average, CG step sizes), [`overlap`][laplace_debiased.diagnostics.overlap] (Ω) and
[`bounds`][laplace_debiased.diagnostics.bounds] (Eq. 7); direction sets in
[`directions`][laplace_debiased.diagnostics.directions]; measurements on a partition in
[`measure`][laplace_debiased.diagnostics.measure]; the whole diagnosis in
[`bias`][laplace_debiased.diagnostics.bias]; plots, JSON and Markdown in
[`report`][laplace_debiased.diagnostics.report].
"""
