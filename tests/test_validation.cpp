// Bad arguments: every public entry point must throw flashmsa::Error naming the argument, and
// must not have written any output (all outputs hold a sentinel byte pattern before the call
// and are compared after).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "test_util.h"

namespace {

using flashmsa::Device;
using flashmsa::DType;
using flashmsa::Mode;
using flashmsa::TensorView;
using msatest::HostTensor;

enum class Op { select, sparse_fwd, fused_bwd, warm_fwd, warm_bwd, msa_fwd, msa_bwd, msa_fwd_warm, msa_bwd_warm };

const char* op_name(Op op) {
  switch (op) {
    case Op::select: return "select_blocks";
    case Op::sparse_fwd: return "sparse_attention_forward";
    case Op::fused_bwd: return "fused_backward";
    case Op::warm_fwd: return "dense_warmup_forward";
    case Op::warm_bwd: return "dense_warmup_backward";
    case Op::msa_fwd: return "msa_forward(sparse)";
    case Op::msa_bwd: return "msa_backward(sparse)";
    case Op::msa_fwd_warm: return "msa_forward(warmup)";
    case Op::msa_bwd_warm: return "msa_backward(warmup)";
  }
  return "?";
}

const std::vector<Op> kAll = {Op::select,   Op::sparse_fwd, Op::fused_bwd,    Op::warm_fwd,   Op::warm_bwd,
                              Op::msa_fwd,  Op::msa_bwd,    Op::msa_fwd_warm, Op::msa_bwd_warm};
// Operations that take block_idx.
const std::vector<Op> kWithIndex = {Op::select, Op::sparse_fwd, Op::fused_bwd, Op::msa_fwd, Op::msa_bwd};
// Operations that take o and lse (as outputs or as saved forward results) and kl.
const std::vector<Op> kWithOutputs = {Op::sparse_fwd, Op::fused_bwd, Op::warm_fwd, Op::warm_bwd,
                                      Op::msa_fwd,    Op::msa_bwd,   Op::msa_fwd_warm, Op::msa_bwd_warm};
// Backward operations (d_o, kl_grad, gradients).
const std::vector<Op> kBackward = {Op::fused_bwd, Op::warm_bwd, Op::msa_bwd, Op::msa_bwd_warm};

constexpr unsigned char kSentinel = 0xA5;

// A valid small fp32 problem with every output allocated; tests mutate one view at a time.
class BadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    c_.heads = {4, 2, 2, 1, 8, 8, 4};
    c_.lengths = {20, 13};
    c_.opt.block_size = 8;
    c_.opt.top_k = 2;
    c_.seed = 300;
    // Mutated input views point here so a missed check cannot read out of bounds.
    scratch_.assign(1 << 16, 0.25f);
    use_problem(c_);
  }

  // The problem of `c` with every output allocated in its dtype (lse and kl fp32), and all the
  // views reset to it.
  void use_problem(const msatest::Case& c) {
    c_ = c;
    pr_ = msatest::make_problem(c_);
    T_ = pr_.cfg.T();
    const auto& h = c_.heads;
    const DType dt = c_.dtype;
    block_idx_ = HostTensor(DType::int32, {h.Hp, T_, c_.opt.top_k});
    o_ = HostTensor(dt, {T_, h.H, h.Dv});
    lse_ = HostTensor(DType::fp32, {h.H, T_});
    kl_ = HostTensor(DType::fp32, {1});
    kl_b_ = HostTensor(DType::fp32, {1});
    dq_ = HostTensor(dt, {T_, h.H, h.D});
    dk_ = HostTensor(dt, {T_, h.Hkv, h.D});
    dv_ = HostTensor(dt, {T_, h.Hkv, h.Dv});
    dqp_ = HostTensor(dt, {T_, h.Hp, h.Dp});
    dkp_ = HostTensor(dt, {T_, h.Hpk, h.Dp});
    in_ = pr_.views();
    opt_ = c_.opt;
    idx_v_ = block_idx_.view();
    o_v_ = o_.view();
    lse_v_ = lse_.view();
    kl_v_ = kl_.view();
    kl_b_v_ = kl_b_.view();
    d_o_v_ = pr_.d_o_t.view();
    kl_grad_v_ = pr_.kl_grad.view();
    grads_ = {dq_.view(), dk_.view(), dv_.view(), dqp_.view(), dkp_.view()};
  }

  std::vector<HostTensor*> outputs() {
    return {&block_idx_, &o_, &lse_, &kl_, &kl_b_, &dq_, &dk_, &dv_, &dqp_, &dkp_};
  }

  void call(Op op) {
    flashmsa::Options opt = opt_;
    // keep_mode_: the msa_* entries get opt_.mode as it is (to test a bad mode) instead of the
    // mode their Op names.
    const auto set_mode = [&](Mode m) {
      if (!keep_mode_) opt.mode = m;
    };
    switch (op) {
      case Op::select: flashmsa::select_blocks(in_, opt, idx_v_); break;
      case Op::sparse_fwd: flashmsa::sparse_attention_forward(in_, idx_v_, opt, o_v_, lse_v_, kl_v_); break;
      case Op::fused_bwd:
        flashmsa::fused_backward(in_, idx_v_, o_v_, lse_v_, d_o_v_, kl_grad_v_, opt, grads_, kl_b_v_);
        break;
      case Op::warm_fwd: flashmsa::dense_warmup_forward(in_, opt, o_v_, lse_v_, kl_v_); break;
      case Op::warm_bwd:
        flashmsa::dense_warmup_backward(in_, o_v_, lse_v_, d_o_v_, kl_grad_v_, opt, grads_, kl_b_v_);
        break;
      case Op::msa_fwd:
        set_mode(Mode::sparse);
        flashmsa::msa_forward(in_, opt, idx_v_, o_v_, lse_v_, kl_v_);
        break;
      case Op::msa_bwd:
        set_mode(Mode::sparse);
        flashmsa::msa_backward(in_, idx_v_, o_v_, lse_v_, d_o_v_, kl_grad_v_, opt, grads_, kl_b_v_);
        break;
      case Op::msa_fwd_warm:
        set_mode(Mode::warmup);
        flashmsa::msa_forward(in_, opt, TensorView(), o_v_, lse_v_, kl_v_);
        break;
      case Op::msa_bwd_warm:
        set_mode(Mode::warmup);
        flashmsa::msa_backward(in_, TensorView(), o_v_, lse_v_, d_o_v_, kl_grad_v_, opt, grads_, kl_b_v_);
        break;
    }
  }

  // Every op of `ops` must throw flashmsa::Error whose message contains one of `names`, with
  // all outputs untouched.
  void expect_rejected(const std::vector<Op>& ops, std::initializer_list<const char*> names) {
    for (Op op : ops) {
      SCOPED_TRACE(op_name(op));
      for (HostTensor* t : outputs()) t->fill_bytes(kSentinel);
      try {
        call(op);
        ADD_FAILURE() << "no error raised";
      } catch (const flashmsa::Error& e) {
        const std::string msg = e.what();
        bool named = false;
        for (const char* n : names) named |= msg.find(n) != std::string::npos;
        EXPECT_TRUE(named) << "message does not name the argument (" << *names.begin() << "): " << msg;
      } catch (const std::exception& e) {
        ADD_FAILURE() << "threw something other than flashmsa::Error: " << e.what();
      }
      const char* labels[] = {"block_idx", "o", "lse", "kl", "kl(backward)", "dq", "dk", "dv", "dqp", "dkp"};
      int i = 0;
      for (HostTensor* t : outputs()) {
        bool untouched = true;
        for (unsigned char b : t->bytes()) untouched &= b == kSentinel;
        EXPECT_TRUE(untouched) << "output '" << labels[i] << "' was written before the error";
        ++i;
      }
    }
  }
  void expect_rejected(const std::vector<Op>& ops, const char* name) { expect_rejected(ops, {name}); }

  // A bf16, BLK 128, K 2 problem of head dim d (one sequence of 5 tokens) whose views all claim to
  // be CUDA memory: the pointers are host memory, so any kernel or copy attempt is caught.
  void use_cuda_problem(int d) {
    msatest::Case c;
    c.heads = {2, 1, 1, 1, d, d, d};
    c.lengths = {5};
    c.dtype = DType::bf16;
    c.opt.block_size = 128;
    c.opt.top_k = 2;
    use_problem(c);
    for (TensorView* v : {&in_.q, &in_.k, &in_.v, &in_.qp, &in_.kp, &in_.cu_seqlens, &idx_v_, &o_v_,
                          &lse_v_, &kl_v_, &kl_b_v_, &d_o_v_, &kl_grad_v_, &grads_.dq, &grads_.dk,
                          &grads_.dv, &grads_.dqp, &grads_.dkp})
      v->device = Device::cuda;
  }

  // A view of the scratch buffer with the given shape (contiguous) and dtype.
  TensorView scratch_view(std::initializer_list<int64_t> shape, DType dtype = DType::fp32) {
    return flashmsa::make_view(scratch_.data(), dtype, shape);
  }
  TensorView cu_view(std::vector<int32_t> values) {
    cu_store_ = std::move(values);
    return flashmsa::make_view(cu_store_.data(), DType::int32, {static_cast<int64_t>(cu_store_.size())});
  }

  // Every op of `ops` must reject the block_idx contents `bad` (an input to them) with a
  // flashmsa::Error naming 'block_idx', and write nothing: the other outputs keep the
  // sentinel and block_idx keeps `bad`.
  void expect_index_rejected(const std::vector<Op>& ops, const std::vector<int32_t>& bad) {
    ASSERT_EQ(static_cast<int64_t>(bad.size()), block_idx_.numel());
    for (Op op : ops) {
      SCOPED_TRACE(op_name(op));
      for (HostTensor* t : outputs()) t->fill_bytes(kSentinel);
      std::memcpy(block_idx_.data(), bad.data(), bad.size() * sizeof(int32_t));
      try {
        call(op);
        ADD_FAILURE() << "no error raised";
      } catch (const flashmsa::Error& e) {
        EXPECT_NE(std::string(e.what()).find("'block_idx'"), std::string::npos)
            << "message does not name 'block_idx': " << e.what();
      } catch (const std::exception& e) {
        ADD_FAILURE() << "threw something other than flashmsa::Error: " << e.what();
      }
      EXPECT_EQ(block_idx_.to_ints(), bad) << "block_idx was modified";
      const char* labels[] = {"o", "lse", "kl", "kl(backward)", "dq", "dk", "dv", "dqp", "dkp"};
      int i = 0;
      for (HostTensor* t : outputs()) {
        if (t == &block_idx_) continue;
        bool untouched = true;
        for (unsigned char b : t->bytes()) untouched &= b == kSentinel;
        EXPECT_TRUE(untouched) << "output '" << labels[i] << "' was written before the error";
        ++i;
      }
    }
  }

  // The selector's block_idx for the current problem (a valid set of contents to mutate).
  std::vector<int32_t> selected_rows() {
    flashmsa::select_blocks(in_, opt_, idx_v_);
    return block_idx_.to_ints();
  }
  // Replaces row (proxy head hp, token t) of `idx` by `row` (K entries).
  std::vector<int32_t> with_row(std::vector<int32_t> idx, int hp, int64_t t, std::vector<int32_t> row) {
    const int K = c_.opt.top_k;
    EXPECT_EQ(static_cast<int>(row.size()), K);
    std::copy(row.begin(), row.end(), idx.begin() + (hp * T_ + t) * K);
    return idx;
  }

  bool keep_mode_ = false;
  msatest::Case c_;
  msatest::Problem pr_;
  int64_t T_ = 0;
  HostTensor block_idx_, o_, lse_, kl_, kl_b_, dq_, dk_, dv_, dqp_, dkp_;
  std::vector<float> scratch_;
  std::vector<int32_t> cu_store_;
  flashmsa::AttentionInputs in_;
  flashmsa::Options opt_;
  TensorView idx_v_, o_v_, lse_v_, kl_v_, kl_b_v_, d_o_v_, kl_grad_v_;
  flashmsa::Gradients grads_;
};

