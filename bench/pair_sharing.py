# How often do the tokens of one 64-row token tile (m = 16: 4 tokens x 16 heads) of a key block's
# list share a second selected block? A forward or backward that summed two key blocks per CTA
# before its fp32 reduce-add (docs/design.md, "fewer fp32 reduce-adds") saves one add per token
# only where a whole tile shares the pair. Inputs as the benchmark's: N(0, 1) qp, kp (Hpk = 1),
# the m3 selection (Hp = 4, Dp = 128, BLK = 128, K = 16, own block always kept), fp32 scores.
# CPU only (numpy): python3 bench/pair_sharing.py 32768   (~1 min at 32k, ~5 at 64k on 2 cores)
import sys

import numpy as np

T = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
HP, D, BLK, K, TILE_TOKENS = 4, 128, 128, 16, 4
nb = (T + BLK - 1) // BLK
rng = np.random.default_rng(1)
kp = rng.standard_normal((T, D), dtype=np.float32)
for p in range(HP):
    qp = rng.standard_normal((T, D), dtype=np.float32)
    sel = np.zeros((T, nb), dtype=bool)
    for r0 in range(0, T, 1024):
        r1 = min(T, r0 + 1024)
        s = qp[r0:r1] @ kp.T
        s[np.arange(T)[None, :] > np.arange(r0, r1)[:, None]] = -np.inf  # causal
        if T % BLK:
            s = np.pad(s, ((0, 0), (0, nb * BLK - T)), constant_values=-np.inf)
        block_max = s.reshape(r1 - r0, nb, BLK).max(axis=2)
        own = np.arange(r0, r1) // BLK
        block_max[np.arange(r1 - r0), own] = np.inf  # the own block is always kept
        order = np.argsort(-block_max, axis=1)
        for i in range(r1 - r0):
            sel[r0 + i, order[i, : min(K, own[i] + 1)]] = True
    tiles = share_any = share_not_own = 0
    for b in range(nb):
        toks = np.nonzero(sel[:, b])[0]  # the block's list, ascending in t
        for j in range(0, len(toks) - TILE_TOKENS + 1, TILE_TOKENS):
            tile = toks[j : j + TILE_TOKENS]
            common = sel[tile].all(axis=0)
            common[b] = False
            tiles += 1
            share_any += common.any()
            own_blocks = np.unique(tile // BLK)
            if len(own_blocks) == 1:
                common[own_blocks[0]] = False  # the tile's common own block
            share_not_own += common.any()
    print(f"T={T} proxy head {p}: {tiles} full tiles; share a second block {share_any / tiles:.3f}, "
          f"one other than their common own block {share_not_own / tiles:.4f}", flush=True)
