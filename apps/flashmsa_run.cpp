// flashmsa_run: the main job. One MSA training step (selection -> sparse forward -> fused backward
// with the KL value) on the best available device, checked against an independent fp64 slice
// reference, with timings, TFLOP/s and selection statistics. Exits non-zero when a check fails.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#ifdef FLASHMSA_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "flashmsa/flashmsa.h"
#include "slice_check.h"
#ifdef FLASHMSA_WITH_CUDA
#include "device_init.h"
#endif

namespace {

using namespace flashmsa;

struct Config {
  std::string device = "auto";
  std::string dtype = "bf16";
  std::string mode = "sparse";
  std::vector<int> seqlens;  // empty: batch x seqlen
  int batch = 1, seqlen = 0;
  int H = 64, Hkv = 4, Hp = 4, Hpk = 1, D = 128, Dv = 128, Dp = 128;
  int block = 128, topk = 16, local_blocks = 1, threads = 0, iters = 0, check_tokens = 6,
      check_keys = 2, sink_blocks = 0;
  float kl_coeff = 1.f;
  bool deterministic = false, full_check = false, quiet = false, forward_kl = false, graph = false,
       bitwise_reruns = false, index_reuse = true;
  uint64_t seed = 1234;
  std::string json;
};

void usage() {
  std::printf(
      "flashmsa_run: one MSA training step (selection, sparse forward, fused backward + KL),\n"
      "checked against an independent fp64 slice reference, with timings.\n\n"
      "Shape (defaults: the MiniMax-M3 shape of msa.md):\n"
      "  --seqlen S         tokens per sequence (default 4096 on CPU, 32768 on CUDA)\n"
      "  --batch B          number of sequences of length S (default 1)\n"
      "  --seqlens a,b,...  explicit sequence lengths (varlen), overrides --seqlen/--batch\n"
      "  --heads H --kv-heads Hkv --proxy-heads Hp --proxy-kv-heads Hpk   (64 4 4 1)\n"
      "  --dim D --dim-v Dv --dim-p Dp                                       (128 128 128)\n"
      "Options:\n"
      "  --block BLK (128) --topk K (16) --local-blocks L (1) --kl-coeff C (1.0)\n"
      "  --mode sparse|warmup (sparse) --dtype bf16|fp16|fp32 (bf16) --deterministic\n"
      "  --sink-blocks N    the first N blocks of every sequence become attention sinks that every\n"
      "                     token selects (qp and kp get +12 on channel 0: every qp row, kp's rows\n"
      "                     of those blocks): the long lists of a trained proxy (default 0: the\n"
      "                     N(0,1) inputs' near-random selection)\n"
      "  --forward-kl       the forward also produces the KL value (as the PyTorch op does)\n"
      "  --graph            also time the whole step captured once in a CUDA graph and replayed, and\n"
      "                     the step (and selection + forward) launched on one stream without\n"
      "                     synchronising between phases\n"
      "  --no-index-reuse   CUDA: the forward and the backward each build their own selection index\n"
      "                     (default: built once in the forward's phase, build_selection_index)\n"
      "Run:\n"
      "  --device auto|cpu|cuda (auto: cuda when an sm_90 GPU is present)\n"
      "  --iters N          timed repetitions (default 1 on CPU, 10 on CUDA; median reported)\n"
      "  --threads N        CPU worker threads (0 = all)\n"
      "  --check-tokens N   query tokens in the fp64 slice check (6); --check-keys N key tokens (2)\n"
      "  --full-check       on CUDA also run the whole step on the CPU backend and compare all outputs\n"
      "  --bitwise-reruns   (with --deterministic) every timed step's gradients and KL value must have\n"
      "                     the same bits as the first one's (a hash of each, downloaded after the step)\n"
      "  --seed N           input seed (1234)\n"
      "  --json FILE        write every figure as JSON\n"
      "  --quiet            no progress lines\n");
}

Config parse(int argc, char** argv) {
  Config c;
  auto need = [&](int& i) -> const char* {
    if (i + 1 >= argc) {
      std::fprintf(stderr, "flashmsa_run: %s needs a value\n", argv[i]);
      std::exit(2);
    }
    return argv[++i];
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto geti = [&] { return std::atoi(need(i)); };
    if (a == "--help" || a == "-h") { usage(); std::exit(0); }
    else if (a == "--device") c.device = need(i);
    else if (a == "--dtype") c.dtype = need(i);
    else if (a == "--mode") c.mode = need(i);
    else if (a == "--seqlen") c.seqlen = geti();
    else if (a == "--batch") c.batch = geti();
    else if (a == "--seqlens") {
      std::stringstream ss(need(i));
      std::string item;
      while (std::getline(ss, item, ',')) c.seqlens.push_back(std::atoi(item.c_str()));
    }
    else if (a == "--heads") c.H = geti();
    else if (a == "--kv-heads") c.Hkv = geti();
    else if (a == "--proxy-heads") c.Hp = geti();
    else if (a == "--proxy-kv-heads") c.Hpk = geti();
    else if (a == "--dim") c.D = geti();
    else if (a == "--dim-v") c.Dv = geti();
    else if (a == "--dim-p") c.Dp = geti();
    else if (a == "--block") c.block = geti();
    else if (a == "--topk") c.topk = geti();
    else if (a == "--local-blocks") c.local_blocks = geti();
    else if (a == "--sink-blocks") c.sink_blocks = geti();
    else if (a == "--kl-coeff") c.kl_coeff = static_cast<float>(std::atof(need(i)));
    else if (a == "--threads") c.threads = geti();
    else if (a == "--iters") c.iters = geti();
    else if (a == "--check-tokens") c.check_tokens = geti();
    else if (a == "--check-keys") c.check_keys = geti();
    else if (a == "--seed") c.seed = std::strtoull(need(i), nullptr, 10);
    else if (a == "--json") c.json = need(i);
    else if (a == "--deterministic") c.deterministic = true;
    else if (a == "--full-check") c.full_check = true;
    else if (a == "--bitwise-reruns") c.bitwise_reruns = true;
    else if (a == "--forward-kl") c.forward_kl = true;
    else if (a == "--graph") c.graph = true;
    else if (a == "--no-index-reuse") c.index_reuse = false;
    else if (a == "--quiet") c.quiet = true;
    else {
      std::fprintf(stderr, "flashmsa_run: unknown flag '%s' (see --help)\n", a.c_str());
      std::exit(2);
    }
  }
  return c;
}

// ---- host numerics -------------------------------------------------------------------------
uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);                      // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}
float bf16_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t float_to_fp16(float f) {  // round to nearest even, via the hardware-free bit path
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (x >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (x < 0x38800000u) {                                              // subnormal or zero
    const float a = std::fabs(f) * 16777216.f;                        // 2^24
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a)));
  }
  const uint32_t mant = x & 0x7fffffu;
  uint32_t h = ((x >> 23) - 112u) << 10 | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}
