"""Per-kernel GPU time of one training step from an ncu CSV (scripts/gpu_kernel_times.sh).

ncu --metrics gpu__time_duration.sum --csv lists every launch of the run in order; the run is
`--steps` identical steps, so the last 1/steps of the launches is the last step. Prints the time
per kernel name (in first-launch order) and the sum, in milliseconds.
"""
import argparse
import csv
import re


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--steps", type=int, default=3, help="steps the run made (flashmsa_run --iters 1: 3)")
    args = ap.parse_args()
    launches = []
    with open(args.csv) as fh:
        for row in csv.reader(fh):
            if len(row) < 15 or not row[0].isdigit():
                continue  # ncu's own lines, the header
            name = re.sub(r"\(.*", "", row[4]).replace("void ", "")
            name = re.sub(r"flashmsa::|cuda::|<unnamed>::", "", name)
            launches.append((name, float(row[-1].replace(",", "")) / 1e6))  # ns -> ms
    last = launches[len(launches) - len(launches) // args.steps:]
    per = {}
    for name, ms in last:
        total, count = per.get(name, (0.0, 0))
        per[name] = (total + ms, count + 1)
    print(f"{len(launches)} launches, last step {len(last)}")
    for name, (ms, count) in per.items():
        print(f"{ms:9.3f} ms  x{count:4d}  {name[:90]}")
    print(f"{sum(ms for ms, _ in per.values()):9.3f} ms  total (serialised)")


if __name__ == "__main__":
    main()
