"""The PyTorch integration: operator registration, autograd against the eager reference,
torch.compile, training equivalence and argument errors. CUDA cases skip without a GPU."""
import math

import pytest
import torch

import flashmsa
from flashmsa.reference import msa_reference

from helpers import check_selection, make_inputs, reference_grads, rel_l2

HAS_CUDA = torch.cuda.is_available() and flashmsa.cuda_built()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device / extension built CPU-only")

# Small CPU problem: H=4 heads in 2 proxy groups, GQA 2:1, one proxy key head; BLK=16 so a
# few hundred tokens span many blocks; K=3 leaves most rows with a real choice.
CPU_CFG = dict(H=4, Hkv=2, Hp=2, Hpk=1, D=16, Dv=24, Dp=8)
CPU_OPT = dict(block_size=16, top_k=3, local_blocks=1)
# The CUDA backend takes bf16, BLK=128, head dims 64/128.
CUDA_CFG = dict(H=8, Hkv=2, Hp=2, Hpk=1, D=64, Dv=64, Dp=64)
CUDA_OPT = dict(block_size=128, top_k=4, local_blocks=1)
# Sequence lengths per device: several blocks more than K so that selection really chooses.
SIZES = {"cpu": dict(B=2, S=75, lens=(37, 0, 130, 1, 64)),
         "cuda": dict(B=2, S=600, lens=(300, 0, 700, 1, 129))}


def _problem(layout, cfg, dtype, device, seed, B=None, S=None, lens=None):
    size = SIZES[torch.device(device).type]
    B = size["B"] if B is None else B
    S = size["S"] if S is None else S
    lens = size["lens"] if lens is None else lens
    gen = torch.Generator().manual_seed(seed)
    if layout == "batch":
        inputs = make_inputs((B, S), dtype=dtype, device=device, generator=gen, **cfg)
        cu = torch.arange(B + 1, dtype=torch.int32) * S
    else:
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
        inputs = make_inputs((int(cu[-1]),), dtype=dtype, device=device, generator=gen, **cfg)
    return inputs, cu


def _packed(t):
    return t.reshape(-1, *t.shape[-2:]) if t.dim() == 4 else t


def _packed_idx(idx):
    # batch block_idx [B, Hp, S, K] -> packed [Hp, B*S, K]
    return idx.permute(1, 0, 2, 3).reshape(idx.shape[1], -1, idx.shape[3]) if idx.dim() == 4 else idx


def _check_against_reference(layout, mode, dtype, device, cfg, opt, seed, tol):
    inputs, cu = _problem(layout, cfg, dtype, device, seed)
    cu_arg = None if layout == "batch" else cu.to(device)
    res = flashmsa.msa_attention(*inputs, cu_arg, mode=mode, **opt)
    gen = torch.Generator().manual_seed(seed + 1)
    d_o = torch.randn(res.out.shape, generator=gen).to(device=device, dtype=dtype)
    g = 0.75  # a KL weight != 1 checks that kl_grad scales dqp/dkp
    loss = (res.out.float() * d_o.float()).sum() + g * res.kl_loss
    grads = torch.autograd.grad(loss, inputs)

    assert res.out.dtype == dtype and res.kl_loss.dtype == torch.float32
    assert res.kl_loss.dim() == 0
    assert torch.isfinite(res.out).all() and torch.isfinite(res.kl_loss)
    fixed = None
    if mode == "sparse":
        assert res.block_idx.dtype == torch.int32
        fixed = _packed_idx(res.block_idx)
        check_selection(fixed, _packed(inputs[3]), _packed(inputs[4]), cu, opt["block_size"],
                        opt["top_k"], opt["local_blocks"])
    else:
        assert res.block_idx is None
    packed_in = [_packed(t) for t in inputs]
    ref, ref_grads = reference_grads(packed_in, cu, _packed(d_o), g, mode=mode,
                                     block_idx=fixed, **opt)
    assert rel_l2(_packed(res.out), ref.out) < tol, "o"
    assert abs(res.kl_loss.item() - ref.kl_loss.item()) <= tol * abs(ref.kl_loss.item()), "kl"
    assert ref.kl_loss.item() > 0
    for name, mine, want in zip(("dq", "dk", "dv", "dqp", "dkp"), grads, ref_grads):
        assert torch.isfinite(mine).all(), name
        assert rel_l2(_packed(mine), want) < tol, name


