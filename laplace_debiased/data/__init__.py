"""Data sets: embedded digits, CIFAR-10/100, CIFAR-10-C/100-C and generated corruptions.

Everything is served as :class:`ImageDataset` (uint8 storage, normalised float tensors) or, for
the digits, as ``TensorDataset``.  Evaluation sets are chosen with one string through
:func:`resolve_eval_set` (e.g. ``"cifar10-test"``, ``"cifar10-c-generated:3"``).
"""

from ..paths import default_data_root
from .cifar import DataIntegrityError, cifar_splits, load_cifar10, load_cifar100
from .cifar_c import CifarC
from .corruptions import CORRUPTIONS, EXTRA_CORRUPTIONS, corrupt
from .digits import digits_splits, load_digits_tensors
from .eval_sets import SPEC_HELP, resolve_eval_set
from .images import CIFAR10_MEAN, CIFAR10_STD, ImageDataset

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "CORRUPTIONS",
    "EXTRA_CORRUPTIONS",
    "SPEC_HELP",
    "CifarC",
    "DataIntegrityError",
    "ImageDataset",
    "cifar_splits",
    "corrupt",
    "default_data_root",
    "digits_splits",
    "load_cifar10",
    "load_cifar100",
    "load_digits_tensors",
    "resolve_eval_set",
]
