"""Data sets: embedded digits, CIFAR-10/100, CIFAR-10-C/100-C and generated corruptions.

Everything is served as :class:`~.images.ImageDataset` (uint8 storage, normalised float tensors)
or, for the digits, as ``TensorDataset``.  Evaluation sets are chosen with one string through
:func:`~.eval_sets.resolve_eval_set` (e.g. ``"cifar10-test"``, ``"cifar10-c-generated:3"``).

Modules: :mod:`.images` (``ImageDataset``, normalisation constants), :mod:`.digits`,
:mod:`.cifar` (CIFAR-10/100 with integrity checks), :mod:`.cifar_c` (CIFAR-10-C/100-C),
:mod:`.corruptions` (generated corruptions), :mod:`.eval_sets` (evaluation sets by name) and
:mod:`.shards` (per-rank shards of a data set).
"""
