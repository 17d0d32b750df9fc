// The public API: argument validation (every check before anything is written) and dispatch
// to the CPU or CUDA backend by the inputs' device.
#include <cmath>
#include <cstdint>
#include <iterator>
#include <sstream>
#include <vector>

#include "flashmsa/flashmsa.h"
#include "params.h"
#include "selection_index_layout.h"

namespace flashmsa {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::bf16: return "bf16";
    case DType::fp16: return "fp16";
    case DType::fp32: return "fp32";
    case DType::int32: return "int32";
  }
  return "unknown";
}

int64_t dtype_size(DType dtype) { return dtype == DType::bf16 || dtype == DType::fp16 ? 2 : 4; }

namespace {
// A view's usable rank: ndim outside [0, 4] is rejected by validation, and never indexes past
// shape[4] / stride[4] on the way there.
int rank(const TensorView& t) { return t.ndim < 0 ? 0 : (t.ndim > 4 ? 4 : t.ndim); }
}  // namespace

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank(*this); ++i) n *= shape[i];
  return n;
}

bool TensorView::is_contiguous() const {
  if (numel() == 0) return true;  // no element to lay out: any strides describe it
  int64_t expected = 1;
  for (int i = rank(*this) - 1; i >= 0; --i) {
    if (shape[i] != 1 && stride[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

TensorView make_view(const void* data, DType dtype, std::initializer_list<int64_t> shape,
                     Device device, int device_index) {
  if (shape.size() > 4) throw Error("make_view: at most 4 dimensions");
  TensorView v;
  v.data = const_cast<void*>(data);
  v.dtype = dtype;
  v.device = device;
  v.device_index = device_index;
  v.ndim = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) v.shape[i++] = s;
  int64_t stride = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.stride[d] = stride;
    stride *= v.shape[d];
  }
  return v;
}

namespace {

[[noreturn]] void fail(const std::string& msg) { throw Error("flashmsa: " + msg); }

std::string shape_str(const TensorView& t) {
  std::ostringstream s;
  if (t.ndim != rank(t)) return "(ndim " + std::to_string(t.ndim) + ")";
  s << "[";
  for (int i = 0; i < t.ndim; ++i) s << (i ? ", " : "") << t.shape[i];
  s << "]";
  return s.str();
}

// Checks one tensor argument against an expected shape, dtype and device.
void check_tensor(const char* name, const TensorView& t, std::initializer_list<int64_t> shape,
                  DType dtype, Device device, int device_index) {
  if (!t.defined()) fail(std::string("argument '") + name + "' is missing");
  if (t.ndim != rank(t))
    fail(std::string("argument '") + name + "' has ndim " + std::to_string(t.ndim) +
         "; views have 0 to 4 dimensions");
  std::vector<int64_t> want(shape);
  bool shape_ok = t.ndim == static_cast<int>(want.size());
  for (int i = 0; shape_ok && i < t.ndim; ++i) shape_ok = t.shape[i] == want[i];
  if (!shape_ok) {
    std::ostringstream s;
    s << "argument '" << name << "' has shape " << shape_str(t) << ", expected [";
    for (size_t i = 0; i < want.size(); ++i) s << (i ? ", " : "") << want[i];
    s << "]";
    fail(s.str());
  }
  if (t.dtype != dtype)
    fail(std::string("argument '") + name + "' has dtype " + dtype_name(t.dtype) + ", expected " +
         dtype_name(dtype));
  if (t.device != device || (device == Device::cuda && t.device_index != device_index))
    fail(std::string("argument '") + name + "' is on a different device than q");
  if (!t.is_contiguous()) fail(std::string("argument '") + name + "' must be contiguous");
  if (t.numel() > 0 && t.data == nullptr)
    fail(std::string("argument '") + name + "' has a null data pointer");
  if (device == Device::cuda && t.numel() > 0 && reinterpret_cast<uintptr_t>(t.data) % 16 != 0)
    fail(std::string("argument '") + name + "' must be 16-byte aligned for the CUDA backend");
}

void check_scalar(const char* name, const TensorView& t, Device device, int device_index) {
  if (t.defined()) check_tensor(name, t, {1}, DType::fp32, device, device_index);
}

bool is_float_dtype(DType d) { return d == DType::bf16 || d == DType::fp16 || d == DType::fp32; }

// Validates the inputs and options; returns params with sizes, options and input pointers.
MsaParams validate_inputs(const AttentionInputs& in, const Options& opt) {
  const TensorView& q = in.q;
  if (!q.defined()) fail("argument 'q' is missing");
  if (q.ndim != 3) fail("argument 'q' must have 3 dimensions [T, H, D], got " + shape_str(q));
  if (!is_float_dtype(q.dtype))
    fail(std::string("argument 'q' has dtype ") + dtype_name(q.dtype) +
         ", expected bf16, fp16 or fp32");
  if (in.k.ndim != 3) fail("argument 'k' must have 3 dimensions [T, Hkv, D], got " + shape_str(in.k));
  if (in.v.ndim != 3) fail("argument 'v' must have 3 dimensions [T, Hkv, Dv], got " + shape_str(in.v));
  if (in.qp.ndim != 3) fail("argument 'qp' must have 3 dimensions [T, Hp, Dp], got " + shape_str(in.qp));
  if (in.kp.ndim != 3) fail("argument 'kp' must have 3 dimensions [T, Hpk, Dp], got " + shape_str(in.kp));
  if (q.device == Device::cuda && !cuda_backend_built())
    fail("argument 'q' is on a CUDA device but this build has no CUDA backend");

  MsaParams p;
  p.T = q.shape[0];
  p.H = static_cast<int>(q.shape[1]);
  p.D = static_cast<int>(q.shape[2]);
  p.Hkv = static_cast<int>(in.k.shape[1]);
  p.Dv = static_cast<int>(in.v.shape[2]);
  p.Hp = static_cast<int>(in.qp.shape[1]);
  p.Dp = static_cast<int>(in.qp.shape[2]);
  p.Hpk = static_cast<int>(in.kp.shape[1]);
  if (p.H < 1 || p.Hkv < 1 || p.Hp < 1 || p.Hpk < 1)
    fail("head counts must be >= 1 (q, k, qp, kp dimension 1)");
  if (p.D < 1 || p.Dv < 1 || p.Dp < 1) fail("head dims must be >= 1 (q, v, qp dimension 2)");
  if (p.H % p.Hkv != 0) fail("argument 'k': H (q heads) must be a multiple of Hkv (k heads)");
  if (p.H % p.Hp != 0) fail("argument 'qp': H (q heads) must be a multiple of Hp (qp heads)");
  if (p.Hp % p.Hpk != 0) fail("argument 'kp': Hp (qp heads) must be a multiple of Hpk (kp heads)");

  const Device dev = q.device;
  const int di = q.device_index;
  check_tensor("q", q, {p.T, p.H, p.D}, q.dtype, dev, di);
  check_tensor("k", in.k, {p.T, p.Hkv, p.D}, q.dtype, dev, di);
  check_tensor("v", in.v, {p.T, p.Hkv, p.Dv}, q.dtype, dev, di);
  check_tensor("qp", in.qp, {p.T, p.Hp, p.Dp}, q.dtype, dev, di);
  check_tensor("kp", in.kp, {p.T, p.Hpk, p.Dp}, q.dtype, dev, di);

  const TensorView& cu = in.cu_seqlens;
  if (!cu.defined() || cu.ndim != 1 || cu.shape[0] < 1)
    fail("argument 'cu_seqlens' must be a 1-D int32 tensor of B+1 >= 1 offsets");
  check_tensor("cu_seqlens", cu, {cu.shape[0]}, DType::int32, dev, di);
  p.B = static_cast<int>(cu.shape[0] - 1);

  if (opt.block_size < 1) fail("option 'block_size' must be >= 1");
  if (opt.top_k < 1) fail("option 'top_k' (K) must be >= 1");
  if (opt.local_blocks < 1 || opt.local_blocks > opt.top_k)
    fail("option 'local_blocks' must be in [1, top_k]");
  if (!std::isfinite(opt.scale) || !std::isfinite(opt.proxy_scale))
    fail("options 'scale' and 'proxy_scale' must be finite");
  if (!std::isfinite(opt.kl_coeff)) fail("option 'kl_coeff' must be finite");
  if (opt.num_threads < 0) fail("option 'num_threads' must be >= 0");
  if (opt.mode != Mode::sparse && opt.mode != Mode::warmup)
    fail("option 'mode' must be Mode::sparse or Mode::warmup");

  p.block_size = opt.block_size;
  p.top_k = opt.top_k;
  p.local_blocks = opt.local_blocks;
  p.scale = opt.scale > 0.f ? opt.scale : 1.f / std::sqrt(static_cast<float>(p.D));
  p.proxy_scale = opt.proxy_scale > 0.f ? opt.proxy_scale : 1.f / std::sqrt(static_cast<float>(p.Dp));
  p.kl_coeff = opt.kl_coeff;
  p.deterministic = opt.deterministic;
  p.num_threads = opt.num_threads;
  p.dtype = q.dtype;
  p.device_index = di;
  p.q = q.data;
  p.k = in.k.data;
  p.v = in.v.data;
  p.qp = in.qp.data;
  p.kp = in.kp.data;
  p.cu_seqlens = static_cast<const int32_t*>(cu.data);
  return p;
}

// Validates cu_seqlens values (on the host) and sets max_seqlen. The host copy is kept alive
// by `storage` when it had to be made here.
void validate_cu_seqlens(const AttentionInputs& in, MsaParams& p, std::vector<int32_t>& storage,
                         Stream stream) {
  const int32_t* host = nullptr;
  if (in.q.device == Device::cpu) {
    host = p.cu_seqlens;
  } else if (in.cu_seqlens_host != nullptr) {
    host = in.cu_seqlens_host;
  } else {
    storage.resize(p.B + 1);
    cuda::copy_to_host(storage.data(), p.cu_seqlens, (p.B + 1) * sizeof(int32_t), p.device_index,
                       stream);
    host = storage.data();
  }
  if (host[0] != 0) fail("argument 'cu_seqlens' must start at 0");
  int max_len = 0;
  for (int b = 0; b < p.B; ++b) {
    if (host[b + 1] < host[b]) fail("argument 'cu_seqlens' must be non-decreasing");
    max_len = std::max(max_len, host[b + 1] - host[b]);
  }
  if (host[p.B] != p.T) fail("argument 'cu_seqlens' must end at T (the token count of q)");
  p.cu_seqlens_host = host;
  p.max_seqlen = max_len;
}

bool on_cuda(const AttentionInputs& in) { return in.q.device == Device::cuda; }

void check_block_idx(const TensorView& block_idx, const MsaParams& p, const AttentionInputs& in) {
  check_tensor("block_idx", block_idx, {p.Hp, p.T, p.top_k}, DType::int32, in.q.device,
               in.q.device_index);
}

struct NamedTensor {
  const char* name;
  const TensorView* t;
};

// No output may overlap another output or an input. The CUDA forward keeps the selection index's
// scratch in o's buffer while block_idx is read; the backward keeps accumulators in dq's buffer
// while its kernels still read the inputs and writes every output from its own buffer.
template <size_t NO, size_t NI>
void reject_overlaps(const NamedTensor (&outputs)[NO], const NamedTensor (&inputs)[NI]) {
  auto overlap = [](const TensorView& a, const TensorView& b) {
    if (!a.defined() || !b.defined() || a.numel() == 0 || b.numel() == 0) return false;
    const auto a0 = reinterpret_cast<uintptr_t>(a.data), b0 = reinterpret_cast<uintptr_t>(b.data);
    return a0 < b0 + static_cast<uintptr_t>(b.numel() * dtype_size(b.dtype)) &&
           b0 < a0 + static_cast<uintptr_t>(a.numel() * dtype_size(a.dtype));
  };
  for (size_t i = 0; i < NO; ++i) {
    for (size_t j = i + 1; j < NO; ++j)
      if (overlap(*outputs[i].t, *outputs[j].t))
        fail(std::string("arguments '") + outputs[i].name + "' and '" + outputs[j].name + "' overlap in memory");
    for (const NamedTensor& x : inputs)
      if (overlap(*outputs[i].t, *x.t))
        fail(std::string("argument '") + outputs[i].name + "' overlaps input '" + x.name + "' in memory");
  }
}

// block_idx: the sparse forward's (undefined for the warm-up), checked here only for overlaps.
void check_forward_outputs(const TensorView& o, const TensorView& lse, const TensorView& kl,
                           MsaParams& p, const AttentionInputs& in, const TensorView& block_idx = TensorView()) {
  check_tensor("o", o, {p.T, p.H, p.Dv}, p.dtype, in.q.device, in.q.device_index);
  check_tensor("lse", lse, {p.H, p.T}, DType::fp32, in.q.device, in.q.device_index);
  check_scalar("kl", kl, in.q.device, in.q.device_index);
  const NamedTensor outputs[] = {{"o", &o}, {"lse", &lse}, {"kl", &kl}};
  const NamedTensor inputs[] = {{"q", &in.q},   {"k", &in.k}, {"v", &in.v}, {"qp", &in.qp},
                                {"kp", &in.kp}, {"cu_seqlens", &in.cu_seqlens}, {"block_idx", &block_idx},
                                {"selection_index", &in.selection_index}};
  reject_overlaps(outputs, inputs);
  p.o = o.data;
  p.lse = static_cast<float*>(lse.data);
  p.kl = kl.defined() ? static_cast<float*>(kl.data) : nullptr;
}

// block_idx: the sparse backward's (undefined for the warm-up), checked here only for overlaps.
void check_backward_args(const TensorView& o, const TensorView& lse, const TensorView& d_o,
                         const TensorView& kl_grad, const Gradients& g, const TensorView& kl,
                         MsaParams& p, const AttentionInputs& in, const TensorView& block_idx = TensorView()) {
  const Device dev = in.q.device;
  const int di = in.q.device_index;
  check_tensor("o", o, {p.T, p.H, p.Dv}, p.dtype, dev, di);
  check_tensor("lse", lse, {p.H, p.T}, DType::fp32, dev, di);
  check_tensor("d_o", d_o, {p.T, p.H, p.Dv}, p.dtype, dev, di);
  check_scalar("kl_grad", kl_grad, dev, di);
  check_tensor("dq", g.dq, {p.T, p.H, p.D}, p.dtype, dev, di);
  check_tensor("dk", g.dk, {p.T, p.Hkv, p.D}, p.dtype, dev, di);
  check_tensor("dv", g.dv, {p.T, p.Hkv, p.Dv}, p.dtype, dev, di);
  check_tensor("dqp", g.dqp, {p.T, p.Hp, p.Dp}, p.dtype, dev, di);
  check_tensor("dkp", g.dkp, {p.T, p.Hpk, p.Dp}, p.dtype, dev, di);
  check_scalar("kl", kl, dev, di);
  const NamedTensor outputs[] = {{"dq", &g.dq}, {"dk", &g.dk}, {"dv", &g.dv}, {"dqp", &g.dqp}, {"dkp", &g.dkp}, {"kl", &kl}};
  const NamedTensor inputs[] = {{"q", &in.q},   {"k", &in.k},     {"v", &in.v},     {"qp", &in.qp},
                                {"kp", &in.kp}, {"o", &o},        {"lse", &lse},    {"d_o", &d_o},
                                {"kl_grad", &kl_grad}, {"cu_seqlens", &in.cu_seqlens}, {"block_idx", &block_idx},
                                {"selection_index", &in.selection_index}};
  reject_overlaps(outputs, inputs);
  p.o = o.data;
  p.lse = static_cast<float*>(lse.data);
  p.d_o = d_o.data;
  p.kl_grad = kl_grad.defined() ? static_cast<const float*>(kl_grad.data) : nullptr;
  p.dq = g.dq.data;
  p.dk = g.dk.data;
  p.dv = g.dv.data;
  p.dqp = g.dqp.data;
  p.dkp = g.dkp.data;
  p.kl = kl.defined() ? static_cast<float*>(kl.data) : nullptr;
}

int64_t index_size(const MsaParams& p) {
  return selection_index_layout(p.T, p.B, p.Hp, p.top_k, p.block_size).size;
}

// The caller's index as an input of the sparse forward / backward (sets p.selection_index).
void check_selection_index(const AttentionInputs& in, MsaParams& p) {
  if (!in.selection_index.defined()) return;
  check_tensor("selection_index", in.selection_index, {index_size(p)}, DType::int32, in.q.device,
               in.q.device_index);
  p.selection_index = static_cast<const int32_t*>(in.selection_index.data);
}

// The index as build_selection_index's output: shape, entries countable in int32 (both backends),
// and no overlap with what the build reads.
void check_index_output(const TensorView& index, const MsaParams& p, const AttentionInputs& in,
                        const TensorView& block_idx) {
  if (static_cast<int64_t>(p.Hp) * p.T * p.top_k >= INT32_MAX)
    throw Error("flashmsa: build_selection_index: argument 'block_idx' has Hp*T*K >= 2^31 entries");
  check_tensor("selection_index", index, {index_size(p)}, DType::int32, in.q.device, in.q.device_index);
  const NamedTensor outputs[] = {{"selection_index", &index}};
  const NamedTensor inputs[] = {{"q", &in.q},   {"k", &in.k}, {"v", &in.v}, {"qp", &in.qp},
                                {"kp", &in.kp}, {"cu_seqlens", &in.cu_seqlens}, {"block_idx", &block_idx}};
  reject_overlaps(outputs, inputs);
}

}  // namespace

void select_blocks(const AttentionInputs& in, const Options& opt, TensorView block_idx,
                   Stream stream) {
  MsaParams p = validate_inputs(in, opt);
  check_block_idx(block_idx, p, in);
  std::vector<int32_t> cu_host;
  validate_cu_seqlens(in, p, cu_host, stream);
  p.block_idx = static_cast<int32_t*>(block_idx.data);
  if (on_cuda(in)) cuda::select_blocks(p, stream);
  else cpu::select_blocks(p);
}

void sparse_attention_forward(const AttentionInputs& in, const TensorView& block_idx,
                              const Options& opt, TensorView o, TensorView lse, TensorView kl,
                              Stream stream) {
  MsaParams p = validate_inputs(in, opt);
  check_block_idx(block_idx, p, in);
  check_selection_index(in, p);
  check_forward_outputs(o, lse, kl, p, in, block_idx);
  std::vector<int32_t> cu_host;
  validate_cu_seqlens(in, p, cu_host, stream);
  p.block_idx = static_cast<int32_t*>(block_idx.data);
  if (on_cuda(in)) cuda::sparse_attention_forward(p, stream);
  else cpu::sparse_attention_forward(p);
}

void fused_backward(const AttentionInputs& in, const TensorView& block_idx, const TensorView& o,
                    const TensorView& lse, const TensorView& d_o, const TensorView& kl_grad,
                    const Options& opt, Gradients grads, TensorView kl, Stream stream) {
  MsaParams p = validate_inputs(in, opt);
  check_block_idx(block_idx, p, in);
  check_selection_index(in, p);
  check_backward_args(o, lse, d_o, kl_grad, grads, kl, p, in, block_idx);
  std::vector<int32_t> cu_host;
  validate_cu_seqlens(in, p, cu_host, stream);
  p.block_idx = static_cast<int32_t*>(block_idx.data);
  if (on_cuda(in)) cuda::fused_backward(p, stream);
  else cpu::fused_backward(p);
}

int64_t selection_index_size(const AttentionInputs& in, const Options& opt) {
  return index_size(validate_inputs(in, opt));
}

void build_selection_index(const AttentionInputs& in, const TensorView& block_idx, const Options& opt,
                           TensorView selection_index, Stream stream) {
  MsaParams p = validate_inputs(in, opt);
  check_block_idx(block_idx, p, in);
  check_index_output(selection_index, p, in, block_idx);
  std::vector<int32_t> cu_host;
  validate_cu_seqlens(in, p, cu_host, stream);
  p.block_idx = static_cast<int32_t*>(block_idx.data);
  auto* index = static_cast<int32_t*>(selection_index.data);
  if (on_cuda(in)) cuda::build_selection_index(p, index, stream);
  else cpu::build_selection_index(p, index);
}

void dense_warmup_forward(const AttentionInputs& in, const Options& opt, TensorView o,
                          TensorView lse, TensorView kl, Stream stream) {
  MsaParams p = validate_inputs(in, opt);
  check_forward_outputs(o, lse, kl, p, in);
  std::vector<int32_t> cu_host;
  validate_cu_seqlens(in, p, cu_host, stream);
  if (on_cuda(in)) cuda::dense_warmup_forward(p, stream);
  else cpu::dense_warmup_forward(p);
}

void dense_warmup_backward(const AttentionInputs& in, const TensorView& o, const TensorView& lse,
                           const TensorView& d_o, const TensorView& kl_grad, const Options& opt,
                           Gradients grads, TensorView kl, Stream stream) {
  MsaParams p = validate_inputs(in, opt);
  check_backward_args(o, lse, d_o, kl_grad, grads, kl, p, in);
  std::vector<int32_t> cu_host;
  validate_cu_seqlens(in, p, cu_host, stream);
  if (on_cuda(in)) cuda::dense_warmup_backward(p, stream);
  else cpu::dense_warmup_backward(p);
}

void msa_forward(const AttentionInputs& in, const Options& opt, TensorView block_idx,
                 TensorView o, TensorView lse, TensorView kl, Stream stream) {
  if (opt.mode == Mode::warmup) {
    dense_warmup_forward(in, opt, o, lse, kl, stream);
    return;
  }
  // Validate everything the forward will check before selection writes block_idx, and copy
  // cu_seqlens to the host at most once for both calls.
  MsaParams p = validate_inputs(in, opt);
  check_block_idx(block_idx, p, in);
  check_forward_outputs(o, lse, kl, p, in, block_idx);
  const bool with_index = in.selection_index.defined();
  if (with_index) check_index_output(in.selection_index, p, in, block_idx);
  std::vector<int32_t> cu_host;
  validate_cu_seqlens(in, p, cu_host, stream);
  if (on_cuda(in)) cuda::check_supported(p, "sparse_attention_forward");
  AttentionInputs with_host = in;
  with_host.cu_seqlens_host = p.cu_seqlens_host;
  select_blocks(with_host, opt, block_idx, stream);
  if (with_index) build_selection_index(with_host, block_idx, opt, in.selection_index, stream);
  sparse_attention_forward(with_host, block_idx, opt, o, lse, kl, stream);
}

void msa_backward(const AttentionInputs& in, const TensorView& block_idx, const TensorView& o,
                  const TensorView& lse, const TensorView& d_o, const TensorView& kl_grad,
                  const Options& opt, Gradients grads, TensorView kl, Stream stream) {
  if (opt.mode == Mode::warmup)
    dense_warmup_backward(in, o, lse, d_o, kl_grad, opt, grads, kl, stream);
  else
    fused_backward(in, block_idx, o, lse, d_o, kl_grad, opt, grads, kl, stream);
}

bool cuda_device_available() { return cuda_backend_built() && cuda::device_available(); }

}  // namespace flashmsa
