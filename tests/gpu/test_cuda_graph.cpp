// A whole training step (select_blocks, sparse_attention_forward with the KL value, fused_backward
// with the KL value) captured into a CUDA graph on a non-blocking stream and replayed: the step
// has no host synchronisation, no non-stream allocation and no other uncapturable call (a
// global-mode capture fails on any of them), and the replays compute what an eager run computes.
// Fast mode uses atomics (the wgmma forward's reduce-adds, the backward's dq), so fast replays are
// compared within the tolerances; deterministic mode must give the same bits. Also the device
// workspace: a caller's allocator serving a whole step, and flashmsa's own pool keeping its memory.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "flashmsa/flashmsa.h"
#include "gpu_test_util.h"

namespace {

using flashmsa::DType;
using gputest::DeviceBuffer;
using gputest::Problem;
using gputest::Shape;
using gputest::shape;

struct StepBuffers {
  DeviceBuffer sel, o, lse, kl_fwd, d_o, dq, dk, dv, dqp, dkp, kl_bwd;
  size_t dq_offset = 0;  // bytes: dq's view starts there (16: only as aligned as the API requires)
};

struct StepResult {
  std::vector<int32_t> sel;
  std::vector<uint16_t> o, dq, dk, dv, dqp, dkp;
  std::vector<float> lse;
  float kl_fwd = 0, kl_bwd = 0;
};

// cudaMemset runs on the legacy default stream, which a non-blocking stream does not wait for:
// the device synchronisation orders the poison before the next run.
void poison(StepBuffers& b) {
  b.sel.fill(gputest::kIntPoisonByte);
  for (DeviceBuffer* x : {&b.o, &b.lse, &b.kl_fwd, &b.dq, &b.dk, &b.dv, &b.dqp, &b.dkp, &b.kl_bwd})
    x->fill(gputest::kFloatPoison);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// The three calls of a step on `stream` (nothing else: the capture records exactly these).
void enqueue_step(const Problem& pr, const flashmsa::Options& opt, StepBuffers& b, cudaStream_t stream) {
  const Shape& s = pr.s;
  const int64_t T = pr.T;
  const auto in = pr.device_inputs();
  const auto sel = gputest::dview(b.sel, DType::int32, {s.Hp, T, s.K});
  const auto o = gputest::dview(b.o, DType::bf16, {T, s.H, s.D});
  const auto lse = gputest::dview(b.lse, DType::fp32, {s.H, T});
  flashmsa::select_blocks(in, opt, sel, stream);
  flashmsa::sparse_attention_forward(in, sel, opt, o, lse, gputest::dview(b.kl_fwd, DType::fp32, {1}), stream);
  void* const dq = static_cast<unsigned char*>(b.dq.get()) + b.dq_offset;
  const flashmsa::Gradients g =
      gputest::grad_views(dq, b.dk.get(), b.dv.get(), b.dqp.get(), b.dkp.get(), s, T, flashmsa::Device::cuda);
  flashmsa::fused_backward(in, sel, o, lse, gputest::dview(b.d_o, DType::bf16, {T, s.H, s.D}),
                           flashmsa::TensorView(), opt, g, gputest::dview(b.kl_bwd, DType::fp32, {1}), stream);
}

StepResult take(const StepBuffers& b) {
  StepResult r;
  r.sel = b.sel.download<int32_t>();
  r.o = b.o.download<uint16_t>();
  r.lse = b.lse.download<float>();
  r.dq = b.dq.download<uint16_t>();
  r.dq.erase(r.dq.begin(), r.dq.begin() + static_cast<std::ptrdiff_t>(b.dq_offset / 2));
  r.dk = b.dk.download<uint16_t>();
  r.dv = b.dv.download<uint16_t>();
  r.dqp = b.dqp.download<uint16_t>();
  r.dkp = b.dkp.download<uint16_t>();
  r.kl_fwd = b.kl_fwd.download<float>()[0];
  r.kl_bwd = b.kl_bwd.download<float>()[0];
  return r;
}

double rel_l2_bf16(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  return gputest::rel_l2(gputest::bf16_to_doubles(a), gputest::bf16_to_doubles(b));
}

// Output and gradient buffers for pr, and a fresh random d_o.
StepBuffers make_step_buffers(const Problem& pr, uint64_t seed) {
  const Shape& s = pr.s;
  const int64_t T = pr.T;
  StepBuffers b;
  b.sel = DeviceBuffer(static_cast<size_t>(s.Hp * T * s.K) * 4);
  b.o = DeviceBuffer(static_cast<size_t>(T * s.H * s.D) * 2);
  b.lse = DeviceBuffer(static_cast<size_t>(s.H * T) * 4);
  b.kl_fwd = DeviceBuffer(4);
  b.kl_bwd = DeviceBuffer(4);
  b.d_o = DeviceBuffer(static_cast<size_t>(T * s.H * s.D) * 2);
  std::mt19937_64 rng(seed + 1);
  b.d_o.upload(gputest::random_bf16(static_cast<size_t>(T * s.H * s.D), rng));
  b.dq = DeviceBuffer(pr.q.size() * 2);
  b.dk = DeviceBuffer(pr.k.size() * 2);
  b.dv = DeviceBuffer(pr.v.size() * 2);
  b.dqp = DeviceBuffer(pr.qp.size() * 2);
  b.dkp = DeviceBuffer(pr.kp.size() * 2);
  return b;
}

// Stream and graph handles of one test, released however it ends.
struct Handles {
  cudaStream_t stream = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ~Handles() {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    if (stream) cudaStreamDestroy(stream);
  }
};

// One test's problem of shape s, its step buffers, options and stream (in g).
struct StepCase {
  Problem pr;
  StepBuffers b;
  flashmsa::Options opt;
  Handles g;
};

void make_step_case(StepCase& c, const Shape& s, uint64_t seed, bool deterministic) {
  gputest::make_problem(c.pr, s, seed);
  c.b = make_step_buffers(c.pr, seed);
  c.opt = c.pr.options();
  c.opt.deterministic = deterministic;
  GPUTEST_CUDA(cudaStreamCreateWithFlags(&c.g.stream, cudaStreamNonBlocking));
}

// Poisons c's buffers, runs one eager step on its stream, takes its results into `out`.
void run_eager(StepCase& c, StepResult& out) {
  poison(c.b);
  enqueue_step(c.pr, c.opt, c.b, c.g.stream);
  GPUTEST_CUDA(cudaStreamSynchronize(c.g.stream));
  out = take(c.b);
}

// Captures `steps` steps on c's stream (global mode: any uncapturable call fails it) into c.g's
// graph / exec; exec stays null on failure. Two steps put a second forward into a capture whose
// helper streams it already holds.
void capture_step(StepCase& c, int steps = 1) {
  GPUTEST_CUDA(cudaStreamBeginCapture(c.g.stream, cudaStreamCaptureModeGlobal));
  try {
    for (int i = 0; i < steps; ++i) enqueue_step(c.pr, c.opt, c.b, c.g.stream);
  } catch (const flashmsa::Error& e) {
    cudaStreamEndCapture(c.g.stream, &c.g.graph);
    FAIL() << "the step threw under capture: " << e.what();
  }
  GPUTEST_CUDA(cudaStreamEndCapture(c.g.stream, &c.g.graph));
  GPUTEST_CUDA(cudaGraphInstantiate(&c.g.exec, c.g.graph, 0));
}

// Every output of r has the bits of e.
void expect_same_bits(const StepResult& r, const StepResult& e, const std::string& what) {
  EXPECT_EQ(r.sel, e.sel) << what << ": selection";
  EXPECT_EQ(r.o, e.o) << what << ": o";
  EXPECT_EQ(r.lse, e.lse) << what << ": lse";
  EXPECT_EQ(r.dq, e.dq) << what << ": dq";
  EXPECT_EQ(r.dk, e.dk) << what << ": dk";
  EXPECT_EQ(r.dv, e.dv) << what << ": dv";
  EXPECT_EQ(r.dqp, e.dqp) << what << ": dqp";
  EXPECT_EQ(r.dkp, e.dkp) << what << ": dkp";
  EXPECT_EQ(std::memcmp(&r.kl_fwd, &e.kl_fwd, 4), 0) << what << ": kl (forward)";
  EXPECT_EQ(std::memcmp(&r.kl_bwd, &e.kl_bwd, 4), 0) << what << ": kl (backward)";
}

void check_captured_step(const Shape& s, uint64_t seed, bool deterministic) {
  StepCase c;
  ASSERT_NO_FATAL_FAILURE(make_step_case(c, s, seed, deterministic));
  StepResult eager;
  run_eager(c, eager);
  capture_step(c);
  if (c.g.exec == nullptr) return;  // capture_step reported why
  for (int replay = 0; replay < 2; ++replay) {
    poison(c.b);  // what a replay does not write stays NaN / 0xAB
    GPUTEST_CUDA(cudaGraphLaunch(c.g.exec, c.g.stream));
    GPUTEST_CUDA(cudaStreamSynchronize(c.g.stream));
    const StepResult r = take(c.b);
    if (deterministic) {
      expect_same_bits(r, eager, "replay " + std::to_string(replay));
      continue;
    }
    EXPECT_EQ(r.sel, eager.sel) << "replay " << replay << ": selection differs";
    const std::vector<uint16_t>* a[6] = {&r.o, &r.dq, &r.dk, &r.dv, &r.dqp, &r.dkp};
    const std::vector<uint16_t>* e[6] = {&eager.o, &eager.dq, &eager.dk, &eager.dv, &eager.dqp, &eager.dkp};
    const char* names[6] = {"o", "dq", "dk", "dv", "dqp", "dkp"};
    for (int i = 0; i < 6; ++i) {
      EXPECT_EQ(gputest::count_nonfinite(gputest::bf16_to_doubles(*a[i])), 0)
          << "replay " << replay << ": " << names[i] << " unwritten";
      EXPECT_LT(rel_l2_bf16(*a[i], *e[i]), 1e-3) << "replay " << replay << ": " << names[i] << " vs eager";
    }
    EXPECT_LT(gputest::max_abs_diff(std::vector<double>(r.lse.begin(), r.lse.end()),
                                    std::vector<double>(eager.lse.begin(), eager.lse.end())),
              1e-4)
        << "replay " << replay << ": lse vs eager";
    EXPECT_NEAR(r.kl_fwd, eager.kl_fwd, 1e-4 * std::fabs(eager.kl_fwd)) << "replay " << replay;
    EXPECT_NEAR(r.kl_bwd, eager.kl_bwd, 1e-4 * std::fabs(eager.kl_bwd)) << "replay " << replay;
  }
  EXPECT_GT(eager.kl_fwd, 0.f) << "a KL of zero would make the kl checks vacuous";
}

// Two steps captured BEFORE any eager call (alone in its process under ctest: then its capture makes
// the pool and the forward's helper streams, and the second forward forks onto helpers the capture
// already holds), replayed, and compared with an eager run made after.
TEST(CudaGraph, FirstCallInsideCapture) {
  GPUTEST_REQUIRE_DEVICE();
  StepCase c;
  ASSERT_NO_FATAL_FAILURE(make_step_case(c, shape(32, 2, 2, 1, 128, 16, {1500, 0, 700}), 213, true));
  poison(c.b);
  capture_step(c, 2);
  if (c.g.exec == nullptr) return;
  GPUTEST_CUDA(cudaGraphLaunch(c.g.exec, c.g.stream));
  GPUTEST_CUDA(cudaStreamSynchronize(c.g.stream));
  const StepResult replay = take(c.b);
  StepResult eager;
  run_eager(c, eager);
  expect_same_bits(replay, eager, "replay of the first call vs eager");
  EXPECT_GT(eager.kl_fwd, 0.f);
}

// m = 16 on Hkv = Hp (the m3 group: wgmma KV-major forward, KL value KV-major, wgmma backward)
// and fm16k's heads (two groups per kv head: the shared-kv backward), fast and deterministic.
TEST(CudaGraph, TrainingStepCapturedAndReplayedFast) {
  GPUTEST_REQUIRE_DEVICE();
  check_captured_step(shape(32, 2, 2, 1, 128, 16, {1500, 0, 700}), 201, false);
  check_captured_step(shape(16, 2, 4, 1, 128, 16, {1300, 333}), 202, false);
}

TEST(CudaGraph, TrainingStepCapturedAndReplayedDeterministic) {
  GPUTEST_REQUIRE_DEVICE();
  check_captured_step(shape(32, 2, 2, 1, 128, 16, {1500, 0, 700}), 203, true);
  check_captured_step(shape(16, 2, 4, 1, 128, 16, {1300, 333}), 204, true);  // m = 4: the two-pass forward
}

// ---- device workspace (flashmsa.h: workspace_memory_pool, set_workspace_allocator) ----

// Makes allocator a (static allocate / deallocate taking a as their context) the process's
// workspace allocator.
template <typename A>
void install_allocator(A& a) {
  flashmsa::WorkspaceAllocator hook;
  hook.allocate = &A::allocate;
  hook.deallocate = &A::deallocate;
  hook.context = &a;
  flashmsa::set_workspace_allocator(hook);
}

// Runs the step eagerly with allocator a serving its workspace, then gives flashmsa its own pool
// back; returns the message of the error the step threw ("" if none).
template <typename A>
std::string run_with_allocator(StepCase& c, A& a, StepResult& out) {
  install_allocator(a);
  std::string error;
  try {
    run_eager(c, out);
  } catch (const flashmsa::Error& e) {
    error = e.what();
  }
  cudaStreamSynchronize(c.g.stream);
  flashmsa::set_workspace_allocator(flashmsa::WorkspaceAllocator());
  return error;
}

// A caller's allocator that counts what it hands out, on the stream it is given.
struct CountingAllocator {
  int allocs = 0, frees = 0;
  size_t live = 0, bytes_total = 0, peak = 0;
  std::vector<std::pair<void*, size_t>> blocks;
  static void* allocate(void* ctx, size_t bytes, int, flashmsa::Stream stream) {
    auto* self = static_cast<CountingAllocator*>(ctx);
    void* p = nullptr;
    if (cudaMallocAsync(&p, bytes, static_cast<cudaStream_t>(stream)) != cudaSuccess) return nullptr;
    ++self->allocs;
    self->live += bytes;
    self->peak = std::max(self->peak, self->live);
    self->bytes_total += bytes;
    self->blocks.emplace_back(p, bytes);
    return p;
  }
  static void deallocate(void* ctx, void* p, int, flashmsa::Stream stream) {
    auto* self = static_cast<CountingAllocator*>(ctx);
    for (auto it = self->blocks.begin(); it != self->blocks.end(); ++it)
      if (it->first == p) {
        self->live -= it->second;
        self->blocks.erase(it);
        ++self->frees;
        cudaFreeAsync(p, static_cast<cudaStream_t>(stream));
        return;
      }
    ADD_FAILURE() << "deallocate of a pointer the allocator never gave out";
  }
};

// Every workspace buffer of a step comes from the caller's allocator and goes back to it, and the
// step computes the same bits as with flashmsa's own pool (deterministic mode).
TEST(CudaWorkspace, CallerAllocatorServesTheWholeStep) {
  GPUTEST_REQUIRE_DEVICE();
  const Shape s = shape(32, 2, 2, 1, 128, 16, {1500, 0, 700});
  StepCase c;
  ASSERT_NO_FATAL_FAILURE(make_step_case(c, s, 211, true));
  StepResult own_pool, hooked;
  run_eager(c, own_pool);

  CountingAllocator counter;
  EXPECT_EQ(run_with_allocator(c, counter, hooked), "") << "the step threw with a caller's allocator";
  EXPECT_GT(counter.allocs, 2) << "the step's index and accumulators did not come from the allocator";
  EXPECT_GT(counter.bytes_total, static_cast<size_t>(c.pr.T * s.H * s.D) * 2)
      << "the backward's accumulators are larger than q";
  EXPECT_EQ(counter.frees, counter.allocs);
  EXPECT_EQ(counter.live, 0u);
  expect_same_bits(hooked, own_pool, "caller's allocator vs flashmsa's pool");
}

// performance.md's memory goal at an fm16k-like shape (two proxy groups per kv head, so dk / dv go
// through accumulators): the step's peak workspace within 2.5 x size(q). The backward's side
// accumulators (dqp, dk, dv) live in the caller's dq buffer until dq's own convert (3.3 x before).
TEST(CudaWorkspace, BackwardWithinTwoAndAHalfQ) {
  GPUTEST_REQUIRE_DEVICE();
  const Shape s = shape(16, 2, 4, 1, 128, 16, {4096});
  StepCase c;
  ASSERT_NO_FATAL_FAILURE(make_step_case(c, s, 217, false));
  CountingAllocator counter;
  StepResult r;
  EXPECT_EQ(run_with_allocator(c, counter, r), "") << "the step threw";
  const double q_bytes = static_cast<double>(c.pr.T) * s.H * s.D * 2;
  EXPECT_GE(static_cast<double>(counter.peak), 2.0 * q_bytes) << "no fp32 dq accumulator in the workspace?";
  EXPECT_LE(static_cast<double>(counter.peak), 2.5 * q_bytes)
      << "peak workspace " << counter.peak / q_bytes << " x size(q)";
  EXPECT_EQ(counter.live, 0u);
}

// performance.md's memory goal for the forward at fm16k (groups of 4 heads, whose default chunk
// accumulators alone are 0.63 x size(q)): selection + forward within 0.5 x size(q). The forward's
// index scratch lives in o's buffer until o is written, and its chunk shrinks towards the goal.
// With the step's selection index in a caller's buffer (held until the backward), the index counts
// against the goal too.
void check_forward_within_half_q(bool caller_index) {
  const Shape s = shape(16, 2, 4, 1, 128, 16, {16384});
  StepCase c;
  ASSERT_NO_FATAL_FAILURE(make_step_case(c, s, 219, false));
  const int64_t T = c.pr.T;
  flashmsa::AttentionInputs in = c.pr.device_inputs();
  const auto sel = gputest::dview(c.b.sel, DType::int32, {s.Hp, T, s.K});
  const auto o = gputest::dview(c.b.o, DType::bf16, {T, s.H, s.D});
  const auto lse = gputest::dview(c.b.lse, DType::fp32, {s.H, T});
  const int64_t index_elements = caller_index ? flashmsa::selection_index_size(in, c.opt) : 0;
  DeviceBuffer index(std::max<int64_t>(index_elements, 1) * 4);
  if (caller_index) in.selection_index = gputest::dview(index, DType::int32, {index_elements});
  poison(c.b);
  CountingAllocator counter;
  install_allocator(counter);
  std::string error;
  try {
    flashmsa::select_blocks(in, c.opt, sel, c.g.stream);
    if (caller_index) flashmsa::build_selection_index(in, sel, c.opt, in.selection_index, c.g.stream);
    flashmsa::sparse_attention_forward(in, sel, c.opt, o, lse, flashmsa::TensorView(), c.g.stream);
  } catch (const flashmsa::Error& e) {
    error = e.what();
  }
  cudaStreamSynchronize(c.g.stream);
  flashmsa::set_workspace_allocator(flashmsa::WorkspaceAllocator());
  EXPECT_EQ(error, "") << "the forward threw";
  const double q_bytes = static_cast<double>(T) * s.H * s.D * 2;
  const double held = static_cast<double>(counter.peak) + 4.0 * index_elements;
  EXPECT_GT(counter.allocs, 0) << "no workspace from the allocator: was the KV-major forward taken?";
  EXPECT_LE(held, 0.5 * q_bytes) << "peak workspace " << counter.peak / q_bytes << " x size(q), index "
                                 << 4.0 * index_elements / q_bytes << " x";
  EXPECT_EQ(counter.live, 0u);
  // Every o and lse element written (poisoned to NaN before; finite inputs give finite outputs).
  size_t bad = 0;
  for (double x : gputest::bf16_to_doubles(c.b.o.download<uint16_t>())) bad += !std::isfinite(x);
  for (float x : c.b.lse.download<float>()) bad += !std::isfinite(x);
  EXPECT_EQ(bad, 0u) << "non-finite outputs (unwritten or scratch left in o)";
}

TEST(CudaWorkspace, ForwardWithinHalfQ) {
  GPUTEST_REQUIRE_DEVICE();
  check_forward_within_half_q(false);
  check_forward_within_half_q(true);
}

// The backward keeps its side accumulators in dq's buffer (fused_backward.cu), at 256-byte offsets
// from dq's start; the API asks dq for 16-byte alignment only. A dq view 16 bytes into its buffer
// gives the same bits in deterministic mode, on token-row tiles (groups of 16): there dq's buffer
// holds the int32 dqp and int64 dkp accumulators (with FLASHMSA_DET_DQ=query deterministic mode's dq
// is query-major and dq's buffer holds nothing).
TEST(CudaWorkspace, DqOnlySixteenByteAligned) {
  GPUTEST_REQUIRE_DEVICE();
  const Shape s = shape(32, 2, 2, 1, 128, 16, {1500, 0, 700});
  const gputest::ScopedEnv kv_dq("FLASHMSA_DET_DQ", "kv");  // an error, not another route, if not taken
  StepCase c;
  ASSERT_NO_FATAL_FAILURE(make_step_case(c, s, 219, true));
  StepResult aligned, offset;
  run_eager(c, aligned);
  c.b.dq = DeviceBuffer(c.b.dq.bytes() + 16);
  c.b.dq_offset = 16;
  run_eager(c, offset);
  expect_same_bits(offset, aligned, "dq 16 bytes into its buffer vs dq at its start");
  const auto head = c.b.dq.download<unsigned char>();
  for (int i = 0; i < 16; ++i)
    EXPECT_EQ(head[i], static_cast<unsigned char>(gputest::kFloatPoison)) << "byte " << i << " before dq was written";
}

// A caller's allocator whose buffers start 16 bytes past a 256-byte boundary: flashmsa refuses them
// (its workspace regions are laid out in 256-byte units from the start, and its kernels' vector
// loads, TMA and bulk reduce-adds need them aligned) with an error, and gives each one back.
struct MisalignedAllocator {
  int allocs = 0, frees = 0;
  static void* allocate(void* ctx, size_t bytes, int, flashmsa::Stream stream) {
    void* p = nullptr;
    if (cudaMallocAsync(&p, bytes + 256, static_cast<cudaStream_t>(stream)) != cudaSuccess) return nullptr;
    ++static_cast<MisalignedAllocator*>(ctx)->allocs;
    return static_cast<char*>(p) + 16;
  }
  static void deallocate(void* ctx, void* p, int, flashmsa::Stream stream) {
    ++static_cast<MisalignedAllocator*>(ctx)->frees;
    cudaFreeAsync(static_cast<char*>(p) - 16, static_cast<cudaStream_t>(stream));
  }
};

TEST(CudaWorkspace, MisalignedAllocatorRefused) {
  GPUTEST_REQUIRE_DEVICE();
  const Shape s = shape(32, 2, 2, 1, 128, 16, {700});
  StepCase c;
  ASSERT_NO_FATAL_FAILURE(make_step_case(c, s, 213, false));
  MisalignedAllocator m;
  StepResult r;
  const std::string error = run_with_allocator(c, m, r);
  EXPECT_NE(error.find("not aligned to 256 bytes"), std::string::npos)
      << "a misaligned workspace buffer was accepted, or another error: " << error;
  EXPECT_GT(m.allocs, 0) << "the step took no workspace from the allocator";
  EXPECT_EQ(m.frees, m.allocs) << "a refused buffer was not given back";
}

// flashmsa's pool gives every buffer back at the end of a call but keeps the memory mapped across
// synchronisations (the next call reuses it), and bad arguments name themselves.
TEST(CudaWorkspace, OwnPoolKeepsItsMemory) {
  GPUTEST_REQUIRE_DEVICE();
  const Shape s = shape(32, 2, 2, 1, 128, 16, {1500, 700});
  StepCase c;
  ASSERT_NO_FATAL_FAILURE(make_step_case(c, s, 212, false));
  int device = 0;
  GPUTEST_CUDA(cudaGetDevice(&device));
  auto pool = static_cast<cudaMemPool_t>(flashmsa::workspace_memory_pool(device));
  uint64_t used = 1, reserved = 0, high = 0;
  GPUTEST_CUDA(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high));  // this step's peak only
  StepResult r;
  run_eager(c, r);
  GPUTEST_CUDA(cudaDeviceSynchronize());  // a synchronisation trims pools above their threshold
  GPUTEST_CUDA(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used));
  GPUTEST_CUDA(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved));
  GPUTEST_CUDA(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high));
  EXPECT_EQ(used, 0u) << "a workspace buffer was not given back";
  EXPECT_GT(high, static_cast<uint64_t>(c.pr.T * s.H * s.D) * 2)
      << "the backward's workspace did not come from the pool";
  EXPECT_GE(reserved, high) << "the pool handed memory back at the synchronisation";
  GPUTEST_CUDA(cudaMemPoolTrimTo(pool, 0));

  gputest::expect_error_containing([] { flashmsa::workspace_memory_pool(-1); }, "'device_index'");
  gputest::expect_error_containing([] { flashmsa::workspace_memory_pool(4096); }, "'device_index'");
  gputest::expect_error_containing(
      [] {
        flashmsa::WorkspaceAllocator half;
        half.allocate = &CountingAllocator::allocate;
        flashmsa::set_workspace_allocator(half);
      },
      "'allocator'");
}

}  // namespace
