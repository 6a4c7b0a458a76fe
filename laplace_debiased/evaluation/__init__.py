"""The predictive and its evaluation, and the main-job pipeline.

* [`predictive`][laplace_debiased.evaluation.predictive] -- the sampled linearized predictive (Eq. 18) for
  posteriors without a cheap eigenbasis (the grid predictive is ``posterior.grid.GridPredictive``);
* [`metrics`][laplace_debiased.evaluation.metrics] -- accuracy, NLL, ECE, Brier, OOD scores;
* [`sweep`][laplace_debiased.evaluation.sweep] -- the resumable prior-precision sweep;
* [`methods`][laplace_debiased.evaluation.methods] -- the table of methods the main job sweeps;
* [`report_page`][laplace_debiased.evaluation.report_page] -- Markdown and HTML calibration reports, from
  [`report_tables`][laplace_debiased.evaluation.report_tables] and
  [`report_figures`][laplace_debiased.evaluation.report_figures] over
  [`report_data`][laplace_debiased.evaluation.report_data];
* [`models`][laplace_debiased.evaluation.models], [`training`][laplace_debiased.evaluation.training] -- the
  small model zoo and cached MAP training;
* [`pipeline`][laplace_debiased.evaluation.pipeline] -- the main job (train, fit, sweep, report).
"""
