"""Shared pieces of the Python tests: random problems, error measures, a selection check."""
import math

import torch

from flashmsa.reference import msa_reference


def make_inputs(shape_prefix, H, Hkv, Hp, Hpk, D, Dv, Dp, dtype, device, requires_grad=True,
                generator=None):
    """Random N(0,1) q, k, v, qp, kp with leading dimensions shape_prefix ([B, S] or [T])."""
    dims = ((H, D), (Hkv, D), (Hkv, Dv), (Hp, Dp), (Hpk, Dp))
    out = []
    for h, d in dims:
        t = torch.randn(*shape_prefix, h, d, generator=generator, dtype=torch.float32)
        t = t.to(device=device, dtype=dtype)
        out.append(t.requires_grad_(requires_grad))
    return out


def rel_l2(a, b):
    a = a.detach().double().cpu()
    b = b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def packed_offsets(cu_seqlens, T):
    return [int(x) for x in cu_seqlens.tolist()] if cu_seqlens is not None else [0, T]


def check_selection(block_idx, qp, kp, cu, block_size, top_k, local_blocks, proxy_scale=None,
                    tol=1e-4):
    """msa.md's acceptance rule for a selection computed in another precision: the row is
    ascending with -1 padding last, holds min(K, visible) blocks, the local blocks are present,
    and every selected block scores >= the K-th best fp64 score minus tol."""
    qp = qp.detach().double().cpu()
    kp = kp.detach().double().cpu()
    block_idx = block_idx.cpu()
    Hp, Hpk, Dp = qp.shape[1], kp.shape[1], qp.shape[2]
    scale_p = Dp ** -0.5 if proxy_scale is None else proxy_scale
    offsets = [int(x) for x in cu.tolist()]
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        n = hi - lo
        if n == 0:
            continue
        nb = (n + block_size - 1) // block_size
        kp_h = kp[lo:hi][:, torch.arange(Hp) // (Hp // Hpk)]
        s = scale_p * torch.einsum("tpd,jpd->ptj", qp[lo:hi], kp_h)
        pos = torch.arange(n)
        s = s.masked_fill(pos[None, :] > pos[:, None], -math.inf)
        s = torch.nn.functional.pad(s, (0, nb * block_size - n), value=-math.inf)
        bs = s.view(Hp, n, nb, block_size).amax(-1)  # [Hp, n, nb]
        sel = block_idx[:, lo:hi].long()  # [Hp, n, K]
        n_loc = pos // block_size
        visible = n_loc + 1
        count = torch.clamp(visible, max=top_k)
        valid = sel >= 0
        assert torch.equal(valid.sum(-1), count[None].expand(Hp, n)), "wrong number of blocks"
        assert torch.equal(valid, (torch.arange(top_k)[None, None] < count[None, :, None])
                           .expand_as(valid)), \
            "-1 padding must come last"
        ascending = (sel[..., 1:] > sel[..., :-1]) | ~valid[..., 1:]
        assert bool(ascending.all()), "indices must ascend"
        assert bool((sel < visible[None, :, None]).all()), "a future block was selected"
        for i in range(local_blocks):
            want = n_loc - i
            ok = ((sel == want[None, :, None]).any(-1)) | (want[None, :] < 0)
            assert bool(ok.all()), "a local block is missing"
        # K-th best score among the non-local visible blocks
        blocks = torch.arange(nb)
        local = (blocks[None, :] <= n_loc[:, None]) & (blocks[None, :] > n_loc[:, None] - local_blocks)
        free = bs.masked_fill(local[None], math.inf)
        kth = torch.sort(free, dim=-1, descending=True).values[..., min(top_k, nb) - 1]
        chosen = torch.gather(free, -1, sel.clamp_min(0))
        ok = (~valid) | (chosen >= kth[..., None] - tol)
        assert bool(ok.all()), "a selected block scores below the K-th best"


def reference_grads(inputs, cu, d_o, g, **kw):
    """fp64 reference output, kl_loss and the five gradients of <o, d_o> + g * kl_loss."""
    leaves = [t.detach().double().requires_grad_(True) for t in inputs]
    r = msa_reference(*leaves, cu, compute_dtype=torch.float64, **kw)
    loss = (r.out.double() * d_o.double()).sum() + g * r.kl_loss.double()
    grads = torch.autograd.grad(loss, leaves)
    return r, grads
