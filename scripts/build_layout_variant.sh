#!/usr/bin/env bash
# A code-layout probe for the wgmma backward (KERNEL=backward, default) or the KV-major forward
# (KERNEL=forward): builds flashmsa_run from the checked-out tree with N `nanosleep 0` instructions
# at the start of the kernel's producer branch (after its setmaxnreg), which moves the producer's
# code N instructions further from the consumers' hot loop and changes nothing else; the source is
# restored afterwards. Prints the loops (start-end offsets) of the m3 fast form of that kernel.
#   [KERNEL=forward] scripts/build_layout_variant.sh N OUT   (OUT: the binary, e.g. ab/run_main_p4)
# Needs cuobjdump (CUOBJDUMP=...; pip's nvidia-cuda-cuobjdump has one).
set -euo pipefail
N=$1 OUT=$2
cd "$(dirname "$0")/.."
BUILD=${BUILD_DIR:-build-gpu}
case ${KERNEL:-backward} in
  backward) SRC=src/cuda/sm90/backward_wgmma.cuh
            ANCHOR='    setmaxnreg_dec<24>();\n    if (steps == 0) return;\n'
            FUN='attn_bwd_wgmma_kernelILb0ELb0ELb0ELi16E' ;;
  forward)  SRC=src/cuda/sm90/forward_kv_wgmma.cu
            ANCHOR='    setmaxnreg_dec<40>();\n    if (threadIdx.x >= 32) return;\n'
            FUN='kvw_fwd_kernelILi16ELNS1_4FormE0E' ;;
  *) echo "KERNEL: backward or forward" >&2; exit 2 ;;
esac
CUOBJDUMP=${CUOBJDUMP:-cuobjdump}
cp "$SRC" "$SRC.orig"
# touch: the restored file must be newer than the padded build, or the next build keeps the pad
trap 'mv "$SRC.orig" "$SRC" && touch "$SRC"' EXIT
python3 - "$SRC" "$N" "$ANCHOR" <<'PY'
import sys
path, n, anchor = sys.argv[1], int(sys.argv[2]), sys.argv[3].replace("\\n", "\n")
s = open(path).read()
assert s.count(anchor) == 1, "producer anchor not found once"
open(path, "w").write(s.replace(anchor, anchor + '    asm volatile("nanosleep.u32 0;");\n' * n, 1))
PY
cmake --build "$BUILD" --target flashmsa_run >/dev/null
mkdir -p "$(dirname "$OUT")"
cp "$BUILD/apps/flashmsa_run" "$OUT"
strip --strip-debug "$OUT"
"$CUOBJDUMP" -sass "$OUT" 2>/dev/null | FUN=$FUN python3 -c '
import os, re, sys
loops, inside = [], False
for line in sys.stdin:
    if "Function : " in line:
        inside = os.environ["FUN"] in line
    if not inside: continue
    m = re.search(r"/\*([0-9a-f]{4,5})\*/\s+(.*BRA[^;]*)", line)
    t = m and re.search(r"(0x[0-9a-f]+)\s*$", m.group(2).strip())
    if t:
        a, b = int(m.group(1), 16), int(t.group(1), 16)
        if b < a and 40 < (a - b) // 16 < 3000: loops.append("%x-%x (%d)" % (b, a, (a - b) // 16))
print("loops (start-end, instructions):", "  ".join(loops))'
