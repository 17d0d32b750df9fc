// torch.ops.flashmsa.*: the library's msa_forward / msa_backward as PyTorch operators.
//
// The operators return fresh outputs and alias nothing; the one mutation is the backward's
// optional kl_out (declared in its schema), which receives the kl_loss value when the forward was
// asked not to form it. The sparse forward also returns the step's selection index
// (build_selection_index), which the backward takes back instead of building its own. Autograd,
// fake tensors and torch.compile are all registered from Python (flashmsa/__init__.py) on top of
// these two schemas. One C++ function serves both devices: the library dispatches on the views'
// device itself; here we only pick the stream and device guard.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <tuple>

#include "flashmsa/flashmsa.h"

#ifdef FLASHMSA_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace {

using at::Tensor;

flashmsa::DType to_dtype(at::ScalarType t, const char* name) {
  switch (t) {
    case at::kBFloat16: return flashmsa::DType::bf16;
    case at::kHalf: return flashmsa::DType::fp16;
    case at::kFloat: return flashmsa::DType::fp32;
    case at::kInt: return flashmsa::DType::int32;
    default:
      TORCH_CHECK(false, "flashmsa: argument '", name, "' has unsupported dtype ", t,
                  " (expected bfloat16, float16 or float32; int32 for indices)");
  }
}

// A view over a contiguous tensor; `shape_override` lets a 0-dim scalar pass as the [1] the
// library asks for.
flashmsa::TensorView view_of(const Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() <= 4, "flashmsa: argument '", name, "' has more than 4 dimensions");
  TORCH_CHECK(t.is_contiguous(), "flashmsa: internal: '", name, "' is not contiguous");
  flashmsa::TensorView v;
  v.data = t.data_ptr();
  v.dtype = to_dtype(t.scalar_type(), name);
  v.device = t.is_cuda() ? flashmsa::Device::cuda : flashmsa::Device::cpu;
  v.device_index = t.is_cuda() ? t.get_device() : 0;
  v.ndim = static_cast<int>(t.dim());
  // Row-major strides from the shape: equal to torch's for a contiguous tensor except on
  // size-0/1 dimensions, where torch's free choice would trip the library's contiguity check.
  int64_t stride = 1;
  for (int i = v.ndim - 1; i >= 0; --i) {
    v.shape[i] = t.size(i);
    v.stride[i] = stride;
    stride *= t.size(i);
  }
  if (v.ndim == 0) {  // a scalar: the library's [1]
    v.ndim = 1;
    v.shape[0] = 1;
    v.stride[0] = 1;
  }
  return v;
}

// The CUDA backend takes 16-byte aligned pointers; a contiguous slice of a larger tensor may
// not be, so such inputs are copied instead of rejected.
Tensor prepare(const Tensor& t) {
  Tensor c = t.contiguous();
  if (c.is_cuda() && c.numel() > 0 && reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0)
    c = c.clone();
  return c;
}

flashmsa::Mode parse_mode(c10::string_view mode) {
  if (mode == "sparse") return flashmsa::Mode::sparse;
  if (mode == "warmup") return flashmsa::Mode::warmup;
  TORCH_CHECK(false, "flashmsa: option 'mode' must be \"sparse\" or \"warmup\", got \"",
              std::string(mode), "\"");
}

flashmsa::Options make_options(int64_t block_size, int64_t top_k, int64_t local_blocks,
                               double scale, double proxy_scale, double kl_coeff,
                               c10::string_view mode, bool deterministic, bool on_cpu) {
  auto fits_int = [](int64_t x) {
    return x >= std::numeric_limits<int>::min() && x <= std::numeric_limits<int>::max();
  };
  TORCH_CHECK(fits_int(block_size), "flashmsa: option 'block_size' is out of range");
  TORCH_CHECK(fits_int(top_k), "flashmsa: option 'top_k' is out of range");
  TORCH_CHECK(fits_int(local_blocks), "flashmsa: option 'local_blocks' is out of range");
  // Checked here too because top_k sizes block_idx before the library validates anything.
  TORCH_CHECK(top_k >= 1, "flashmsa: option 'top_k' (K) must be >= 1");
  flashmsa::Options opt;
  opt.block_size = static_cast<int>(block_size);
  opt.top_k = static_cast<int>(top_k);
  opt.local_blocks = static_cast<int>(local_blocks);
  opt.scale = static_cast<float>(scale);
  opt.proxy_scale = static_cast<float>(proxy_scale);
  opt.kl_coeff = static_cast<float>(kl_coeff);
  opt.deterministic = deterministic;
  opt.mode = parse_mode(mode);
  // Follow torch.set_num_threads so the op shares the machine like the rest of the model.
  opt.num_threads = on_cpu ? std::max(1, at::get_num_threads()) : 0;
  return opt;
}

