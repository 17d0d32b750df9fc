// Internal: the validated problem every backend receives. Plain pointers and sizes, no views,
// so kernels and host dispatch stay independent of the public API and of any framework.
// All tensors are contiguous; pointers live on the backend's device unless named *_host.
#pragma once

#include <cstdint>

#include "flashmsa/flashmsa.h"

namespace flashmsa {

struct MsaParams {
  // ---- sizes ----
  int64_t T = 0;   // total tokens
  int B = 0;       // sequences
  int H = 0, Hkv = 0, Hp = 0, Hpk = 0;
  int D = 0, Dv = 0, Dp = 0;
  int max_seqlen = 0;
  // ---- options (resolved) ----
  int block_size = 128;
  int top_k = 16;
  int local_blocks = 1;
  float scale = 0.f;        // resolved: never <= 0 here
  float proxy_scale = 0.f;  // resolved
  float kl_coeff = 1.f;
  bool deterministic = false;
  int num_threads = 0;
  DType dtype = DType::bf16;  // of q, k, v, qp, kp, o, d_o and the gradients
  int device_index = 0;
  // ---- inputs ----
  const void* q = nullptr;              // [T, H, D]
  const void* k = nullptr;              // [T, Hkv, D]
  const void* v = nullptr;              // [T, Hkv, Dv]
  const void* qp = nullptr;             // [T, Hp, Dp]
  const void* kp = nullptr;             // [T, Hpk, Dp]
  const int32_t* cu_seqlens = nullptr;  // [B+1] on the backend's device
  const int32_t* cu_seqlens_host = nullptr;  // [B+1] on the host, validated
  // ---- selection ----
  int32_t* block_idx = nullptr;  // [Hp, T, K]; written by select, read by forward/backward
  bool all_blocks = false;       // block_idx is the dense warm-up's every-visible-block selection
  // The caller's prebuilt inverted index of block_idx (selection_index_layout.h), or nullptr: the
  // CUDA forward and backward then build their own. The CPU attention does not read it.
  const int32_t* selection_index = nullptr;  // [selection_index_layout(...).size]
  // ---- forward outputs / backward inputs ----
  void* o = nullptr;      // [T, H, Dv]
  float* lse = nullptr;   // [H, T]
  float* kl = nullptr;    // [1] kl_loss; nullptr = not requested
  // ---- backward ----
  const void* d_o = nullptr;       // [T, H, Dv]
  const float* kl_grad = nullptr;  // [1] upstream gradient of kl_loss; nullptr = 1
  void* dq = nullptr;              // [T, H, D]
  void* dk = nullptr;              // [T, Hkv, D]
  void* dv = nullptr;              // [T, Hkv, Dv]
  void* dqp = nullptr;             // [T, Hp, Dp]
  void* dkp = nullptr;             // [T, Hpk, Dp]

  // Head maps of msa.md.
  int kv_head(int h) const { return h / (H / Hkv); }
  int proxy_key_head(int p) const { return p / (Hp / Hpk); }
  int group_size() const { return H / Hp; }  // m
};

// Backend entry points. The API layer (src/api.cpp) validates and fills MsaParams, then calls
// one of these. CUDA versions take the stream as void* to keep this header CUDA-free.
namespace cpu {
void select_blocks(const MsaParams& p);
void sparse_attention_forward(const MsaParams& p);
void fused_backward(const MsaParams& p);
void dense_warmup_forward(const MsaParams& p);
void dense_warmup_backward(const MsaParams& p);
void build_selection_index(const MsaParams& p, int32_t* index);  // index [layout size]
}  // namespace cpu

namespace cuda {
void select_blocks(const MsaParams& p, void* stream);
void sparse_attention_forward(const MsaParams& p, void* stream);
void fused_backward(const MsaParams& p, void* stream);
void dense_warmup_forward(const MsaParams& p, void* stream);
void dense_warmup_backward(const MsaParams& p, void* stream);
void build_selection_index(const MsaParams& p, int32_t* index, void* stream);
bool device_available();
// Device-to-host copy ordered on `stream`, then a wait for it (used to validate cu_seqlens).
void copy_to_host(void* dst, const void* src, int64_t bytes, int device_index, void* stream);
// Throws Error naming the argument if the CUDA kernels cannot take this problem (dtype, head
// dims, block size, sizes). Called before any launch, and by msa_forward before selection.
void check_supported(const MsaParams& p, const char* operation);
}  // namespace cuda

}  // namespace flashmsa
