"""Single batch against the two-batch K-FAC estimates at equal samples on a BatchNorm ResNet-20 and the
real CIFAR-10 (setting 4 of ``benchmarks/PROTOCOL_V3.md``, run as ``benchmarks/PROTOCOL_V3_RESNET.md``
states). The draws, candidates, reference, predictive and files are those of
``cifar_cnn_estimators.py`` (its :func:`~benchmarks.cifar_cnn_estimators.run`); only the network and
the test set's size differ.

    OMP_NUM_THREADS=1 python benchmarks/resnet20_estimators.py --seeds 70000 70064 \\
        --cache ~/.cache/laplace-debiased-study/v3-resnet20 [--data DIR] [--batch-sizes 512]

The MAP: ``resnet20_w8`` (ResNet-20 with BatchNorm after every convolution, channels 8 / 16 / 32,
68,786 weights), the MAP of ``benchmarks/normalisation.py``: ``python -m benchmarks.cifar10.train
--model resnet20_w8 --n-train 10000 --epochs 30`` (trained here when its cache has no model). K-FAC
blocks for the convolutions and the linear head and one dense GGN block per BatchNorm layer, as
``DebiasedKronLaplace`` fits them. The test set: 1,000 images, the first of the permutation that
``cifar_cnn_estimators.py`` takes its 2,000 from.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.cifar_cnn_estimators import run  # noqa: E402
from benchmarks.normalisation import MAP  # noqa: E402

N_TEST = 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs=2, required=True, metavar=("FIRST", "STOP"),
                        help="the draws' seeds, range(FIRST, STOP)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[512])
    parser.add_argument("--cache", type=Path, required=True, help="one JSON per draw (resumes)")
    parser.add_argument("--data", default=None, help="CIFAR-10 root (benchmarks/cifar10/data.py)")
    args = parser.parse_args(argv)
    run(list(range(*args.seeds)), args.batch_sizes, args.cache.expanduser(), args.data, MAP, N_TEST)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