// The unmodified problem is accepted by every entry point (so each failure below is caused by
// its one mutation). Needs the CPU backend.
TEST_F(BadInput, BaselineIsAccepted) {
  for (Op op : kAll) {
    // kAll's order makes each backward see the block_idx, o and lse of the forward before it.
    SCOPED_TRACE(op_name(op));
    EXPECT_NO_THROW(call(op));
  }
}

// ---- shapes of the five inputs ----

TEST_F(BadInput, WrongRankOfEachInput) {
  const auto& h = c_.heads;
  in_.q = scratch_view({T_, h.H * h.D});
  expect_rejected(kAll, "'q'");
  SetUp();
  in_.k = scratch_view({T_, h.Hkv, h.D, 1});
  expect_rejected(kAll, "'k'");
  SetUp();
  in_.v = scratch_view({T_ * h.Hkv * h.Dv});
  expect_rejected(kAll, "'v'");
  SetUp();
  in_.qp = scratch_view({T_, h.Hp});
  expect_rejected(kAll, "'qp'");
  SetUp();
  in_.kp = scratch_view({1, T_, h.Hpk, h.Dp});
  expect_rejected(kAll, "'kp'");
}

TEST_F(BadInput, WrongTokenCount) {
  const auto& h = c_.heads;
  in_.k = scratch_view({T_ - 1, h.Hkv, h.D});
  expect_rejected(kAll, "'k'");
  SetUp();
  in_.v = scratch_view({T_ + 1, h.Hkv, h.Dv});
  expect_rejected(kAll, "'v'");
  SetUp();
  in_.qp = scratch_view({T_ - 1, h.Hp, h.Dp});
  expect_rejected(kAll, "'qp'");
  SetUp();
  in_.kp = scratch_view({T_ + 3, h.Hpk, h.Dp});
  expect_rejected(kAll, "'kp'");
  SetUp();
  // q defines T, so a wrong q is reported against the first tensor that disagrees with it.
  in_.q = scratch_view({T_ + 1, h.H, h.D});
  expect_rejected(kAll, {"'q'", "'k'"});
}

