#!/usr/bin/env python3
"""How skewed a selection flashmsa_run's inputs make (host only, numpy): one proxy head, N(0, 1) qp / kp,
with --sink-blocks 1 as flashmsa_run makes it (+12 on every token's qp[0] and on the sink keys' kp[0]),
blocks picked as select_blocks picks them (model_list_pieces.lists_from_proxy). Prints how many blocks
most later tokens pick and the longest lists in the last token chunk (the backward's CTAs of one chunk
walk those lists; see docs/perf-notes.md, sixtieth session).
  python3 scripts/count_hot_blocks.py --seqlen 32768 --sink-blocks 1"""
import argparse

import numpy as np

from model_list_pieces import lists_from_proxy, proxy_keys

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--seqlen", type=int, default=32768)
ap.add_argument("--sink-blocks", type=int, default=1)
ap.add_argument("--top-k", type=int, default=16)
ap.add_argument("--chunk", type=int, default=4096, help="tokens of the last chunk whose lists are counted")
a = ap.parse_args()
T = a.seqlen
lists = lists_from_proxy(T, a.top_k, a.sink_blocks > 0, np.random.default_rng(1), proxy_keys(T, a.sink_blocks))
NB = len(lists)
frac = np.array([len(l) for l in lists]) / np.maximum(T - np.arange(NB) * 128, 1)
last = sorted((int(np.count_nonzero(l >= T - a.chunk)) for l in lists), reverse=True)
print(f"T {T}, sink blocks {a.sink_blocks}: blocks picked by > 25% / 50% / 90% of the later tokens: "
      f"{(frac > 0.25).sum()} / {(frac > 0.5).sum()} / {(frac > 0.9).sum()}")
print(f"last {a.chunk}-token chunk, longest lists (tokens):", last[:16])
