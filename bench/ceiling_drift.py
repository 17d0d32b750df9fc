"""How the bf16 matmul ceiling moves under sustained load on this card (the bench's ceiling).

Runs 8192^3 products for --seconds, timing windows of 20 (median each) back to back, while
nvidia-smi samples the SM clock, power and clock-event reasons every 50 ms. Prints one line per
window: time since start, TFLOP/s, and the last sample's clock / power / reasons.
"""
import argparse
import subprocess
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=8.0)
    args = ap.parse_args()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_event_reasons.active",
                            "--format=csv,noheader,nounits", "-lms", "50"], stdout=subprocess.PIPE, text=True,
                           bufsize=1)
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.time()
    rows = []
    while time.time() - t0 < args.seconds:
        times = []
        for _ in range(20):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            a @ b
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1))
        times.sort()
        rows.append((time.time() - t0, 2 * n**3 / (times[10] * 1e-3) / 1e12))
    smi.terminate()
    samples = [l.strip() for l in smi.stdout.read().splitlines() if l.strip()]
    for i, (t, tf) in enumerate(rows):
        s = samples[min(len(samples) - 1, int(t / 0.05))] if samples else "-"
        if i < 10 or i % 5 == 0 or i == len(rows) - 1:
            print(f"{t:6.2f} s  {tf:6.0f} TFLOP/s   smi: {s}")


if __name__ == "__main__":
    main()
