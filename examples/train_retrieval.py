#!/usr/bin/env python3
"""Does MSA learn? A small decoder trained on long-context key-value retrieval.

Task (multi-query associative recall in a haystack): a sequence of S tokens holds, among random
filler tokens, N (key, value) pairs written as two adjacent tokens at random places; after a
query marker come Q of those keys again, each followed by its value. The loss is only on the Q
answers (the value predicted at its key's position), so the model has to find, far back, where
the key was written and copy the token after it: an induction circuit whose second hop spans
the whole sequence. With sparse attention the proxy has to pick the block holding that pair.

Two runs of the same code and size:
  msa   : `--warmup-steps` steps in "warmup" mode (dense attention, proxy distilled), then
          "sparse" (top_k blocks of block_size per query and proxy head).
  dense : the same model kept in "warmup" mode (default "dense" = SDPA; --dense-mode warmup trains its proxy too).
Logged on a fixed evaluation set: task loss, answer accuracy, kl_loss, and the proxy's recall
of the blocks dense attention weights most (eager computation at the answer positions).

    PYTHONPATH=python FLASHMSA_TORCH_LIBRARY=build-f/python/_C.so \
        python3 examples/train_retrieval.py              # CPU default, a few minutes
    python3 examples/train_retrieval.py --long --device cuda   # H200 preset, S=16384
Writes examples/results/<name>.json and <name>.png.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from flashmsa.layers import MSAAttention, MSAProjections, set_msa_mode

BOS, QRY, FIRST_FILLER = 0, 1, 2


# ---------------------------------------------------------------------------------------------
# The task


class Task:
    def __init__(self, seq_len, n_pairs, n_queries, n_keys, n_values, n_fillers):
        self.S, self.N, self.Q = seq_len, n_pairs, n_queries
        self.nK, self.nV, self.nF = n_keys, n_values, n_fillers
        self.key0 = FIRST_FILLER + n_fillers
        self.val0 = self.key0 + n_keys
        self.vocab = self.val0 + n_values
        self.ctx = seq_len - 2 - 2 * n_queries  # tokens between BOS and the query marker
        if n_pairs > n_keys or n_queries > n_pairs or 2 * n_pairs > self.ctx:
            raise ValueError("need n_queries <= n_pairs <= n_keys and 2*n_pairs <= context")

    def batch(self, B, gen):
        """tokens [B, S] int64, answer positions [B, Q] (where the value is predicted), targets
        [B, Q] (the value tokens)."""
        S, N, Q, C = self.S, self.N, self.Q, self.ctx
        tok = torch.randint(FIRST_FILLER, FIRST_FILLER + self.nF, (B, S), generator=gen)
        tok[:, 0] = BOS
        keys = torch.argsort(torch.rand(B, self.nK, generator=gen), dim=1)[:, :N]  # distinct
        vals = torch.randint(0, self.nV, (B, N), generator=gen)
        # pairs sit on distinct even offsets of the context, so they never overlap
        slots = torch.argsort(torch.rand(B, C // 2, generator=gen), dim=1)[:, :N]
        kpos = 1 + 2 * slots
        rows = torch.arange(B)[:, None]
        tok[rows, kpos] = self.key0 + keys
        tok[rows, kpos + 1] = self.val0 + vals
        tok[:, 1 + C] = QRY
        pick = torch.argsort(torch.rand(B, N, generator=gen), dim=1)[:, :Q]  # distinct queries
        qk, qv = torch.gather(keys, 1, pick), torch.gather(vals, 1, pick)
        qpos = 2 + C + 2 * torch.arange(Q)[None, :].expand(B, Q)
        tok[rows, qpos] = self.key0 + qk
        tok[rows, qpos + 1] = self.val0 + qv
        return tok, qpos, self.val0 + qv


# ---------------------------------------------------------------------------------------------
# The model: pre-norm decoder, MSAAttention + SwiGLU MLP


class MLP(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.up = nn.Linear(d, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        a, b = self.up(x).chunk(2, dim=-1)
        return self.down(F.silu(a) * b)


class Block(nn.Module):
    def __init__(self, d, attn_kw, mlp_mult):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.attn = MSAAttention(d, **attn_kw)
        self.mlp = MLP(d, int(mlp_mult * d))

    def forward(self, x):
        a, kl = self.attn(self.n1(x))
        x = x + a
        return x + self.mlp(self.n2(x)), kl


class Decoder(nn.Module):
    def __init__(self, vocab, d, n_layers, attn_kw, mlp_mult=2.0, prev_emb=True):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        # The previous token's identity at every position (a bigram embedding, the job a short
        # causal convolution does in many current models): a value token then carries its key,
        # so one attention hop retrieves. Without it the model must first grow an induction
        # circuit, which takes far longer than a CPU demo allows.
        self.prev = nn.Embedding(vocab, d) if prev_emb else None
        self.blocks = nn.ModuleList(Block(d, attn_kw, mlp_mult) for _ in range(n_layers))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        nn.init.normal_(self.emb.weight, std=d ** -0.5)
        if self.prev is not None:
            nn.init.normal_(self.prev.weight, std=d ** -0.5)

    def forward(self, tok, positions):
        """tok [B, S]; positions [B, Q]: the only places whose logits are needed.
        Returns logits [B, Q, vocab] and the list of the layers' kl_loss."""
        x = self.emb(tok)
        if self.prev is not None:
            x = x + self.prev(F.pad(tok[:, :-1], (1, 0), value=BOS))
        kls = []
        for blk in self.blocks:
            x, kl = blk(x)
            kls.append(kl)
        h = torch.gather(x, 1, positions[..., None].expand(-1, -1, x.shape[-1]))
        return self.head(self.norm(h)), kls