# --------------------------------------------------------------------------------------------
# Autograd against the eager reference (fp64), CPU.

@pytest.mark.parametrize("layout", ["batch", "packed"])
@pytest.mark.parametrize("mode", ["sparse", "warmup"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_cpu_matches_reference(layout, mode, dtype, tol):
    _check_against_reference(layout, mode, dtype, "cpu", CPU_CFG, CPU_OPT, seed=11, tol=tol)


@pytest.mark.parametrize("cfg,opt", [
    (dict(H=4, Hkv=4, Hp=4, Hpk=4, D=8, Dv=8, Dp=8), dict(block_size=8, top_k=1, local_blocks=1)),
    (dict(H=6, Hkv=3, Hp=2, Hpk=2, D=16, Dv=8, Dp=16), dict(block_size=16, top_k=4, local_blocks=2)),
    (dict(H=2, Hkv=1, Hp=1, Hpk=1, D=32, Dv=32, Dp=4), dict(block_size=64, top_k=2, local_blocks=1)),
])
def test_cpu_edge_configs(cfg, opt):
    """K=1 (local only), Hp=H (m=1), Hpk=Hp, local_blocks=2, blocks longer than sequences."""
    _check_against_reference("packed", "sparse", torch.float32, "cpu", cfg, opt, seed=5, tol=1e-5)


def test_cpu_empty_batch():
    inputs = make_inputs((0,), dtype=torch.float32, device="cpu", **CPU_CFG)
    res = flashmsa.msa_attention(*inputs, torch.zeros(1, dtype=torch.int32), **CPU_OPT)
    assert res.out.shape == (0, 4, 24) and res.block_idx.shape == (2, 0, 3)
    assert res.kl_loss.item() == 0.0
    (res.out.sum() + res.kl_loss).backward()
    assert inputs[0].grad.shape == inputs[0].shape


def test_kl_only_and_output_only_gradients():
    """The KL trains the proxy only; the output trains q, k, v only."""
    inputs, cu = _problem("packed", CPU_CFG, torch.float32, "cpu", seed=3)
    res = flashmsa.msa_attention(*inputs, cu, **CPU_OPT)
    g_kl = torch.autograd.grad(res.kl_loss, inputs, retain_graph=True)
    assert all(float(t.abs().max()) == 0.0 for t in g_kl[:3])
    assert all(float(t.abs().max()) > 0.0 for t in g_kl[3:])
    g_o = torch.autograd.grad(res.out.sum(), inputs)
    assert all(float(t.abs().max()) > 0.0 for t in g_o[:3])
    assert all(float(t.abs().max()) == 0.0 for t in g_o[3:])


def test_cu_seqlens_as_list_and_int64():
    inputs, cu = _problem("packed", CPU_CFG, torch.float32, "cpu", seed=4)
    a = flashmsa.msa_attention(*inputs, cu, **CPU_OPT)
    b = flashmsa.msa_attention(*inputs, cu.tolist(), **CPU_OPT)
    c = flashmsa.msa_attention(*inputs, cu.long(), **CPU_OPT)
    for r in (b, c):
        assert torch.equal(a.out, r.out) and torch.equal(a.block_idx, r.block_idx)
        assert torch.equal(a.kl_loss, r.kl_loss)


def _grads(inputs, cu, device, **kw):
    res = flashmsa.msa_attention(*inputs, cu, **kw)
    gen = torch.Generator().manual_seed(2)
    d_o = torch.randn(res.out.shape, generator=gen).to(device=device, dtype=res.out.dtype)
    return (res.out, res.kl_loss) + torch.autograd.grad(
        (res.out.float() * d_o.float()).sum() + res.kl_loss, inputs)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_deterministic_is_bitwise_reproducible(device):
    cfg, opt, dtype = (CPU_CFG, CPU_OPT, torch.float32) if device == "cpu" else \
        (CUDA_CFG, CUDA_OPT, torch.bfloat16)
    inputs, cu = _problem("packed", cfg, dtype, device, seed=8)
    a = _grads(inputs, cu, device, deterministic=True, **opt)
    b = _grads(inputs, cu, device, deterministic=True, **opt)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_non_contiguous_inputs():
    """q, k, v as slices of one fused projection (strided views) give the same values and
    gradients as contiguous copies."""
    T, H, Hkv, D = 150, 4, 2, 16
    cu = torch.tensor([0, 70, 150], dtype=torch.int32)
    gen = torch.Generator().manual_seed(6)
    qkv = torch.randn(T, H + 2 * Hkv, D, generator=gen).requires_grad_(True)
    qpkp = torch.randn(T, 3, 8, generator=gen).requires_grad_(True)
    views = (qkv[:, :H], qkv[:, H:H + Hkv], qkv[:, H + Hkv:], qpkp[:, :2], qpkp[:, 2:])
    assert not views[0].is_contiguous()
    r1 = flashmsa.msa_attention(*views, cu, **CPU_OPT)
    g1 = torch.autograd.grad(r1.out.sum() + r1.kl_loss, (qkv, qpkp))
    copies = [t.detach().contiguous().requires_grad_(True) for t in views]
    r2 = flashmsa.msa_attention(*copies, cu, **CPU_OPT)
    g2 = torch.autograd.grad(r2.out.sum() + r2.kl_loss, copies)
    assert torch.equal(r1.out, r2.out) and torch.equal(r1.kl_loss, r2.kl_loss)
    assert torch.equal(g1[0], torch.cat(g2[:3], dim=1))
    assert torch.equal(g1[1], torch.cat(g2[3:], dim=1))


# --------------------------------------------------------------------------------------------
# Operator registration: schema, fake kernels, autograd registration, AOT dispatch.

def _op_args(device, dtype, cfg, opt, mode, requires_grad=True):
    lens = (40, 0, 90) if device == "cpu" else (200, 0, 300)
    inputs, cu = _problem("packed", cfg, dtype, device, seed=7, lens=lens)
    host = cu if device != "cpu" else None
    return (*[t.detach().requires_grad_(requires_grad) for t in inputs], cu.to(device), host,
            opt["block_size"], opt["top_k"], opt["local_blocks"], 0.0, 0.0, 0.5, mode, False)


def _opcheck(device, dtype, cfg, opt, mode):
    args = _op_args(device, dtype, cfg, opt, mode)
    torch.library.opcheck(torch.ops.flashmsa.forward.default, args)
    o, lse, idx, kl, index = torch.ops.flashmsa.forward(*[a.detach() if isinstance(a, torch.Tensor)
                                                          else a for a in args])
    gen = torch.Generator().manual_seed(1)
    d_o = torch.randn(o.shape, generator=gen).to(device=device, dtype=dtype)
    kl_grad = torch.tensor(1.5, device=device)
    bargs = (*[a.detach() if isinstance(a, torch.Tensor) else a for a in args[:7]], idx, o, lse,
             d_o, kl_grad, *args[7:])
    torch.library.opcheck(torch.ops.flashmsa.backward.default, bargs)
    # With the forward's selection index: the same gradients (the CPU backend does not read it).
    torch.library.opcheck(torch.ops.flashmsa.backward.default, (*bargs, None, index))
    # With kl_out: the forward skips the KL value, the backward writes it (a declared mutation).
    kl_out = torch.full((), float("nan"), device=device)
    torch.library.opcheck(torch.ops.flashmsa.forward.default, (*args, kl_out))
    torch.library.opcheck(torch.ops.flashmsa.backward.default, (*bargs, kl_out))


@pytest.mark.parametrize("mode", ["sparse", "warmup"])
def test_opcheck_cpu(mode):
    _opcheck("cpu", torch.float32, CPU_CFG, CPU_OPT, mode)


# --------------------------------------------------------------------------------------------
# torch.compile and training.

class TinyMSA(torch.nn.Module):
    """Projections -> MSA -> output projection; returns (y, kl_loss)."""

    def __init__(self, dm, H, Hkv, Hp, Hpk, D, Dv, Dp, attn, opt, packed=False):
        super().__init__()
        self.shape = (H, Hkv, Hp, Hpk, D, Dv, Dp)
        self.wq = torch.nn.Linear(dm, H * D)
        self.wk = torch.nn.Linear(dm, Hkv * D)
        self.wv = torch.nn.Linear(dm, Hkv * Dv)
        self.wqp = torch.nn.Linear(dm, Hp * Dp)
        self.wkp = torch.nn.Linear(dm, Hpk * Dp)
        self.wo = torch.nn.Linear(H * Dv, dm)
        self.attn = attn
        self.opt = opt
        self.packed = packed

    def forward(self, x, cu_seqlens=None):
        H, Hkv, Hp, Hpk, D, Dv, Dp = self.shape
        lead = x.shape[:-1]
        q = self.wq(x).view(*lead, H, D)
        k = self.wk(x).view(*lead, Hkv, D)
        v = self.wv(x).view(*lead, Hkv, Dv)
        qp = self.wqp(x).view(*lead, Hp, Dp)
        kp = self.wkp(x).view(*lead, Hpk, Dp)
        r = self.attn(q, k, v, qp, kp, cu_seqlens, **self.opt)
        return self.wo(r.out.reshape(*lead, H * Dv)), r.kl_loss


def _reference_attn(*args, **kw):
    return msa_reference(*args, compute_dtype=torch.float64, **kw)


@pytest.mark.parametrize("layout,backend", [("batch", "inductor"), ("packed", "aot_eager")])
def test_compile_fullgraph_cpu(layout, backend):
    """Inductor on the batch layout; the packed layout through AOTAutograd only (the same fake
    kernels and autograd path, without a second slow C++ code generation)."""
    torch.manual_seed(0)
    model = TinyMSA(32, **CPU_CFG, attn=flashmsa.msa_attention, opt=CPU_OPT)
    if layout == "batch":
        args = (torch.randn(2, 80, 32),)
    else:
        args = (torch.randn(150, 32), torch.tensor([0, 33, 33, 150], dtype=torch.int32))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)  # a graph break raises
    y0, kl0 = model(*args)
    y1, kl1 = compiled(*args)
    (y0.square().mean() + kl0).backward()
    g0 = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (y1.square().mean() + kl1).backward()
    assert torch.allclose(y0, y1, rtol=1e-5, atol=1e-6)
    assert torch.allclose(kl0, kl1, rtol=1e-5, atol=1e-7)
    for a, p in zip(g0, model.parameters()):
        assert torch.allclose(a, p.grad, rtol=1e-4, atol=1e-6)


def test_compile_dynamic_packed_lengths_cpu():
    """Packed batches of changing lengths and sequence counts (what a training loop that packs
    documents feeds) run through one graph compiled with dynamic=True: the fake kernels take
    symbolic sizes, and the outputs and gradients equal eager's."""
    torch.manual_seed(0)
    model = TinyMSA(32, **CPU_CFG, attn=flashmsa.msa_attention, opt=CPU_OPT, packed=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=True)
    for i, cu in enumerate(([0, 33, 33, 150], [0, 100, 211], [0, 97])):
        x = torch.randn(cu[-1], 32)
        cu = torch.tensor(cu, dtype=torch.int32)
        grads = []
        for run in (model, compiled):
            model.zero_grad()
            # after the first compilation, a recompilation raises
            with torch.compiler.set_stance("fail_on_recompile" if i > 0 else "default"):
                y, kl = run(x, cu)
            (y.square().mean() + kl).backward()
            grads.append((y.detach(), kl.detach(), [p.grad.clone() for p in model.parameters()]))
        (y0, kl0, g0), (y1, kl1, g1) = grads
        assert torch.allclose(y0, y1, rtol=1e-5, atol=1e-6)
        assert torch.allclose(kl0, kl1, rtol=1e-5, atol=1e-7) and kl0.item() > 0
        for a, b in zip(g0, g1):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


# Biases of k and kp get an exactly zero gradient (a constant shift of every key leaves each
# softmax and each block ranking unchanged); their "updates" are rounding noise, so they are
# left out of the comparison.
_ZERO_GRAD_PARAMS = ("wk.bias", "wkp.bias")


def _sgd_equivalence(device, cfg, opt, attn_mine, attn_ref, dm, batch, seqlen, steps=10, lr=0.1):
    """Trains two copies of TinyMSA (fp32 parameters) for `steps` SGD steps on the same data,
    one with attn_mine, one with attn_ref. Returns (worst relative L2 error of the parameter
    updates, smallest relative change of a parameter tensor)."""
    torch.manual_seed(0)
    mine = TinyMSA(dm, **cfg, attn=attn_mine, opt=opt).to(device)
    ref = TinyMSA(dm, **cfg, attn=attn_ref, opt=opt).to(device)
    ref.load_state_dict(mine.state_dict())
    start = [p.detach().clone() for p in mine.parameters()]
    gen = torch.Generator().manual_seed(123)
    x = torch.randn(batch, seqlen, dm, generator=gen).to(device)
    target = torch.randn(x.shape, generator=gen).to(device)
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in (mine, ref)]
    for _ in range(steps):
        for m, o in zip((mine, ref), opts):
            o.zero_grad()
            y, kl = m(x)
            loss = (y.float() - target).square().mean() + kl
            loss.backward()
            o.step()
    worst, moved = 0.0, math.inf
    for (name, a), b, s0 in zip(mine.named_parameters(), ref.parameters(), start):
        if name in _ZERO_GRAD_PARAMS:
            continue
        worst = max(worst, rel_l2(a - s0, b - s0))
        moved = min(moved, rel_l2(a, s0))
    return worst, moved


