#!/usr/bin/env python3
"""Host model of the sparse backward's L2 traffic (attn_bwd_wgmma_kernel, token-row form, m3 shape):
which CTA order and list walk keep the gathered Q / dO rows and the fp32 dQ rows in L2.

Model: one CTA per (proxy group p, key block g); CTAs start in grid order on `sms` SMs as SMs free
up; a CTA walks its block's list in tiles of 64 tokens, each tile 16 head steps of 4 tokens (the
tokens' Q and dO rows of the group's 16 heads, 4 KB each, and one 8 KB reduce-add of their dQ rows)
and one proxy step (the tile's 64 Qp rows of 256 B and dqp rows of 512 B). Every SM runs one step per
round (all steps cost the same). L2: LRU over those rows with `l2_mb` of capacity; a miss reads the
row from DRAM (reduce-adds too: L2 fetches the line before adding), an evicted dQ / dqp row is
written back. Selection: each token's own block plus top_k - 1 distinct earlier blocks drawn
uniformly per group (what the benchmark's N(0,1) inputs give: the selector's picks are spread over
the causal blocks). K, V, Kp (once per CTA) and the dkp adds (L2-resident) are left out.

Orders (--order): block  = g major, p fastest (blockIdx = g * Hp + p: the kernel's);
                   group = p major (blockIdx = p * NB + g).
                   pairs = two groups at a time, block-major inside;
                   wave  = windows of `sms` blocks (one wave), the Hp groups one after the other in each.
Walks (--walk):    desc (the kernel's sparse walk: from the list's end), asc, zigzag (even waves of
                   `sms` CTAs desc, odd ones asc: the dense warm-up's walk).
"""
import argparse
import random
from collections import OrderedDict


def make_lists(T, blk, top_k, Hp, seed):
    rng = random.Random(seed)
    NB = (T + blk - 1) // blk
    lists = [[[] for _ in range(NB)] for _ in range(Hp)]
    for p in range(Hp):
        for t in range(T):
            own = t // blk
            picks = {own}
            if own <= top_k - 1:
                picks.update(range(own))
            else:
                while len(picks) < top_k:
                    picks.add(rng.randrange(own))
            for b in picks:
                lists[p][b].append(t)  # ascending t
    return lists, NB


def simulate(lists, NB, Hp, order, walk, sms, l2_bytes, heads=16):
    if order == "block":
        ctas = [(g, p) for g in range(NB) for p in range(Hp)]
    elif order == "group":
        ctas = [(g, p) for p in range(Hp) for g in range(NB)]
    elif order == "pairs":  # two groups at a time, block-major inside
        ctas = [(g, p) for p0 in range(0, Hp, 2) for g in range(NB) for p in range(p0, min(Hp, p0 + 2))]
    else:  # "wave": windows of `sms` blocks, group by group inside a window
        ctas = [(g, p) for w in range(0, NB, sms) for p in range(Hp) for g in range(w, min(NB, w + sms))]
    q_row, dq_row, qp_row, dqp_row = heads * 256, heads * 512, 256, 512
    lru = OrderedDict()  # key -> (bytes, dirty)
    used = 0
    st = {"read_hit": 0, "read_miss": 0, "red_hit": 0, "red_miss": 0, "dram_read": 0, "dram_write": 0}

    def touch(key, size, red):
        nonlocal used
        e = lru.get(key)
        if e is not None:
            lru.move_to_end(key)
            if red:
                lru[key] = (size, True)
                st["red_hit"] += size
            else:
                st["read_hit"] += size
            return
        st["red_miss" if red else "read_miss"] += size
        st["dram_read"] += size
        lru[key] = (size, red)
        used += size
        while used > l2_bytes:
            _, (sz, dirty) = lru.popitem(last=False)
            used -= sz
            if dirty:
                st["dram_write"] += sz

    def steps_of(g, p, idx):
        toks = lists[p][g]
        if walk == "desc" or (walk == "zigzag" and (idx // sms) % 2 == 0):
            toks = toks[::-1]
        for i0 in range(0, len(toks), 64):
            tile = toks[i0:i0 + 64]
            for s in range(16):
                yield ("head", tile[4 * s:4 * s + 4])
            yield ("proxy", tile)

    nxt = 0
    running = [None] * sms
    rounds = 0
    while True:
        active = False
        for sm in range(sms):
            while running[sm] is None and nxt < len(ctas):
                g, p = ctas[nxt]
                nxt += 1
                if lists[p][g]:
                    running[sm] = (p, steps_of(g, p, nxt - 1))
            if running[sm] is None:
                continue
            p, it = running[sm]
            step = next(it, None)
            if step is None:
                running[sm] = None
                continue
            active = True
            kind, toks = step
            if kind == "head":
                for t in toks:
                    touch(("q", p, t), q_row, False)
                    touch(("do", p, t), q_row, False)
                    touch(("dq", p, t), dq_row, True)
            else:
                for t in toks:
                    touch(("qp", p, t), qp_row, False)
                    touch(("dqp", p, t), dqp_row, True)
        rounds += 1
        if not active and nxt >= len(ctas):
            break
    for _, (sz, dirty) in lru.items():
        if dirty:
            st["dram_write"] += sz
    st["rounds"] = rounds
    return st


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=65536)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--proxy-heads", type=int, default=4)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--l2-mb", type=float, default=40.0, help="L2 capacity left to these rows")
    ap.add_argument("--orders", default="block,group")
    ap.add_argument("--walks", default="desc,asc")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    lists, NB = make_lists(args.seqlen, 128, args.top_k, args.proxy_heads, args.seed)
    for order in args.orders.split(","):
        for walk in args.walks.split(","):
            s = simulate(lists, NB, args.proxy_heads, order, walk, args.sms, int(args.l2_mb * 2**20))
            rh = s["read_hit"] / max(1, s["read_hit"] + s["read_miss"])
            dh = s["red_hit"] / max(1, s["red_hit"] + s["red_miss"])
            print("order %-5s walk %-4s: read hit %5.1f%%, reduce hit %5.1f%%, DRAM read %6.1f GB, write %6.1f GB,"
                  " rounds %d" % (order, walk, 100 * rh, 100 * dh, s["dram_read"] / 1e9, s["dram_write"] / 1e9,
                                  s["rounds"]), flush=True)


if __name__ == "__main__":
    main()
