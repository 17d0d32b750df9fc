"""flashmsa: MiniMax Sparse Attention (MSA) for PyTorch.

    out, kl_loss, block_idx = flashmsa.msa_attention(q, k, v, qp, kp)

The math is the project's spec (shared/spec/msa.md); flashmsa.reference holds an eager PyTorch
version of it. The operators torch.ops.flashmsa.forward / backward come from the C++ extension
(flashmsa/_C.so, built by `pip install .`); this module adds autograd, fake-tensor kernels (for
torch.compile / torch.export) and the user-facing function.
"""
from __future__ import annotations

import glob
import os
from typing import NamedTuple, Optional, Sequence, Union

import torch

__all__ = ["MSAOutput", "msa_attention", "cuda_built", "library_path"]


def _find_library() -> str:
    # FLASHMSA_TORCH_LIBRARY lets a plain CMake build (build-*/python/_C.so) be used without pip.
    env = os.environ.get("FLASHMSA_TORCH_LIBRARY")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_C*.so")))
    if not found:
        raise ImportError(
            "flashmsa: the compiled extension _C.so is missing next to " + here + "; install the "
            "package with `pip install --no-build-isolation .` or set FLASHMSA_TORCH_LIBRARY")
    return found[0]


library_path = _find_library()
torch.ops.load_library(library_path)

_ops = torch.ops.flashmsa
_MODES = ("sparse", "warmup")


def cuda_built() -> bool:
    """Whether the extension was built with the CUDA backend."""
    return bool(_ops.cuda_built())


class MSAOutput(NamedTuple):
    out: torch.Tensor  # [B, S, H, Dv] or [T, H, Dv], the inputs' dtype
    kl_loss: torch.Tensor  # 0-dim fp32, differentiable: its gradient trains qp and kp
    block_idx: Optional[torch.Tensor]  # int32 [B, Hp, S, K] or [Hp, T, K]; None in warm-up mode


# ---------------------------------------------------------------------------------------------
# Fake kernels: shapes and dtypes only, for FakeTensor / torch.compile / torch.export.


def _selection_index_size(T, B, Hp, K, block_size):
    """int32 elements of the forward's selection index: src/selection_index_layout.h's formula
    (four arrays, each padded to 64 elements), from shapes only."""
    def padded(n):
        return (n + 63) // 64 * 64
    nb_max = (T + B * (block_size - 1)) // block_size
    return (padded(B + 1) + padded(torch.sym_max(nb_max, 1)) + padded(Hp * T * K)
            + padded(Hp * nb_max + 1))


@torch.library.register_fake("flashmsa::forward")
def _forward_fake(q, k, v, qp, kp, cu_seqlens, cu_seqlens_host, block_size, top_k, local_blocks,
                  scale, proxy_scale, kl_coeff, attention_mode, deterministic, kl_out=None):
    T, H, Dv, Hp = q.shape[0], q.shape[1], v.shape[2], qp.shape[1]
    o = q.new_empty((T, H, Dv))
    lse = q.new_empty((H, T), dtype=torch.float32)
    shape = (Hp, T, top_k) if attention_mode == "sparse" else (0,)
    block_idx = q.new_empty(shape, dtype=torch.int32)
    kl = q.new_empty((), dtype=torch.float32)
    n = _selection_index_size(T, cu_seqlens.shape[0] - 1, Hp, top_k, block_size) \
        if attention_mode == "sparse" else 0
    selection_index = q.new_empty((n,), dtype=torch.int32)
    return o, lse, block_idx, kl, selection_index


@torch.library.register_fake("flashmsa::backward")
def _backward_fake(q, k, v, qp, kp, cu_seqlens, cu_seqlens_host, block_idx, o, lse, d_o, kl_grad,
                   block_size, top_k, local_blocks, scale, proxy_scale, kl_coeff,
                   attention_mode, deterministic, kl_out=None, selection_index=None):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format),
            torch.empty_like(qp, memory_format=torch.contiguous_format),
            torch.empty_like(kp, memory_format=torch.contiguous_format))


# ---------------------------------------------------------------------------------------------
# Autograd: the forward op saves what the fused backward needs (the selection index too, so the
# backward does not build it again); lse, block_idx and the index carry no gradient. The KL
# gradient enters the backward as a tensor (no host synchronisation). kl_out, a forward input
# that needs no gradient, is handed to the backward op, which writes the kl_loss value into it (a
# mutation of a forward input in the backward, which torch.compile carries).


