"""Kernel timeline of one MSA training step on the GPU, from torch.profiler (CUPTI).

ncu serialises launches, so it cannot say what overlaps; this records every kernel and memset of
the last of a few steps (selection + forward + backward through the PyTorch op, the KL value
from the backward via kl_value_out) with its stream, start and end, and prints them in start
order with the time the GPU ran nothing inside the step.

Usage: python bench/timeline.py [--seqlen 65536] [--heads 64 --kv-heads 4] [--json out.json]
"""
import argparse
import json
import os
import re
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

import flashmsa


def short(name: str) -> str:
    name = re.sub(r"flashmsa::|cuda::|<unnamed>::|\(anonymous namespace\)::", "", name)
    return re.sub(r"\(.*", "", name).replace("void ", "")[:70]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--proxy-heads", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not flashmsa.cuda_built():
        raise SystemExit("bench/timeline.py: needs a CUDA device and flashmsa built with CUDA")
    if args.steps < 1:
        raise SystemExit("bench/timeline.py: --steps must be >= 1")
    S, H, Hkv, Hp, D = args.seqlen, args.heads, args.kv_heads, args.proxy_heads, 128
    bf = torch.bfloat16
    torch.manual_seed(0)
    q = torch.randn(S, H, D, device="cuda", dtype=bf, requires_grad=True)
    k = torch.randn(S, Hkv, D, device="cuda", dtype=bf, requires_grad=True)
    v = torch.randn(S, Hkv, D, device="cuda", dtype=bf, requires_grad=True)
    qp = torch.randn(S, Hp, D, device="cuda", dtype=bf, requires_grad=True)
    kp = torch.randn(S, 1, D, device="cuda", dtype=bf, requires_grad=True)
    d_o = torch.randn(S, H, D, device="cuda", dtype=bf)
    kl = torch.zeros(1, device="cuda", dtype=torch.float32)
    cu = [0, S]

    def step() -> None:
        for t in (q, k, v, qp, kp):
            t.grad = None  # no gradient-accumulation kernels in the timeline
        out = flashmsa.msa_attention(q, k, v, qp, kp, cu, kl_value_out=kl)
        torch.autograd.backward([out.out, out.kl_loss], [d_o, torch.ones_like(out.kl_loss)])

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            trace = json.load(fh)["traceEvents"]
    rows = [{"name": short(e["name"]), "cat": e["cat"], "stream": e.get("args", {}).get("stream"),
             "start": float(e["ts"]), "end": float(e["ts"]) + float(e.get("dur", 0))}
            for e in trace if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")]
    rows.sort(key=lambda r: r["start"])
    # The steps are identical: the last 1 / steps of the activities are the last step's.
    rows = rows[len(rows) - len(rows) // args.steps:]
    t0 = rows[0]["start"]
    busy_end, idle = t0, 0.0
    print(f"{len(rows)} GPU activities in the last step (S={S}, H={H}, Hkv={Hkv}, Hp={Hp}); ms from its first")
    print(f"{'start':>9} {'end':>9} {'dur':>8} {'idle':>7} {'stream':>6}  activity")
    for r in rows:
        gap = max(0.0, r["start"] - busy_end)
        idle += gap
        busy_end = max(busy_end, r["end"])
        print(f"{(r['start'] - t0) / 1e3:9.3f} {(r['end'] - t0) / 1e3:9.3f} {(r['end'] - r['start']) / 1e3:8.3f} "
              f"{gap / 1e3:7.3f} {str(r['stream']):>6}  {r['name']}")
    span = (busy_end - t0) / 1e3
    print(f"step span {span:.3f} ms, GPU idle {idle / 1e3:.3f} ms inside it")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"S": S, "H": H, "Hkv": Hkv, "Hp": Hp, "span_ms": span, "idle_ms": idle / 1e3,
                       "activities": [{**r, "start": (r["start"] - t0) / 1e3, "end": (r["end"] - t0) / 1e3}
                                      for r in rows]}, fh, indent=1)


if __name__ == "__main__":
    main()
