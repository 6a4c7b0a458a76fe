"""The predictive and its evaluation, and the main-job pipeline.

* :mod:`.predictive` -- ``GridPredictive``: the linearized predictive over a prior-precision grid;
* :mod:`.metrics` -- accuracy, NLL, ECE, Brier, OOD scores;
* :mod:`.sweep` -- the resumable prior-precision sweep;
* :mod:`.report` -- Markdown and HTML calibration reports;
* :mod:`.models`, :mod:`.training` -- the small model zoo and cached MAP training;
* :mod:`.pipeline` -- the main job (train, fit, sweep, report).
"""
