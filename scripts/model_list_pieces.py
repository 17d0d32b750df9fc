#!/usr/bin/env python3
"""Host model of the fused backward's CTA schedule with attention-sink selections and list pieces.

Each proxy group's tokens select K distinct blocks: the own block and K - 1 others uniformly among the
earlier blocks (the benchmark's N(0, 1) selection is near that), with --sink block 0 among them. A CTA's part
is a key block's list within one token chunk (none: the whole list); it costs a + tiles (64 tokens a
tile); an empty part costs e. CTAs go in grid order to the first free SM (one CTA per SM, as the
kernel's 384 x 168 registers allow). Pieces: each part past `cap` tokens keeps its first piece in its own
CTA; the later pieces run in slots placed first in the group's range (the overflow form; --front: all the
cut part's pieces there, its own CTA empty). Prints the
makespan (tile units) and its ratio to the balanced bound, per case.

  python3 scripts/model_list_pieces.py --seqlen 32768 --chunks 16       # the H100's m3/32k
  python3 scripts/model_list_pieces.py --seqlen 65536 --chunks 16 --tile-tokens 4 --front --caps 0,512,2048 \
      --proxy-inputs                                                     # flashmsa_run's sink inputs, m3/64k
"""
import argparse
import heapq

import numpy as np


def lists_for_group(T, K, sink, rng):
    """Block lists of one proxy group: each token keeps its own block and min(K - 1, b) distinct others
    uniformly among the b earlier blocks (with a sink, block 0 and K - 2 others)."""
    nb = (T + 127) // 128
    rows_t, rows_b = [np.arange(T)], [np.arange(T) // 128]
    for b in range(1, nb):
        t = np.arange(128 * b, min(128 * (b + 1), T))
        pool = np.arange(1, b) if sink else np.arange(b)
        k = min(K - 1 - (1 if sink else 0), len(pool))
        if k > 0:
            pick = np.argpartition(rng.random((len(t), len(pool))), k - 1, axis=1)[:, :k]
            rows_t.append(np.repeat(t, k))
            rows_b.append(pool[pick].ravel())
        if sink:
            rows_t.append(t)
            rows_b.append(np.zeros(len(t), dtype=np.int64))
    tokens, blocks = np.concatenate(rows_t), np.concatenate(rows_b)
    order = np.lexsort((tokens, blocks))
    b_sorted, t_sorted = blocks[order], tokens[order]
    starts = np.searchsorted(b_sorted, np.arange(nb + 1))
    return [t_sorted[starts[g]:starts[g + 1]] for g in range(nb)]


def proxy_keys(T, sink_blocks):
    """The shared proxy keys (Hpk = 1) of flashmsa_run's inputs: N(0, 1), with --sink-blocks adding 12 to
    the sink keys' kp[0]."""
    kp = np.random.default_rng(2).standard_normal((T, 128)).astype(np.float32)
    kp[: 128 * sink_blocks, 0] += 12
    return kp


def lists_from_proxy(T, K, sink, rng, kp):
    """Block lists of one proxy group selected as select_blocks does on flashmsa_run's inputs: N(0, 1) qp
    (this group's) and kp (shared: Hpk = 1), with --sink-blocks 1 adding 12 to every qp[0] and to the sink
    keys' kp[0]; each token keeps its own block and the K - 1 best others by causal block max of qp.kp.
    Such inputs skew beyond the sink: every token ranks the blocks by their kp[0] maxima."""
    D, nb = kp.shape[1], (T + 127) // 128
    qp = rng.standard_normal((T, D)).astype(np.float32)
    if sink:
        qp[:, 0] += 12
    rows_t, rows_b = [], []
    for t0 in range(0, T, 512):
        rows = np.arange(t0, min(T, t0 + 512))
        n = rows[-1] // 128 + 1
        sc = qp[rows] @ kp[: n * 128].T
        sc[np.arange(n * 128)[None, :] > rows[:, None]] = -np.inf
        best = sc.reshape(len(rows), n, 128).max(2)
        best[np.arange(len(rows)), rows // 128] = np.inf
        k = min(K, n)
        pick = np.argpartition(-best, k - 1, axis=1)[:, :k]
        rows_t.append(np.repeat(rows, k))
        rows_b.append(pick.ravel())
    tokens, blocks = np.concatenate(rows_t), np.concatenate(rows_b)
    order = np.lexsort((tokens, blocks))
    b_sorted, t_sorted = blocks[order], tokens[order]
    starts = np.searchsorted(b_sorted, np.arange(nb + 1))
    return [t_sorted[starts[g]:starts[g + 1]] for g in range(nb)]


def ctas(lists, T, chunk, cap, a, e, K, tile_tokens, front):
    """The group's CTA costs in grid order: its T K / cap overflow slots first (empty ones cost e), then
    the (chunk, block) parts. A tile holds tile_tokens tokens and costs tile_tokens / 64 units. front:
    a cut part puts all its pieces in the overflow slots and its own CTA exits (costs e)."""
    nb = len(lists)
    nc = (T + chunk - 1) // chunk if chunk else 1
    cost = lambda n: a + -(-n // tile_tokens) * tile_tokens / 64
    main, overflow = [], []
    for c in range(nc):
        for g in range(nb):
            toks = lists[g]
            if chunk:
                lo, hi = np.searchsorted(toks, [c * chunk, (c + 1) * chunk])
                n = hi - lo
            else:
                n = len(toks)
            if n == 0:
                main.append(e)
                continue
            count = -(-n // cap) if cap else 1
            sizes = [(n * (j + 1)) // count - (n * j) // count for j in range(count)]
            if front and count > 1:
                main.append(e)
                overflow += [cost(s) for s in sizes]
            else:
                main.append(cost(sizes[0]))
                overflow += [cost(s) for s in sizes[1:]]
    slots = max((2 if front else 1) * (T * K // cap), 1) if cap else 0
    assert len(overflow) <= slots or not cap
    return overflow + [e] * (slots - len(overflow)) + main


def makespan(costs, sms):
    free = [0.0] * sms
    heapq.heapify(free)
    end = 0.0
    for c in costs:
        t = heapq.heappop(free) + c
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--chunks", type=int, default=16, help="token chunks (0: none)")
    ap.add_argument("--block-major", action="store_true", help="groups interleaved per block (SHARED_KV, fm16k)")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--cta-cost", type=float, default=0.5, help="a: a CTA's fixed cost, in tiles")
    ap.add_argument("--empty-cost", type=float, default=0.05)
    ap.add_argument("--caps", default="0,512,1024,2048,4096,8192")
    ap.add_argument("--tile-tokens", type=int, default=64, help="tokens a tile (token rows of m heads: 64 / m)")
    ap.add_argument("--front", action="store_true", help="a cut part's pieces all in the overflow slots")
    ap.add_argument("--proxy-inputs", action="store_true",
                    help="select as select_blocks does on flashmsa_run's inputs (lists_from_proxy), not uniformly")
    args = ap.parse_args()
    T = args.seqlen
    chunk = -(-T // args.chunks) if args.chunks else 0
    rng = np.random.default_rng(1)
    for sink in (False, True):
        if args.proxy_inputs:
            kp = proxy_keys(T, int(sink))
            lists = [lists_from_proxy(T, args.topk, sink, rng, kp) for _ in range(args.groups)]
        else:
            lists = [lists_for_group(T, args.topk, sink, rng) for _ in range(args.groups)]
        longest = max(len(l) for gl in lists for l in gl)
        for cap in [int(c) for c in args.caps.split(",")]:
            per_group = [ctas(gl, T, chunk, cap, args.cta_cost, args.empty_cost, args.topk, args.tile_tokens,
                              args.front) for gl in lists]
            if args.block_major:  # x = slot * Hp + p: the groups' CTAs interleaved
                costs = [c for row in zip(*per_group) for c in row]
            else:  # y = p: group after group
                costs = [c for row in per_group for c in row]
            work = sum(costs)
            span = makespan(costs, args.sms)
            print(f"sink={int(sink)} cap={cap:5d} longest list {longest:6d}: makespan {span:9.1f} tiles, "
                  f"balanced {work / args.sms:9.1f}, ratio {span / (work / args.sms):.3f}")


if __name__ == "__main__":
    main()
