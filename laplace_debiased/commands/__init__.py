"""One module per CLI command; see [`laplace_debiased.cli`][laplace_debiased.cli] for the protocol."""
