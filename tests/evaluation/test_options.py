"""Pipeline options (:mod:`laplace_debiased.evaluation.options`): defaults < config file < flags,
config keys with dashes or underscores, and each bad value refused with its flag's name."""

from __future__ import annotations

import argparse
import json

import pytest

from laplace_debiased.evaluation.options import DEFAULTS, METHODS, add_pipeline_arguments, check_links, load_config, resolve_options


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_pipeline_arguments(parser)
    return parser.parse_args(list(argv))


def test_unset_flags_take_the_defaults():
    opts = resolve_options(_parse())
    assert {k: opts[k] for k in DEFAULTS} == DEFAULTS
    assert set(DEFAULTS["methods"]) <= set(METHODS)


def test_a_config_file_overrides_defaults_and_flags_override_the_file(tmp_path):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"repeats": 5, "batch-size": 16, "seed": 4}))
    opts = resolve_options(_parse("--config", str(config), "--seed", "9"))
    assert (opts["repeats"], opts["batch_size"], opts["seed"]) == (5, 16, 9)
    toml = tmp_path / "c.toml"
    toml.write_text('rank = 7\nlinks = ["probit"]\n')
    assert load_config(toml) == {"rank": 7, "links": ["probit"]}


@pytest.mark.parametrize("text, match", [("[1, 2]", "must hold a table"), ("{", "cannot parse config"),
                                         ('{"nope": 1}', r"unknown option\(s\) \['nope'\]")])
def test_bad_config_files_are_refused(tmp_path, text, match):
    path = tmp_path / "c.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_config(path)
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.json")


@pytest.mark.parametrize("given, match", [  # as a config file or a caller may give them, unchecked by argparse
    ({"methods": ["kron_nope"]}, "unknown method"),
    ({"methods": ["kron_full", "kron_full"]}, "repeated method"),
    ({"repeats": 0}, "--repeats must be a positive integer"),
    ({"batch_size": 1}, "at least 2"),
    ({"links": ["probit", "probit"]}, "repeated link"),
    ({"lock_timeout": -1.0}, "--lock-timeout must be >= 0"),
])
def test_bad_values_are_refused_with_their_flag(given, match):
    with pytest.raises(ValueError, match=match):
        resolve_options(argparse.Namespace(**given))


def test_cifar_data_evaluates_on_its_own_test_set_unless_told_otherwise():
    assert resolve_options(_parse("--data", "cifar100"))["eval"] == ["cifar100-test"]
    assert resolve_options(_parse())["eval"] == []
    with pytest.raises(ValueError, match="unknown link 'nope'"):
        check_links(["nope"])
