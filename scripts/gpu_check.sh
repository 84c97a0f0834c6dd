#!/usr/bin/env bash
# The GPU check of issue 7, in one go (under 8 minutes on one H200):
#   1. the Triton kernel tests, compiled and run on the GPU (PAGEDSERVE_TEST_DEVICE=cuda);
#   2. the decode-attention microbenchmark: achieved bandwidth against the GPU's peak;
#   3. end to end: output tokens/s of 256 requests on a Llama-3-8B-shaped random model,
#      CUDA graphs on and off (where the engine has them), and the batch-1 decode step against
#      the weight-reading time.
# It uses the Python that is there (PYTHON=..., default python3) with the repo on PYTHONPATH,
# so it needs torch and triton installed; wheels brought along in $WHEELS (default
# shared/wheels) are installed first, offline. Every stage runs under its own timeout and the
# summary at the end says which passed.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
WHEELS=${WHEELS:-shared/wheels}
export PYTHONPATH="$PWD/src:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET

if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "== installing wheels from $WHEELS (offline)"
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" "$WHEELS"/*.whl || true
fi

echo "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" - <<'EOF' || { echo "torch with CUDA and triton are needed"; exit 1; }
import torch, triton
print(f"torch {torch.__version__}, triton {triton.__version__}, cuda {torch.version.cuda}")
assert torch.cuda.is_available(), "no CUDA device"
print(torch.cuda.get_device_name())
EOF

declare -A status
stage() {  # stage NAME SECONDS CMD...
    local name=$1 seconds=$2
    shift 2
    echo
    echo "== $name (limit ${seconds}s)"
    local start=$SECONDS
    timeout "$seconds" "$@"
    local rc=$?
    status[$name]="rc=$rc in $((SECONDS - start))s"
}

stage kernel-tests 150 env PAGEDSERVE_TEST_DEVICE=cuda \
    "$PY" -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py
stage decode-bench 90 "$PY" scripts/bench_decode_attention.py
stage end-to-end 240 "$PY" scripts/gpu_e2e.py

echo
echo "== summary"
for name in kernel-tests decode-bench end-to-end; do
    echo "$name: ${status[$name]}"
done
