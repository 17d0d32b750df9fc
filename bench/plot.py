"""Plots a bench_gpu.py JSON: training-step time vs sequence length, flashmsa against its peers.

Usage: python bench/plot.py bench/results/<run>.json [--out bench/results/<run>.png]
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def value(run: dict, key: str):
    """run[key], or run[a][b] for key 'a.b'; None when absent."""
    for part in key.split("."):
        if not isinstance(run, dict) or part not in run:
            return None
        run = run[part]
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--out")
    args = ap.parse_args()
    with open(args.json) as fh:
        res = json.load(fh)
    configs = sorted({r["config"] for r in res["runs"]})
    fig, axes = plt.subplots(1, len(configs), figsize=(5.5 * len(configs), 4.2), squeeze=False)
    series = [
        ("flashmsa_step_ms", "flashmsa op step (select+fwd+KL, bwd)", "o-"),
        ("cpp_phases.step_ms", "flashmsa C++ API step (select+fwd, bwd+KL)", "D-"),
        ("ideal_step_ms", "ideal (FLOPs / measured matmul rate)", "k:"),
        ("cudnn_fwdbwd_ms", "dense SDPA cuDNN fwd+bwd", "s--"),
        ("flex_fwdbwd_ms", "FlexAttention per-token fwd+bwd", "^--"),
    ]
    for ax, name in zip(axes[0], configs):
        runs = sorted((r for r in res["runs"] if r["config"] == name), key=lambda r: r["S"])
        for key, label, style in series:
            pts = [(r["S"], value(r, key)) for r in runs if value(r, key) is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
        r0 = runs[0]
        ax.set_title(f"{name}: H={r0['H']} Hkv={r0['Hkv']} Hp={r0['Hp']} D={r0['D']} K={r0['K']}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("ms (median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{res['card']}, commit {res['commit'][:10]}, {res['date']}, "
                 f"matmul ceiling {res['ceiling_tflops']:.0f} TFLOP/s", fontsize=9)
    fig.tight_layout()
    out = args.out or args.json.replace(".json", ".png")
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
