"""The CIFAR-10 headline benchmark (paper Fig. 6) as a package: ``python -m benchmarks.cifar10``."""
