// flashmsa: MiniMax Sparse Attention (MSA) training kernels.
//
// Plain C++ API over raw pointers. Every operation takes non-owning TensorViews; the backend
// (CPU or CUDA) is chosen by the views' device. The exact math is ../shared/spec/msa.md.
//
// Layout: packed "varlen", tokens of all sequences concatenated, cu_seqlens [B+1] int32.
//   q  [T, H,   D ]   k  [T, Hkv, D ]   v  [T, Hkv, Dv]
//   qp [T, Hp,  Dp]   kp [T, Hpk, Dp]
// All tensors must be contiguous (row-major, innermost dimension last). Inputs share one dtype
// (bf16, fp16 or fp32); outputs o and the gradients have that dtype too; lse, the KL value and
// the upstream KL gradient are fp32; block indices are int32.
//
// Errors: every bad argument raises flashmsa::Error whose message names the argument; all checks
// run before anything is written.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>

namespace flashmsa {

enum class DType : int { bf16 = 0, fp16 = 1, fp32 = 2, int32 = 3 };
enum class Device : int { cpu = 0, cuda = 1 };

const char* dtype_name(DType dtype);
int64_t dtype_size(DType dtype);

// A non-owning view of a tensor of up to 4 dimensions. Strides are in elements.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::fp32;
  Device device = Device::cpu;
  int device_index = 0;
  int ndim = 0;
  int64_t shape[4] = {0, 0, 0, 0};
  int64_t stride[4] = {0, 0, 0, 0};

  int64_t numel() const;
  bool is_contiguous() const;
  bool defined() const { return ndim > 0 || data != nullptr; }
};

// A contiguous view over `data` with the given shape.
TensorView make_view(const void* data, DType dtype, std::initializer_list<int64_t> shape,
                     Device device = Device::cpu, int device_index = 0);

class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

enum class Mode : int {
  sparse = 0,  // top-K block selection, block-sparse main attention, KL on the selected keys
  warmup = 1,  // dense causal main attention, KL over all causal keys (quadratic)
};

struct Options {
  int block_size = 128;     // BLK: tokens per key block, aligned to each sequence start
  int top_k = 16;           // K: blocks kept per (proxy head, query), local blocks included
  int local_blocks = 1;     // the query's own block and the (local_blocks-1) before it are kept
  float scale = 0.f;        // main softmax scale; <= 0 means D^-0.5
  float proxy_scale = 0.f;  // proxy score scale; <= 0 means Dp^-0.5
  float kl_coeff = 1.f;     // kl_loss = kl_coeff * mean over (p, t) of KL[p, t]
  bool deterministic = false;  // bitwise-reproducible gradients (may cost time)
  Mode mode = Mode::sparse;    // used by msa_forward / msa_backward
  int num_threads = 0;         // CPU backend worker threads; 0 = all hardware threads
};

// The five inputs and the sequence boundaries.
struct AttentionInputs {
  TensorView q;           // [T, H, D]
  TensorView k;           // [T, Hkv, D]
  TensorView v;           // [T, Hkv, Dv]
  TensorView qp;          // [T, Hp, Dp]   proxy queries
  TensorView kp;          // [T, Hpk, Dp]  proxy keys
  TensorView cu_seqlens;  // [B+1] int32 on the inputs' device; cu[0] = 0, cu[B] = T
  // Optional host copy of cu_seqlens. The CUDA backend validates it on the host; without it
  // the CUDA backend copies cu_seqlens to the host once (a synchronisation).
  const int32_t* cu_seqlens_host = nullptr;
  // Optional: the inverted selection index of the block_idx passed with these inputs, built by
  // build_selection_index from that same block_idx (int32 [selection_index_size(in, opt)], on the
  // inputs' device). The CUDA sparse forward, its KL value and the fused backward then read it
  // instead of each building their own; nothing checks that it matches block_idx (that would cost
  // the build it saves). The CPU attention and the dense warm-up do not read it.
  TensorView selection_index;
};

// The gradients must not overlap each other, the KL output or any input (rejected): the CUDA
// backward uses dq's buffer for its smaller accumulators until it writes dq last.
struct Gradients {
  TensorView dq;   // [T, H, D]
  TensorView dk;   // [T, Hkv, D]
  TensorView dv;   // [T, Hkv, Dv]
  TensorView dqp;  // [T, Hp, Dp]
  TensorView dkp;  // [T, Hpk, Dp]
};

// `stream` is a cudaStream_t for the CUDA backend (nullptr = default stream); ignored on CPU.
using Stream = void*;

// Selection (msa.md forward steps 1-4): block_idx [Hp, T, K] int32, ascending, -1 padding last.
void select_blocks(const AttentionInputs& in, const Options& opt, TensorView block_idx,
                   Stream stream = nullptr);