def test_sgd_equivalence_cpu():
    """10 SGD steps with the op vs the fp64 eager reference (fp32 model and inputs): every
    parameter tensor's total update agrees to a relative L2 error < 1e-4 (measured 1e-5)."""
    worst, moved = _sgd_equivalence("cpu", CPU_CFG, CPU_OPT, flashmsa.msa_attention,
                                    _reference_attn, dm=32, batch=2,
                                    seqlen=8 * CPU_OPT["block_size"] + 5)
    assert moved > 1e-4, moved  # training really changed every parameter tensor
    assert worst < 1e-4, worst


# --------------------------------------------------------------------------------------------
# Errors name the argument.

@pytest.mark.parametrize("case,name", [
    ("k_dim", "'k'"), ("heads_qp", "'qp'"), ("cu_end", "'cu_seqlens'"), ("top_k", "'top_k'"),
    ("mode", "'mode'"), ("q_ndim", "'q'"), ("v_dtype", "'v'"), ("kp_heads", "'kp'"),
    ("local", "'local_blocks'"), ("scale", "'scale'"), ("cu_float", "'cu_seqlens'"),
    ("top_k_neg", "'top_k'"), ("block_size", "'block_size'"),
])
def test_bad_arguments(case, name):
    inputs, cu = _problem("packed", CPU_CFG, torch.float32, "cpu", seed=9)
    q, k, v, qp, kp = [t.detach() for t in inputs]
    kw = dict(CPU_OPT)
    if case == "k_dim":
        k = k[..., :8].contiguous()
    elif case == "heads_qp":
        qp = torch.randn(qp.shape[0], 3, qp.shape[2])
        kp = torch.randn(kp.shape[0], 3, kp.shape[2])
    elif case == "cu_end":
        cu = cu.clone()
        cu[-1] -= 1
    elif case == "top_k":
        kw["top_k"] = 0
    elif case == "mode":
        kw["mode"] = "dense"
    elif case == "q_ndim":
        q = q[None]
    elif case == "v_dtype":
        v = v.double()
    elif case == "kp_heads":
        kp = torch.randn(kp.shape[0], 3, kp.shape[2])
    elif case == "local":
        kw["local_blocks"] = kw["top_k"] + 1
    elif case == "scale":
        kw["scale"] = -1.0
    elif case == "top_k_neg":
        kw["top_k"] = -2
    elif case == "block_size":
        kw["block_size"] = 0
    elif case == "cu_float":
        cu = cu.float()
    with pytest.raises(RuntimeError, match=name):
        flashmsa.msa_attention(q, k, v, qp, kp, cu, **kw)


