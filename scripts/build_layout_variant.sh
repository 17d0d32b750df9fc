#!/usr/bin/env bash
# A code-layout probe for the wgmma backward: builds flashmsa_run from the checked-out tree with N
# `nanosleep 0` instructions at the start of the producer's branch (after its setmaxnreg), which
# moves the producer's code N instructions further from the consumers' hot loop and changes
# nothing else; the source is restored afterwards. Prints the loops' offsets in the m3 fast form
# (attn_bwd_wgmma_kernel<0,0,0,16>): hot loop first, the producer's step loops after.
#   scripts/build_layout_variant.sh N OUT   (OUT: where the binary goes, e.g. ab/run_main_p4)
# Needs cuobjdump (CUOBJDUMP=...; pip's nvidia-cuda-cuobjdump has one).
set -euo pipefail
N=$1 OUT=$2
cd "$(dirname "$0")/.."
BUILD=${BUILD_DIR:-build-gpu}
SRC=src/cuda/sm90/backward_wgmma.cuh
CUOBJDUMP=${CUOBJDUMP:-cuobjdump}
cp "$SRC" "$SRC.orig"
# touch: the restored file must be newer than the padded build, or the next build keeps the pad
trap 'mv "$SRC.orig" "$SRC" && touch "$SRC"' EXIT
python3 - "$SRC" "$N" <<'PY'
import sys
path, n = sys.argv[1], int(sys.argv[2])
s = open(path).read()
anchor = "    setmaxnreg_dec<24>();\n    if (steps == 0) return;\n"
assert s.count(anchor) == 1, "producer anchor not found once"
open(path, "w").write(s.replace(anchor, anchor + '    asm volatile("nanosleep.u32 0;");\n' * n, 1))
PY
cmake --build "$BUILD" --target flashmsa_run >/dev/null
mkdir -p "$(dirname "$OUT")"
cp "$BUILD/apps/flashmsa_run" "$OUT"
strip --strip-debug "$OUT"
F='_ZN8flashmsa4cuda3bwd21attn_bwd_wgmma_kernelILb0ELb0ELb0ELi16EEEvPK13__nv_bfloat16S5_S5_S5_PKfS7_NS1_5IndexEiiifPfPS3_SA_NS1_8FoldArgsES7_PvSC_'
"$CUOBJDUMP" -sass -fun "$F" "$OUT" 2>/dev/null | python3 -c '
import re, sys
loops = []
for line in sys.stdin:
    m = re.search(r"/\*([0-9a-f]{4,5})\*/\s+(.*BRA[^;]*)", line)
    t = m and re.search(r"(0x[0-9a-f]+)\s*$", m.group(2).strip())
    if t:
        a, b = int(m.group(1), 16), int(t.group(1), 16)
        if b < a and 40 < (a - b) // 16 < 3000: loops.append("%x-%x (%d)" % (b, a, (a - b) // 16))
print("loops (start-end, instructions):", "  ".join(loops))'
