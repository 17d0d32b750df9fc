#!/usr/bin/env bash
# The next device session's first call (prepared in the twenty-fifth session): the stages the record at
# 15bdd33 left out (its call ran `main bench` at m3 32k / 64k, then `scale`): the whole GPU suite, the
# 33-test memcheck, the PyTorch CUDA tests and the benchmark over every config (gqa8 and fm16k too).
# Build here first: bash scripts/build_gpu_bundle.sh (-> scratch-gpu/, xz), then carry ["scratch-gpu"].
# ~6.5-8 min; split into `tests sanitizer python` and `bench` if the call's limit is near.
set -uo pipefail
cd "$(dirname "$0")/.."
exec bash scripts/gpu_check.sh ${STAGES:-tests sanitizer python bench}