TEST_F(BadInput, WrongHeadDims) {
  const auto& h = c_.heads;
  in_.k = scratch_view({T_, h.Hkv, h.D + 1});
  expect_rejected(kAll, "'k'");
  SetUp();
  in_.v = scratch_view({T_, h.Hkv + 1, h.Dv});  // v heads must match k heads
  expect_rejected(kAll, "'v'");
  SetUp();
  in_.kp = scratch_view({T_, h.Hpk, h.Dp + 2});
  expect_rejected(kAll, "'kp'");
  SetUp();
  in_.q = scratch_view({T_, h.H, h.D + 1});  // D from q disagrees with k
  expect_rejected(kAll, {"'q'", "'k'"});
}

TEST_F(BadInput, BadHeadRatios) {
  const auto& h = c_.heads;
  in_.k = scratch_view({T_, 3, h.D});  // H = 4 not a multiple of Hkv = 3
  in_.v = scratch_view({T_, 3, h.Dv});
  expect_rejected(kAll, "'k'");
  SetUp();
  in_.qp = scratch_view({T_, 3, h.Dp});  // H % Hp
  expect_rejected(kAll, "'qp'");
  SetUp();
  in_.kp = scratch_view({T_, 3, h.Dp});  // Hp = 2 not a multiple of Hpk = 3
  expect_rejected(kAll, "'kp'");
  SetUp();
  in_.k = scratch_view({T_, 8, h.D});  // Hkv > H
  in_.v = scratch_view({T_, 8, h.Dv});
  expect_rejected(kAll, "'k'");
}