// Block-sparse main attention over precomputed block indices (msa.md step 5), and, when `kl`
// is given (a [1] fp32 view), the distillation loss kl_loss of step 6. block_idx must have
// select_blocks' format (rows ascending, entries in [0, own block], -1 padding last). The CPU
// backend checks its contents and raises Error naming 'block_idx'; the CUDA backend does not
// read it back to the host (that would synchronise) and skips out-of-range entries.
//   o [T, H, Dv] input dtype, lse [H, T] fp32 (natural log), kl [1] fp32 (optional).
// The outputs must not overlap each other, block_idx or any input (rejected): the CUDA forward
// uses o's buffer for its selection index's scratch before it writes o.
void sparse_attention_forward(const AttentionInputs& in, const TensorView& block_idx,
                              const Options& opt, TensorView o, TensorView lse,
                              TensorView kl = TensorView(), Stream stream = nullptr);

// One backward for the main attention (dq, dk, dv) and the proxy's KL (dqp, dkp).
//   d_o [T, H, Dv]; kl_grad: optional [1] fp32 upstream gradient g of kl_loss (absent = 1);
//   kl: optional [1] fp32, receives the kl_loss value. Gradients are overwritten (not added).
void fused_backward(const AttentionInputs& in, const TensorView& block_idx, const TensorView& o,
                    const TensorView& lse, const TensorView& d_o, const TensorView& kl_grad,
                    const Options& opt, Gradients grads, TensorView kl = TensorView(),
                    Stream stream = nullptr);

// The inverted selection index, once per training step (msa_forward builds it when
// in.selection_index is given): for each (proxy head, key block), the (token, slot) entries of
// block_idx that chose it. Its size in int32 elements depends on shapes only (T, B, Hp, K and the
// block size: about Hp T K), so a framework can allocate it before the data exist. The CPU
// backend writes the same array as the CUDA one.
int64_t selection_index_size(const AttentionInputs& in, const Options& opt);
void build_selection_index(const AttentionInputs& in, const TensorView& block_idx, const Options& opt,
                           TensorView selection_index, Stream stream = nullptr);

// Dense warm-up mode: dense causal main attention and the proxy KL over all causal keys.
void dense_warmup_forward(const AttentionInputs& in, const Options& opt, TensorView o,
                          TensorView lse, TensorView kl = TensorView(), Stream stream = nullptr);
void dense_warmup_backward(const AttentionInputs& in, const TensorView& o, const TensorView& lse,
                           const TensorView& d_o, const TensorView& kl_grad, const Options& opt,
                           Gradients grads, TensorView kl = TensorView(), Stream stream = nullptr);

// Convenience: the whole step by opt.mode. Sparse: select_blocks + sparse_attention_forward
// (block_idx is written), with build_selection_index between them when in.selection_index is
// given (it is written too; pass the same inputs to msa_backward); warm-up: dense_warmup_forward
// (block_idx may be left undefined).
void msa_forward(const AttentionInputs& in, const Options& opt, TensorView block_idx,
                 TensorView o, TensorView lse, TensorView kl = TensorView(),
                 Stream stream = nullptr);
void msa_backward(const AttentionInputs& in, const TensorView& block_idx, const TensorView& o,
                  const TensorView& lse, const TensorView& d_o, const TensorView& kl_grad,
                  const Options& opt, Gradients grads, TensorView kl = TensorView(),
                  Stream stream = nullptr);

// Whether this build has the CUDA backend, and whether a usable sm_90 device is present.
bool cuda_backend_built();
bool cuda_device_available();

// Device workspace of the CUDA backend (index, accumulators, scratch: up to ~2.3 x size(q) in the
// backward). By default it comes from a stream-ordered memory pool that flashmsa owns per device
// and that KEEPS its memory between calls, as a framework's caching allocator does: with the
// default CUDA pool, which hands memory back at every synchronisation, re-mapping 2.4 GB cost
// 3.5 ms of a 47 ms backward at m3/64k on an H200. cudaMemPoolTrimTo(pool, 0) on
// workspace_memory_pool(device) gives the kept memory back; its cudaMemPoolAttrUsedMemHigh is the
// workspace peak.
void* workspace_memory_pool(int device_index);  // a cudaMemPool_t; Error in a build without CUDA

// Or the caller's allocator (the PyTorch op installs torch's caching allocator), for every later
// call in the process. allocate returns `bytes` of memory on the current device (device_index),
// 256-byte aligned (else flashmsa gives it back and raises Error), usable in the order of `stream`
// (a cudaStream_t), or nullptr (flashmsa then raises Error);
// deallocate is called once the buffer's last use is enqueued on `stream`. Both null: flashmsa's
// pool again.
struct WorkspaceAllocator {
  void* (*allocate)(void* context, size_t bytes, int device_index, Stream stream) = nullptr;
  void (*deallocate)(void* context, void* ptr, int device_index, Stream stream) = nullptr;
  void* context = nullptr;
};
void set_workspace_allocator(const WorkspaceAllocator& allocator);

}  // namespace flashmsa