def _setup_context(ctx, inputs, output):
    (q, k, v, qp, kp, cu_seqlens, cu_seqlens_host, *options, kl_out) = inputs
    o, lse, block_idx, kl, selection_index = output
    ctx.save_for_backward(q, k, v, qp, kp, cu_seqlens, cu_seqlens_host, block_idx, o, lse, kl_out,
                          selection_index)
    ctx.options = options
    ctx.mark_non_differentiable(lse, block_idx, selection_index)


def _backward(ctx, d_o, d_lse, d_block_idx, d_kl, d_selection_index):
    (q, k, v, qp, kp, cu_seqlens, cu_seqlens_host, block_idx, o, lse, kl_out,
     selection_index) = ctx.saved_tensors
    if d_o is None:
        d_o = torch.zeros_like(o)
    if d_kl is None:
        d_kl = torch.zeros((), dtype=torch.float32, device=o.device)
    dq, dk, dv, dqp, dkp = _ops.backward(q, k, v, qp, kp, cu_seqlens, cu_seqlens_host, block_idx,
                                         o, lse, d_o, d_kl, *ctx.options, kl_out, selection_index)
    # No gradient for cu_seqlens, cu_seqlens_host, the options and kl_out.
    return (dq, dk, dv, dqp, dkp) + (None,) * (3 + len(ctx.options))


torch.library.register_autograd("flashmsa::forward", _backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# The user API.


def _fail(msg: str):
    raise RuntimeError("flashmsa: " + msg)


def _check_kl_request(kl_value_out, need_kl: bool):
    if kl_value_out is not None and not need_kl:
        _fail("argument 'kl_value_out' asks for the KL value, and need_kl=False says nobody "
              "reads it: pass one of them")


def _as_cu_seqlens(cu_seqlens, device: torch.device):
    """(device copy, host copy or None). A CPU tensor or a list given for CUDA inputs doubles as
    the host copy, which spares the library a device-to-host synchronisation."""
    if isinstance(cu_seqlens, (list, tuple)):
        cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int32)
    if not isinstance(cu_seqlens, torch.Tensor):
        _fail("argument 'cu_seqlens' must be a 1-D int32 tensor or a list of ints")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or \
            cu_seqlens.dtype == torch.bool:
        _fail(f"argument 'cu_seqlens' must hold integers, got {cu_seqlens.dtype}")
    cu_seqlens = cu_seqlens.to(torch.int32)
    if cu_seqlens.device == device:
        return cu_seqlens, None
    if cu_seqlens.device.type == "cpu":
        return cu_seqlens.to(device, non_blocking=True), cu_seqlens
    _fail(f"argument 'cu_seqlens' is on {cu_seqlens.device}, q is on {device}")


