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
out=$(cd "$out" && pwd)  # absolute: the script changes directory next
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/adaptmem-site .whl/*.whl
    export PYTHONPATH=/tmp/adaptmem-site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 ||
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.txt" 2>&1
status=0
run() {  # run LOG SECONDS COMMAND...: log to $out/LOG, remember the first failure
    local log=$1 seconds=$2
    shift 2
    timeout "$seconds" "$@" 2>&1 | tee "$out/$log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}
case $step in
    tests)
        run gpu-tests.log 240 python3 -m pytest -q -m gpu -p no:cacheprovider
        parallel=()  # the whole suite with CUDA present; pytest-xdist spreads it when there
        if python3 -c "import xdist" 2>/dev/null; then parallel=(-n 8); fi
        run all-tests.log 300 python3 -m pytest -q -p no:cacheprovider "${parallel[@]}"
        ;;
    paging) run paging.log 560 python3 benchmarks/paging.py --gpu-only --write ;;
    chunking) run chunking.log 560 python3 benchmarks/chunking.py --write ;;
    loading) run loading.log 560 python3 benchmarks/loading.py --timeout 120 ;;
    *)
        echo "unknown step '$step': tests, paging, chunking or loading" >&2
        exit 2
        ;;
esac
cp benchmarks/RESULTS.md "$out/RESULTS.md"
exit "$status"
