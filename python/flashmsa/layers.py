"""A drop-in causal self-attention module built on MiniMax Sparse Attention (MSA).

    from flashmsa.layers import MSAAttention
    attn = MSAAttention(d_model=512, n_heads=8, n_kv_heads=2, n_proxy_heads=2, n_proxy_kv_heads=1,
                        block_size=128, top_k=16)
    y, kl_loss = attn(x)                      # x [B, S, d_model]
    loss = task_loss(y) + kl_loss             # kl_loss trains the proxy (and only the proxy)

See docs/training.md for the training recipe (dense warm-up, then sparse).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MSAAttention", "MSAProjections", "apply_rope", "positions_from_cu_seqlens",
           "set_msa_mode", "MODES"]

# "dense" is plain causal attention (torch SDPA) with the proxy idle: an exact dense baseline
# that needs neither the extension nor the quadratic proxy distillation of "warmup".
MODES = ("warmup", "sparse", "dense")


class MSAProjections(NamedTuple):
    """Per-head inputs of the attention op, after QK-norm and RoPE (same layout as x's tokens)."""
    q: torch.Tensor  # [..., H, D]
    k: torch.Tensor  # [..., Hkv, D]
    v: torch.Tensor  # [..., Hkv, Dv]
    qp: torch.Tensor  # [..., Hp, Dp]
    kp: torch.Tensor  # [..., Hpk, Dp]


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of every packed token inside its own sequence (RoPE restarts per sequence)."""
    cu = torch.as_tensor(cu_seqlens).to(torch.long)  # [B+1]
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths, output_size=total)  # [T]
    return torch.arange(total, device=cu.device) - starts


def _rope_tables(pos: torch.Tensor, dim: int, theta: float):
    """cos/sin [..., 1, dim/2] for integer positions pos [...], computed in fp32."""
    inv_freq = theta ** (-torch.arange(0, dim, 2, device=pos.device, dtype=torch.float32) / dim)
    ang = pos.to(torch.float32)[..., None] * inv_freq  # [..., dim/2]
    return ang.cos()[..., None, :], ang.sin()[..., None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, half-split convention. x [..., heads, dim]; cos/sin [..., 1, dim/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.to(x.dtype)


def set_msa_mode(model: nn.Module, mode: str) -> None:
    """Switch every MSAAttention inside `model` to `mode` ("warmup", "sparse" or "dense")."""
    for m in model.modules():
        if isinstance(m, MSAAttention):
            m.set_mode(mode)


class MSAAttention(nn.Module):
    """Causal multi-head self-attention with an MSA block selector ("proxy").

    Main path: q = Wq x (n_heads x head_dim), k/v = Wk/Wv x (n_kv_heads, GQA), optional per-head
    RMSNorm on q and k, RoPE on q and k, attention, then Wo. Proxy path: qp = Wqp x
    (n_proxy_heads x proxy_dim), kp = Wkp x (n_proxy_kv_heads), its own optional RMSNorm, RoPE.
    Proxy head p scores key blocks for the main heads p*m .. p*m+m-1 (m = n_heads/n_proxy_heads).

    Modes (attribute `mode`, or `set_mode`):
      "sparse": each proxy head selects `top_k` blocks of `block_size` keys per query (the
                `local_blocks` most recent blocks always), main attention runs on them only.
      "warmup": dense causal attention; the proxy is distilled on all causal keys (quadratic).
                Train a while in this mode first so the proxy learns where attention goes.
      "dense":  dense causal attention through torch SDPA, proxy unused, kl_loss = 0.
    forward returns (y, kl_loss). kl_loss = kl_coeff * mean KL(main heads' attention || proxy's);
    add it to the training loss. With `detach_proxy_input` (default) the proxy reads x.detach(),
    so kl_loss trains exactly the proxy's parameters (Wqp, Wkp, their norms) and the task loss
    never reaches them: the selection is not differentiable.

    Shapes: x [B, S, d_model] (cu_seqlens None), or packed x [T, d_model] / [1, T, d_model] with
    cu_seqlens [B+1] (int32 offsets; sequences do not see each other and RoPE restarts at each).
    Constraints (from the op): n_heads % n_kv_heads == 0, n_heads % n_proxy_heads == 0,
    n_proxy_heads % n_proxy_kv_heads == 0; head_dim and proxy_dim even (RoPE).
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: Optional[int] = None, *,
                 head_dim: Optional[int] = None, v_head_dim: Optional[int] = None,
                 n_proxy_heads: Optional[int] = None, n_proxy_kv_heads: int = 1,
                 proxy_dim: Optional[int] = None, block_size: int = 128, top_k: int = 16,
                 local_blocks: int = 1, kl_coeff: float = 1.0, qk_norm: bool = True,
                 rope_theta: float = 10000.0, bias: bool = False, mode: str = "sparse",
                 detach_proxy_input: bool = True, deterministic: bool = False,
                 attn_dtype: Optional[torch.dtype] = None, norm_eps: float = 1e-6, device=None,
                 dtype=None):
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        head_dim = d_model // n_heads if head_dim is None else head_dim
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        n_proxy_heads = n_kv_heads if n_proxy_heads is None else n_proxy_heads
        proxy_dim = head_dim if proxy_dim is None else proxy_dim
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        if n_heads % n_proxy_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_proxy_heads "
                             f"({n_proxy_heads})")
        if n_proxy_heads % n_proxy_kv_heads:
            raise ValueError(f"n_proxy_heads ({n_proxy_heads}) must be a multiple of "
                             f"n_proxy_kv_heads ({n_proxy_kv_heads})")
        if head_dim % 2 or proxy_dim % 2:
            raise ValueError("head_dim and proxy_dim must be even (RoPE rotates pairs)")
        if block_size < 1 or top_k < 1 or local_blocks < 1:
            raise ValueError("block_size, top_k and local_blocks must be >= 1")
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.head_dim, self.v_head_dim = head_dim, v_head_dim
        self.n_proxy_heads, self.n_proxy_kv_heads, self.proxy_dim = (
            n_proxy_heads, n_proxy_kv_heads, proxy_dim)
        self.block_size, self.top_k, self.local_blocks = block_size, top_k, local_blocks
        self.kl_coeff, self.rope_theta = kl_coeff, rope_theta
        self.detach_proxy_input, self.deterministic = detach_proxy_input, deterministic
        # The op's input dtype (e.g. torch.bfloat16 for the CUDA kernels); None keeps q's dtype.
        self.attn_dtype = attn_dtype
        # When True, forward keeps the selection of its last sparse call in `last_block_idx`
        # (int32 [B, Hp, S, K] or [Hp, T, K]) for diagnostics such as the proxy's recall.
        self.record_selection = False
        self.last_block_idx: Optional[torch.Tensor] = None
        self.set_mode(mode)

        kw = dict(device=device, dtype=dtype)
        self.wq = nn.Linear(d_model, n_heads * head_dim, bias=bias, **kw)
        self.wk = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias, **kw)
        self.wv = nn.Linear(d_model, n_kv_heads * v_head_dim, bias=bias, **kw)
        self.wo = nn.Linear(n_heads * v_head_dim, d_model, bias=bias, **kw)
        self.wqp = nn.Linear(d_model, n_proxy_heads * proxy_dim, bias=bias, **kw)
        self.wkp = nn.Linear(d_model, n_proxy_kv_heads * proxy_dim, bias=bias, **kw)
        if qk_norm:
            self.q_norm = nn.RMSNorm(head_dim, eps=norm_eps, **kw)
            self.k_norm = nn.RMSNorm(head_dim, eps=norm_eps, **kw)
            self.qp_norm = nn.RMSNorm(proxy_dim, eps=norm_eps, **kw)
            self.kp_norm = nn.RMSNorm(proxy_dim, eps=norm_eps, **kw)
        else:
            self.q_norm = self.k_norm = self.qp_norm = self.kp_norm = None

    def set_mode(self, mode: str) -> "MSAAttention":
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        return self

    def proxy_parameters(self):
        """The parameters trained by kl_loss alone (useful for separate optimiser groups)."""
        mods = [self.wqp, self.wkp] + [m for m in (self.qp_norm, self.kp_norm) if m is not None]
        for m in mods:
            yield from m.parameters()

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, heads={self.n_heads}/{self.n_kv_heads}x{self.head_dim}, "
                f"proxy={self.n_proxy_heads}/{self.n_proxy_kv_heads}x{self.proxy_dim}, "
                f"block_size={self.block_size}, top_k={self.top_k}, "
                f"local_blocks={self.local_blocks}, kl_coeff={self.kl_coeff}, mode={self.mode!r}")

    # -----------------------------------------------------------------------------------------

    def _flatten_packed(self, x: torch.Tensor, cu_seqlens) -> torch.Tensor:
        if cu_seqlens is None:
            if x.dim() != 3:
                raise ValueError(f"x must be [B, S, d_model] without cu_seqlens, got {tuple(x.shape)}")
            return x
        if x.dim() == 3 and x.shape[0] == 1:
            x = x[0]
        if x.dim() != 2:
            raise ValueError(f"x must be [T, d_model] or [1, T, d_model] with cu_seqlens, got "
                             f"{tuple(x.shape)}")
        return x

    def project(self, x: torch.Tensor,
                cu_seqlens: Union[None, torch.Tensor, Sequence[int]] = None) -> MSAProjections:
        """q, k, v, qp, kp for x (after QK-norm and RoPE), shaped [B, S, heads, dim] or
        [T, heads, dim]. The proxy's are computed from x.detach() if detach_proxy_input."""
        x = self._flatten_packed(x, cu_seqlens)
        lead = x.shape[:-1]  # (B, S) or (T,)
        if cu_seqlens is None:
            pos = torch.arange(x.shape[1], device=x.device)  # [S], broadcast over B
        else:
            cu = torch.as_tensor(cu_seqlens, dtype=torch.int32)
            pos = positions_from_cu_seqlens(cu.to(x.device), x.shape[0])  # [T]

        q = self.wq(x).view(*lead, self.n_heads, self.head_dim)
        k = self.wk(x).view(*lead, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(*lead, self.n_kv_heads, self.v_head_dim)
        xp = x.detach() if self.detach_proxy_input else x
        qp = self.wqp(xp).view(*lead, self.n_proxy_heads, self.proxy_dim)
        kp = self.wkp(xp).view(*lead, self.n_proxy_kv_heads, self.proxy_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
            qp, kp = self.qp_norm(qp), self.kp_norm(kp)
        cos, sin = _rope_tables(pos, self.head_dim, self.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.proxy_dim != self.head_dim:
            cos, sin = _rope_tables(pos, self.proxy_dim, self.rope_theta)
        qp, kp = apply_rope(qp, cos, sin), apply_rope(kp, cos, sin)
        return MSAProjections(q, k, v, qp, kp)

    def _dense_sdpa(self, q, k, v, cu_seqlens):
        """Plain causal attention; packed input runs sequence by sequence."""
        def one(q1, k1, v1):  # [S, heads, dim] each -> [S, H, Dv]
            o = F.scaled_dot_product_attention(q1.transpose(0, 1), k1.transpose(0, 1),
                                               v1.transpose(0, 1), is_causal=True,
                                               enable_gqa=self.n_heads != self.n_kv_heads)
            return o.transpose(0, 1)

        if cu_seqlens is None:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True,
                                               enable_gqa=self.n_heads != self.n_kv_heads)
            return o.transpose(1, 2)
        offs = [int(c) for c in torch.as_tensor(cu_seqlens).tolist()]
        parts = [one(q[a:b], k[a:b], v[a:b]) for a, b in zip(offs[:-1], offs[1:]) if b > a]
        if not parts:
            return q.new_zeros(0, self.n_heads, self.v_head_dim)
        return torch.cat(parts)

    def forward(self, x: torch.Tensor,
                cu_seqlens: Union[None, torch.Tensor, Sequence[int]] = None,
                kl_value_out: Optional[torch.Tensor] = None, need_kl: bool = True):
        """x [B, S, d_model] (or packed [T, d_model] with cu_seqlens) -> (y like x, kl_loss 0-dim fp32).

        kl_value_out (one float32 value on x's device, optional): msa_attention's; the backward
        writes kl_loss's value there and the forward skips forming it (kl_loss then holds 0 and
        only carries the proxy's gradient). Dense mode writes 0.
        need_kl=False: msa_attention's; nobody reads the KL value (e.g. evaluation), so the
        forward does not form it and kl_loss holds 0 (still carrying the proxy's gradient); an
        error beside kl_value_out, in every mode."""
        from flashmsa import _check_kl_request, msa_attention  # the extension loads with the package
        _check_kl_request(kl_value_out, need_kl)  # in every mode, dense included
        in_shape = x.shape
        p = self.project(x, cu_seqlens)
        # the op wants one dtype for all five inputs (autocast may leave the norms in fp32)
        dt = p.q.dtype if self.attn_dtype is None else self.attn_dtype
        q, k, v, qp, kp = (t.to(dt) for t in p)
        if self.mode == "dense":
            o = self._dense_sdpa(q, k, v, cu_seqlens)
            kl = torch.zeros((), dtype=torch.float32, device=x.device)
            if kl_value_out is not None:
                kl_value_out.zero_()
        else:
            r = msa_attention(q, k, v, qp, kp, cu_seqlens, block_size=self.block_size,
                              top_k=self.top_k, local_blocks=self.local_blocks,
                              kl_coeff=self.kl_coeff, mode=self.mode,
                              deterministic=self.deterministic, kl_value_out=kl_value_out,
                              need_kl=need_kl)
            o, kl = r.out, r.kl_loss
            if self.record_selection:
                self.last_block_idx = r.block_idx
        if not torch.is_autocast_enabled(o.device.type):
            o = o.to(self.wo.weight.dtype)
        y = self.wo(o.reshape(*o.shape[:-2], self.n_heads * self.v_head_dim))
        return y.reshape(*in_shape[:-1], self.d_model), kl