float fp16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  float f;
  if (e == 0) {
    f = std::ldexp(static_cast<float>(m), -24);
    return sign ? -f : f;
  }
  uint32_t u = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112u) << 23) | (m << 13));
  std::memcpy(&f, &u, 4);
  return f;
}

// A host tensor of the run's dtype, with its fp32 values (after rounding) kept beside it.
struct HostTensor {
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<unsigned char> bytes;
  int64_t numel() const {
    int64_t n = 1;
    for (auto s : shape) n *= s;
    return n;
  }
  void set(int64_t i, float x) {
    if (dtype == DType::fp32) std::memcpy(&bytes[i * 4], &x, 4);
    else {
      uint16_t h = dtype == DType::bf16 ? float_to_bf16(x) : float_to_fp16(x);
      std::memcpy(&bytes[i * 2], &h, 2);
    }
  }
  float get(int64_t i) const {
    if (dtype == DType::fp32) {
      float x;
      std::memcpy(&x, &bytes[i * 4], 4);
      return x;
    }
    uint16_t h;
    std::memcpy(&h, &bytes[i * 2], 2);
    return dtype == DType::bf16 ? bf16_to_float(h) : fp16_to_float(h);
  }
  std::vector<float> to_float() const {
    std::vector<float> out(numel());
    for (int64_t i = 0; i < numel(); ++i) out[i] = get(i);
    return out;
  }
};

HostTensor make_tensor(DType dtype, std::vector<int64_t> shape) {
  HostTensor t{dtype, std::move(shape), {}};
  t.bytes.resize(t.numel() * dtype_size(dtype));
  return t;
}

HostTensor random_tensor(DType dtype, std::vector<int64_t> shape, std::mt19937_64& rng) {
  HostTensor t = make_tensor(dtype, std::move(shape));
  std::normal_distribution<float> n(0.f, 1.f);
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, n(rng));
  return t;
}

// ---- device memory ---------------------------------------------------------------------------
[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "flashmsa_run: %s\n", msg.c_str());
  std::exit(1);
}

#ifdef FLASHMSA_WITH_CUDA
void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) die(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(e));
}
#endif

