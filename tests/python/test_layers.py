"""flashmsa.layers.MSAAttention on CPU: shapes, where gradients go, the mode switch, packing."""
import math

import pytest
import torch

from flashmsa.layers import MSAAttention, positions_from_cu_seqlens, set_msa_mode
from flashmsa.reference import msa_reference

PROXY = ("wqp", "wkp", "qp_norm", "kp_norm")
MAIN = ("wq", "wk", "wv", "wo", "q_norm", "k_norm")


def make(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(d_model=48, n_heads=4, n_kv_heads=2, head_dim=12, n_proxy_heads=2,
               n_proxy_kv_heads=1, proxy_dim=8, block_size=16, top_k=3)
    cfg.update(kw)
    m = MSAAttention(**cfg)
    # the RMSNorm gains start at 1; random gains make a wrong norm or a missed one visible
    with torch.no_grad():
        for name in ("q_norm", "k_norm", "qp_norm", "kp_norm"):
            getattr(m, name).weight.uniform_(0.5, 1.5)
    return m


def grads_by_module(m):
    out = {}
    for name in MAIN + PROXY:
        g = [p.grad for p in getattr(m, name).parameters()]
        out[name] = None if any(x is None for x in g) else sum(x.norm().item() for x in g)
    return out


@pytest.mark.parametrize("mode", ["warmup", "sparse", "dense"])
def test_shapes_and_finite(mode):
    m = make().set_mode(mode)
    x = torch.randn(2, 70, 48)
    y, kl = m(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert kl.shape == () and kl.dtype == torch.float32
    assert torch.isfinite(y).all()
    if mode == "dense":
        assert kl.item() == 0.0
    else:
        assert kl.item() > 0.0


@pytest.mark.parametrize("mode", ["warmup", "sparse"])
def test_gradients_task_loss_vs_kl(mode):
    """The task loss reaches every main projection and no proxy parameter; kl_loss reaches
    every proxy parameter and nothing else (the proxy reads x.detach())."""
    m = make().set_mode(mode)
    x = torch.randn(2, 70, 48, requires_grad=True)
    y, kl = m(x)
    (y * torch.randn_like(y)).sum().backward(retain_graph=True)
    g = grads_by_module(m)
    for name in MAIN:
        assert g[name] is not None and g[name] > 0, name
    for name in PROXY:
        assert g[name] is None or g[name] == 0, name
    assert x.grad is not None and x.grad.abs().sum() > 0

    m.zero_grad(set_to_none=True)
    x.grad = None
    kl.backward()
    g = grads_by_module(m)
    for name in PROXY:
        assert g[name] is not None and g[name] > 0, name
    for name in MAIN:
        assert g[name] is None or g[name] == 0, name
    assert x.grad is None or x.grad.abs().sum() == 0


@pytest.mark.parametrize("mode", ["warmup", "sparse", "dense"])
def test_kl_value_out_from_backward(mode):
    """With kl_value_out the backward writes the KL value and the parameters get the same
    gradients as with the forward's value."""
    x = torch.randn(2, 70, 48)
    grads, values = [], []
    for buf in (None, torch.full((), float("nan"))):
        m = make().set_mode(mode)
        y, kl = m(x, kl_value_out=buf)
        (y.square().mean() + kl).backward()
        grads.append([p.grad.clone() for p in m.parameters() if p.grad is not None])
        values.append(kl.item() if buf is None else buf.item())
        if buf is not None and mode != "dense":
            assert kl.item() == 0.0
    assert abs(values[1] - values[0]) <= 1e-5 * max(abs(values[0]), 1e-30)
    assert (values[0] > 0) == (mode != "dense")
    assert len(grads[0]) == len(grads[1])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["warmup", "sparse"])
def test_need_kl_false_trains_the_same(mode):
    """need_kl=False: kl_loss holds 0, and y and every gradient (the proxy's too) are the plain
    run's."""
    x = torch.randn(2, 70, 48)
    runs = []
    for need_kl in (True, False):
        m = make().set_mode(mode)
        y, kl = m(x, need_kl=need_kl)
        (y.square().mean() + kl).backward()
        runs.append((y.detach(), kl.item(), {n: p.grad for n, p in m.named_parameters()}))
    (y0, kl0, g0), (y1, kl1, g1) = runs
    assert kl0 > 0 and kl1 == 0.0 and torch.equal(y0, y1)
    assert g0["wqp.weight"].abs().sum() > 0
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n


@pytest.mark.parametrize("mode", ["warmup", "sparse", "dense"])
def test_need_kl_false_beside_kl_value_out_is_an_error(mode):
    with pytest.raises(RuntimeError, match="'kl_value_out'.*need_kl=False"):
        make().set_mode(mode)(torch.randn(1, 20, 48), kl_value_out=torch.zeros(()), need_kl=False)


def test_proxy_parameters_lists_exactly_the_proxy():
    m = make()
    ids = {id(p) for p in m.proxy_parameters()}
    want = {id(p) for name in PROXY for p in getattr(m, name).parameters()}
    assert ids == want


def test_mode_switch_and_full_topk_equals_warmup():
    """With top_k >= the number of blocks sparse attends to every causal key, so its output
    and kl_loss are the warm-up's; with a small top_k they differ."""
    S, blk = 70, 16
    nb = math.ceil(S / blk)
    m = make(top_k=nb)
    x = torch.randn(2, S, 48)
    y_w, kl_w = m.set_mode("warmup")(x)
    y_s, kl_s = m.set_mode("sparse")(x)
    y_d, _ = m.set_mode("dense")(x)
    assert m.mode == "dense"
    torch.testing.assert_close(y_s, y_w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kl_s, kl_w, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(y_d, y_w, rtol=1e-4, atol=1e-5)

    m.top_k = 2
    y_2, _ = m.set_mode("sparse")(x)
    assert (y_2 - y_w).abs().max() > 1e-3
    with pytest.raises(ValueError):
        m.set_mode("bogus")


def test_set_msa_mode_reaches_nested_modules():
    net = torch.nn.Sequential(make(), torch.nn.Sequential(make(seed=1)))
    set_msa_mode(net, "warmup")
    assert [mod.mode for mod in net.modules() if isinstance(mod, MSAAttention)] == ["warmup"] * 2


def test_matches_reference_on_projections():
    """forward = wo(msa(project(x))), checked against the eager reference, selection included."""
    m = make().set_mode("sparse")
    m.record_selection = True
    x = torch.randn(2, 70, 48)
    y, kl = m(x)
    p = m.project(x)
    r = msa_reference(*p, block_size=16, top_k=3)
    want = m.wo(r.out.reshape(2, 70, -1))
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(kl, r.kl_loss, rtol=1e-4, atol=1e-6)
    assert torch.equal(m.last_block_idx, r.block_idx)


def test_rope_is_applied_to_main_and_proxy():
    """Shifting a sequence's content by one position changes q/qp (RoPE) but rotating back
    gives the same dot products: scores depend on relative positions only."""
    m = make()
    x = torch.randn(1, 20, 48)
    p = m.project(x)
    p_shift = m.project(torch.cat([torch.randn(1, 1, 48), x], dim=1))
    for a, b in ((p.q, p_shift.q), (p.qp, p_shift.qp), (p.k, p_shift.k), (p.kp, p_shift.kp)):
        assert not torch.allclose(a, b[:, 1:], atol=1e-4)  # absolute positions differ
    s = torch.einsum("bthd,bjhd->bhtj", p.qp, p.kp.expand_as(p.qp))
    s_shift = torch.einsum("bthd,bjhd->bhtj", p_shift.qp[:, 1:], p_shift.kp[:, 1:].expand_as(p.qp))
    torch.testing.assert_close(s, s_shift, rtol=1e-4, atol=1e-4)
    s = torch.einsum("bthd,bjhd->bhtj", p.q[:, :, :2], p.k[:, :, :1].expand(-1, -1, 2, -1))
    s_shift = torch.einsum("bthd,bjhd->bhtj", p_shift.q[:, 1:, :2],
                           p_shift.k[:, 1:, :1].expand(-1, -1, 2, -1))
    torch.testing.assert_close(s, s_shift, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["warmup", "sparse", "dense"])
def test_packed_equals_separate(mode):
    """Packed sequences (cu_seqlens) give each sequence what it gets alone, RoPE restarting."""
    m = make().set_mode(mode)
    lens = [37, 0, 70, 5]
    xs = [torch.randn(1, n, 48) for n in lens]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    packed = torch.cat(xs, dim=1)
    y, kl = m(packed, cu)
    assert y.shape == packed.shape
    y2, _ = m(packed[0], cu)  # [T, d] works too
    assert y2.shape == packed[0].shape
    kl_sum = 0.0
    for x, lo in zip(xs, cu[:-1].tolist()):
        if x.shape[1] == 0:
            continue
        yi, kli = m(x)
        torch.testing.assert_close(y[:, lo:lo + x.shape[1]], yi, rtol=1e-4, atol=1e-5)
        kl_sum += kli.item() * x.shape[1]
    # kl_loss is a mean over tokens: the packed one is the token-weighted mean of the parts
    assert abs(kl.item() - kl_sum / packed.shape[1]) < 1e-4 * max(1.0, abs(kl.item()))


@pytest.mark.parametrize("mode", ["warmup", "sparse"])
@pytest.mark.parametrize("reentrant,kl_out", [(False, False), (True, False), (False, True),
                                               (True, True)])
def test_activation_checkpointing_gives_the_same_gradients(mode, reentrant, kl_out):
    """torch.utils.checkpoint drops the layer's activations and runs its forward again (the
    selection included) inside the backward. The CPU backend is deterministic, so the outputs,
    the KL value (returned, or written by the backward into kl_value_out) and every gradient
    equal the plain run's bit for bit. (Reentrant with kl_value_out: the first forward runs
    without grad, so it forms the value too and returns it in kl_loss; the backward then writes
    the buffer again, with the plain run's value.)"""
    x = torch.randn(2, 70, 48)
    runs = []
    for checkpointed in (False, True):
        m = make(seed=3).set_mode(mode)
        xi = x.clone().requires_grad_(True)
        buf = torch.full((), float("nan")) if kl_out else None
        if checkpointed:
            y, kl = torch.utils.checkpoint.checkpoint(m, xi, None, buf, use_reentrant=reentrant)
        else:
            y, kl = m(xi, None, buf)
        (y.square().mean() + kl).backward()
        grads = {n: p.grad for n, p in m.named_parameters()}
        runs.append((y.detach(), buf if kl_out else kl.detach(), xi.grad, grads))
    (y0, kl0, gx0, g0), (y1, kl1, gx1, g1) = runs
    assert kl0.item() > 0
    assert torch.equal(y0, y1) and torch.equal(kl0, kl1) and torch.equal(gx0, gx1)
    for name in MAIN + PROXY:
        for n in g0:
            if n.startswith(name + "."):
                assert g0[n] is not None and g0[n].abs().sum() > 0, n
                assert torch.equal(g0[n], g1[n]), n


def test_positions_from_cu_seqlens():
    cu = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    assert positions_from_cu_seqlens(cu, 5).tolist() == [0, 1, 2, 0, 1]


def test_bad_configurations():
    with pytest.raises(ValueError):
        MSAAttention(48, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError):
        MSAAttention(48, n_heads=4, n_proxy_heads=3)
    with pytest.raises(ValueError):
        MSAAttention(48, n_heads=4, n_proxy_heads=2, n_proxy_kv_heads=3)
    with pytest.raises(ValueError):
        MSAAttention(48, n_heads=4, head_dim=7)
    with pytest.raises(ValueError):
        make()(torch.randn(70, 48))  # 2-D input needs cu_seqlens


def test_training_step_changes_only_what_it_should():
    """One optimiser step on task + kl: main and proxy parameters both move."""
    m = make().set_mode("sparse")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    x = torch.randn(2, 70, 48)
    y, kl = m(x)
    (y.square().mean() + kl).backward()
    opt.step()
    for n, p in m.named_parameters():
        assert not torch.equal(p, before[n]), n
