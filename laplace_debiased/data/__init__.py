"""Data sets: embedded digits, CIFAR-10/100, CIFAR-10-C/100-C and generated corruptions.

Everything is served as [`ImageDataset`][laplace_debiased.data.images.ImageDataset] (uint8 storage, normalised
float tensors) or, for the digits, as ``TensorDataset``.  Evaluation sets are chosen with one string through
[`resolve_eval_set`][laplace_debiased.data.eval_sets.resolve_eval_set] (e.g. ``"cifar10-test"``,
``"cifar10-c-generated:3"``).

Modules: [`images`][laplace_debiased.data.images] (``ImageDataset``, normalisation constants),
[`digits`][laplace_debiased.data.digits], [`cifar`][laplace_debiased.data.cifar] (CIFAR-10/100 with integrity
checks), [`cifar_c`][laplace_debiased.data.cifar_c] (CIFAR-10-C/100-C),
[`corruptions`][laplace_debiased.data.corruptions] (generated corruptions),
[`eval_sets`][laplace_debiased.data.eval_sets] (evaluation sets by name) and
[`shards`][laplace_debiased.data.shards] (per-rank shards of a data set).
"""
