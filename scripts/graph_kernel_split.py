"""Per-kernel GPU time inside and outside CUDA graphs, from an nsys SQLite export.

scripts/gpu_graph_probe.sh profiles `flashmsa_run --graph` (eager steps, then graph replays
alternating with the same step launched on one stream) with --cuda-graph-trace=node, so every
kernel of a replay is its own record with a graph node id. Prints, per kernel name, the mean
duration outside and inside graphs and the difference per step.
"""
import argparse
import sqlite3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sqlite")
    args = ap.parse_args()
    db = sqlite3.connect(args.sqlite)
    cols = [r[1] for r in db.execute("PRAGMA table_info(CUPTI_ACTIVITY_KIND_KERNEL)")]
    node = "graphNodeId" if "graphNodeId" in cols else None
    name_col = "shortName" if "shortName" in cols else "demangledName"
    sel = f"SELECT s.value, k.end - k.start, {('k.' + node) if node else '0'} FROM CUPTI_ACTIVITY_KIND_KERNEL k " \
          f"JOIN StringIds s ON s.id = k.{name_col}"
    per = {}
    for name, dur, gid in db.execute(sel):
        key = (name, bool(gid))
        n, t = per.get(key, (0, 0))
        per[key] = (n + 1, t + dur)
    graph_launches = sum(n for (name, g), (n, t) in per.items() if g)
    print(f"columns: graph node column {node!r}; kernel records inside graphs: {graph_launches}")
    names = sorted({k[0] for k in per}, key=lambda x: -per.get((x, False), (0, 0))[1])
    print(f"{'kernel':48s} {'n out':>6s} {'us out':>10s} {'n in':>6s} {'us in':>10s} {'in/out':>7s}")
    for nm in names:
        no, to = per.get((nm, False), (0, 0))
        ni, ti = per.get((nm, True), (0, 0))
        mo = to / no / 1e3 if no else float("nan")
        mi = ti / ni / 1e3 if ni else float("nan")
        print(f"{nm[:48]:48s} {no:6d} {mo:10.1f} {ni:6d} {mi:10.1f} {mi / mo if no and ni else float('nan'):7.3f}")


if __name__ == "__main__":
    main()
