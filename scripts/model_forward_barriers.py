#!/usr/bin/env python3
"""Host-side model checker of the producer/consumer mbarrier protocol of kvw_fwd_kernel
(src/cuda/sm90/forward_kv_wgmma.cu), original (main; det_sum: 7d923d5 / f100058) and fixed
(exp/ring-parity-fix; det_sum: exp/two-pass-fix-candidates 12c3fce).

One CTA: agent 0 = producer (lane 0; the 32-lane k_full arrival is one arrival of weight 32),
agents 1, 2 = consumer warpgroups cw = 0, 1 (arrivals of weight 128).
Every agent's control flow depends only on the work list (not on the schedule), so each agent is
compiled into a straight-line list of ops; the state is (pcs, barriers, buffers, in-flight TMAs,
open read intervals).

Barriers: exact PTX phase semantics: phase number, pending arrivals (reset to the init count on
completion), tx count (expect_tx adds, TMA completion subtracts); a phase completes when pending
== 0 and tx == 0; try_wait.parity(P) is true iff (current phase & 1) != P.

Error classes:
  overarrive   : arrive / arrive.expect_tx on a barrier whose pending count is 0 (PTX UB).
                 Continuation: tx is added, pending stays 0 ("absorbed").
  stale_read   : a read (S: Q stage + K + list; PV: V; info read at k_full) of a buffer that
                 does not hold the intended tile/item, or whose TMA has not landed.
  overwrite    : a producer TMA issue (or list write) into a buffer that another agent is inside
                 a read interval of, or (TMA) into a buffer with a TMA still in flight.
  inflight_exit: a TMA still in flight when every agent has exited.
  deadlock     : no enabled action, no TMA in flight, agents unfinished.
"""
import argparse
import random
import sys
from collections import deque

KSTAGES = 5
NBUF_Q = KSTAGES


def bar_names(fixed):
    nfull = 2 * KSTAGES if fixed else KSTAGES
    names = [("full", b) for b in range(nfull)] + [("empty", s) for s in range(KSTAGES)]
    names += [("k_full",), ("k_empty",), ("v_full",), ("v_empty",)]
    counts = {}
    for n in names:
        if n[0] == "full":
            counts[n] = 1
        elif n[0] == "empty":
            counts[n] = 128
        elif n[0] == "k_full":
            counts[n] = 32
        elif n[0] == "v_full":
            counts[n] = 1
        else:
            counts[n] = 256
    return names, counts


