#!/usr/bin/env bash
# ALL-CNN-C on one GPU, reduced CIFAR-10 (as benchmarks/results/allcnnc), with the default
# (shrunk) estimate's rows next to the single batch and the paper's debiased K-FAC.
set -uo pipefail
T0=$(date +%s); say() { echo "== $1 (t=$(( $(date +%s) - T0 ))s)"; }
{
say setup
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devrun/wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, laplace, laplace_debiased; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
say "the project's CUDA test"
python3 -m pytest -q -p no:cacheprovider tests/computers/test_batches.py -k cuda || exit 1
say data
python3 .devrun/build_small.py /tmp/cifar || exit 1
} 2>&1 | tee $OUT/setup.log
[ "${PIPESTATUS[0]}" = 0 ] || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
say benchmark | tee -a $OUT/setup.log
timeout ${BENCH_TIMEOUT:-520} python3 -m benchmarks.cifar10 --setting allcnnc --device cuda --threads 8 --data /tmp/cifar \
  --out /tmp/bench --repeats 2 --n-val 500 --n-test 1000 --n-corrupt 100 --n-ood 100 --chunk-size 64 \
  --estimators shrunk 2>&1 | tee $OUT/run.log
say "benchmark exit status ${PIPESTATUS[0]}" | tee -a $OUT/setup.log
cp /tmp/bench/allcnnc/results.md /tmp/bench/allcnnc/results.json $OUT/ 2>/dev/null
cp /tmp/bench/allcnnc/fig6_kron.png $OUT/ 2>/dev/null
ls /tmp/bench/allcnnc/