// FLASHMSA_POISON=1 fills fresh outputs with NaN / a bad index before the library runs, so a
// test catches any element the backend forgot to write.
bool poison_outputs() {
  static const bool on = [] {
    const char* e = std::getenv("FLASHMSA_POISON");
    return e != nullptr && e[0] != '\0' && e[0] != '0';
  }();
  return on;
}

void poison(Tensor& t) {
  if (!poison_outputs() || t.numel() == 0) return;
  if (t.is_floating_point()) t.fill_(std::numeric_limits<double>::quiet_NaN());
  else t.fill_(-12345);
}

// The inputs, made contiguous and kept alive for the call.
struct Inputs {
  Tensor q, k, v, qp, kp, cu, cu_host;
  flashmsa::AttentionInputs views;
};

Inputs make_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& qp,
                   const Tensor& kp, const Tensor& cu_seqlens,
                   const std::optional<Tensor>& cu_seqlens_host) {
  Inputs in;
  in.q = prepare(q);
  in.k = prepare(k);
  in.v = prepare(v);
  in.qp = prepare(qp);
  in.kp = prepare(kp);
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt,
              "flashmsa: argument 'cu_seqlens' must be int32, got ", cu_seqlens.scalar_type());
  in.cu = prepare(cu_seqlens);
  in.views.q = view_of(in.q, "q");
  in.views.k = view_of(in.k, "k");
  in.views.v = view_of(in.v, "v");
  in.views.qp = view_of(in.qp, "qp");
  in.views.kp = view_of(in.kp, "kp");
  in.views.cu_seqlens = view_of(in.cu, "cu_seqlens");
  if (cu_seqlens_host.has_value() && cu_seqlens_host->defined()) {
    const Tensor& h = *cu_seqlens_host;
    TORCH_CHECK(h.device().is_cpu() && h.scalar_type() == at::kInt && h.dim() == 1 &&
                    h.numel() == cu_seqlens.numel(),
                "flashmsa: argument 'cu_seqlens_host' must be a CPU int32 copy of cu_seqlens");
    in.cu_host = h.contiguous();
    in.views.cu_seqlens_host = in.cu_host.data_ptr<int32_t>();
  }
  return in;
}

#ifdef FLASHMSA_TORCH_CUDA
// The library's device workspace (up to ~2.3 x size(q) in the backward) from torch's caching
// allocator, so it shares torch's cache (and its graph pools under capture) instead of a second
// pool that torch cannot reclaim. Installed once, before the op's first CUDA call.
void* torch_workspace_allocate(void*, size_t bytes, int, flashmsa::Stream stream) {
  try {
    return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(bytes, static_cast<cudaStream_t>(stream));
  } catch (const c10::Error&) {
    return nullptr;  // the library raises its own error, naming the size
  }
}
void torch_workspace_deallocate(void*, void* ptr, int, flashmsa::Stream) noexcept {
  try {
    c10::cuda::CUDACachingAllocator::raw_delete(ptr);
  } catch (...) {  // called from destructors too: a failure here must not terminate
  }
}
void install_torch_workspace_allocator() {
  static const bool installed = [] {
    flashmsa::WorkspaceAllocator a;
    a.allocate = &torch_workspace_allocate;
    a.deallocate = &torch_workspace_deallocate;
    flashmsa::set_workspace_allocator(a);
    return true;
  }();
  (void)installed;
}
#endif

// Runs `body` with q's device current and the current stream, turning library errors into
// c10::Error (RuntimeError in Python) with the library's message, which names the argument.
template <typename F>
void run_on_device(const Tensor& q, F&& body) {
  flashmsa::Stream stream = nullptr;
#ifdef FLASHMSA_TORCH_CUDA
  std::optional<c10::cuda::CUDAGuard> guard;
  if (q.is_cuda()) {
    install_torch_workspace_allocator();
    guard.emplace(q.device());
    stream = static_cast<flashmsa::Stream>(c10::cuda::getCurrentCUDAStream(q.get_device()).stream());
  }
#else
  TORCH_CHECK(!q.is_cuda(), "flashmsa: argument 'q' is on CUDA but the extension was built "
                            "without CUDA support");
#endif
  try {
    body(stream);
  } catch (const flashmsa::Error& e) {
    TORCH_CHECK(false, e.what());
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "flashmsa: ", e.what());
  }
}