// ---- dtypes ----

TEST_F(BadInput, DtypeMismatch) {
  in_.k.dtype = DType::fp16;
  expect_rejected(kAll, "'k'");
  SetUp();
  in_.v.dtype = DType::bf16;
  expect_rejected(kAll, "'v'");
  SetUp();
  in_.qp.dtype = DType::bf16;
  expect_rejected(kAll, "'qp'");
  SetUp();
  in_.kp.dtype = DType::int32;
  expect_rejected(kAll, "'kp'");
  SetUp();
  in_.q.dtype = DType::int32;
  expect_rejected(kAll, "'q'");
  SetUp();
  o_v_.dtype = DType::bf16;
  expect_rejected(kWithOutputs, "'o'");
  SetUp();
  d_o_v_.dtype = DType::fp16;
  expect_rejected(kBackward, "'d_o'");
  SetUp();
  grads_.dq.dtype = DType::bf16;
  expect_rejected(kBackward, "'dq'");
  SetUp();
  grads_.dkp.dtype = DType::int32;
  expect_rejected(kBackward, "'dkp'");
  SetUp();
  idx_v_.dtype = DType::fp32;
  expect_rejected(kWithIndex, "'block_idx'");
}

// ---- cu_seqlens ----

TEST_F(BadInput, CuSeqlensNotStartingAtZero) {
  in_.cu_seqlens = cu_view({1, 20, static_cast<int32_t>(T_)});
  expect_rejected(kAll, "'cu_seqlens'");
}

TEST_F(BadInput, CuSeqlensDecreasing) {
  in_.cu_seqlens = cu_view({0, 21, 13, static_cast<int32_t>(T_)});
  expect_rejected(kAll, "'cu_seqlens'");
}

TEST_F(BadInput, CuSeqlensNotEndingAtT) {
  in_.cu_seqlens = cu_view({0, 20, static_cast<int32_t>(T_ - 1)});
  expect_rejected(kAll, "'cu_seqlens'");
  SetUp();
  in_.cu_seqlens = cu_view({0, 20, static_cast<int32_t>(T_ + 1)});
  expect_rejected(kAll, "'cu_seqlens'");
}

TEST_F(BadInput, CuSeqlensWrongDtypeOrShape) {
  in_.cu_seqlens.dtype = DType::fp32;
  expect_rejected(kAll, "'cu_seqlens'");
  SetUp();
  in_.cu_seqlens = flashmsa::make_view(pr_.cu.data(), DType::int32, {1, 3});
  expect_rejected(kAll, "'cu_seqlens'");
  SetUp();
  in_.cu_seqlens = flashmsa::make_view(pr_.cu.data(), DType::int32, {0});
  expect_rejected(kAll, "'cu_seqlens'");
  SetUp();
  in_.cu_seqlens = TensorView();
  expect_rejected(kAll, "'cu_seqlens'");
}

// ---- options ----

TEST_F(BadInput, BadOptions) {
  opt_.top_k = 0;
  expect_rejected(kAll, "top_k");
  SetUp();
  opt_.top_k = -3;
  expect_rejected(kAll, "top_k");
  SetUp();
  opt_.local_blocks = 3;  // > K = 2
  expect_rejected(kAll, "local_blocks");
  SetUp();
  opt_.local_blocks = 0;
  expect_rejected(kAll, "local_blocks");
  SetUp();
  opt_.block_size = 0;
  expect_rejected(kAll, "block_size");
  SetUp();
  opt_.num_threads = -1;
  expect_rejected(kAll, "num_threads");
  SetUp();
  opt_.scale = std::numeric_limits<float>::quiet_NaN();
  expect_rejected(kAll, "scale");
  SetUp();
  opt_.kl_coeff = std::numeric_limits<float>::infinity();
  expect_rejected(kAll, "kl_coeff");
}

// ---- layout ----

