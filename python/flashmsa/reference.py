"""An eager PyTorch implementation of MSA, written to read like the spec (shared/spec/msa.md).

It is the ground truth of the Python tests and the eager baseline of bench/cpu_vs_eager.py:
dense masked matrices per sequence (memory grows with S^2), differentiable by autograd, the
distillation teacher detached. Same arguments and layouts as flashmsa.msa_attention, plus
`compute_dtype` (the precision of all arithmetic) and an optional fixed selection `block_idx`
(so a test can check attention and gradients independently of near-tie selection flips).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F


class ReferenceOutput(NamedTuple):
    out: torch.Tensor  # like q's layout, the inputs' dtype
    kl_loss: torch.Tensor  # 0-dim fp32
    block_idx: Optional[torch.Tensor]  # int32 [B, Hp, S, K] / [Hp, T, K]; None in warm-up mode
    lse: torch.Tensor  # fp32 [H, T] (packed order of tokens), natural log


def select_blocks(s: torch.Tensor, block_size: int, top_k: int,
                  local_blocks: int) -> torch.Tensor:
    """Steps 2-4 of the forward for one sequence.

    s: [Hp, n, n] causal proxy scores (any value above the diagonal; it is masked here).
    Returns block indices [Hp, n, K] int64: ascending, -1 padding last.
    """
    Hp, n, _ = s.shape
    nb = (n + block_size - 1) // block_size
    pos = torch.arange(n, device=s.device)
    causal = pos[None, :] <= pos[:, None]  # [t, j]
    # 2. block max-pool over the causal part of each block
    masked = s.masked_fill(~causal, -math.inf)
    masked = F.pad(masked, (0, nb * block_size - n), value=-math.inf)
    bs = masked.view(Hp, n, nb, block_size).amax(dim=-1)  # [Hp, n, nb]
    # 3. the query's own block (and the local_blocks-1 before it) always wins
    n_loc = (pos // block_size)[:, None]  # [n, 1]
    blocks = torch.arange(nb, device=s.device)[None, :]  # [1, nb]
    visible = blocks <= n_loc
    local = visible & (blocks > n_loc - local_blocks)
    bs = bs.masked_fill(local, math.inf).masked_fill(~visible, -math.inf)
    # 4. top-K, ties to the lower block index: a stable descending sort keeps index order
    order = torch.sort(bs, dim=-1, descending=True, stable=True).indices
    kk = min(top_k, nb)
    order = order[..., :kk]
    count = torch.clamp(n_loc + 1, max=top_k)  # visible blocks that are selected, [n, 1]
    keep = torch.arange(kk, device=s.device)[None, None, :] < count[None]  # [1, n, kk]
    chosen = torch.where(keep, order, torch.full_like(order, nb))  # nb sorts after real blocks
    chosen = chosen.sort(dim=-1).values
    chosen = torch.where(chosen == nb, torch.full_like(chosen, -1), chosen)
    if kk < top_k:
        chosen = F.pad(chosen, (0, top_k - kk), value=-1)
    return chosen


def _key_mask_from_blocks(block_idx: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    """[Hp, n, K] block indices -> [Hp, n, n] bool: key j is in a selected block and j <= t."""
    Hp = block_idx.shape[0]
    nb = (n + block_size - 1) // block_size
    block_mask = torch.zeros(Hp, n, nb + 1, dtype=torch.bool, device=block_idx.device)
    # padding (-1) is routed to the spare column nb and dropped
    idx = torch.where(block_idx < 0, torch.full_like(block_idx, nb), block_idx).long()
    block_mask.scatter_(-1, idx, True)
    pos = torch.arange(n, device=block_idx.device)
    key_mask = block_mask[:, :, pos // block_size]
    return key_mask & (pos[None, :] <= pos[:, None])[None]


def _one_sequence(q, k, v, qp, kp, *, block_size, top_k, local_blocks, scale, proxy_scale,
                  sparse, block_idx):
    """One sequence, all tensors already in the compute dtype.

    q [n, H, D], k [n, Hkv, D], v [n, Hkv, Dv], qp [n, Hp, Dp], kp [n, Hpk, Dp],
    block_idx: None (select here) or [Hp, n, K].
    Returns o [n, H, Dv], the sum over (p, t) of KL[p, t], block_idx [Hp, n, K] (or None), lse [H, n].
    """
    n, H, _ = q.shape
    Hkv, Hp, Hpk = k.shape[1], qp.shape[1], kp.shape[1]
    m = H // Hp
    kv_of = torch.arange(H, device=q.device) // (H // Hkv)  # main head -> kv head
    p_of = torch.arange(H, device=q.device) // m  # main head -> proxy head
    pk_of = torch.arange(Hp, device=q.device) // (Hp // Hpk)  # proxy head -> proxy key head
    pos = torch.arange(n, device=q.device)
    causal = pos[None, :] <= pos[:, None]

    # 1. proxy scores s[p, t, j]
    s = proxy_scale * torch.einsum("tpd,jpd->ptj", qp, kp[:, pk_of])

    # 2-4. selection (not differentiable), or the dense causal set in warm-up mode
    if sparse:
        if block_idx is None:
            with torch.no_grad():
                block_idx = select_blocks(s.detach(), block_size, top_k, local_blocks)
        key_mask = _key_mask_from_blocks(block_idx, n, block_size)  # [Hp, n, n]
    else:
        key_mask = causal.expand(Hp, n, n)

    # 5. main attention of head h over the keys its proxy head selected
    logits = scale * torch.einsum("thd,jhd->htj", q, k[:, kv_of])
    logits = logits.masked_fill(~key_mask[p_of], -math.inf)
    lse = torch.logsumexp(logits, dim=-1)  # [H, n]
    P = torch.softmax(logits, dim=-1)  # [H, n, n]
    o = torch.einsum("htj,jhd->thd", P, v[:, kv_of])

    # 6. distillation: teacher = mean attention of the group (detached), student = proxy softmax
    teacher = P.detach().view(Hp, m, n, n).mean(dim=1)  # heads p*m .. p*m+m-1 form group p
    log_student = torch.log_softmax(s.masked_fill(~key_mask, -math.inf), dim=-1)
    log_student = log_student.masked_fill(~key_mask, 0.0)  # keep -inf out of the products
    log_teacher = torch.log(teacher.clamp_min(torch.finfo(teacher.dtype).tiny))
    terms = torch.where(teacher > 0, teacher * (log_teacher - log_student),
                        torch.zeros((), dtype=s.dtype, device=s.device))  # 0 log 0 = 0
    return o, terms.sum(), block_idx, lse


def msa_reference(q, k, v, qp, kp, cu_seqlens=None, *, block_size=128, top_k=16,
                  local_blocks=1, scale=None, proxy_scale=None, kl_coeff=1.0, mode="sparse",
                  compute_dtype=torch.float32, block_idx=None) -> ReferenceOutput:
    """MSA by the book. Layouts as flashmsa.msa_attention: [B, S, heads, dim] without
    cu_seqlens, [T, heads, dim] with it. `block_idx`, when given, is the packed [Hp, T, K]
    selection to use instead of selecting (sparse mode only)."""
    if mode not in ("sparse", "warmup"):
        raise ValueError(f"mode must be 'sparse' or 'warmup', got {mode!r}")
    sparse = mode == "sparse"
    batched = cu_seqlens is None
    in_dtype = q.dtype
    if batched:
        B, S = q.shape[0], q.shape[1]
        q, k, v, qp, kp = (t.reshape(B * S, *t.shape[2:]) for t in (q, k, v, qp, kp))
        offsets = [b * S for b in range(B + 1)]
    else:
        offsets = [int(x) for x in torch.as_tensor(cu_seqlens).tolist()]
    T, H, D = q.shape
    Hp, Dp = qp.shape[1], qp.shape[2]
    scale = D ** -0.5 if scale is None else scale
    proxy_scale = Dp ** -0.5 if proxy_scale is None else proxy_scale
    q, k, v, qp, kp = (t.to(compute_dtype) for t in (q, k, v, qp, kp))

    outs, lses, idxs = [], [], []
    kl_sum = torch.zeros((), dtype=compute_dtype, device=q.device)
    for b in range(len(offsets) - 1):
        lo, hi = offsets[b], offsets[b + 1]
        if hi == lo:
            continue
        given = None if block_idx is None else block_idx[:, lo:hi].to(q.device)
        o, kl, idx, lse = _one_sequence(
            q[lo:hi], k[lo:hi], v[lo:hi], qp[lo:hi], kp[lo:hi], block_size=block_size,
            top_k=top_k, local_blocks=local_blocks, scale=scale, proxy_scale=proxy_scale,
            sparse=sparse, block_idx=given)
        outs.append(o)
        lses.append(lse)
        idxs.append(idx)
        kl_sum = kl_sum + kl

    Dv = v.shape[2]
    out = torch.cat(outs) if outs else q.new_zeros((0, H, Dv))
    lse = torch.cat(lses, dim=1) if lses else q.new_zeros((H, 0))
    kl_loss = (kl_coeff * kl_sum / max(Hp * T, 1)).to(torch.float32)
    sel = None
    if sparse:
        sel = torch.cat(idxs, dim=1).to(torch.int32) if idxs else \
            torch.zeros((Hp, 0, top_k), dtype=torch.int32, device=q.device)
    out = out.to(in_dtype)
    if batched:
        out = out.view(B, S, H, Dv)
        if sel is not None:
            sel = sel.view(Hp, B, S, top_k).permute(1, 0, 2, 3)
    return ReferenceOutput(out, kl_loss, sel, lse.to(torch.float32))
