#!/usr/bin/env bash
# One prepared run of every GPU check issue 40 asks for, for a session that is lent a GPU through the device tool.
#
#   bash benchmarks/gpu_session.sh prepare      # here, with the package registry: the peers' wheels into .whl/
#   device run: bash benchmarks/gpu_session.sh run      (carry [".whl"], timeout_s 600)
#
# "run" installs explain (no dependencies: the machine's image has torch, torchvision, timm, opencv, scipy) and the
# carried wheels of the peers and of what the image lacks, then within its 10 minutes: tests/test_cuda.py, the
# per-call overhead next to the peers (benchmarks/overhead.py) and the dataset run (benchmarks/batch_throughput.py),
# each writing its section of benchmarks/RESULTS.md with the card's name. Everything it prints and the updated
# RESULTS.md come back under $OUT (copy RESULTS.md's new sections into the repository's).
set -u
mode=${1:-}
wheels=.whl
if [ "$mode" = prepare ]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    mkdir -p "$wheels"
    # pure-Python wheels (py3-none-any) of the peers the benchmarks call, the versions installed here; --no-deps: the
    # image has their dependencies
    python3 -m pip download --no-deps --only-binary=:all: -d "$wheels" \
        "captum==$(python3 -c 'import captum; print(captum.__version__)')" \
        "torchcam==$(python3 -c 'import importlib.metadata as m; print(m.version("torchcam"))')" \
        "zennit==$(python3 -c 'import importlib.metadata as m; print(m.version("zennit"))')"
    ls -l "$wheels"
    exit 0
fi
if [ "$mode" != run ]; then
    echo "usage: bash benchmarks/gpu_session.sh prepare|run" >&2
    exit 2
fi
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu_session}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))" | tee -a "$out/gpu.txt"
# each step bounded so that the later ones run too; the whole under the device tool's 600 s
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$out/test_cuda.txt"
timeout 240 python3 benchmarks/overhead.py --device cuda --rounds 20 --write 2>&1 | tee "$out/overhead.txt"
timeout 150 python3 benchmarks/batch_throughput.py --device cuda --repeats 2 --write 2>&1 | tee "$out/throughput.txt"
cp benchmarks/RESULTS.md "$out/RESULTS.md"