# --------------------------------------------------------------------------------------------
# kl_value_out: the KL value formed by the backward instead of a forward pass of its own.

def _kl_value_from_backward(device, dtype, cfg, opt, mode, layout, tol, kl_tol):
    """The same step with and without kl_value_out: the value written by the backward matches
    the forward's kl_loss, the returned kl_loss holds 0 but still trains the proxy, and the
    outputs and gradients agree."""
    inputs, cu = _problem(layout, cfg, dtype, device, seed=11)
    cu_arg = None if layout == "batch" else cu.to(device)
    gen = torch.Generator().manual_seed(12)
    d_o = torch.randn(*inputs[0].shape[:-1], inputs[2].shape[-1], generator=gen)
    d_o = d_o.to(device=device, dtype=dtype)

    def run(kl_value_out):
        leaves = [t.detach().requires_grad_() for t in inputs]
        res = flashmsa.msa_attention(*leaves, cu_arg, mode=mode, kl_value_out=kl_value_out, **opt)
        ((res.out.float() * d_o.float()).sum() + 0.75 * res.kl_loss).backward()
        return res, [t.grad for t in leaves]

    ref, ref_grads = run(None)
    buf = torch.full((), float("nan"), device=device)
    res, grads = run(buf)
    assert ref.kl_loss.item() > 0
    assert res.kl_loss.item() == 0.0 and res.kl_loss.requires_grad
    assert abs(buf.item() - ref.kl_loss.item()) <= kl_tol * ref.kl_loss.item()
    assert rel_l2(res.out, ref.out) <= tol
    for name, mine, want in zip(("dq", "dk", "dv", "dqp", "dkp"), grads, ref_grads):
        assert rel_l2(mine, want) <= tol, name
    assert grads[3].abs().sum() > 0  # the proxy does get a gradient


