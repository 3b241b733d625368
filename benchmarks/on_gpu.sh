#!/usr/bin/env bash
# Runs the GPU half of the checks on a machine whose python3 already has torch (and
# torchvision, transformers, accelerate, safetensors, pytest, hypothesis), without touching
# its torch. One step per call keeps each well inside a 10-minute limit:
#
#   bash benchmarks/on_gpu.sh tests      # pytest -m gpu, then the whole suite with CUDA present
#   bash benchmarks/on_gpu.sh paging     # benchmarks/paging.py --gpu-only --write
#   bash benchmarks/on_gpu.sh chunking   # benchmarks/chunking.py --write
#   bash benchmarks/on_gpu.sh loading    # benchmarks/loading.py
#   bash benchmarks/on_gpu.sh lease      # all of it, cut to fit one short lease (below)
#
# 'lease' runs, in the order $STEPS names them (default: recheck tests spill paging chunking
# loading; 'suite' adds the whole test suite on up to 8 workers), each within
# what is left of $BUDGET
# seconds (default 480): tests is pytest -m gpu, spill is spill.py --device cuda (the spill
# tier's CUDA path, which no simulation reaches: autograd is not simulated), paging is
# paging.py --gpu-only, chunking is chunking.py at batches 1, 4 and 16, loading is
# loading.py for the GPT-2 small shape, one round; 'loading-cpu' is loading.py on that host's
# CPU (issue 16's warm target, on a second and larger machine), GPT-2 small and
# large, two rounds; 'loading-threads' is the warm copying load there with the loader's
# pool at 4 and 16 threads, the bandwidth limits measured in the first round only;
# 'pinned' is pinned.py (a paged model's page-locked bytes and page() time, pinned at its
# size against torch's allocator).
# 'recheck' runs the tests named in benchmarks/gpu_recheck.txt (those a GPU run failed,
# changed since without one) in one process. A step that would get under 20 seconds is
# skipped, and says so. Every step writes its log to $OUT, and every failing test its
# traceback to $OUT/failures.txt as it fails (tests/conftest.py), so a step cut short still
# says why. At most 8 files come back: gpu.txt (the machine and the install), failures.txt,
# RESULTS.md and one log per step, 'recheck' and 'tests' sharing tests.log (the default
# lease writes 8). On an H200 host the whole suite took over 360 s
# (2026-11-28; on 15 workers whose torch each ran a thread per core, and about as fast on
# 8): give 'suite' a call of its own, STEPS=suite BUDGET=560.
set -uo pipefail
step=${1:?"which step: tests, paging, chunking, loading or lease"}
out=${OUT:-/tmp/adaptmem-gpu}
mkdir -p "$out"
out=$(cd "$out" && pwd)  # absolute: the script changes directory next
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 ADAPTMEM_FAILURE_LOG="$out/failures.txt"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/adaptmem-site .whl/*.whl
    export PYTHONPATH=/tmp/adaptmem-site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >>"$out/gpu.txt" 2>&1 ||
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import sys, torch; print(sys.version); print('torch', torch.__version__, \
torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
    python3 -c "import adaptmem; from adaptmem import adaptive; print('adaptmem imports')"
} >>"$out/gpu.txt" 2>&1
# The whole suite spreads over up to 8 workers where pytest-xdist is there, each worker's
# torch on its share of the cores (by default each takes every core, and 15 workers on 16
# cores ran no faster than 8). pytest-benchmark (in the GPU image) warns under xdist, and
# this suite makes warnings errors: it is turned off.
suite=(python3 -m pytest -q -rfE -p no:cacheprovider -p no:benchmark)
cores=$(nproc)
workers=$((cores > 8 ? 8 : cores))
if python3 -c "import xdist" 2>/dev/null; then
    suite=(env OMP_NUM_THREADS=$((cores / workers)) "${suite[@]}" -n "$workers")
fi
recheck=()  # node ids, '#' lines and blank ones left out
while IFS= read -r line; do
    case $line in '#'* | '') ;; *) recheck+=("$line") ;; esac
done < <(cat benchmarks/gpu_recheck.txt 2>/dev/null)
status=0
run() {  # run LOG SECONDS COMMAND...: log to $out/LOG, remember the first failure
    local log=$1 seconds=$2
    shift 2
    timeout "$seconds" "$@" 2>&1 | tee -a "$out/$log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}
case $step in
    tests)
        run tests.log 240 python3 -m pytest -q -m gpu -p no:cacheprovider
        run all-tests.log 300 "${suite[@]}"  # the whole suite with CUDA present
        ;;
    paging) run paging.log 560 python3 benchmarks/paging.py --gpu-only --write ;;
    chunking) run chunking.log 560 python3 benchmarks/chunking.py --write ;;
    loading) run loading.log 560 python3 benchmarks/loading.py --timeout 120 ;;
    lease)
        deadline=$((SECONDS + ${BUDGET:-480}))
        within() {  # within LOG SECONDS COMMAND...: run, cut to what is left of the budget
            local log=$1 want=$2 left=$((deadline - SECONDS))
            shift 2
            if [ "$left" -lt 20 ]; then
                echo "skipped $log: ${left}s of the budget left" | tee -a "$out/gpu.txt"
                return
            fi
            run "$log" $((want < left ? want : left)) "$@"
        }
        for part in ${STEPS:-recheck tests spill paging chunking loading}; do
            case $part in
                recheck)  # nothing to recheck: skipped (a bare pytest would run everything)
                    if [ "${#recheck[@]}" -eq 0 ]; then
                        echo "skipped recheck: benchmarks/gpu_recheck.txt names no test" | tee -a "$out/gpu.txt"
                    else
                        within tests.log 180 python3 -m pytest -q -rfE -p no:cacheprovider -p no:benchmark "${recheck[@]}"
                    fi ;;
                tests) within tests.log 150 python3 -m pytest -q -rs -m gpu -p no:cacheprovider ;;
                spill) within spill.log 90 python3 benchmarks/spill.py --device cuda --rounds 3 --write ;;
                paging) within paging.log 180 python3 benchmarks/paging.py --gpu-only --write ;;
                chunking) within chunking.log 120 python3 benchmarks/chunking.py --batches 1,4,16 --write ;;
                loading) within loading.log 150 python3 benchmarks/loading.py --models small --rounds 1 --timeout 60 ;;
                loading-cpu) within loading-cpu.log 300 python3 benchmarks/loading.py --device cpu --models small,large --rounds 2 --timeout 120 ;;
                loading-threads) within loading-threads.log 300 python3 benchmarks/loading.py --device cpu --models small,large --cache warm --rounds 3 --only "(.pt)" --threads 4,16 --limits first --timeout 60 ;;
                pinned) within pinned.log 90 python3 benchmarks/pinned.py --rounds 2 --write ;;
                suite) within all-tests.log 600 "${suite[@]}" ;;
                *) echo "unknown lease part '$part'" | tee -a "$out/gpu.txt" ;;
            esac
        done
        ;;
    *)
        echo "unknown step '$step': tests, paging, chunking, loading or lease" >&2
        exit 2
        ;;
esac
cp benchmarks/RESULTS.md "$out/RESULTS.md"
exit "$status"
