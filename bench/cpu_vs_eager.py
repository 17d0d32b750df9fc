"""CPU goal of shared/spec/performance.md: forward+backward of the flashmsa CPU backend (through
the PyTorch op) vs the eager PyTorch implementation of msa.md (flashmsa.reference), same
process, same inputs, same thread count.

    python3 bench/cpu_vs_eager.py [--seqlen 4096] [--repeats 3] [--dtype float32]

Prints both times and the ratio and writes bench/results/cpu_vs_eager_<date>.json.
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import time

import torch

import flashmsa
from flashmsa.reference import msa_reference


def git_commit():
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, capture_output=True, text=True).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def step(attn, inputs, d_o, **kw):
    """One forward+backward; the loss includes the KL so the proxy's backward runs too."""
    for t in inputs:
        t.grad = None
    r = attn(*inputs, **kw)
    loss = (r.out.float() * d_o).sum() + r.kl_loss
    loss.backward()
    return r, [t.grad for t in inputs]


def time_it(fn, repeats):
    fn()  # warm-up (allocator, thread pool)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--Hkv", type=int, default=2)
    ap.add_argument("--Hp", type=int, default=2)
    ap.add_argument("--Hpk", type=int, default=1)
    ap.add_argument("--dim", type=int, default=64, help="D = Dv = Dp")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/...)")
    args = ap.parse_args()

    dtype = getattr(torch, args.dtype)
    B, S, D = args.batch, args.seqlen, args.dim
    gen = torch.Generator().manual_seed(0)
    shapes = ((args.H, D), (args.Hkv, D), (args.Hkv, D), (args.Hp, D), (args.Hpk, D))
    inputs = [torch.randn(B, S, h, d, generator=gen).to(dtype).requires_grad_(True)
              for h, d in shapes]
    d_o = torch.randn(B, S, args.H, D, generator=gen)
    opts = dict(block_size=args.block_size, top_k=args.top_k)

    threads = torch.get_num_threads()
    print(f"shape B={B} S={S} H={args.H} Hkv={args.Hkv} Hp={args.Hp} Hpk={args.Hpk} D={D} "
          f"K={args.top_k} BLK={args.block_size} {args.dtype}; torch threads {threads}")

    # Agreement first (a fast wrong kernel is no result): same selection, outputs close.
    r_op, g_op = step(flashmsa.msa_attention, inputs, d_o, **opts)
    g_op = [g.clone() for g in g_op]
    r_ref, g_ref = step(lambda *a, **k: msa_reference(*a, compute_dtype=torch.float32, **k),
                        inputs, d_o, **opts)

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    same_sel = torch.equal(r_op.block_idx, r_ref.block_idx)
    errs = {"o": rel(r_op.out, r_ref.out), "kl": abs(r_op.kl_loss.item() - r_ref.kl_loss.item())
            / abs(r_ref.kl_loss.item())}
    errs.update({n: rel(a, b) for n, a, b in zip(("dq", "dk", "dv", "dqp", "dkp"), g_op, g_ref)})
    print(f"agreement: selection identical {same_sel}; rel err " +
          ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))

    t_op, all_op = time_it(lambda: step(flashmsa.msa_attention, inputs, d_o, **opts),
                           args.repeats)
    t_ref, all_ref = time_it(
        lambda: step(lambda *a, **k: msa_reference(*a, compute_dtype=torch.float32, **k),
                     inputs, d_o, **opts), args.repeats)
    ratio = t_ref / t_op
    print(f"flashmsa op (CPU backend) fwd+bwd: {t_op * 1e3:9.1f} ms  (median of {args.repeats})")
    print(f"eager PyTorch reference   fwd+bwd: {t_ref * 1e3:9.1f} ms  (median of {args.repeats})")
    print(f"speed-up: {ratio:.2f}x  (goal >= 5x)")

    now = datetime.datetime.now(datetime.timezone.utc)
    record = {
        "benchmark": "cpu_vs_eager",
        "date": now.isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "machine": {"cpu": cpu_name(), "logical_cpus": os.cpu_count(), "torch_threads": threads,
                    "torch": torch.__version__, "python": platform.python_version()},
        "config": {"B": B, "S": S, "H": args.H, "Hkv": args.Hkv, "Hp": args.Hp,
                   "Hpk": args.Hpk, "D": D, "Dv": D, "Dp": D, "K": args.top_k,
                   "BLK": args.block_size, "dtype": args.dtype},
        "op_ms": t_op * 1e3, "op_all_ms": [t * 1e3 for t in all_op],
        "eager_ms": t_ref * 1e3, "eager_all_ms": [t * 1e3 for t in all_ref],
        "speedup": ratio, "goal_speedup": 5.0, "goal_met": ratio >= 5.0,
        "agreement": {"selection_identical": same_sel, **errs},
    }
    path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                    f"cpu_vs_eager_{now.strftime('%Y%m%d_%H%M%S')}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    print("wrote", path)


if __name__ == "__main__":
    main()