// A buffer on the run's device holding one tensor; frees itself.
class Buffer {
 public:
  Buffer(bool cuda, DType dtype, std::vector<int64_t> shape)
      : cuda_(cuda), dtype_(dtype), shape_(std::move(shape)) {
    bytes_ = dtype_size(dtype_);
    for (auto s : shape_) bytes_ *= s;
    const size_t alloc = std::max<int64_t>(bytes_, 16);
#ifdef FLASHMSA_WITH_CUDA
    if (cuda_) {
      cuda_ok(cudaMalloc(&ptr_, alloc), "cudaMalloc");
      return;
    }
#endif
    host_.resize(alloc);
    ptr_ = host_.data();
  }
  Buffer(bool cuda, const HostTensor& t) : Buffer(cuda, t.dtype, t.shape) { upload(t.bytes.data()); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
#ifdef FLASHMSA_WITH_CUDA
    if (cuda_) cudaFree(ptr_);
#endif
  }
  void upload(const void* src) {
#ifdef FLASHMSA_WITH_CUDA
    if (cuda_) {
      cuda_ok(cudaMemcpy(ptr_, src, bytes_, cudaMemcpyHostToDevice), "upload");
      return;
    }
#endif
    std::memcpy(ptr_, src, bytes_);
  }
  void poison() {  // 0xFF bytes: NaN in every float format, -1 in int32
#ifdef FLASHMSA_WITH_CUDA
    if (cuda_) {
      cuda_ok(cudaMemset(ptr_, 0xFF, bytes_), "poison");
      return;
    }
#endif
    std::memset(ptr_, 0xFF, bytes_);
  }
  HostTensor download() const {
    HostTensor t = make_tensor(dtype_, shape_);
#ifdef FLASHMSA_WITH_CUDA
    if (cuda_) {
      cuda_ok(cudaMemcpy(t.bytes.data(), ptr_, bytes_, cudaMemcpyDeviceToHost), "download");
      return t;
    }
#endif
    std::memcpy(t.bytes.data(), ptr_, bytes_);
    return t;
  }
  TensorView view() const {
    TensorView v;
    v.data = ptr_;
    v.dtype = dtype_;
    v.device = cuda_ ? Device::cuda : Device::cpu;
    v.ndim = static_cast<int>(shape_.size());
    int64_t stride = 1;
    for (int d = v.ndim - 1; d >= 0; --d) {
      v.shape[d] = shape_[d];
      v.stride[d] = stride;
      stride *= shape_[d];
    }
    return v;
  }
  int64_t bytes() const { return bytes_; }

 private:
  bool cuda_;
  DType dtype_;
  std::vector<int64_t> shape_;
  int64_t bytes_ = 0;
  void* ptr_ = nullptr;
  std::vector<unsigned char> host_;
};