@pytest.mark.parametrize("layout", ["batch", "packed"])
@pytest.mark.parametrize("mode", ["sparse", "warmup"])
def test_kl_value_from_backward_cpu(layout, mode):
    _kl_value_from_backward("cpu", torch.float32, CPU_CFG, CPU_OPT, mode, layout, 1e-5, 1e-5)


def test_kl_value_out_without_backward():
    """No backward can follow (grad mode off, or nothing requires grad): the forward forms the
    value and writes it into kl_value_out itself."""
    inputs, cu = _problem("packed", CPU_CFG, torch.float32, "cpu", seed=13)
    want = flashmsa.msa_attention(*inputs, cu, **CPU_OPT).kl_loss.item()
    buf = torch.full((1,), float("nan"))
    with torch.no_grad():
        res = flashmsa.msa_attention(*[t.requires_grad_() for t in inputs], cu,
                                     kl_value_out=buf, **CPU_OPT)
    assert res.kl_loss.item() == want and buf.item() == want
    buf.fill_(float("nan"))
    res = flashmsa.msa_attention(*[t.detach() for t in inputs], cu, kl_value_out=buf, **CPU_OPT)
    assert buf.item() == want


def test_kl_value_out_compile_cpu():
    """torch.compile (fullgraph) carries the backward's write into kl_value_out."""
    class WithKlOut(TinyMSA):
        def forward(self, x, kl_value_out):
            H, Hkv, Hp, Hpk, D, Dv, Dp = self.shape
            lead = x.shape[:-1]
            r = flashmsa.msa_attention(
                self.wq(x).view(*lead, H, D), self.wk(x).view(*lead, Hkv, D),
                self.wv(x).view(*lead, Hkv, Dv), self.wqp(x).view(*lead, Hp, Dp),
                self.wkp(x).view(*lead, Hpk, Dp), kl_value_out=kl_value_out, **self.opt)
            return self.wo(r.out.reshape(*lead, H * Dv)), r.kl_loss

    torch.manual_seed(0)
    model = WithKlOut(32, **CPU_CFG, attn=flashmsa.msa_attention, opt=CPU_OPT)
    x = torch.randn(2, 80, 32)
    _, kl_eager = TinyMSA.forward(model, x)  # the forward's own value
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    buf = torch.full((), float("nan"))
    y, kl = compiled(x, buf)
    assert kl.item() == 0.0 and torch.isnan(buf)
    (y.square().mean() + kl).backward()
    assert abs(buf.item() - kl_eager.item()) <= 1e-5 * kl_eager.item()
    assert model.wqp.weight.grad is not None and model.wqp.weight.grad.abs().sum() > 0