def msa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qp: torch.Tensor,
                  kp: torch.Tensor,
                  cu_seqlens: Union[None, torch.Tensor, Sequence[int]] = None, *,
                  block_size: int = 128, top_k: int = 16, local_blocks: int = 1,
                  scale: Optional[float] = None, proxy_scale: Optional[float] = None,
                  kl_coeff: float = 1.0, mode: str = "sparse",
                  deterministic: bool = False,
                  kl_value_out: Optional[torch.Tensor] = None,
                  need_kl: bool = True) -> MSAOutput:
    """MiniMax Sparse Attention (causal), training forward with autograd.

    Layouts:
      batch  (cu_seqlens None): q [B, S, H, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv],
                                qp [B, S, Hp, Dp], kp [B, S, Hpk, Dp]  ->  out [B, S, H, Dv]
      packed (cu_seqlens [B+1]): the same without B, tokens of all sequences concatenated
                                ([T, heads, dim]); attention never crosses a sequence boundary.
                                cu_seqlens may be a CPU tensor or a list even for CUDA inputs
                                (that avoids a synchronisation).
    Head counts: H % Hkv == 0, H % Hp == 0, Hp % Hpk == 0.

    mode="sparse": each proxy head selects top_k key blocks of block_size tokens per query
    (local_blocks most recent blocks always kept); main attention runs on those blocks.
    mode="warmup": dense causal attention; the proxy is distilled on all causal keys.

    Returns MSAOutput(out, kl_loss, block_idx). kl_loss = kl_coeff * mean over proxy heads and
    tokens of KL(teacher || proxy); add it to the loss to train qp/kp (it sends no gradient into
    q, k, v). block_idx is int32 [B, Hp, S, K] (batch) or [Hp, T, K] (packed), ascending, -1
    padding last; None in warm-up mode.

    kl_value_out: an optional one-element float32 tensor on q's device. Forming the KL value in
    the forward takes a pass over every head's scores of its own (the backward forms it anyway,
    fused); with kl_value_out the forward skips that pass and the backward writes the value into
    kl_value_out. kl_loss then still carries the proxy's gradient, but its value is 0: log
    kl_value_out after backward() instead. Where no backward can follow (grad mode off, or no
    input requires grad), the forward forms the value and writes it there itself.

    need_kl=False: nobody reads the KL value (inference, evaluation, or training that does not
    log it), so the forward skips its pass over the scores and kl_loss holds 0. kl_loss still
    carries the proxy's gradient: backward() trains qp/kp exactly as with need_kl=True.
    """
    if mode not in _MODES:
        _fail(f"option 'mode' must be one of {_MODES}, got {mode!r}")
    for name, value in (("scale", scale), ("proxy_scale", proxy_scale)):
        if value is not None and not float(value) > 0.0:
            _fail(f"option '{name}' must be > 0 (None means the default dim**-0.5), got {value}")
    names = ("q", "k", "v", "qp", "kp")
    tensors = (q, k, v, qp, kp)
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            _fail(f"argument '{name}' must be a torch.Tensor")
    batched = cu_seqlens is None
    want_dim = 4 if batched else 3
    for name, t in zip(names, tensors):
        if t.dim() != want_dim:
            layout = "[B, S, heads, dim] (no cu_seqlens)" if batched else \
                "[T, heads, dim] (with cu_seqlens)"
            _fail(f"argument '{name}' must have {want_dim} dimensions {layout}, "
                  f"got shape {tuple(t.shape)}")

    if batched:
        B, S = q.shape[0], q.shape[1]
        for name, t in zip(names[1:], tensors[1:]):
            if t.shape[0] != B or t.shape[1] != S:
                _fail(f"argument '{name}' has shape {tuple(t.shape)}; its first two dimensions "
                      f"must be q's [B, S] = [{B}, {S}]")
        q, k, v, qp, kp = (t.reshape(B * S, t.shape[2], t.shape[3]) for t in tensors)
        # Equal-length sequences: the offsets are known on the host, so CUDA needs no sync.
        cu_host = torch.arange(B + 1, dtype=torch.int32) * S
        if q.device.type == "cpu":
            cu_dev, cu_host = cu_host, None
        else:
            cu_dev = torch.arange(B + 1, dtype=torch.int32, device=q.device) * S
    else:
        cu_dev, cu_host = _as_cu_seqlens(cu_seqlens, q.device)

    kl_out = None
    _check_kl_request(kl_value_out, need_kl)
    if not need_kl:
        # The op skips the forward's KL pass whenever it gets a kl_out; nobody reads this one.
        kl_out = torch.empty((), dtype=torch.float32, device=q.device)
    elif kl_value_out is not None:
        if not isinstance(kl_value_out, torch.Tensor) or kl_value_out.dtype != torch.float32 or \
                kl_value_out.numel() != 1 or kl_value_out.dim() > 1:
            _fail("argument 'kl_value_out' must be one float32 value (a 0-dim or [1] tensor), got "
                  + (f"{kl_value_out.dtype} {tuple(kl_value_out.shape)}"
                     if isinstance(kl_value_out, torch.Tensor) else type(kl_value_out).__name__))
        if kl_value_out.device != q.device:
            _fail(f"argument 'kl_value_out' is on {kl_value_out.device}, q is on {q.device}")
        if kl_value_out.requires_grad:
            _fail("argument 'kl_value_out' must not require grad (it receives a value to log)")
        backward_follows = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        kl_out = kl_value_out if backward_follows else None
    o, _lse, block_idx, kl, _index = _ops.forward(
        q, k, v, qp, kp, cu_dev, cu_host, int(block_size), int(top_k), int(local_blocks),
        float(scale) if scale is not None else 0.0,
        float(proxy_scale) if proxy_scale is not None else 0.0,
        float(kl_coeff), mode, bool(deterministic), kl_out)
    if kl_value_out is not None and kl_out is None:  # no backward to form it: the forward did
        kl_value_out.copy_(kl.reshape(kl_value_out.shape))

    if mode != "sparse":
        block_idx = None
    if batched:
        o = o.view(B, S, o.shape[1], o.shape[2])
        if block_idx is not None:
            block_idx = block_idx.view(block_idx.shape[0], B, S, block_idx.shape[2]) \
                .permute(1, 0, 2, 3)
    return MSAOutput(o, kl, block_idx)