// ---- timing ----------------------------------------------------------------------------------
double now_s() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Times fn (milliseconds) on the device: CUDA events on `stream` (a cudaStream_t; null: the
// default stream) on CUDA, a wall clock on the CPU.
double time_ms([[maybe_unused]] bool cuda, const std::function<void()>& fn, [[maybe_unused]] void* stream = nullptr) {
#ifdef FLASHMSA_WITH_CUDA
  if (cuda) {
    const auto st = static_cast<cudaStream_t>(stream);
    cudaEvent_t a, b;
    cuda_ok(cudaEventCreate(&a), "event");
    cuda_ok(cudaEventCreate(&b), "event");
    cuda_ok(cudaEventRecord(a, st), "event");
    fn();
    cuda_ok(cudaEventRecord(b, st), "event");
    cuda_ok(cudaEventSynchronize(b), "event sync");
    float ms = 0;
    cuda_ok(cudaEventElapsedTime(&ms, a, b), "elapsed");
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return ms;
  }
#endif
  const double t0 = now_s();
  fn();
  return (now_s() - t0) * 1e3;
}

// Peak workspace (flashmsa's memory pool on device 0) since the last reset.
struct WorkspaceMeter {
  bool cuda;
  void reset() {
#ifdef FLASHMSA_WITH_CUDA
    if (!cuda) return;
    auto pool = static_cast<cudaMemPool_t>(workspace_memory_pool(0));
    uint64_t zero = 0;
    cuda_ok(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero), "mempool reset");
#endif
  }
  int64_t peak() const {
#ifdef FLASHMSA_WITH_CUDA
    if (!cuda) return 0;
    auto pool = static_cast<cudaMemPool_t>(workspace_memory_pool(0));
    uint64_t high = 0;
    cuda_ok(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high), "mempool high");
    return static_cast<int64_t>(high);
#else
    return 0;
#endif
  }
};

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = double(a[i]) - b[i];
    num += std::isfinite(d) ? d * d : 1e30;
    den += double(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace

int main(int argc, char** argv) {
  Config c = parse(argc, argv);
  const bool have_gpu = cuda_device_available();
  bool cuda = false;
  if (c.device == "cuda") {
    if (!have_gpu) die("--device cuda: no usable CUDA device (or a build without the CUDA backend)");
    cuda = true;
  } else if (c.device == "auto") {
    cuda = have_gpu;
  } else if (c.device != "cpu") {
    die("--device must be auto, cpu or cuda");
  }
  if (c.seqlen == 0) c.seqlen = cuda ? 32768 : 4096;
  if (c.iters == 0) c.iters = cuda ? 10 : 1;
  const DType dtype = c.dtype == "bf16" ? DType::bf16 : c.dtype == "fp16" ? DType::fp16
                      : c.dtype == "fp32" ? DType::fp32 : (die("--dtype must be bf16, fp16 or fp32"), DType::bf16);
  if (c.mode != "sparse" && c.mode != "warmup") die("--mode must be sparse or warmup");
  if (c.bitwise_reruns && !c.deterministic)
    die("--bitwise-reruns needs --deterministic (the fast mode's fp32 atomics add in no fixed order)");
  if (c.seqlens.empty()) c.seqlens.assign(std::max(c.batch, 0), c.seqlen);
  if (c.sink_blocks < 0) die("--sink-blocks must be >= 0");

  std::vector<int32_t> cu{0};
  for (int L : c.seqlens) {
    if (L < 0) die("--seqlens: lengths must be >= 0");
    cu.push_back(cu.back() + L);
  }
  const int64_t T = cu.back();
  const int B = static_cast<int>(c.seqlens.size());

  Options opt;
  opt.block_size = c.block;
  opt.top_k = c.topk;
  opt.local_blocks = c.local_blocks;
  opt.kl_coeff = c.kl_coeff;
  opt.deterministic = c.deterministic;
  opt.mode = c.mode == "warmup" ? Mode::warmup : Mode::sparse;
  opt.num_threads = c.threads;

  const double t_start = now_s();
  auto log = [&](const char* fmt, auto... args) {
    if (c.quiet) return;
    std::printf("[%7.1f s] ", now_s() - t_start);
    std::printf(fmt, args...);
    std::printf("\n");
    std::fflush(stdout);
  };
  log("device %s | T=%lld (B=%d) H=%d Hkv=%d Hp=%d Hpk=%d D=%d Dv=%d Dp=%d BLK=%d K=%d mode=%s dtype=%s",
      cuda ? "cuda" : "cpu", (long long)T, B, c.H, c.Hkv, c.Hp, c.Hpk, c.D, c.Dv, c.Dp, c.block,
      c.topk, c.mode.c_str(), c.dtype.c_str());

  // Inputs: N(0,1) on the host for the CPU, generated on the GPU for CUDA (large sizes would
  // spend minutes in host RNG); host copies are kept only when the slice check needs them.
  const bool need_host = c.check_tokens > 0 || c.full_check;
  std::mt19937_64 rng(c.seed);
  [[maybe_unused]] uint64_t salt = c.seed;  // per-tensor seeds of the device generator
  auto make_input = [&](std::vector<int64_t> shape, HostTensor& host) {
    auto buf = std::make_unique<Buffer>(cuda, dtype, shape);
#ifdef FLASHMSA_WITH_CUDA
    if (cuda) {
      try {
        app::fill_normal_device(buf->view().data, dtype, buf->view().numel(), ++salt);
      } catch (const Error& e) {
        die(e.what());
      }
      host = need_host ? buf->download() : make_tensor(dtype, {0});
      return buf;
    }
#endif
    host = random_tensor(dtype, shape, rng);
    buf->upload(host.bytes.data());
    return buf;
  };
  HostTensor q, k, v, qp, kp, d_o;
  auto bq_ = make_input({T, c.H, c.D}, q);
  auto bk_ = make_input({T, c.Hkv, c.D}, k);
  auto bv_ = make_input({T, c.Hkv, c.Dv}, v);
  auto bqp_ = make_input({T, c.Hp, c.Dp}, qp);
  auto bkp_ = make_input({T, c.Hpk, c.Dp}, kp);
  auto bdo_ = make_input({T, c.H, c.Dv}, d_o);
  Buffer &bq = *bq_, &bk = *bk_, &bv = *bv_, &bqp = *bqp_, &bkp = *bkp_, &bdo = *bdo_;
  HostTensor cu_t = make_tensor(DType::int32, {B + 1});
  std::memcpy(cu_t.bytes.data(), cu.data(), cu.size() * 4);
  Buffer bcu(cuda, cu_t);
  if (c.sink_blocks > 0) {
    // The sink keys' proxy scores rise by ~12^2 scale_p (12.7 at Dp = 128) against N(0, 1 + 144 / Dp)
    // for the others, so every token ranks the sink blocks first (after its own block).
    const float bias = 12.f;
    const int64_t sink_tokens = static_cast<int64_t>(c.sink_blocks) * c.block;
#ifdef FLASHMSA_WITH_CUDA
    if (cuda) {
      try {
        const auto* dcu = static_cast<const int32_t*>(bcu.view().data);
        app::add_to_first_channel_device(bqp.view().data, dtype, T, c.Hp, c.Dp, dcu, B, -1, bias);
        app::add_to_first_channel_device(bkp.view().data, dtype, T, c.Hpk, c.Dp, dcu, B, sink_tokens, bias);
      } catch (const Error& e) {
        die(e.what());
      }
      if (need_host) {
        qp = bqp.download();
        kp = bkp.download();
      }
    }
#endif
    if (!cuda) {
      for (int b = 0; b < B; ++b)
        for (int64_t t = cu[b]; t < cu[b + 1]; ++t) {
          for (int h = 0; h < c.Hp; ++h) qp.set((t * c.Hp + h) * c.Dp, qp.get((t * c.Hp + h) * c.Dp) + bias);
          if (t - cu[b] < sink_tokens)
            for (int h = 0; h < c.Hpk; ++h) kp.set((t * c.Hpk + h) * c.Dp, kp.get((t * c.Hpk + h) * c.Dp) + bias);
        }
      bqp.upload(qp.bytes.data());
      bkp.upload(kp.bytes.data());
    }
  }
  log("inputs ready (N(0,1)%s, seed %llu)", c.sink_blocks > 0 ? ", sink blocks" : "", (unsigned long long)c.seed);

  Buffer bidx(cuda, DType::int32, {c.Hp, T, c.topk}), bo(cuda, dtype, {T, c.H, c.Dv}),
      blse(cuda, DType::fp32, {c.H, T}), bkl(cuda, DType::fp32, {1});
  Buffer bdq(cuda, dtype, {T, c.H, c.D}), bdk(cuda, dtype, {T, c.Hkv, c.D}),
      bdv(cuda, dtype, {T, c.Hkv, c.Dv}), bdqp(cuda, dtype, {T, c.Hp, c.Dp}),
      bdkp(cuda, dtype, {T, c.Hpk, c.Dp});
  for (Buffer* b : {&bidx, &bo, &blse, &bkl, &bdq, &bdk, &bdv, &bdqp, &bdkp}) b->poison();

  AttentionInputs in;
  in.q = bq.view();
  in.k = bk.view();
  in.v = bv.view();
  in.qp = bqp.view();
  in.kp = bkp.view();
  in.cu_seqlens = bcu.view();
  in.cu_seqlens_host = cu.data();
  Gradients g{bdq.view(), bdk.view(), bdv.view(), bdqp.view(), bdkp.view()};
  const bool sparse = opt.mode == Mode::sparse;
  // The selection index built once per step, in the forward's phase, and read by the forward, its
  // KL value and the backward (the CPU attention does not read it: not built there).
  const bool reuse = cuda && sparse && c.index_reuse;
  Buffer bsi(cuda, DType::int32, {reuse ? selection_index_size(in, opt) : 0});
  bsi.poison();
  if (reuse) in.selection_index = bsi.view();
  auto sparse_forward = [&](const TensorView& kl_fwd, Stream stream) {
    if (reuse) build_selection_index(in, bidx.view(), opt, bsi.view(), stream);
    sparse_attention_forward(in, bidx.view(), opt, bo.view(), blse.view(), kl_fwd, stream);
  };

  std::vector<double> t_sel, t_fwd, t_bwd;
  // --bitwise-reruns: a hash (FNV-1a over the bytes) of the gradients and KL value of each timed step.
  auto step_hash = [&] {
    uint64_t h = 1469598103934665603ull;
    for (const Buffer* t : {&bdq, &bdk, &bdv, &bdqp, &bdkp, &bkl})
      for (unsigned char byte : t->download().bytes) h = (h ^ byte) * 1099511628211ull;
    return h;
  };
  std::vector<uint64_t> hashes;
  WorkspaceMeter meter{cuda};
  int64_t ws_fwd = 0, ws_bwd = 0;
  try {
    const int warmup = cuda ? 2 : 0;
    for (int it = 0; it < warmup + c.iters; ++it) {
      const bool timed = it >= warmup;
      meter.reset();
      const double s = sparse ? time_ms(cuda, [&] { select_blocks(in, opt, bidx.view()); }) : 0.0;
      const double f = time_ms(cuda, [&] {
        const TensorView kl_fwd = c.forward_kl ? bkl.view() : TensorView();
        if (sparse) sparse_forward(kl_fwd, nullptr);
        else dense_warmup_forward(in, opt, bo.view(), blse.view(), kl_fwd);
      });
      ws_fwd = std::max(ws_fwd, meter.peak() + bsi.bytes());
      meter.reset();
      const double b = time_ms(cuda, [&] {
        msa_backward(in, bidx.view(), bo.view(), blse.view(), bdo.view(), TensorView(), opt, g,
                     bkl.view());
      });
      ws_bwd = std::max(ws_bwd, meter.peak() + bsi.bytes());
      if (timed) {
        t_sel.push_back(s);
        t_fwd.push_back(f);
        t_bwd.push_back(b);
        if (c.bitwise_reruns) hashes.push_back(step_hash());
      }
      log("step %d/%d: select %.2f ms, forward %.2f ms, backward %.2f ms%s", it + 1,
          warmup + c.iters, s, f, b, timed ? "" : " (warm-up)");
    }
  } catch (const Error& e) {
    die(e.what());
  }
  // The step as a training loop without per-phase synchronisation runs it, captured once.
  std::vector<double> t_graph, t_stream, t_sel_fwd;
#ifdef FLASHMSA_WITH_CUDA
  if (cuda && c.graph) {
    cudaStream_t gs = nullptr;
    cuda_ok(cudaStreamCreateWithFlags(&gs, cudaStreamNonBlocking), "stream");
    auto launch_step = [&](bool with_backward) {
      if (sparse) select_blocks(in, opt, bidx.view(), gs);
      const TensorView kl_fwd = c.forward_kl ? bkl.view() : TensorView();
      if (sparse) sparse_forward(kl_fwd, gs);
      else dense_warmup_forward(in, opt, bo.view(), blse.view(), kl_fwd, gs);
      if (with_backward)
        msa_backward(in, bidx.view(), bo.view(), blse.view(), bdo.view(), TensorView(), opt, g, bkl.view(), gs);
    };
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    cuda_ok(cudaStreamBeginCapture(gs, cudaStreamCaptureModeGlobal), "begin capture");
    try {
      launch_step(true);
    } catch (const Error& e) {
      cudaStreamEndCapture(gs, &graph);
      die(e.what());
    }
    cuda_ok(cudaStreamEndCapture(gs, &graph), "end capture");
    cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "graph instantiate");
    // The replay, and beside it (alternating) the same step launched eagerly on the same stream
    // with no synchronisation between its phases (what the replay alone changes), and selection +
    // forward so launched. The phases timed one by one above leave the GPU idle between them;
    // under the card's power cap that idle time lets the next phase start at a higher clock.
    auto eager = [&](bool with_backward) {
      return time_ms(cuda, [&] {
        try {
          launch_step(with_backward);
        } catch (const Error& e) {
          die(e.what());
        }
      }, gs);
    };
    for (int it = 0; it < 2 + c.iters; ++it) {
      const double ms = time_ms(cuda, [&] { cuda_ok(cudaGraphLaunch(exec, gs), "graph launch"); }, gs);
      const double ms_stream = eager(true), ms_sel_fwd = eager(false);
      if (it >= 2) {
        t_graph.push_back(ms);
        t_stream.push_back(ms_stream);
        t_sel_fwd.push_back(ms_sel_fwd);
      }
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(gs);
  }
#endif

  // ---- results back to the host ----
  HostTensor idx_h = sparse ? bidx.download() : HostTensor{};
  float kl = bkl.download().get(0);
  app::HostProblem hp;
  hp.T = T;
  hp.H = c.H; hp.Hkv = c.Hkv; hp.Hp = c.Hp; hp.Hpk = c.Hpk;
  hp.D = c.D; hp.Dv = c.Dv; hp.Dp = c.Dp;
  hp.block_size = c.block; hp.top_k = c.topk; hp.local_blocks = c.local_blocks;
  hp.scale = 1.0 / std::sqrt(double(c.D));
  hp.proxy_scale = 1.0 / std::sqrt(double(c.Dp));
  hp.kl_coeff = c.kl_coeff;
  hp.cu_seqlens = cu;
  if (need_host) {
    hp.q = q.to_float(); hp.k = k.to_float(); hp.v = v.to_float();
    hp.qp = qp.to_float(); hp.kp = kp.to_float(); hp.d_o = d_o.to_float();
    hp.o = bo.download().to_float();
    hp.lse = blse.download().to_float();
    hp.dq = bdq.download().to_float(); hp.dk = bdk.download().to_float();
    hp.dv = bdv.download().to_float(); hp.dqp = bdqp.download().to_float();
    hp.dkp = bdkp.download().to_float();
    hp.have_backward = true;
  }
  hp.kl = kl;

  // Selection statistics and the sel count of msa.md's FLOP formulas.
  double sel_per_head = 0;  // sum over t of |J|, averaged over proxy heads
  int64_t rows_padded = 0, picks = 0, recent = 0;
  double dist_sum = 0;
  // The longest (proxy head, key block) token list: the kernels' KV-major work per block.
  int64_t longest_list = 0, n_lists = 0;
  if (sparse) {
    std::vector<int32_t> idx(idx_h.numel());
    std::memcpy(idx.data(), idx_h.bytes.data(), idx.size() * 4);
    hp.block_idx = idx;
    std::vector<int64_t> first_block{0};  // global index of each sequence's first block
    for (int b = 0; b < B; ++b) first_block.push_back(first_block.back() + (cu[b + 1] - cu[b] + c.block - 1) / c.block);
    n_lists = first_block.back() * c.Hp;
    std::vector<int64_t> list_len(n_lists, 0);
    for (int b = 0; b < B; ++b)
      for (int64_t t = cu[b]; t < cu[b + 1]; ++t) {
        const int64_t pos = t - cu[b];
        const int64_t n_loc = pos / c.block;
        for (int p = 0; p < c.Hp; ++p) {
          const int32_t* r = &idx[(p * T + t) * c.topk];
          bool padded = false;
          for (int i = 0; i < c.topk; ++i) {
            if (r[i] < 0) { padded = true; continue; }
            sel_per_head += r[i] == n_loc ? double(pos - n_loc * c.block + 1) : double(c.block);
            ++picks;
            dist_sum += double(n_loc - r[i]);
            longest_list = std::max(longest_list, ++list_len[p * first_block.back() + first_block[b] + r[i]]);
            recent += n_loc - r[i] < 4;
          }
          rows_padded += padded;
        }
      }
    sel_per_head /= c.Hp;
  } else {
    // Warm-up attends to every causal key: the slice check sees it as selecting all visible blocks.
    int max_blocks = 1;
    for (int b = 0; b < B; ++b) {
      const double L = cu[b + 1] - cu[b];
      sel_per_head += L * (L + 1) / 2;
      max_blocks = std::max(max_blocks, static_cast<int>((L + c.block - 1) / c.block));
    }
    hp.top_k = max_blocks;
    hp.local_blocks = 1;
    hp.block_idx.assign(size_t(c.Hp) * T * max_blocks, -1);
    for (int b = 0; b < B; ++b)
      for (int64_t t = cu[b]; t < cu[b + 1]; ++t)
        for (int p = 0; p < c.Hp; ++p)
          for (int n = 0; n <= (t - cu[b]) / c.block; ++n) hp.block_idx[(p * T + t) * max_blocks + n] = n;
  }
  double causal_pairs = 0;
  for (int b = 0; b < B; ++b) {
    const double L = cu[b + 1] - cu[b];
    causal_pairs += L * (L + 1) / 2;
  }
  const double fl_sel = sparse ? 2.0 * c.Dp * c.Hp * causal_pairs : 0.0;
  const double fl_fwd = 2.0 * (c.D + c.Dv) * c.H * sel_per_head;
  const double fl_bwd = 2.0 * (3.0 * c.D + 2.0 * c.Dv) * c.H * sel_per_head +
                        2.0 * (double(c.D) * c.H + 3.0 * c.Dp * c.Hp) * sel_per_head;
  const double ms_sel = median(t_sel), ms_fwd = median(t_fwd), ms_bwd = median(t_bwd);
  auto tflops = [](double flop, double ms) { return ms > 0 ? flop / (ms * 1e-3) / 1e12 : 0.0; };

  // ---- checks ----
  log("checking a slice against the fp64 reference ...");
  app::SliceReport rep;
  rep.pass = std::isfinite(kl);  // without host copies only the KL value can be checked
  if (need_host)
    rep = app::check_slice(hp, c.check_tokens, c.check_keys, c.seed + 1,
                           dtype == DType::fp32 ? 1e-4 : 1e-2);
  else
    log("slice check skipped (--check-tokens 0)");
  bool pass = rep.pass;
  bool finite = std::isfinite(kl);
  for (const auto* vec : {&hp.o, &hp.lse, &hp.dq, &hp.dk, &hp.dv, &hp.dqp, &hp.dkp})
    for (float x : *vec)
      if (!std::isfinite(x)) { finite = false; break; }
  pass = pass && finite;
  bool bitwise = true;
  for (uint64_t h : hashes) bitwise = bitwise && h == hashes.front();
  pass = pass && bitwise;

  std::string full_summary;
  if (cuda && c.full_check) {
    log("running the same step on the CPU backend for the full comparison ...");
    Buffer cq(false, q), ck(false, k), cv(false, v), cqp(false, qp), ckp(false, kp), cdo(false, d_o),
        ccu(false, cu_t), cidx(false, idx_h.dtype, idx_h.shape.empty() ? std::vector<int64_t>{c.Hp, T, c.topk} : idx_h.shape);
    if (sparse) cidx.upload(idx_h.bytes.data());
    Buffer co(false, dtype, {T, c.H, c.Dv}), clse(false, DType::fp32, {c.H, T}), ckl(false, DType::fp32, {1});
    Buffer cdq(false, dtype, {T, c.H, c.D}), cdk(false, dtype, {T, c.Hkv, c.D}),
        cdv(false, dtype, {T, c.Hkv, c.Dv}), cdqp(false, dtype, {T, c.Hp, c.Dp}),
        cdkp(false, dtype, {T, c.Hpk, c.Dp});
    AttentionInputs ci{cq.view(), ck.view(), cv.view(), cqp.view(), ckp.view(), ccu.view(), nullptr, TensorView()};
    Gradients cg{cdq.view(), cdk.view(), cdv.view(), cdqp.view(), cdkp.view()};
    if (sparse) sparse_attention_forward(ci, cidx.view(), opt, co.view(), clse.view());
    else dense_warmup_forward(ci, opt, co.view(), clse.view());
    msa_backward(ci, cidx.view(), co.view(), clse.view(), cdo.view(), TensorView(), opt, cg, ckl.view());
    const float kl_cpu = ckl.download().get(0);
    const double e_o = rel_l2(hp.o, co.download().to_float());
    const double e_dq = rel_l2(hp.dq, cdq.download().to_float());
    const double e_dk = rel_l2(hp.dk, cdk.download().to_float());
    const double e_dv = rel_l2(hp.dv, cdv.download().to_float());
    const double e_dqp = rel_l2(hp.dqp, cdqp.download().to_float());
    const double e_dkp = rel_l2(hp.dkp, cdkp.download().to_float());
    const double e_kl = std::fabs(kl - kl_cpu) / std::max(1e-30, double(std::fabs(kl_cpu)));
    char buf[400];
    std::snprintf(buf, sizeof(buf),
                  "full check vs CPU backend: rel L2 o %.2e dq %.2e dk %.2e dv %.2e dqp %.2e dkp %.2e, "
                  "kl rel %.2e",
                  e_o, e_dq, e_dk, e_dv, e_dqp, e_dkp, e_kl);
    full_summary = buf;
    const double tol = dtype == DType::fp32 ? 1e-4 : 1e-2;
    pass = pass && e_o < tol && e_dq < tol && e_dk < tol && e_dv < tol && e_dqp < tol &&
           e_dkp < tol && e_kl < tol;
  }

  // ---- report ----
  std::printf("\n== flashmsa_run: %s, T=%lld, H=%d Hkv=%d Hp=%d Hpk=%d D=%d, K=%d, BLK=%d, %s ==\n",
              cuda ? "CUDA" : "CPU", (long long)T, c.H, c.Hkv, c.Hp, c.Hpk, c.D, c.topk, c.block,
              c.mode.c_str());
  std::printf("%-22s %10s %12s\n", "phase", "ms", "TFLOP/s");
  if (sparse) std::printf("%-22s %10.3f %12.3f\n", "select_blocks", ms_sel, tflops(fl_sel, ms_sel));
  std::printf("%-22s %10.3f %12.3f\n",
              sparse ? (c.forward_kl ? "sparse forward + KL" : "sparse forward")
                     : (c.forward_kl ? "warm-up fwd + KL" : "dense warm-up fwd"),
              ms_fwd,
              tflops(fl_fwd, ms_fwd));
  std::printf("%-22s %10.3f %12.3f\n", "backward (+KL)", ms_bwd, tflops(fl_bwd, ms_bwd));
  std::printf("%-22s %10.3f %12.3f\n", "training step", ms_sel + ms_fwd + ms_bwd,
              tflops(fl_sel + fl_fwd + fl_bwd, ms_sel + ms_fwd + ms_bwd));
  if (!t_graph.empty()) {
    std::printf("%-22s %10.3f %12.3f\n", "step (CUDA graph)", median(t_graph),
                tflops(fl_sel + fl_fwd + fl_bwd, median(t_graph)));
    std::printf("%-22s %10.3f %12.3f\n", "step (one stream)", median(t_stream),
                tflops(fl_sel + fl_fwd + fl_bwd, median(t_stream)));
    std::printf("%-22s %10.3f %12.3f\n", sparse ? "select+fwd (1 stream)" : "fwd (one stream)", median(t_sel_fwd),
                tflops(fl_sel + fl_fwd, median(t_sel_fwd)));
  }
  std::printf("kl_loss = %.6g\n", kl);
  if (sparse && picks > 0)
    std::printf("selection: %.1f keys/query/head (sel), %.2f blocks/row, %.1f%% rows padded, "
                "mean distance %.1f blocks, %.1f%% of picks within 4 blocks, longest block list %lld tokens "
                "(%.1fx the mean)\n",
                sel_per_head / double(T), double(picks) / (double(T) * c.Hp),
                100.0 * rows_padded / (double(T) * c.Hp), dist_sum / picks, 100.0 * recent / picks,
                (long long)longest_list, double(longest_list) * n_lists / double(picks));
  if (cuda)
    std::printf("extra device memory (stream-ordered workspace peak): forward %.1f MB, backward "
                "%.1f MB (q is %.1f MB)%s\n",
                ws_fwd / 1e6, ws_bwd / 1e6, bq.bytes() / 1e6,
                reuse ? ", each with the step's selection index" : "");
  std::printf("%s\n", rep.summary().c_str());
  if (!full_summary.empty()) std::printf("%s\n", full_summary.c_str());
  if (!finite) std::printf("non-finite values in the outputs (unwritten or overflow)\n");
  if (!hashes.empty())
    std::printf("bitwise reruns: the gradients and KL value of the %zu timed steps %s\n", hashes.size(),
                bitwise ? "have identical bits" : "DIFFER");
  std::printf("RESULT: %s\n", pass ? "PASS" : "FAIL");

  if (!c.json.empty()) {
    std::ofstream js(c.json);
    js << "{\"device\": \"" << (cuda ? "cuda" : "cpu") << "\", \"T\": " << T << ", \"B\": " << B
       << ", \"H\": " << c.H << ", \"Hkv\": " << c.Hkv << ", \"Hp\": " << c.Hp
       << ", \"Hpk\": " << c.Hpk << ", \"D\": " << c.D << ", \"Dv\": " << c.Dv
       << ", \"Dp\": " << c.Dp << ", \"K\": " << c.topk << ", \"BLK\": " << c.block
       << ", \"sink_blocks\": " << c.sink_blocks << ", \"mode\": \"" << c.mode << "\", \"dtype\": \"" << c.dtype << "\""
       << ", \"forward_kl\": " << (c.forward_kl ? "true" : "false")
       << ", \"index_reuse\": " << (reuse ? "true" : "false") << ", \"iters\": " << c.iters << ", \"ms_select\": " << ms_sel << ", \"ms_forward\": " << ms_fwd
       << ", \"ms_backward\": " << ms_bwd << ", \"ms_step_graph\": " << (t_graph.empty() ? 0.0 : median(t_graph))
       << ", \"ms_step_stream\": " << (t_stream.empty() ? 0.0 : median(t_stream))
       << ", \"ms_select_forward_stream\": " << (t_sel_fwd.empty() ? 0.0 : median(t_sel_fwd))
       << ", \"flop_select\": " << fl_sel
       << ", \"flop_forward\": " << fl_fwd << ", \"flop_backward\": " << fl_bwd
       << ", \"sel_per_head\": " << sel_per_head << ", \"kl_loss\": " << kl
       << ", \"workspace_forward_bytes\": " << ws_fwd << ", \"workspace_backward_bytes\": " << ws_bwd
       << ", \"q_bytes\": " << bq.bytes() << ", \"check_pass\": " << (pass ? "true" : "false")
       << "}\n";
  }
  return pass ? 0 : 1;
}
