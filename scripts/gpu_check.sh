#!/usr/bin/env bash
# The cupy backend on a real GPU, in one run of at most ~8 minutes on a fresh machine with one
# H100 (80 GB) or H200, 16 cores and the package registries only (no other downloads):
#
#   1. installs the package with its CUDA extra (cupy-cuda12x) into a fresh virtual environment;
#   2. runs the backend conformance suite, the cupy tests and every CUDA kernel test on the device
#      (tests/test_cuda_kernels.py and test_cuda_mma.py compare each kernel with the NumPy
#      reference there too: the int8 mma's fragment layout meets the hardware's here first);
#   3. synthesizes a real-width file of 6 layers with the real mix of compression ratios
#      (ds4-gguf synth --preset flash --layers 6), and the layout of the 43-layer model;
#   4. measures the HBM read floor (a read kernel over 4 GiB, best of 10) and runs
#      ds4-bench --backend cupy --peer cpu (a 2048-token prefill, then 32 decoded tokens);
#   5. times the expert kernels at Flash's widths (scripts/cuda_kernel_bench.py: decode GB/s
#      against the floor, prefill TOP/s of ds4's int8 tensor-core GEMM beside the FMA tiles, and
#      ds4_gemm == ds4_matvec bit for bit at full size), and the 6-layer decode with the MoE CUDA
#      graphs and without (logits bit for bit, both rates);
#   6. prints decode and prefill beside the floor, extrapolated to 43 layers.
# Every check prints "ok" or MISMATCH/FAILED/SHORT; the summary at the end lists the failures.
#
# Usage: scripts/gpu_check.sh [WORKDIR]   (default /tmp/ds4-gpu-check; the output also goes to
# WORKDIR/gpu_check.log, and into $OUT when that is set). Environment: PYTHON (default python3),
# LAYERS (6), RECIPE (q2), SKIP_INSTALL=1 (use the active environment), SKIP_TESTS=1.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${1:-/tmp/ds4-gpu-check}
PYTHON=${PYTHON:-python3}
LAYERS=${LAYERS:-6}
RECIPE=${RECIPE:-q2}
mkdir -p "$WORK"
LOG="$WORK/gpu_check.log"
exec > >(tee "$LOG") 2>&1
T0=$(date +%s)
step() { echo; echo "== [$(( $(date +%s) - T0 )) s] $*"; }
FAILED=()
check() { local what=$1; shift; if "$@"; then echo "$what: ok"; else echo "$what: FAILED (rc $?)"; FAILED+=("$what"); fi; }

step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi not found"
nproc
command -v g++ >/dev/null || echo "no g++: the emulation-only tests skip; the kernel comparisons still run on the device"

if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then
    step "install: pip install -e '.[cuda,test]' into $WORK/venv"
    "$PYTHON" -m venv "$WORK/venv"
    # shellcheck disable=SC1091
    source "$WORK/venv/bin/activate"
    python -m pip install -q --upgrade pip
    python -m pip install -q -e "${ROOT}[cuda,test]"
fi
cd "$ROOT"
python - <<'EOF'
import cupy
p = cupy.cuda.runtime.getDeviceProperties(0)
print(f"cupy {cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, "
      f"{p['name'].decode()} sm_{p['major']}{p['minor']}, {p['totalGlobalMem'] / 2**30:.1f} GiB")
EOF
python -c "from engine.backends import registry as R; print(R.describe('cupy')); assert R.pick('auto').name == 'cupy'"

if [[ "${SKIP_TESTS:-0}" != 1 ]]; then
    step "conformance suite, cupy tests and the CUDA kernels' tests on the device"
    check "tests on the device" timeout 240 python -m pytest -q -p no:cacheprovider -k cupy \
        tests/test_backend_conformance.py tests/test_cupy_backend.py tests/test_cupy_ds4.py \
        tests/test_cupy_graphs.py tests/test_cuda_kernels.py tests/test_cuda_mma.py tests/test_cuda_compress.py
fi

step "synthesize: $LAYERS real-width layers ($RECIPE), and the 43-layer layout (sparse, no data)"
SMALL="$WORK/flash-$LAYERS-$RECIPE.gguf"
FULL="$WORK/flash-43-layout.gguf"
[[ -f "$SMALL" ]] || ds4-gguf synth --preset flash --layers "$LAYERS" --recipe "$RECIPE" "$SMALL"
[[ -f "$FULL" ]] || ds4-gguf synth --preset flash --layers 43 --recipe "$RECIPE" --fill zero "$FULL"
ls -l "$SMALL"

