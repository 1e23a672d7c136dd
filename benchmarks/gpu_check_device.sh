#!/bin/sh
# On a lent GPU machine (the device tool's `run`, carrying .whl): the wheels of
# benchmarks/gpu_check_wheels.sh installed beside the image's packages, an `llmctl` launcher
# beside its python3 (the server tests start `llmctl serve`; the tree itself is put on the import
# path by gpu_check.py), then the check, its JSON and log into $OUT (or DIR).
#   sh benchmarks/gpu_check_device.sh [DIR] [BUDGET_S] [gpu_check.py's options, e.g. --stages cuda_tests]
set -u
out=${1:-${OUT:-gpu-check-results}}
budget=${2:-420}
[ $# -ge 2 ] && shift 2 || shift $#
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/llmctl-site .whl/*.whl && export PYTHONPATH=/tmp/llmctl-site
fi
bin=$(python3 -c 'import os, sys; print(os.path.dirname(sys.executable))')
if [ ! -e "$bin/llmctl" ]; then
    printf '#!%s\nimport sys\nfrom llmctl.cli.main import main\nsys.exit(main())\n' \
        "$bin/python3" > "$bin/llmctl" && chmod +x "$bin/llmctl"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
timeout $((budget + 40)) python3 benchmarks/gpu_check.py --out "$out" --budget "$budget" "$@"