def _need_kl_matches(device, dtype, cfg, opt, mode):
    """need_kl=False: the same output, kl_loss 0, and the same gradients from task + kl_loss (the
    proxy's included): the forward only skips forming the value."""
    inputs, cu = _problem("packed", cfg, dtype, device, seed=17)
    runs = []
    for need_kl in (True, False):
        xs = [t.detach().clone().requires_grad_() for t in inputs]
        res = flashmsa.msa_attention(*xs, cu, mode=mode, need_kl=need_kl, deterministic=True,
                                     **opt)
        (res.out.float().square().mean() + res.kl_loss).backward()
        runs.append((res, [x.grad for x in xs]))
    (want, want_grads), (res, grads) = runs
    assert want.kl_loss.item() > 0 and res.kl_loss.item() == 0.0
    assert torch.equal(res.out, want.out)
    for name, mine, ref in zip(("dq", "dk", "dv", "dqp", "dkp"), grads, want_grads):
        assert torch.equal(mine, ref), name
    assert grads[3].abs().sum() > 0  # the proxy is still trained
    with torch.no_grad():
        res = flashmsa.msa_attention(*inputs, cu, mode=mode, need_kl=False, **opt)
    assert res.kl_loss.item() == 0.0 and torch.equal(res.out, want.out)


