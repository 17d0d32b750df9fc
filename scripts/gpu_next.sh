#!/usr/bin/env bash
# The next device call: a full record on main's build (the GPU suite, the 33-test memcheck, the
# PyTorch CUDA tests, the main job, the scale runs, the benchmark over every config).
#   bash scripts/build_gpu_bundle.sh            (here, first)
#   bash scripts/gpu_next.sh                    (device; carry ["scratch-gpu"]; ~8-9 min, so
#   STAGES="tests sanitizer python" and STAGES="main scale bench" split it over two calls)
set -uo pipefail
cd "$(dirname "$0")/.."
exec bash scripts/gpu_check.sh ${STAGES:-tests sanitizer python main scale bench}
