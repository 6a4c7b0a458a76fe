"""One loader batch: inputs and targets of pairs and mappings, its size, its device."""

import pytest
import torch

from laplace_debiased.data.batch import batch_inputs_targets, batch_size, input_tensor, on_device


def test_pairs_and_mappings_split_as_laplace_torch_does():
    x, y = torch.randn(5, 2), torch.arange(5)
    X, Y = batch_inputs_targets((x, y))
    assert X is x and Y is y and batch_size((x, y)) == 5
    batch = {"input_ids": x, "labels": y}
    X, Y = batch_inputs_targets(batch)
    assert X is batch and Y is y  # the model consumes the whole mapping
    assert input_tensor(X, "input_ids") is x and input_tensor(x, "input_ids") is x
    assert batch_size({"x": x, "t": y[:3]}, "x", "t") == 3  # the targets' length counts


def test_bad_batches_say_what_to_set():
    with pytest.raises(KeyError, match="dict_key_x / dict_key_y"):
        batch_inputs_targets({"inputs": torch.ones(2)})
    with pytest.raises(ValueError, match="pair"):
        batch_inputs_targets((torch.ones(2), torch.ones(2), torch.ones(2)))


def test_on_device_moves_every_tensor_and_keeps_the_batch_kind():
    x, y = torch.ones(3, 2), torch.zeros(3, dtype=torch.long)
    pair = on_device((x, y), "meta")
    assert isinstance(pair, tuple) and pair[0].is_meta and pair[1].is_meta
    d = on_device({"input_ids": x, "labels": y, "name": "kept"}, "meta")
    assert d["input_ids"].is_meta and d["labels"].is_meta and d["name"] == "kept"
    nested = on_device(({"input_ids": x}, y), "meta")
    assert nested[0]["input_ids"].is_meta and nested[1].is_meta
    assert on_device((x, y), None)[0] is x and on_device((x, y), "cpu")[0] is x  # no copies
    with pytest.raises(ValueError, match="meta device"):
        on_device((torch.empty(3, 2, device="meta"), y), "cpu")