// kl_out: a one-element fp32 tensor on q's device (checked in the forward too, so a bad one fails
// before any work, not in the backward).
void check_kl_out(const std::optional<Tensor>& kl_out, const Tensor& q) {
  if (!kl_out) return;
  const Tensor& t = *kl_out;
  TORCH_CHECK(t.scalar_type() == at::kFloat, "flashmsa: argument 'kl_out' must be float32, got ",
              t.scalar_type());
  TORCH_CHECK(t.numel() == 1 && t.dim() <= 1,
              "flashmsa: argument 'kl_out' must hold one value (0-dim or [1]), got shape ", t.sizes());
  TORCH_CHECK(t.device() == q.device(), "flashmsa: argument 'kl_out' is on ", t.device(),
              ", q is on ", q.device());
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> forward(
    const Tensor& q,             // [T, H, D]
    const Tensor& k,             // [T, Hkv, D]
    const Tensor& v,             // [T, Hkv, Dv]
    const Tensor& qp,            // [T, Hp, Dp]
    const Tensor& kp,            // [T, Hpk, Dp]
    const Tensor& cu_seqlens,    // [B+1] int32, q's device
    const std::optional<Tensor>& cu_seqlens_host,  // [B+1] int32 CPU, optional
    int64_t block_size, int64_t top_k, int64_t local_blocks, double scale, double proxy_scale,
    double kl_coeff, c10::string_view mode, bool deterministic,
    const std::optional<Tensor>& kl_out) {  // given: the backward forms the KL value, not this
  TORCH_CHECK(q.dim() == 3, "flashmsa: argument 'q' must have 3 dimensions [T, H, D]");
  check_kl_out(kl_out, q);
  TORCH_CHECK(v.dim() == 3, "flashmsa: argument 'v' must have 3 dimensions [T, Hkv, Dv]");
  TORCH_CHECK(qp.dim() == 3, "flashmsa: argument 'qp' must have 3 dimensions [T, Hp, Dp]");
  const flashmsa::Options opt = make_options(block_size, top_k, local_blocks, scale, proxy_scale,
                                             kl_coeff, mode, deterministic, !q.is_cuda());
  Inputs in = make_inputs(q, k, v, qp, kp, cu_seqlens, cu_seqlens_host);
  const int64_t T = q.size(0), H = q.size(1), Dv = v.size(2), Hp = qp.size(1);
  const bool sparse = opt.mode == flashmsa::Mode::sparse;

  Tensor o = at::empty({T, H, Dv}, in.q.options());                                  // [T, H, Dv]
  Tensor lse = at::empty({H, T}, in.q.options().dtype(at::kFloat));                  // [H, T]
  Tensor block_idx = at::empty(sparse ? std::vector<int64_t>{Hp, T, top_k}           // [Hp, T, K]
                                      : std::vector<int64_t>{0},                     // warm-up: [0]
                               in.q.options().dtype(at::kInt));
  // With kl_out the forward skips the KL value (a pass over every head's scores again, since
  // the sparse and warm-up forwards do not keep the probabilities): kl carries only the gradient
  // path and holds 0.
  Tensor kl = kl_out ? at::zeros({}, in.q.options().dtype(at::kFloat))             // scalar
                     : at::empty({}, in.q.options().dtype(at::kFloat));
  // [selection_index_size] int32 (sparse; its size depends on shapes only) or [0] (warm-up).
  int64_t index_size = 0;
  if (sparse)
    run_on_device(in.q, [&](flashmsa::Stream) { index_size = flashmsa::selection_index_size(in.views, opt); });
  Tensor selection_index = at::empty({index_size}, in.q.options().dtype(at::kInt));
  poison(o);
  poison(lse);
  poison(block_idx);
  poison(selection_index);
  if (!kl_out) poison(kl);
  if (sparse) in.views.selection_index = view_of(selection_index, "selection_index");

  run_on_device(in.q, [&](flashmsa::Stream stream) {
    flashmsa::msa_forward(in.views, opt,
                          sparse ? view_of(block_idx, "block_idx") : flashmsa::TensorView(),
                          view_of(o, "o"), view_of(lse, "lse"),
                          kl_out ? flashmsa::TensorView() : view_of(kl, "kl"), stream);
  });
  return {o, lse, block_idx, kl, selection_index};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> backward(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& qp, const Tensor& kp,
    const Tensor& cu_seqlens, const std::optional<Tensor>& cu_seqlens_host,
    const Tensor& block_idx,  // [Hp, T, K] int32 (sparse) or [0] (warm-up)
    const Tensor& o,          // [T, H, Dv]
    const Tensor& lse,        // [H, T] fp32
    const Tensor& d_o,        // [T, H, Dv]
    const Tensor& kl_grad,    // scalar (or [1]) fp32: upstream gradient of kl_loss
    int64_t block_size, int64_t top_k, int64_t local_blocks, double scale, double proxy_scale,
    double kl_coeff, c10::string_view mode, bool deterministic,
    const std::optional<Tensor>& kl_out,            // [1] or 0-dim fp32: receives the kl_loss value
    const std::optional<Tensor>& selection_index) {  // the forward's, or absent: built again
  const flashmsa::Options opt = make_options(block_size, top_k, local_blocks, scale, proxy_scale,
                                             kl_coeff, mode, deterministic, !q.is_cuda());
  Inputs in = make_inputs(q, k, v, qp, kp, cu_seqlens, cu_seqlens_host);
  const bool sparse = opt.mode == flashmsa::Mode::sparse;
  TORCH_CHECK(kl_grad.numel() == 1, "flashmsa: argument 'kl_grad' must hold one value");
  check_kl_out(kl_out, q);  // one fp32 element: always contiguous and aligned, written in place
  // Upstream gradients may be expanded scalars or a different float type; the kernels want
  // dense tensors of the input dtype (d_o) and one fp32 value (kl_grad), read on the device.
  Tensor d_o_c = prepare(d_o.to(in.q.scalar_type()));
  Tensor g = prepare(kl_grad.to(at::kFloat).reshape({}));
  Tensor o_c = prepare(o);
  Tensor lse_c = prepare(lse);
  Tensor idx_c = sparse ? prepare(block_idx) : block_idx;
  Tensor index_c;
  if (sparse && selection_index && selection_index->defined()) {  // dtype and size: the library's checks
    index_c = prepare(*selection_index);
    in.views.selection_index = view_of(index_c, "selection_index");
  }

  Tensor dq = at::empty_like(in.q);    // [T, H, D]
  Tensor dk = at::empty_like(in.k);    // [T, Hkv, D]
  Tensor dv = at::empty_like(in.v);    // [T, Hkv, Dv]
  Tensor dqp = at::empty_like(in.qp);  // [T, Hp, Dp]
  Tensor dkp = at::empty_like(in.kp);  // [T, Hpk, Dp]
  for (Tensor* t : {&dq, &dk, &dv, &dqp, &dkp}) poison(*t);

  run_on_device(in.q, [&](flashmsa::Stream stream) {
    flashmsa::Gradients grads;
    grads.dq = view_of(dq, "dq");
    grads.dk = view_of(dk, "dk");
    grads.dv = view_of(dv, "dv");
    grads.dqp = view_of(dqp, "dqp");
    grads.dkp = view_of(dkp, "dkp");
    flashmsa::msa_backward(in.views, sparse ? view_of(idx_c, "block_idx") : flashmsa::TensorView(),
                           view_of(o_c, "o"), view_of(lse_c, "lse"), view_of(d_o_c, "d_o"),
                           view_of(g, "kl_grad"), opt, grads,
                           kl_out ? view_of(*kl_out, "kl_out") : flashmsa::TensorView(), stream);
  });
  return {dq, dk, dv, dqp, dkp};
}

bool cuda_built() { return flashmsa::cuda_backend_built(); }

}  // namespace

// The mode argument is `attention_mode`: functionalization of the mutating backward (torch.compile)
// passes the op's arguments by name next to its own `mode`.
TORCH_LIBRARY(flashmsa, m) {
  m.def(
      "forward(Tensor q, Tensor k, Tensor v, Tensor qp, Tensor kp, Tensor cu_seqlens, "
      "Tensor? cu_seqlens_host, int block_size, int top_k, int local_blocks, float scale, "
      "float proxy_scale, float kl_coeff, str attention_mode, bool deterministic, Tensor? kl_out=None) "
      "-> (Tensor o, Tensor lse, Tensor block_idx, Tensor kl, Tensor selection_index)");
  m.def(
      "backward(Tensor q, Tensor k, Tensor v, Tensor qp, Tensor kp, Tensor cu_seqlens, "
      "Tensor? cu_seqlens_host, Tensor block_idx, Tensor o, Tensor lse, Tensor d_o, "
      "Tensor kl_grad, int block_size, int top_k, int local_blocks, float scale, "
      "float proxy_scale, float kl_coeff, str attention_mode, bool deterministic, "
      "Tensor(a!)? kl_out=None, Tensor? selection_index=None) "
      "-> (Tensor dq, Tensor dk, Tensor dv, Tensor dqp, Tensor dkp)");
  // Build facts for Python, as an op so no pybind module is needed.
  m.def("cuda_built() -> bool", &cuda_built);
}

TORCH_LIBRARY_IMPL(flashmsa, CPU, m) {
  m.impl("forward", &forward);
  m.impl("backward", &backward);
}

#ifdef FLASHMSA_TORCH_CUDA
TORCH_LIBRARY_IMPL(flashmsa, CUDA, m) {
  m.impl("forward", &forward);
  m.impl("backward", &backward);
}
#endif
