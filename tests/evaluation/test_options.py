"""Pipeline options (:mod:`laplace_debiased.evaluation.options`): defaults < config file < flags,
config keys with dashes or underscores, and each bad value refused with its flag's name."""

from __future__ import annotations

import argparse
import json

import pytest

from laplace_debiased.evaluation.methods import METHODS
from laplace_debiased.evaluation.options import (
    DEFAULTS, add_pipeline_arguments, check_links, load_config, method_key, resolve_options, split_method_key,
    sweep_methods,
)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_pipeline_arguments(parser)
    return parser.parse_args(list(argv))


def test_unset_flags_take_the_defaults():
    opts = resolve_options(_parse())
    assert {k: opts[k] for k in DEFAULTS} == DEFAULTS
    assert set(DEFAULTS["methods"]) <= set(METHODS)  # the table of methods


def test_a_config_file_overrides_defaults_and_flags_override_the_file(tmp_path):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"repeats": 5, "batch-size": 16, "seed": 4}))
    opts = resolve_options(_parse("--config", str(config), "--seed", "9"))
    assert (opts["repeats"], opts["batch_size"], opts["seed"]) == (5, [16], 9)
    toml = tmp_path / "c.toml"
    toml.write_text('rank = 7\nlinks = ["probit"]\nbatch-size = [32, 128]\n')
    assert load_config(toml) == {"rank": 7, "links": ["probit"], "batch_size": [32, 128]}
    assert resolve_options(_parse("--config", str(toml)))["batch_size"] == [32, 128]
    assert resolve_options(_parse("--config", str(toml), "--batch-size", "64"))["batch_size"] == [64]


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
    ({"batch_size": [32, 1]}, r"at least 2 .*, got 1"),
    ({"batch_size": []}, "at least one value"),
    ({"batch_size": [32, 32]}, "repeated batch size"),
    ({"batch_size": [32.0]}, "takes integers"),
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


def test_batch_size_takes_one_value_or_several():
    assert resolve_options(_parse("--batch-size", "64"))["batch_size"] == [64]
    assert resolve_options(_parse("--batch-size", "32", "128"))["batch_size"] == [32, 128]
    with pytest.raises(SystemExit):  # argparse: at least one integer
        _parse("--batch-size")


def test_the_default_job_covers_both_regimes_with_the_single_paper_and_default_fits():
    assert DEFAULTS["batch_size"] == [32, 128]
    assert DEFAULTS["methods"] == ["kron_single", "kron_debiased", "kron_corrected", "kron_full"]


def test_one_batch_size_keeps_the_method_names_and_several_name_each_b():
    methods = ["kron_single", "kron_full", "kron_debiased"]
    assert sweep_methods({"methods": methods, "batch_size": 64}) == sweep_methods({"methods": methods, "batch_size": [64]}) \
        == [("kron_single", "kron_single", 64), ("kron_full", "kron_full", None), ("kron_debiased", "kron_debiased", 64)]
    assert sweep_methods({"methods": methods, "batch_size": [32, 128]}) == [
        ("kron_single@b32", "kron_single", 32), ("kron_single@b128", "kron_single", 128),
        ("kron_full", "kron_full", None),  # the full batch once
        ("kron_debiased@b32", "kron_debiased", 32), ("kron_debiased@b128", "kron_debiased", 128)]
    for key, method, b in sweep_methods({"methods": methods, "batch_size": [32, 128]}):
        assert split_method_key(key) == (method, b) and method_key(method, b) == key
    assert split_method_key("kron_single") == ("kron_single", None)
