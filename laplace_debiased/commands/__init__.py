"""One module per CLI command; see :mod:`laplace_debiased.cli` for the protocol."""
