"""``python -m laplace_debiased`` runs the command-line interface."""

from laplace_debiased.cli import main

raise SystemExit(main())