# ---------------------------------------------------------------------------------------------
# Proxy recall, eagerly


@torch.no_grad()
def proxy_recall(layer: MSAAttention, x, qpos, max_seqs):
    """For the answer positions qpos [B, Q] of the first max_seqs sequences, compare the blocks
    dense attention weights most with the blocks the proxy selects (both eagerly, from the
    layer's own q, k, qp, kp). x is the layer's input [B, S, d]. Returns a dict of means:
      recall        |top-K dense blocks  n  proxy's K| / |top-K dense blocks|
      recall_nonlocal  the same with the local block(s) left out of both sets
      mass          fraction of dense attention mass inside the proxy's blocks
      recall_top1   how often the proxy selects the heaviest non-local block
    and the number of rows where the eager selection differs from the op's (sparse mode)."""
    B = min(max_seqs, x.shape[0])
    x, qpos = x[:B], qpos[:B].cpu()
    p = MSAProjections(*(t.float().cpu() for t in layer.project(x)))  # the eager part on CPU
    H, Hkv, Hp, Hpk = layer.n_heads, layer.n_kv_heads, layer.n_proxy_heads, layer.n_proxy_kv_heads
    BLK, K, L = layer.block_size, layer.top_k, layer.local_blocks
    S = x.shape[1]
    nb = (S + BLK - 1) // BLK
    rows = torch.arange(B)[:, None]
    q = p.q[rows, qpos].float()  # [B, Q, H, D]
    k = p.k.float()[:, :, torch.arange(H) // (H // Hkv)]  # [B, S, H, D]
    logits = torch.einsum("bqhd,bshd->bhqs", q, k) * layer.head_dim ** -0.5
    j = torch.arange(S)
    causal = j[None, None, :] <= qpos[:, :, None]  # [B, Q, S]
    P = torch.softmax(logits.masked_fill(~causal[:, None], -math.inf), dim=-1)
    P = P.view(B, Hp, H // Hp, *P.shape[2:]).mean(2)  # [B, Hp, Q, S] group mean
    pad = nb * BLK - S
    mass = F.pad(P, (0, pad)).view(*P.shape[:-1], nb, BLK).sum(-1)  # [B, Hp, Q, nb]

    qp = p.qp[rows, qpos].float()  # [B, Q, Hp, Dp]
    kp = p.kp.float()[:, :, torch.arange(Hp) // (Hp // Hpk)]
    s = torch.einsum("bqpd,bspd->bpqs", qp, kp) * layer.proxy_dim ** -0.5
    s = F.pad(s.masked_fill(~causal[:, None], -math.inf), (0, pad), value=-math.inf)
    bs = s.view(*s.shape[:-1], nb, BLK).amax(-1)  # [B, Hp, Q, nb]
    n_loc = (qpos // BLK)[:, None, :, None]  # [B, 1, Q, 1]
    blk = torch.arange(nb)
    visible = blk <= n_loc
    local = visible & (blk > n_loc - L)
    kk = min(K, nb)

    def topk_set(score):
        score = score.masked_fill(~visible, -math.inf)
        order = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :kk]
        member = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, order, True)
        return member & visible

    proxy_sel = topk_set(bs.masked_fill(local, math.inf))
    dense_sel = topk_set(mass)
    hit = (dense_sel & proxy_sel).sum(-1).float()
    recall = (hit / dense_sel.sum(-1).clamp_min(1)).mean().item()
    dn = dense_sel & ~local
    nl_hit = (dn & proxy_sel).sum(-1).float()
    nl_cnt = dn.sum(-1)
    nonlocal_recall = (nl_hit.sum() / nl_cnt.sum().clamp_min(1)).item()
    covered = (mass * proxy_sel).sum(-1).mean().item()
    # the single heaviest non-local block: for a retrieval head, the block holding the pair
    far = visible & ~local
    heavy = mass.masked_fill(~far, -1.0).argmax(-1, keepdim=True)
    top1_hit = torch.gather(proxy_sel, -1, heavy)[..., 0]  # [B, Hp, Q]
    has_far = far.any(-1).expand_as(top1_hit)
    top1_hit = top1_hit & has_far
    top1 = (top1_hit.sum() / has_far.sum().clamp_min(1)).item()

    mismatch = None
    if layer.mode == "sparse" and layer.last_block_idx is not None:
        # the op's own selection at the same rows: [B, Hp, S, K] -> [B, Hp, Q, K]
        op = layer.last_block_idx[:B].long().cpu()
        op = torch.gather(op, 2, qpos[:, None, :, None].expand(-1, Hp, -1, op.shape[-1]))
        op_set = torch.zeros(*op.shape[:-1], nb + 1, dtype=torch.bool)
        op_set.scatter_(-1, torch.where(op < 0, nb, op), True)
        mismatch = int((op_set[..., :nb] != proxy_sel).any(-1).sum().item())
    return dict(recall=recall, recall_nonlocal=nonlocal_recall, mass=covered, recall_top1=top1,
                selection_mismatch=mismatch)


# ---------------------------------------------------------------------------------------------
# Training


def attention_layers(model):
    return [b.attn for b in model.blocks]


@torch.no_grad()
def evaluate(model, ev, args):
    tok, qpos, tgt = ev
    inputs = {}
    hooks = [blk.attn.register_forward_pre_hook(
        lambda mod, a, i=i: inputs.__setitem__(i, a[0].detach()))
        for i, blk in enumerate(model.blocks)]
    for layer in attention_layers(model):
        layer.record_selection = True
    losses, correct, kls = [], 0, []
    for lo in range(0, tok.shape[0], args.batch):
        t, qp_, tg = tok[lo:lo + args.batch], qpos[lo:lo + args.batch], tgt[lo:lo + args.batch]
        logits, kl = model(t.to(args.device), qp_.to(args.device))
        logits = logits.float().cpu()
        losses.append(F.cross_entropy(logits.flatten(0, 1), tg.flatten(), reduction="sum").item())
        correct += (logits.argmax(-1) == tg).sum().item()
        kls.append([float(v) for v in kl])
        if lo == 0:  # recall on the first eval batch (the hooks captured it)
            rec = [proxy_recall(layer, inputs[i], qp_, args.recall_seqs)
                   for i, layer in enumerate(attention_layers(model))]
    for h in hooks:
        h.remove()
    for layer in attention_layers(model):
        layer.record_selection, layer.last_block_idx = False, None
    n = tgt.numel()
    kl_layers = [sum(c) / len(c) for c in zip(*kls)]
    return dict(loss=sum(losses) / n, acc=correct / n, kl=sum(kl_layers), kl_layers=kl_layers,
                recall=sum(r["recall"] for r in rec) / len(rec),
                recall_nonlocal=sum(r["recall_nonlocal"] for r in rec) / len(rec),
                mass=sum(r["mass"] for r in rec) / len(rec),
                recall_top1=sum(r["recall_top1"] for r in rec) / len(rec), recall_layers=rec)


def curriculum(args, task):
    """step -> the Task to sample. The first args.curriculum steps train on shorter sequences
    (min_seq_len, doubling up to seq_len, equal numbers of steps each, the same density of
    pairs, larger batches): at 1024 tokens the attention of a fresh model is spread so thin that it does not
    find the key within a CPU budget, while at 128 it does in ~150 steps, and the content match
    it learns carries over to longer sequences. Evaluation always uses the full length."""
    lengths = []
    n = args.min_seq_len
    while n < task.S and args.curriculum > 0:
        lengths.append(n)
        n *= 2
    tasks = [Task(L, max(task.Q, task.N * L // task.S), task.Q, task.nK, task.nV, task.nF)
             for L in lengths]
    per = args.curriculum / max(len(lengths), 1)

    def pick(step):
        i = int(step // per) if per > 0 else len(tasks)
        return tasks[i] if i < len(tasks) else task
    return pick


def train(run_name, args, task, warmup_steps, final_mode):
    torch.manual_seed(args.seed)
    attn_kw = dict(n_heads=args.heads, n_kv_heads=args.kv_heads, n_proxy_heads=args.proxy_heads,
                   n_proxy_kv_heads=args.proxy_kv_heads, proxy_dim=args.proxy_dim,
                   block_size=args.block_size, top_k=args.top_k, local_blocks=args.local_blocks,
                   kl_coeff=args.kl_coeff, qk_norm=args.qk_norm,
                   attn_dtype=torch.bfloat16 if args.bf16 else None)
    model = Decoder(task.vocab, args.d_model, args.layers, attn_kw,
                    prev_emb=not args.no_prev_emb).to(args.device)
    proxy = {id(p) for layer in attention_layers(model) for p in layer.proxy_parameters()}
    main_params = [p for p in model.parameters() if id(p) not in proxy]
    proxy_params = [p for p in model.parameters() if id(p) in proxy]
    opt = torch.optim.AdamW([dict(params=main_params, weight_decay=args.wd),
                             dict(params=proxy_params, weight_decay=0.0)],
                            lr=args.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.lr_warmup) *
                                              (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))))
    gen = torch.Generator().manual_seed(args.seed + 1)
    stages = curriculum(args, task)
    ev = task.batch(args.eval_seqs, torch.Generator().manual_seed(12345))
    hist = []
    run_loss, run_n, t0 = 0.0, 0, time.time()
    mode = "warmup" if warmup_steps > 0 else final_mode
    set_msa_mode(model, mode)
    print(f"[{run_name}] {sum(p.numel() for p in model.parameters())/1e6:.2f}M params, "
          f"mode {mode}", flush=True)
    for step in range(args.steps + 1):
        if step == warmup_steps and mode != final_mode:
            mode = final_mode
            set_msa_mode(model, mode)
            print(f"[{run_name}] step {step}: switch to {mode}", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            r = evaluate(model, ev, args)
            model.train()
            r.update(step=step, mode=mode, train_loss=run_loss / max(run_n, 1),
                     time_s=time.time() - t0)
            hist.append(r)
            run_loss, run_n = 0.0, 0
            print(f"[{run_name}] step {step:5d} {mode:6s} train {r['train_loss']:.3f} "
                  f"eval {r['loss']:.3f} acc {r['acc']:.3f} kl {r['kl']:.3f} "
                  f"recall {r['recall']:.3f} (nonlocal {r['recall_nonlocal']:.3f}, mass "
                  f"{r['mass']:.3f}, top1 {r['recall_top1']:.3f}) {r['time_s']:.0f}s", flush=True)
        if step == args.steps:
            break
        t_ = stages(step)
        # short sequences come in larger batches: about the same tokens per step
        tok, qpos, tgt = t_.batch(min(args.batch * task.S // t_.S, 8 * args.batch), gen)
        logits, kls = model(tok.to(args.device), qpos.to(args.device))
        task_loss = F.cross_entropy(logits.float().flatten(0, 1), tgt.to(args.device).flatten())
        kl_total = sum(kls)
        # kl_total trains only the proxies (their inputs are detached inside MSAAttention)
        (task_loss + kl_total).backward()
        torch.nn.utils.clip_grad_norm_(main_params, args.clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        run_loss += task_loss.item()
        run_n += 1
    final = dict(hist[-1])
    # the MSA model run densely, and the dense model run sparsely: how much does sparsity cost
    other = "warmup" if final_mode == "sparse" else "sparse"
    set_msa_mode(model, other)
    model.eval()
    final[f"as_{other}"] = {k: v for k, v in evaluate(model, ev, args).items()
                            if k in ("loss", "acc", "kl", "recall", "mass", "recall_top1")}
    return dict(history=hist, final=final, time_s=time.time() - t0)


def plot(path, runs, args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(2, 2, figsize=(11, 7.5))
    panels = [("loss", "eval task loss (answers)", False), ("acc", "answer accuracy", False),
              ("kl", "kl_loss (sum over layers)", False),
              ("recall", f"proxy recall of dense top-{args.top_k} blocks", False)]
    colors = {"msa": "tab:red", "dense": "tab:blue"}
    for a, (key, title, _) in zip(ax.flat, panels):
        for name, run in runs.items():
            xs = [h["step"] for h in run["history"]]
            a.plot(xs, [h[key] for h in run["history"]], color=colors[name], marker=".",
                   label=name)
            if key == "recall":
                a.plot(xs, [h["recall_nonlocal"] for h in run["history"]], color=colors[name],
                       ls="--", label=f"{name} (non-local blocks)")
                a.plot(xs, [h["mass"] for h in run["history"]], color=colors[name], ls=":",
                       label=f"{name} (attention mass covered)")
                a.plot(xs, [h["recall_top1"] for h in run["history"]], color=colors[name],
                       ls="-.", label=f"{name} (heaviest far block)")
        if key == "loss":
            for name, run in runs.items():
                xs = [h["step"] for h in run["history"]][1:]
                a.plot(xs, [h["train_loss"] for h in run["history"]][1:], color=colors[name],
                       alpha=0.35, label=f"{name} train")
        if args.warmup_steps < args.steps:
            a.axvline(args.warmup_steps, color="gray", ls="--", lw=1)
        a.set_title(title)
        a.set_xlabel("step")
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.suptitle(f"key-value retrieval, S={args.seq_len}, block {args.block_size}, "
                 f"top-{args.top_k} of {math.ceil(args.seq_len / args.block_size)} blocks; "
                 f"dashed line: warm-up -> sparse")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--long", action="store_true", help="H200 preset: S=16384, BLK=128, K=16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--name", default=None, help="results file stem (default from the preset)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument("--queries", type=int, default=8)
    ap.add_argument("--keys", type=int, default=16)
    ap.add_argument("--values", type=int, default=16)
    ap.add_argument("--fillers", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--proxy-heads", type=int, default=2)
    ap.add_argument("--proxy-kv-heads", type=int, default=1)
    ap.add_argument("--proxy-dim", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--local-blocks", type=int, default=1)
    ap.add_argument("--kl-coeff", type=float, default=1.0)
    ap.add_argument("--qk-norm", action="store_true",
                    help="RMSNorm per head on q/k and qp/kp (off: with unit norm gains the "
                         "logits stay too flat to pick 1 key of 1000 within a short run)")
    ap.add_argument("--no-prev-emb", action="store_true",
                    help="drop the previous-token embedding (then an induction circuit is needed)")
    ap.add_argument("--bf16", action="store_true", help="run the attention op in bf16")
    ap.add_argument("--steps", type=int, default=450)
    ap.add_argument("--warmup-steps", type=int, default=300,
                    help="dense warm-up steps of the MSA run before it goes sparse")
    ap.add_argument("--dense-mode", default="dense", choices=("warmup", "dense"),
                    help="mode of the dense comparison run (dense = SDPA, the cheapest; warmup also trains its proxy)")
    ap.add_argument("--skip-dense", action="store_true")
    ap.add_argument("--curriculum", type=int, default=200,
                    help="steps on shorter sequences first (0: always seq-len)")
    ap.add_argument("--min-seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--lr-warmup", type=int, default=30)
    ap.add_argument("--wd", type=float, default=0.01)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-seqs", type=int, default=32)
    ap.add_argument("--recall-seqs", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.long:
        # Head dims 64 (d_model / heads and proxy_dim): the CUDA kernels take D, Dp in {64, 128}.
        long = dict(seq_len=16384, pairs=64, queries=16, keys=64, values=64, d_model=256,
                    layers=2, heads=4, kv_heads=2, proxy_heads=2, proxy_dim=64, block_size=128,
                    top_k=16, steps=2000, warmup_steps=1200, curriculum=800, min_seq_len=256,
                    batch=8, eval_every=100, eval_seqs=32, lr=3e-3, bf16=True)
        given = {a.lstrip("-").split("=")[0].replace("-", "_")
                 for a in (argv or sys.argv[1:]) if a.startswith("--")}
        for k, v in long.items():
            if k not in given:
                setattr(args, k, v)
    name = args.name or ("retrieval_long" if args.long else "retrieval_cpu")
    torch.set_num_threads(args.threads)
    task = Task(args.seq_len, args.pairs, args.queries, args.keys, args.values, args.fillers)

    t0 = time.time()
    runs = {"msa": train("msa", args, task, args.warmup_steps, "sparse")}
    if not args.skip_dense:
        runs["dense"] = train("dense", args, task, 0, args.dense_mode)
    total = time.time() - t0

    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    summary = {n: dict(final_acc=r["final"]["acc"], final_loss=r["final"]["loss"],
                       final_kl=r["final"]["kl"], final_recall=r["final"]["recall"],
                       final_recall_nonlocal=r["final"]["recall_nonlocal"],
                       final_mass=r["final"]["mass"],
                       final_recall_top1=r["final"]["recall_top1"],
                       final_recall_top1_layers=[x["recall_top1"] for x in r["final"]["recall_layers"]],
                       final_recall_layers=[x["recall"] for x in r["final"]["recall_layers"]],
                       time_s=r["time_s"])
               for n, r in runs.items()}
    blob = dict(config=vars(args), task=dict(vocab=task.vocab, context=task.ctx),
                torch=torch.__version__, total_time_s=total, summary=summary, runs=runs)
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(blob, f, indent=1)
    plot(os.path.join(out_dir, name + ".png"), runs, args)
    print(json.dumps(summary, indent=1))
    print(f"wrote {out_dir}/{name}.json and .png in {total:.0f}s")


if __name__ == "__main__":
    main()