TEST_F(BadInput, NonContiguousTensors) {
  const auto& h = c_.heads;
  // q with a padded row stride (as a slice of a wider tensor would have).
  in_.q = scratch_view({T_, h.H, h.D});
  in_.q.stride[1] = h.D + 1;
  in_.q.stride[0] = h.H * (h.D + 1);
  expect_rejected(kAll, "'q'");
  SetUp();
  std::swap(in_.k.stride[0], in_.k.stride[1]);  // a transposed view
  expect_rejected(kAll, "'k'");
  SetUp();
  in_.v.stride[2] = 2;
  expect_rejected(kAll, "'v'");
  SetUp();
  in_.qp.stride[0] *= 2;
  expect_rejected(kAll, "'qp'");
  SetUp();
  in_.kp.stride[2] = 0;  // a broadcast view
  expect_rejected(kAll, "'kp'");
  SetUp();
  // Outputs: a [T, H, Dv] view over head-major memory (same buffer, same size).
  o_v_.stride[0] = h.Dv;
  o_v_.stride[1] = T_ * h.Dv;
  expect_rejected(kWithOutputs, "'o'");
  SetUp();
  std::swap(grads_.dq.stride[0], grads_.dq.stride[1]);
  expect_rejected(kBackward, "'dq'");
  SetUp();
  std::swap(idx_v_.stride[0], idx_v_.stride[1]);
  expect_rejected(kWithIndex, "'block_idx'");
}

TEST_F(BadInput, NullDataPointer) {
  in_.q.data = nullptr;
  expect_rejected(kAll, "'q'");
  SetUp();
  o_v_.data = nullptr;
  expect_rejected(kWithOutputs, "'o'");
}

// ---- outputs and saved tensors ----

TEST_F(BadInput, MissingArguments) {
  in_.q = TensorView();
  expect_rejected(kAll, "'q'");
  SetUp();
  in_.kp = TensorView();
  expect_rejected(kAll, "'kp'");
  SetUp();
  o_v_ = TensorView();
  expect_rejected(kWithOutputs, "'o'");
  SetUp();
  lse_v_ = TensorView();
  expect_rejected(kWithOutputs, "'lse'");
  SetUp();
  idx_v_ = TensorView();
  expect_rejected(kWithIndex, "'block_idx'");
  SetUp();
  d_o_v_ = TensorView();
  expect_rejected(kBackward, "'d_o'");
  const char* names[] = {"'dq'", "'dk'", "'dv'", "'dqp'", "'dkp'"};
  TensorView flashmsa::Gradients::*fields[] = {&flashmsa::Gradients::dq, &flashmsa::Gradients::dk,
                                               &flashmsa::Gradients::dv, &flashmsa::Gradients::dqp,
                                               &flashmsa::Gradients::dkp};
  for (int i = 0; i < 5; ++i) {
    SetUp();
    grads_.*fields[i] = TensorView();
    expect_rejected(kBackward, names[i]);
  }
}

TEST_F(BadInput, WrongLseShapeOrDtype) {
  const auto& h = c_.heads;
  lse_v_ = flashmsa::make_view(lse_.data(), DType::fp32, {T_, h.H});  // token-major instead of [H, T]
  expect_rejected(kWithOutputs, "'lse'");
  SetUp();
  lse_v_.dtype = DType::bf16;
  expect_rejected(kWithOutputs, "'lse'");
  SetUp();
  lse_v_ = flashmsa::make_view(lse_.data(), DType::fp32, {h.H * T_});
  expect_rejected(kWithOutputs, "'lse'");
}

TEST_F(BadInput, WrongShapesOfOtherArguments) {
  const auto& h = c_.heads;
  o_v_ = flashmsa::make_view(o_.data(), DType::fp32, {T_, h.H * h.Dv, 1});
  expect_rejected(kWithOutputs, "'o'");
  SetUp();
  idx_v_ = flashmsa::make_view(block_idx_.data(), DType::int32, {h.Hp, T_, 1});  // K - 1
  expect_rejected(kWithIndex, "'block_idx'");
  SetUp();
  idx_v_ = flashmsa::make_view(block_idx_.data(), DType::int32, {T_, h.Hp, 2});  // token-major
  expect_rejected(kWithIndex, "'block_idx'");
  SetUp();
  kl_v_ = flashmsa::make_view(lse_.data(), DType::fp32, {2});
  expect_rejected({Op::sparse_fwd, Op::warm_fwd, Op::msa_fwd, Op::msa_fwd_warm}, "'kl'");
  SetUp();
  kl_b_v_.dtype = DType::int32;
  expect_rejected(kBackward, "'kl'");
  SetUp();
  kl_grad_v_.dtype = DType::bf16;
  expect_rejected(kBackward, "'kl_grad'");
  SetUp();
  kl_grad_v_ = flashmsa::make_view(scratch_.data(), DType::fp32, {1, 1});
  expect_rejected(kBackward, "'kl_grad'");
  SetUp();
  d_o_v_ = flashmsa::make_view(scratch_.data(), DType::fp32, {T_, h.H, h.Dv + 1});
  expect_rejected(kBackward, "'d_o'");
  SetUp();
  grads_.dk = flashmsa::make_view(dk_.data(), DType::fp32, {T_, h.Hkv, h.D - 1});
  expect_rejected(kBackward, "'dk'");
  SetUp();
  grads_.dv = flashmsa::make_view(dv_.data(), DType::fp32, {T_ - 1, h.Hkv, h.Dv});
  expect_rejected(kBackward, "'dv'");
  SetUp();
  grads_.dqp = flashmsa::make_view(dqp_.data(), DType::fp32, {T_, h.Hp * h.Dp});
  expect_rejected(kBackward, "'dqp'");
}