@pytest.mark.parametrize("mode", ["sparse", "warmup"])
def test_need_kl_false_cpu(mode):
    _need_kl_matches("cpu", torch.float32, CPU_CFG, CPU_OPT, mode)


def test_need_kl_false_compile_cpu():
    """torch.compile (fullgraph) with need_kl=False: eager's output, kl_loss 0, and the proxy
    still trained."""
    torch.manual_seed(0)
    model = TinyMSA(32, **CPU_CFG, attn=flashmsa.msa_attention, opt=dict(CPU_OPT, need_kl=False))
    x = torch.randn(2, 80, 32)
    torch._dynamo.reset()
    runs = []
    for run in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        model.zero_grad()
        y, kl = run(x)
        (y.square().mean() + kl).backward()
        runs.append((y.detach(), kl.item(), [p.grad.clone() for p in model.parameters()]))
    (y0, kl0, g0), (y1, kl1, g1) = runs
    assert kl0 == 0.0 and kl1 == 0.0 and torch.allclose(y0, y1, rtol=1e-5, atol=1e-6)
    assert model.wqp.weight.grad.abs().sum() > 0  # the proxy is still trained
    for a, b in zip(g0, g1):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_need_kl_false_with_kl_value_out_is_an_error():
    inputs, cu = _problem("packed", CPU_CFG, torch.float32, "cpu", seed=9)
    with pytest.raises(RuntimeError, match="'kl_value_out'.*need_kl=False"):
        flashmsa.msa_attention(*inputs, cu, kl_value_out=torch.zeros(()), need_kl=False,
                               **CPU_OPT)


@pytest.mark.parametrize("bad,match", [
    (lambda: torch.zeros((), dtype=torch.float64), "float32"),
    (lambda: torch.zeros(2), "one float32 value"),
    (lambda: torch.zeros((), requires_grad=True), "require grad"),
    (lambda: 0.0, "one float32 value"),
])
def test_kl_value_out_bad(bad, match):
    inputs, cu = _problem("packed", CPU_CFG, torch.float32, "cpu", seed=9)
    with pytest.raises(RuntimeError, match="'kl_value_out'.*" + match):
        flashmsa.msa_attention(*inputs, cu, kl_value_out=bad(), **CPU_OPT)


# --------------------------------------------------------------------------------------------
# CUDA (the H200): the same checks on bf16 at the CUDA backend's sizes.

@needs_cuda
@pytest.mark.parametrize("layout", ["batch", "packed"])
@pytest.mark.parametrize("mode", ["sparse", "warmup"])
def test_cuda_matches_reference(layout, mode):
    _check_against_reference(layout, mode, torch.bfloat16, "cuda", CUDA_CFG, CUDA_OPT, seed=21,
                             tol=1e-2)


@needs_cuda
def test_cuda_cu_seqlens_host_and_device_agree():
    inputs, cu = _problem("packed", CUDA_CFG, torch.bfloat16, "cuda", seed=2)
    a = flashmsa.msa_attention(*inputs, cu, **CUDA_OPT)  # CPU offsets: no sync
    b = flashmsa.msa_attention(*inputs, cu.cuda(), **CUDA_OPT)  # device offsets
    assert torch.equal(a.out, b.out) and torch.equal(a.block_idx, b.block_idx)