step "HBM read floor (4 GiB, best of 10)"
FLOOR=$(python - <<'EOF'
import cupy
src = r'''
extern "C" __global__ void read_sum(const float4* __restrict__ a, long long n, float* out) {
    float s = 0.f;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float4 v = a[i]; s += v.x + v.y + v.z + v.w;
    }
    if (s == 1234.5f) out[0] = s;       // (never true: keeps the reads)
}'''
k = cupy.RawKernel(src, "read_sum")
n = (4 << 30) // 16
a, out = cupy.ones(n * 4, dtype=cupy.float32), cupy.zeros(1, dtype=cupy.float32)
sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
best = float("inf")
for _ in range(11):
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    e0.record(); k((sms * 8,), (512,), (a, cupy.int64(n), out)); e1.record(); e1.synchronize()
    best = min(best, cupy.cuda.get_elapsed_time(e0, e1) / 1e3)
print(f"{a.nbytes / best:.6e}")
EOF
)
echo "HBM read floor: $(python -c "print(f'{$FLOOR / 1e9:.0f}')") GB/s"

step "expert kernels at Flash's widths (decode GB/s, prefill TOP/s, ds4_gemm == ds4_matvec)"
check "kernel bench" timeout 120 python scripts/cuda_kernel_bench.py --tokens 2048 --floor "$FLOOR"

step "decode of the $LAYERS-layer file with the MoE CUDA graphs and without"
check "graphs" timeout 180 python scripts/cuda_kernel_bench.py --graphs "$SMALL" --graph-tokens 32

step "ds4-bench --backend cupy --peer cpu: 2048-token prefill, 32 decoded tokens"
check "ds4-bench" timeout 300 ds4-bench -m "$SMALL" --backend cupy --peer cpu --ctx-start 2048 --ctx-max 2048 \
    --gen-tokens 32 --csv "$WORK/bench.csv"
[[ -f "$WORK/bench.csv" ]] && cat "$WORK/bench.csv"

step "against the floor, extrapolated to 43 layers"
[[ -f "$WORK/bench.csv" ]] && python - "$SMALL" "$FULL" "$WORK/bench.csv" "$FLOOR" <<'EOF'
import csv
import sys

from engine.bench import flops_per_token
from engine.gguf.inspect import report
from engine.gguf.model_file import ModelFile

small, full, table, floor = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
cost = {}
for name, path in (("small", small), ("full", full)):
    with ModelFile.open(path) as m:
        cost[name] = (report(m)["bytes_per_token"]["short"], flops_per_token(m), m.config.n_layer)
rows = {r["backend"]: r for r in csv.DictReader(open(table))}
(b_s, f_s, n_s), (b_f, f_f, n_f) = cost["small"], cost["full"]
for be, r in rows.items():
    dec, pre = float(r["gen_tps"]), float(r["prefill_tps"])
    gbs = b_s * dec                                   # weight bytes read per second while decoding
    print(f"{be}: {n_s} layers: decode {dec:.1f} t/s ({gbs / 1e9:.0f} GB/s of weights, {gbs / floor:.0%} of "
          f"the {floor / 1e9:.0f} GB/s HBM floor), prefill {pre:.0f} t/s ({f_s * pre / 1e12:.1f} TFLOP/s)")
    # the same efficiency on the 43-layer model: decode reads b_f bytes a token, prefill does f_f FLOPs
    print(f"{be}: {n_f} layers (extrapolated): decode {gbs / b_f:.1f} t/s (floor {floor / b_f:.1f} t/s), "
          f"prefill {pre * f_s / f_f:.0f} t/s")
r = rows.get("cupy")
if r is not None:
    dec_frac = b_s * float(r["gen_tps"]) / floor
    pre43 = float(r["prefill_tps"]) * f_s / f_f
    print(f"acceptance: decode {dec_frac:.0%} of the read floor (target >= 50 %): "
          f"{'ok' if dec_frac >= 0.5 else 'SHORT'}; prefill at 43 layers {pre43:.0f} t/s "
          f"(target >= 5000): {'ok' if pre43 >= 5000 else 'SHORT'}")
EOF
step "done"
if (( ${#FAILED[@]} )); then echo "FAILED: ${FAILED[*]}"; else echo "all checks ok"; fi
if [[ -n "${OUT:-}" ]]; then cp "$LOG" "$WORK/bench.csv" "$OUT/" 2>/dev/null || true; fi
(( ${#FAILED[@]} == 0 ))    # exit status: 1 when a check failed