TEST_F(BadInput, MixedDevices) {
  in_.k.device = Device::cuda;
  expect_rejected(kAll, {"'k'", "CUDA"});
  SetUp();
  o_v_.device = Device::cuda;
  expect_rejected(kWithOutputs, {"'o'", "CUDA"});
}

// A CUDA device requested where there is none (CPU-only build, or no usable GPU): a clear
// flashmsa::Error, no crash, nothing written. The pointers are host memory, so any attempt to
// run a kernel or copy would be caught by the sentinel check or crash the test.
TEST_F(BadInput, CudaDeviceWithoutCuda) {
  if (flashmsa::cuda_device_available()) GTEST_SKIP() << "a CUDA device is present (tests/gpu covers it)";
  // Head dims 64 so a CUDA build gets past its support check to the device.
  use_cuda_problem(64);
  // Any message will do as long as it is a flashmsa::Error; "CUDA" or "cuda" appears in both
  // the no-backend and the no-device messages.
  expect_rejected(kAll, {"CUDA", "cuda"});
  // The same with a host copy of cu_seqlens (skips the device-to-host validation copy).
  in_.cu_seqlens_host = pr_.cfg.cu_seqlens.data();
  expect_rejected(kAll, {"CUDA", "cuda"});
}

// Head dims the CUDA kernels do not take (D = 256): an error that names the arguments and the
// dims, before anything is written (a build without the CUDA backend names 'q' too).
TEST_F(BadInput, CudaHeadDim256) {
  if (flashmsa::cuda_device_available()) GTEST_SKIP() << "host pointers posing as device memory";
  use_cuda_problem(256);
  in_.cu_seqlens_host = pr_.cfg.cu_seqlens.data();
  if (flashmsa::cuda_backend_built()) expect_rejected(kAll, "'q', 'v', 'qp' have head dims D = 256");
  else expect_rejected(kAll, "'q'");
}

// ---- block_idx contents (sparse forward and backward read it; the CPU backend checks it) ----
//
// The fixture: BLK 8, K 2, sequences of 20 tokens (blocks 0..2, tokens 0..19) and 13 tokens
// (blocks 0..1, tokens 20..32). A token at position pos of its sequence may name blocks
// 0 .. pos/8 only.
const std::vector<Op> kReadIndex = {Op::sparse_fwd, Op::fused_bwd, Op::msa_bwd};

// The selector's own output is accepted (so each rejection below is caused by its one row).
TEST_F(BadInput, BlockIdxValidContentsAccepted) {
  const std::vector<int32_t> good = selected_rows();
  for (int32_t x : good) ASSERT_GE(x, -1);
  // A hand-made valid row too: fewer blocks than K, -1 padding last.
  const std::vector<int32_t> padded = with_row(good, 1, 19, {2, -1});
  for (const auto& idx : {good, padded}) {
    for (Op op : kReadIndex) {
      SCOPED_TRACE(op_name(op));
      std::memcpy(block_idx_.data(), idx.data(), idx.size() * sizeof(int32_t));
      EXPECT_NO_THROW(call(op));
    }
  }
}

// (a) A block after the token's own block: it exists in the sequence, but lies in the future.
TEST_F(BadInput, BlockIdxFutureBlock) {
  const std::vector<int32_t> good = selected_rows();
  expect_index_rejected(kReadIndex, with_row(good, 0, 0, {0, 1}));    // seq 0, pos 0: own block 0
  expect_index_rejected(kReadIndex, with_row(good, 1, 10, {1, 2}));   // seq 0, pos 10: own block 1
  expect_index_rejected(kReadIndex, with_row(good, 0, 20, {0, 1}));   // seq 1, pos 0: own block 0
  expect_index_rejected(kReadIndex, with_row(good, 1, 27, {1, -1}));  // seq 1, pos 7: own block 0
}

// (b) Below -1, or at/after the sequence's number of blocks.
TEST_F(BadInput, BlockIdxOutOfRange) {
  const std::vector<int32_t> good = selected_rows();
  expect_index_rejected(kReadIndex, with_row(good, 0, 5, {0, -2}));
  expect_index_rejected(kReadIndex, with_row(good, 1, 19, {-2, 2}));
  expect_index_rejected(kReadIndex, with_row(good, 0, 12, {std::numeric_limits<int32_t>::min(), -1}));
  expect_index_rejected(kReadIndex, with_row(good, 0, 19, {2, 3}));  // seq 0 has 3 blocks
  // Block 2 exists in sequence 0 but not in sequence 1 (2 blocks): indices are per sequence.
  expect_index_rejected(kReadIndex, with_row(good, 1, 32, {1, 2}));
  expect_index_rejected(kReadIndex, with_row(good, 1, 32, {0, std::numeric_limits<int32_t>::max()}));
}

