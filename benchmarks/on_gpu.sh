#!/usr/bin/env bash
# Runs the GPU half of the checks on a machine whose python3 already has torch (and
# torchvision, transformers, accelerate, safetensors, pytest, hypothesis), without touching
# its torch. One step per call keeps each well inside a 10-minute limit:
#
#   bash benchmarks/on_gpu.sh tests      # pytest -m gpu, then the whole suite with CUDA present
#   bash benchmarks/on_gpu.sh paging     # benchmarks/paging.py --gpu-only --write
#   bash benchmarks/on_gpu.sh chunking   # benchmarks/chunking.py --write
#   bash benchmarks/on_gpu.sh loading    # benchmarks/loading.py
#
# Logs and the updated RESULTS.md go to $OUT (default /tmp/adaptmem-gpu). toma and
# pytorch-optimem, the rivals the benchmarks compare against, are pure-Python wheels: put them
# in .whl/ (pip download --no-deps toma pytorch-optimem -d .whl) and they are installed first;
# without them the rivals' rows say they are missing.
set -uo pipefail
step=${1:?"which step: tests, paging, chunking or loading"}
out=${OUT:-/tmp/adaptmem-gpu}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/adaptmem-site .whl/*.whl
    export PYTHONPATH=/tmp/adaptmem-site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 ||
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.txt" 2>&1
case $step in
    tests)
        timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider 2>&1 | tee "$out/gpu-tests.log"
        timeout 300 python3 -m pytest -q -p no:cacheprovider -n 8 2>&1 | tee "$out/all-tests.log"
        ;;
    paging)
        timeout 560 python3 benchmarks/paging.py --gpu-only --write 2>&1 | tee "$out/paging.log"
        ;;
    chunking)
        timeout 560 python3 benchmarks/chunking.py --write 2>&1 | tee "$out/chunking.log"
        ;;
    loading)
        timeout 560 python3 benchmarks/loading.py --timeout 120 2>&1 | tee "$out/loading.log"
        ;;
    *)
        echo "unknown step '$step': tests, paging, chunking or loading" >&2
        exit 2
        ;;
esac
status=${PIPESTATUS[0]}
cp benchmarks/RESULTS.md "$out/RESULTS.md"
exit "$status"