@needs_cuda
def test_cuda_workspace_comes_from_torch_allocator():
    """The library's backward workspace (an fp32 dq accumulator of 2 x size(q) among it) is taken
    from torch's caching allocator: torch's peak during the op exceeds its five outputs by more
    than size(q). With flashmsa's own pool it would be the outputs alone."""
    inputs, cu = _problem("packed", CUDA_CFG, torch.bfloat16, "cuda", seed=5)
    q, k, v, qp, kp = (t.detach() for t in inputs)
    o, lse, idx, _, _ = torch.ops.flashmsa.forward(q, k, v, qp, kp, cu.cuda(), cu, 128, 4, 1, 0.0, 0.0,
                                                   1.0, "sparse", False)
    d_o = torch.randn_like(o)
    g = torch.ones((), device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grads = torch.ops.flashmsa.backward(q, k, v, qp, kp, cu.cuda(), cu, idx, o, lse, d_o, g, 128, 4, 1,
                                        0.0, 0.0, 1.0, "sparse", False)
    torch.cuda.synchronize()
    outputs = sum(t.numel() * t.element_size() for t in grads)
    assert torch.cuda.max_memory_allocated() - base > outputs + q.numel() * q.element_size()
    assert all(torch.isfinite(t).all() for t in grads)


@needs_cuda
def test_cuda_backward_reads_the_forward_index():
    """The backward given the forward's selection index: bitwise the gradients of its own build
    (deterministic mode); given the index of another selection: different gradients (it is read)."""
    inputs, cu = _problem("packed", CUDA_CFG, torch.bfloat16, "cuda", seed=9)
    q, k, v, qp, kp = (t.detach() for t in inputs)
    opts = (128, 4, 1, 0.0, 0.0, 1.0, "sparse", True)
    o, lse, idx, _, index = torch.ops.flashmsa.forward(q, k, v, qp, kp, cu.cuda(), cu, *opts)
    other = torch.ops.flashmsa.forward(q, k, v, qp.flip(0), kp, cu.cuda(), cu, *opts)[4]
    assert index.dtype == torch.int32 and not torch.equal(index, other)
    d_o = torch.randn_like(o)
    g = torch.ones((), device="cuda")

    def grads(selection_index):
        return torch.ops.flashmsa.backward(q, k, v, qp, kp, cu.cuda(), cu, idx, o, lse, d_o, g, *opts,
                                           selection_index=selection_index)
    own = grads(None)
    assert all(torch.equal(a, b) for a, b in zip(own, grads(index)))
    assert not all(torch.equal(a, b) for a, b in zip(own, grads(other)))


@needs_cuda
@pytest.mark.parametrize("mode", ["sparse", "warmup"])
def test_opcheck_cuda(mode):
    _opcheck("cuda", torch.bfloat16, CUDA_CFG, CUDA_OPT, mode)


@needs_cuda
def test_compile_fullgraph_cuda():
    torch.manual_seed(0)
    model = TinyMSA(64, **CUDA_CFG, attn=flashmsa.msa_attention, opt=CUDA_OPT).cuda()
    model = model.to(torch.bfloat16)
    x = torch.randn(2, 300, 64, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    y0, kl0 = model(x)
    y1, kl1 = compiled(x)
    assert rel_l2(y1, y0) < 1e-2
    assert abs(kl1.item() - kl0.item()) <= 1e-2 * abs(kl0.item())
    (y1.float().square().mean() + kl1).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@needs_cuda
@pytest.mark.parametrize("mode", ["sparse", "warmup"])
def test_kl_value_from_backward_cuda(mode):
    # bf16 on the GPU: the fast kernels' fp32 reduce-adds are not bitwise reproducible, and the
    # forward's KL pass and the backward's fused KL sum in different orders.
    _kl_value_from_backward("cuda", torch.bfloat16, CUDA_CFG, CUDA_OPT, mode, "packed", 1e-2, 1e-3)


@needs_cuda
def test_sgd_equivalence_cuda():
    """10 SGD steps on CUDA: fp32 parameters, attention inputs cast to bf16 (the CUDA backend's
    dtype) for both the op and the fp64 reference; the parameter updates agree to a relative L2
    error < 2e-2 (the same check through the CPU backend measures ~7e-4)."""
    def attn_bf16(q, k, v, qp, kp, cu, **kw):
        r = flashmsa.msa_attention(*(t.to(torch.bfloat16) for t in (q, k, v, qp, kp)), cu, **kw)
        return r._replace(out=r.out.float())

    def ref_bf16(q, k, v, qp, kp, cu, **kw):
        r = msa_reference(*(t.to(torch.bfloat16) for t in (q, k, v, qp, kp)), cu,
                          compute_dtype=torch.float64, **kw)
        return r._replace(out=r.out.float())

    worst, moved = _sgd_equivalence("cuda", CUDA_CFG, CUDA_OPT, attn_bf16, ref_bf16, dm=64,
                                    batch=1, seqlen=6 * 128 + 40)
    assert moved > 1e-5, moved
    assert worst < 2e-2, worst
