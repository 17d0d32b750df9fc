#!/usr/bin/env python3
"""How skewed a selection flashmsa_run's inputs make (host only, numpy): one proxy head, N(0, 1) qp / kp,
with --sink-blocks 1 as flashmsa_run makes it (+12 on every token's qp[0] and on the sink keys' kp[0]),
blocks picked as select_blocks picks them (causal block max of qp.kp, the own block always, top K).
Prints how many blocks most later tokens pick and the longest lists in the last token chunk (the
backward's CTAs of one chunk walk those lists; see docs/perf-notes.md, sixtieth session).
  python3 scripts/count_hot_blocks.py --seqlen 32768 --sink-blocks 1"""
import argparse
from collections import Counter

import numpy as np

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--seqlen", type=int, default=32768)
ap.add_argument("--sink-blocks", type=int, default=1)
ap.add_argument("--top-k", type=int, default=16)
ap.add_argument("--chunk", type=int, default=4096, help="tokens of the last chunk whose lists are counted")
a = ap.parse_args()
T, D, K, B = a.seqlen, 128, a.top_k, 128
rng = np.random.default_rng(0)
qp = rng.standard_normal((T, D)).astype(np.float32)
kp = rng.standard_normal((T, D)).astype(np.float32)
if a.sink_blocks:
    qp[:, 0] += 12
    kp[: B * a.sink_blocks, 0] += 12
NB = (T + B - 1) // B
picks = np.zeros(NB, int)
last_chunk = Counter()
for t0 in range(0, T, 512):
    rows = np.arange(t0, min(T, t0 + 512))
    nb = rows[-1] // B + 1
    s = qp[rows] @ kp[: nb * B].T
    s[np.arange(nb * B)[None, :] > rows[:, None]] = -np.inf
    best = s.reshape(len(rows), nb, B).max(2)
    best[np.arange(len(rows)), rows // B] = np.inf  # the own block, always kept
    kk = min(K, nb)
    top = np.argpartition(-best, kk - 1, axis=1)[:, :kk]
    for i, t in enumerate(rows):
        picks[top[i]] += 1
        if t >= T - a.chunk:
            last_chunk.update(top[i].tolist())
frac = picks / np.maximum(T - np.arange(NB) * B, 1)
print(f"T {T}, sink blocks {a.sink_blocks}: blocks picked by > 25% / 50% / 90% of the later tokens: "
      f"{(frac > 0.25).sum()} / {(frac > 0.5).sum()} / {(frac > 0.9).sum()}")
print(f"last {a.chunk}-token chunk, longest lists (tokens):", sorted(last_chunk.values(), reverse=True)[:16])