// (c) Not strictly ascending: descending, or a duplicate.
TEST_F(BadInput, BlockIdxNotAscending) {
  const std::vector<int32_t> good = selected_rows();
  expect_index_rejected(kReadIndex, with_row(good, 0, 19, {2, 1}));
  expect_index_rejected(kReadIndex, with_row(good, 1, 31, {1, 0}));
  expect_index_rejected(kReadIndex, with_row(good, 0, 19, {2, 2}));
  expect_index_rejected(kReadIndex, with_row(good, 1, 0, {0, 0}));
}

// (d) -1 padding followed by a valid entry (padding must be trailing).
TEST_F(BadInput, BlockIdxPaddingNotTrailing) {
  {
    const std::vector<int32_t> good = selected_rows();
    expect_index_rejected(kReadIndex, with_row(good, 0, 19, {-1, 2}));
    expect_index_rejected(kReadIndex, with_row(good, 1, 0, {-1, 0}));
  }
  // K = 3: -1 in the middle of a row.
  msatest::Case c = c_;
  c.opt.top_k = 3;
  use_problem(c);
  const std::vector<int32_t> good = selected_rows();
  expect_index_rejected(kReadIndex, with_row(good, 1, 19, {1, -1, 2}));
  expect_index_rejected(kReadIndex, with_row(good, 0, 30, {0, -1, 1}));  // seq 1, pos 10
  expect_index_rejected(kReadIndex, with_row(good, 0, 19, {-1, -1, 2}));
}

// ---- Options::mode and malformed views ----

// A mode that is neither sparse nor warmup is an error, with or without a block_idx.
TEST_F(BadInput, InvalidMode) {
  keep_mode_ = true;
  opt_.mode = static_cast<Mode>(7);
  // msa_fwd / msa_bwd pass block_idx, the _warm variants pass none.
  expect_rejected({Op::msa_fwd, Op::msa_bwd, Op::msa_fwd_warm, Op::msa_bwd_warm}, "mode");
  opt_.mode = static_cast<Mode>(-1);
  expect_rejected({Op::msa_fwd, Op::msa_bwd, Op::msa_fwd_warm, Op::msa_bwd_warm}, "mode");
}

// ndim outside [0, 4] (TensorView holds 4 dims): an Error, never a read past shape[3].
TEST_F(BadInput, NdimOutOfRange) {
  for (int nd : {5, -1, 100}) {
    SCOPED_TRACE("ndim " + std::to_string(nd));
    SetUp();
    in_.q.ndim = nd;
    expect_rejected(kAll, "'q'");
    SetUp();
    in_.kp.ndim = nd;
    expect_rejected(kAll, "'kp'");
    SetUp();
    o_v_.ndim = nd;
    expect_rejected(kWithOutputs, "'o'");
    SetUp();
    idx_v_.ndim = nd;
    expect_rejected(kWithIndex, "'block_idx'");
    SetUp();
    grads_.dv.ndim = nd;
    expect_rejected(kBackward, "'dv'");
  }
}

// Gradients may not share memory with each other or with an input (the CUDA backward keeps
// accumulators in dq's buffer while its kernels read the inputs).
TEST_F(BadInput, OverlappingOutputs) {
  const auto& h = c_.heads;
  const DType dt = c_.dtype;
  grads_.dqp = flashmsa::make_view(dq_.data(), dt, {T_, h.Hp, h.Dp});  // inside dq
  expect_rejected(kBackward, "'dq' and 'dqp' overlap");
  SetUp();
  grads_.dq = flashmsa::make_view(in_.q.data, dt, {T_, h.H, h.D});  // in place of q
  expect_rejected(kBackward, "'dq' overlaps input 'q'");
  SetUp();
  grads_.dv = flashmsa::make_view(pr_.d_o_t.data(), dt, {T_, h.Hkv, h.Dv});  // inside d_o
  expect_rejected(kBackward, "'dv' overlaps input 'd_o'");
  SetUp();
  kl_b_v_ = flashmsa::make_view(static_cast<unsigned char*>(dkp_.data()) + 4, DType::fp32, {1});
  expect_rejected(kBackward, "'dkp' and 'kl' overlap");
  SetUp();
  grads_.dkp = flashmsa::make_view(block_idx_.data(), c_.dtype, {T_, h.Hpk, h.Dp});  // over the selection
  expect_rejected({Op::fused_bwd, Op::msa_bwd}, "'dkp' overlaps input 'block_idx'");
}

