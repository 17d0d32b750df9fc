#!/usr/bin/env python3
"""Summarise ncu's SASS page (scripts/gpu_stalls.sh: NAME_sass.csv): total stall samples, the
instructions holding the most with their main reasons, and the share of samples on waits:
mbarrier try-wait spins (the branch after SYNCS.PHASECHK...TRYWAIT) and the instruction after each
named-barrier BAR.SYNC (its barrier stall is charged to the next instruction).
Usage: sass_stalls.py FILE.csv [TOP]"""
import csv
import sys


def main() -> None:
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 15
    rows = list(csv.reader(open(path)))
    hdr = next(r for r in rows if "Address" in r and "Source" in r)
    data = [r for r in rows[rows.index(hdr) + 1:] if len(r) == len(hdr)]
    i_src, i_all = hdr.index("Source"), hdr.index("Warp Stall Sampling (All Samples)")
    i_exec = hdr.index("Instructions Executed")
    reasons = [i for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
    num = lambda x: float(x.replace(",", "") or 0)
    total = sum(num(r[i_all]) for r in data)
    print(f"{path}: {total:.0f} samples over {len(data)} instructions")
    for r in sorted(data, key=lambda r: -num(r[i_all]))[:top]:
        n_all = max(num(r[i_all]), 1)
        why = sorted(((num(r[i]), hdr[i][6:]) for i in reasons), reverse=True)
        named = sum(n for n, _ in why)  # the CSV names no reason for some samples (e.g. HGMMA's)
        print(f"  {100 * num(r[i_all]) / total:5.1f}%  {r[i_src].strip()[:64]:64s} "
              + ", ".join(f"{w} {n / n_all:.0%}" for n, w in why[:2] if n > 0)
              + (f", unnamed {1 - named / n_all:.0%}" if named < 0.9 * n_all else "")
              + f"  (executed {r[i_exec]})")
    spins = bars = 0.0
    for k, r in enumerate(data[:-1]):
        src = r[i_src]
        if "TRYWAIT" in src:
            spins += num(data[k + 1][i_all])
        if "BAR.SYNC" in src and "0x0" not in src.split("BAR.SYNC")[1][:20]:
            bars += num(data[k + 1][i_all])
    print(f"  try-wait spins {100 * spins / total:.1f}%, after named barriers {100 * bars / total:.1f}% of all samples")


if __name__ == "__main__":
    main()
