"""Shared set-ups of the command tests."""

from __future__ import annotations

import argparse

import pytest

from laplace_debiased.cli import build_parser


@pytest.fixture
def parse_args():
    """``parse_args(command, *argv)``: the namespace the CLI's parser of ``command`` gives ``argv``."""
    def parse(command: str, *argv: str) -> argparse.Namespace:
        parser, _ = build_parser(command)
        return parser.parse_args(list(argv))

    return parse