// The forward's outputs may not share memory with each other, an input or block_idx (the CUDA
// forward keeps its selection index's scratch in o's buffer while it reads block_idx).
TEST_F(BadInput, OverlappingForwardOutputs) {
  const auto& h = c_.heads;
  const DType dt = c_.dtype;
  const std::vector<Op> forwards = {Op::sparse_fwd, Op::warm_fwd, Op::msa_fwd, Op::msa_fwd_warm};
  // o's view may reach past the buffer it starts in (into whatever the heap put next), so the
  // input named first need not be that buffer: only the output is asserted.
  o_v_ = flashmsa::make_view(in_.q.data, dt, {T_, h.H, h.Dv});  // in place of q
  expect_rejected(forwards, "'o' overlaps input '");
  SetUp();
  // From kp on: o is larger than kp, so its tail may also cover an output the heap put after kp
  // (lse: 'o' and 'lse' overlap, checked first; seen once in CI's generic-ISA run). Either error names o.
  o_v_ = flashmsa::make_view(in_.kp.data, dt, {T_, h.H, h.Dv});
  expect_rejected(forwards, {"'o' overlaps input '", "'o' and '"});
  SetUp();
  lse_v_ = flashmsa::make_view(o_.data(), DType::fp32, {h.H, T_});  // inside o
  expect_rejected(forwards, "'o' and 'lse' overlap");
  SetUp();
  // o and block_idx at the start of one buffer that holds either: o overlaps block_idx only.
  const int64_t o_bytes = T_ * h.H * h.Dv * static_cast<int64_t>(flashmsa::dtype_size(dt));
  const int64_t idx_bytes = h.Hp * T_ * c_.opt.top_k * int64_t{4};
  HostTensor shared(DType::int32, {std::max(o_bytes, idx_bytes) / 4 + 1});
  o_v_ = flashmsa::make_view(shared.data(), dt, {T_, h.H, h.Dv});
  idx_v_ = flashmsa::make_view(shared.data(), DType::int32, {h.Hp, T_, c_.opt.top_k});
  expect_rejected({Op::sparse_fwd, Op::msa_fwd}, "'o' overlaps input 'block_idx'");
}

// A caller's selection index: its size from shapes (exactly), int32, and no overlap with what
// the call writes or (for its build) reads; the warm-up does not read it.
TEST_F(BadInput, SelectionIndex) {
  const int64_t n = flashmsa::selection_index_size(in_, opt_);
  HostTensor index(DType::int32, {n + 1});
  const std::vector<Op> sparse_ops = {Op::sparse_fwd, Op::fused_bwd, Op::msa_fwd, Op::msa_bwd};
  in_.selection_index = flashmsa::make_view(index.data(), DType::int32, {n - 1});
  expect_rejected(sparse_ops, "'selection_index' has shape");
  in_.selection_index = flashmsa::make_view(index.data(), DType::fp32, {n});
  expect_rejected(sparse_ops, "'selection_index' has dtype");
  in_.selection_index = flashmsa::make_view(o_.data(), DType::int32, {n});  // inside o
  ASSERT_LE(n * 4, o_.numel() * flashmsa::dtype_size(c_.dtype)) << "the test wants the index inside o";
  expect_rejected({Op::sparse_fwd, Op::msa_fwd}, "'o' overlaps input 'selection_index'");
  in_.selection_index = flashmsa::make_view(dq_.data(), DType::int32, {n});  // inside dq
  expect_rejected({Op::fused_bwd, Op::msa_bwd}, "'dq' overlaps input 'selection_index'");
  // msa_forward builds it after selection writes block_idx: they may not share memory (block_idx
  // inside the index's own buffer, so that nothing else can be the overlap found).
  HostTensor shared(DType::int32, {n});
  in_.selection_index = shared.view();
  idx_v_ = flashmsa::make_view(shared.data(), DType::int32, {c_.heads.Hp, T_, c_.opt.top_k});
  expect_rejected({Op::msa_fwd}, "'selection_index' overlaps input 'block_idx'");
  idx_v_ = block_idx_.view();

  // build_selection_index: the same checks on its output, before anything is written.
  in_.selection_index = TensorView();
  flashmsa::select_blocks(in_, opt_, idx_v_);
  auto build_error = [&](const TensorView& out) -> std::string {
    try {
      flashmsa::build_selection_index(in_, idx_v_, opt_, out);
    } catch (const flashmsa::Error& e) {
      return e.what();
    }
    return "no error";
  };
  index.fill_bytes(kSentinel);
  EXPECT_NE(build_error(flashmsa::make_view(index.data(), DType::int32, {n + 1})).find("'selection_index' has shape"),
            std::string::npos);
  EXPECT_NE(build_error(flashmsa::make_view(block_idx_.data(), DType::int32, {n})).find("'selection_index' overlaps"),
            std::string::npos);
  for (unsigned char b : index.bytes()) ASSERT_EQ(b, kSentinel) << "the index was written before the error";
  EXPECT_EQ(build_error(flashmsa::make_view(index.data(), DType::int32, {n})), "no error");

  // Built and given: every sparse op accepts it; a mis-sized one is not read by the warm-up.
  in_.selection_index = flashmsa::make_view(index.data(), DType::int32, {n});
  for (Op op : {Op::sparse_fwd, Op::fused_bwd, Op::msa_fwd, Op::msa_bwd}) EXPECT_NO_THROW(call(op)) << op_name(op);
  in_.selection_index = flashmsa::make_view(index.data(), DType::int32, {n - 1});
  for (Op op : {Op::warm_fwd, Op::warm_bwd}) EXPECT_NO_THROW(call(op)) << op_name(op);
}

}  // namespace