def full_bar(tg, fixed):
    if fixed:
        return ("full", tg % (2 * KSTAGES)), (tg // (2 * KSTAGES)) & 1
    return ("full", tg % KSTAGES), (tg // KSTAGES) & 1


def compile_producer(work, fixed, withv):
    ops = []
    tile_g = 0
    n = len(work)
    for it in range(n + 1):
        buf = it & 1
        ops.append(("wlist", ("L", buf), it))            # list + info of item it (generic writes)
        if it > 0:
            ops.append(("wait", ("k_empty",), (it - 1) & 1))
        if it == n:
            ops.append(("arrive", ("k_full",), 32, 0))  # terminal item: ntok = -1
            break
        ops.append(("arrive", ("k_full",), 32, 1))      # lane 0 arrive.expect_tx + 31 lanes
        ops.append(("tma", ("K",), it, ("k_full",)))
        nt = work[it]

        def issue_q(i):
            tg = tile_g + i
            st = tg % KSTAGES
            fb, _ = full_bar(tg, fixed)
            if tg >= KSTAGES:
                ops.append(("wait", ("empty", st), ((tg // KSTAGES) - 1) & 1))
            ops.append(("arrive", fb, 1, 1))
            ops.append(("tma", ("Q", st), tg, fb))

        early = min(nt, 2)
        for i in range(early):
            issue_q(i)
        if withv and it > 0:
            ops.append(("wait", ("v_empty",), (it - 1) & 1))
        if withv:
            ops.append(("arrive", ("v_full",), 1, 1))
            ops.append(("tma", ("V",), it, ("v_full",)))
        for i in range(early, nt):
            issue_q(i)
        tile_g += nt
    ops.append(("exit",))
    return ops


def compile_consumer(work, cw, fixed, withv):
    ops = []
    tile_g = 0
    n = len(work)
    for it in range(n + 1):
        buf = it & 1
        ops.append(("wait", ("k_full",), it & 1))
        ops.append(("read", (("L", buf), it)))           # sInfo[buf]
        if it == n:
            break
        nt = work[it]
        i = 0 if (tile_g & 1) == cw else 1
        if i >= nt:
            ops.append(("arrive", ("k_empty",), 128, 0))
            if withv:
                if fixed:
                    ops.append(("wait", ("v_full",), it & 1))
                ops.append(("arrive", ("v_empty",), 128, 0))
            tile_g += nt
            continue

        def s_reads(tg):
            return ((("Q", tg % KSTAGES), tg), (("K",), it), (("L", buf), it))

        tg = tile_g + i
        fb, par = full_bar(tg, fixed)
        ops.append(("wait", fb, par))
        ops.append(("rbegin", "S", s_reads(tg), tg))
        ops.append(("rend", "S"))
        ops.append(("arrive", ("empty", tg % KSTAGES), 128, 0))
        if i + 2 >= nt:
            ops.append(("arrive", ("k_empty",), 128, 0))
        if withv:
            ops.append(("wait", ("v_full",), it & 1))
        while True:
            inext = i + 2
            if inext >= nt:
                break
            tgn = tile_g + inext
            fb, par = full_bar(tgn, fixed)
            ops.append(("wait", fb, par))
            if withv:
                ops.append(("rbegin", "PV", ((("V",), it),), tg))
            ops.append(("rbegin", "S", s_reads(tgn), tgn))
            if withv:
                ops.append(("rend", "PV"))              # wgmma_wait<1>
            ops.append(("rend", "S"))                   # wgmma_wait<0>
            ops.append(("arrive", ("empty", tgn % KSTAGES), 128, 0))
            if inext + 2 >= nt:
                ops.append(("arrive", ("k_empty",), 128, 0))
            i = inext
            tg = tgn
        if withv:
            ops.append(("rbegin", "PV", ((("V",), it),), tg))
            ops.append(("rend", "PV"))
            ops.append(("arrive", ("v_empty",), 128, 0))
        tile_g += nt
    ops.append(("exit",))
    return ops


AGENT_NAMES = ["P", "C0", "C1"]


class Sim:
    """State of one execution. Agents: 0 producer, 1/2 consumer warpgroups."""

    __slots__ = ("progs", "pcs", "bars", "counts", "bufs", "inflight", "reads", "next_id",
                 "errors", "trace", "done", "keep_trace")

    def __init__(self, work, fixed, withv, keep_trace=True):
        self.progs = [compile_producer(work, fixed, withv),
                      compile_consumer(work, 0, fixed, withv),
                      compile_consumer(work, 1, fixed, withv)]
        self.pcs = [0, 0, 0]
        names, counts = bar_names(fixed)
        self.counts = counts
        self.bars = {nm: [0, counts[nm], 0] for nm in names}  # phase, pending, tx
        bufs = {("Q", s): [None, 0] for s in range(KSTAGES)}  # tag, in-flight TMAs into it
        bufs[("K",)] = [None, 0]
        bufs[("V",)] = [None, 0]
        bufs[("L", 0)] = [None, 0]
        bufs[("L", 1)] = [None, 0]
        self.bufs = bufs
        self.inflight = []   # (id, buf, tag, bar)
        self.reads = [dict(), dict(), dict()]  # agent -> {"S"/"PV": reads tuple}
        self.next_id = 0
        self.errors = []     # (step, class, text)
        self.trace = [] if keep_trace else None
        self.done = [False, False, False]
        self.keep_trace = keep_trace

    def clone(self):
        c = Sim.__new__(Sim)
        c.progs = self.progs
        c.pcs = list(self.pcs)
        c.counts = self.counts
        c.bars = {k: list(v) for k, v in self.bars.items()}
        c.bufs = {k: list(v) for k, v in self.bufs.items()}
        c.inflight = list(self.inflight)
        c.reads = [dict(r) for r in self.reads]
        c.next_id = self.next_id
        c.errors = list(self.errors)
        c.trace = list(self.trace) if self.trace is not None else None
        c.done = list(self.done)
        c.keep_trace = self.keep_trace
        return c

    def key(self):
        return (tuple(self.pcs),
                tuple(tuple(v) for v in self.bars.values()),
                tuple(tuple(v) for v in self.bufs.values()),
                tuple(sorted((b, t, br) for (_, b, t, br) in self.inflight)),
                tuple(tuple(sorted(r.items())) for r in self.reads))

    # ---- barriers
    def err(self, cls, text, sub=""):
        self.errors.append((len(self.trace) if self.trace is not None else 0, cls, text, sub))
        if self.trace is not None:
            self.trace.append("      !! %s: %s" % (cls, text))

    def _complete(self, nm):
        b = self.bars[nm]
        if b[1] == 0 and b[2] == 0:
            b[0] += 1
            b[1] = self.counts[nm]

    def arrive(self, who, nm, w, tx):
        b = self.bars[nm]
        if b[1] < w or b[1] == 0:
            self.err("overarrive", "%s arrives (w=%d, tx+%d) on %s with pending %d, tx %d, phase %d"
                     % (AGENT_NAMES[who], w, tx, bname(nm), b[1], b[2], b[0]), nm[0])
            b[2] += tx
            self._complete(nm)
            return
        b[2] += tx
        b[1] -= w
        self._complete(nm)

    def can_wait(self, nm, par):
        return (self.bars[nm][0] & 1) != par

    # ---- buffers
    def check_reads(self, who, reads, what):
        for buf, tag in reads:
            have, pend = self.bufs[buf]
            if have != tag or pend:
                self.err("stale_read", "%s %s reads %s for %s but it holds %s%s"
                         % (AGENT_NAMES[who], what, bname(buf), tag, have,
                            " (TMA in flight)" if pend else ""), buf[0])

    def check_write(self, who, buf, tag, what):
        for a in range(3):
            if a == who:
                continue
            for rn, rd in self.reads[a].items():
                for b, t in rd:
                    if b == buf:
                        self.err("overwrite", "%s %s into %s (for %s) while %s's %s reads it (for %s)"
                                 % (AGENT_NAMES[who], what, bname(buf), tag, AGENT_NAMES[a], rn, t), buf[0] + "/read")
        if what == "TMA" and self.bufs[buf][1]:
            self.err("overwrite", "%s TMA into %s (for %s) while a TMA into it (for %s) is in flight"
                     % (AGENT_NAMES[who], bname(buf), tag, self.bufs[buf][0]), buf[0] + "/inflight")

    # ---- scheduling
    def agent_enabled(self, a):
        if self.done[a]:
            return False
        op = self.progs[a][self.pcs[a]]
        if op[0] == "wait":
            return self.can_wait(op[1], op[2])
        return True

    def enabled(self):
        acts = [("A", a) for a in range(3) if self.agent_enabled(a)]
        acts += [("T", i) for i in range(len(self.inflight))]
        return acts

    def step(self, act):
        kind, x = act
        if kind == "T":
            tid, buf, tag, nm = self.inflight.pop(x)
            if self.trace is not None:
                self.trace.append("  TMA lands: %s <- %s (on %s)" % (bname(buf), tag, bname(nm)))
            self.bufs[buf][1] -= 1
            b = self.bars[nm]
            b[2] -= 1
            if b[2] < 0:
                self.err("tx_negative", "tx of %s below 0" % bname(nm))
            self._complete(nm)
            return
        a = x
        op = self.progs[a][self.pcs[a]]
        self.pcs[a] += 1
        if self.trace is not None:
            self.trace.append("%-3s %s" % (AGENT_NAMES[a], self.fmt(op)))
        o = op[0]
        if o == "wait":
            pass
        elif o == "arrive":
            self.arrive(a, op[1], op[2], op[3])
        elif o == "tma":
            _, buf, tag, nm = op
            self.check_write(a, buf, tag, "TMA")
            self.bufs[buf][0] = tag
            self.bufs[buf][1] += 1
            self.inflight.append((self.next_id, buf, tag, nm))
            self.next_id += 1
        elif o == "wlist":
            _, buf, tag = op
            self.check_write(a, buf, tag, "list write")
            self.bufs[buf][0] = tag
        elif o == "read":
            self.check_reads(a, (op[1],), "info read")
        elif o == "rbegin":
            _, rn, reads, tg = op
            self.check_reads(a, reads, rn + "(tile %d)" % tg)
            self.reads[a][rn] = reads
        elif o == "rend":
            del self.reads[a][op[1]]
        elif o == "exit":
            self.done[a] = True
            if all(self.done) and self.inflight:
                self.err("inflight_exit", "CTA exits with TMA in flight: %s"
                         % ", ".join("%s<-%s" % (bname(b), t) for (_, b, t, _) in self.inflight))

    def fmt(self, op):
        o = op[0]
        if o == "wait":
            b = self.bars[op[1]]
            return "wait %s parity %d  [phase %d pending %d tx %d]" % (bname(op[1]), op[2], b[0], b[1], b[2])
        if o == "arrive":
            return "arrive%s %s (w=%d)" % (".expect_tx" if op[3] else "", bname(op[1]), op[2])
        if o == "tma":
            return "TMA issue %s <- %s (on %s)" % (bname(op[1]), op[2], bname(op[3]))
        if o == "wlist":
            return "write list/info %s <- item %d" % (bname(op[1]), op[2])
        if o == "read":
            return "read info %s (item %d)" % (bname(op[1][0]), op[1][1])
        if o == "rbegin":
            return "%s begin (tile %d) reads %s" % (op[1], op[3], ", ".join("%s=%s" % (bname(b), t) for b, t in op[2]))
        if o == "rend":
            return "%s end" % op[1]
        return o

    def finished(self):
        return all(self.done)


def bname(nm):
    if len(nm) == 1:
        return nm[0]
    return "%s[%d]" % nm


CLASSES = ["overarrive", "stale_read", "overwrite", "inflight_exit", "tx_negative", "deadlock"]


def rand_work(rng, max_items):
    n = rng.randint(1, max_items)
    return [1 if rng.random() < 0.4 else rng.randint(2, 6) for _ in range(n)]


def run_once(work, fixed, withv, rng, bias, keep_trace):
    s = Sim(work, fixed, withv, keep_trace)
    steps = 0
    while True:
        if s.finished():
            break
        agents = [a for a in range(3) if s.agent_enabled(a)]
        nin = len(s.inflight)
        if not agents and not nin:
            s.err("deadlock", "no enabled action, no TMA in flight; pcs %s, next ops %s"
                  % (s.pcs, [s.fmt(s.progs[a][s.pcs[a]]) if not s.done[a] else "done" for a in range(3)]))
            break
        if bias:
            # TMA completions delayed; the oldest in-flight load picked rarely.
            if nin and (not agents or rng.random() < 0.15):
                if nin > 1 and rng.random() >= 0.1:
                    act = ("T", rng.randrange(1, nin))
                else:
                    act = ("T", 0)
            else:
                act = ("A", rng.choice(agents))
        else:
            r = rng.randrange(len(agents) + nin)
            act = ("A", agents[r]) if r < len(agents) else ("T", r - len(agents))
        s.step(act)
        steps += 1
        if steps > 100000:
            s.err("deadlock", "step limit")
            break
    return s


def campaign(fixed, withv, bias, runs, seed, max_items):
    rng = random.Random(seed)
    hit = {c: 0 for c in CLASSES}
    first = {c: 0 for c in CLASSES}
    best = {}  # class -> (len of trace up to first occurrence, work, trace)
    clean_deadlock = 0
    any_err = 0
    firstsub, hitsub = {}, {}
    for r in range(runs):
        work = rand_work(rng, max_items)
        s = run_once(work, fixed, withv, rng, bias, keep_trace=True)
        if not s.errors:
            continue
        any_err += 1
        seen = set()
        fs = s.errors[0][1] + ":" + s.errors[0][3]
        firstsub[fs] = firstsub.get(fs, 0) + 1
        for (pos, cls, text, sub) in s.errors:
            ks = cls + ":" + sub
            hitsub[ks] = hitsub.get(ks, 0) + 1
            if cls in seen:
                continue
            seen.add(cls)
            hit[cls] += 1
            L = pos + 1
            if cls not in best or L < best[cls][0]:
                best[cls] = (L, list(work), s.trace[:pos + 1])
        first[s.errors[0][1]] += 1
        if s.errors[0][1] == "deadlock":
            clean_deadlock += 1
    return dict(firstsub=firstsub, hitsub=hitsub, hit=hit, first=first, best=best, any=any_err, runs=runs, clean_deadlock=clean_deadlock)


def bfs_min(work, fixed, withv, cls, allow_prior=False, max_states=300000):
    """Shortest interleaving (in steps) of this work list reaching error class cls."""
    s0 = Sim(work, fixed, withv, keep_trace=True)
    q = deque([s0])
    seen = {s0.key()}
    while q:
        s = q.popleft()
        acts = s.enabled()
        if not acts:
            continue
        for act in acts:
            c = s.clone()
            c.step(act)
            if any(e[1] == cls for e in c.errors):
                return c
            if c.errors and not allow_prior:  # minimal traces free of other, earlier errors
                continue
            if not c.finished() and not c.enabled():
                if cls == "deadlock":
                    c.err("deadlock", "no enabled action")
                    return c
                continue
            k = c.key()
            if k in seen:
                continue
            seen.add(k)
            if len(seen) > max_states:
                return None
            q.append(c)
    return None


def explore(work, fixed, withv, max_states=2000000):
    """All interleavings (state-space search) of one work list: the error classes reachable
    (an error state is not expanded further), the number of distinct states, and completeness."""
    s0 = Sim(work, fixed, withv, keep_trace=False)
    stack = [s0]
    seen = {s0.key()}
    found = set()
    while stack:
        s = stack.pop()
        acts = s.enabled()
        if not acts:
            if not s.finished():
                found.add("deadlock")
            continue
        for act in acts:
            c = s.clone()
            c.step(act)
            if c.errors:
                found.update(e[1] for e in c.errors)
                continue
            k = c.key()
            if k in seen:
                continue
            seen.add(k)
            if len(seen) > max_states:
                return found, len(seen), False
            stack.append(c)
    return found, len(seen), True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-items", type=int, default=8)
    ap.add_argument("--bfs", action="store_true", help="BFS-minimise the shortest random trace's work list")
    ap.add_argument("--only", default="", help="comma list of configs, e.g. orig-V-unif")
    ap.add_argument("--exhaustive", type=int, default=0,
                    help="instead: all interleavings of every work list of 1..N items (tiles 1..6)")
    ap.add_argument("--sample4", type=int, default=0, help="with --exhaustive: also this many random 4..6-item lists")
    args = ap.parse_args()
    if args.exhaustive:
        import itertools
        lists = [list(w) for n in range(1, args.exhaustive + 1) for w in itertools.product(range(1, 7), repeat=n)]
        rng = random.Random(args.seed)
        for _ in range(args.sample4):
            lists.append(rand_work(rng, 6) + [rng.randint(1, 6) for _ in range(3)])
        for fixed in (False, True):
            for withv in (True, False):
                name = "%s-%s" % ("fixed" if fixed else "orig", "V" if withv else "detsum")
                cnt = {c: 0 for c in CLASSES}
                ex = {}
                states = 0
                incomplete = 0
                for w in lists:
                    found, n, complete = explore(w, fixed, withv)
                    states += n
                    incomplete += not complete
                    for c in found:
                        cnt[c] += 1
                        ex.setdefault(c, w)
                print("== exhaustive %s: %d work lists, %d states in all, %d searches cut short; lists with "
                      "a reachable error, per class: %s; first list per class: %s"
                      % (name, len(lists), states, incomplete, ", ".join("%s %d" % (c, cnt[c]) for c in CLASSES), ex))
                sys.stdout.flush()
        return
    configs = []
    for fixed in (False, True):
        for withv in (True, False):
            for bias in (False, True):
                name = "%s-%s-%s" % ("fixed" if fixed else "orig", "V" if withv else "detsum",
                                     "bias" if bias else "unif")
                if args.only and name not in args.only.split(","):
                    continue
                configs.append((name, fixed, withv, bias))
    results = {}
    for i, (name, fixed, withv, bias) in enumerate(configs):
        res = campaign(fixed, withv, bias, args.runs, args.seed * 1000 + i, args.max_items)
        results[name] = res
        print("== %s: %d runs, %d with an error" % (name, res["runs"], res["any"]))
        print("   runs hitting class (any point): " + ", ".join("%s %d" % (c, res["hit"][c]) for c in CLASSES))
        print("   runs by FIRST error class     : " + ", ".join("%s %d" % (c, res["first"][c]) for c in CLASSES))
        print("   first error, by buffer/barrier: " + ", ".join("%s %d" % kv for kv in sorted(res["firstsub"].items())))
        print("   error occurrences by sub-kind : " + ", ".join("%s %d" % kv for kv in sorted(res["hitsub"].items())))
        sys.stdout.flush()
    for name, res in results.items():
        if not res["best"]:
            continue
        print("\n######## shortest random traces, %s" % name)
        for cls, (L, work, tr) in sorted(res["best"].items()):
            print("--- %s: work (tiles per item) %s, %d trace lines to the error" % (cls, work, L))
            print("\n".join(tr))
    if args.bfs:
        print("\n######## BFS-minimal traces (fewest steps, all interleavings of one small work list)")
        for withv in (True, False):
            tag = "orig-%s" % ("V" if withv else "detsum")
            for cls in CLASSES:
                cands = set()
                for nm in (tag + "-unif", tag + "-bias"):
                    res = results.get(nm)
                    if res and cls in res["best"]:
                        w = res["best"][cls][1]
                        for k in range(1, len(w) + 1):
                            cands.add(tuple(w[:k]))
                if not cands:
                    continue
                got = None
                for allow in (False, True):
                    for w in sorted(cands, key=lambda w: (len(w), sum(w))):
                        s = bfs_min(list(w), False, withv, cls, allow_prior=allow)
                        if s is not None:
                            got = (w, s, allow)
                            break
                    if got:
                        break
                if got:
                    w, s, allow = got
                    print("--- %s %s: work %s, %d steps%s" % (tag, cls, list(w),
                          sum(1 for t in s.trace if not t.startswith("      !!")),
                          " (needs earlier errors)" if allow else " (no earlier error)"))
                    print("\n".join(s.trace))
                else:
                    print("--- %s %s: BFS found none within the state limit" % (tag, cls))
                sys.stdout.flush()

if __name__ == "__main__":
    main()
