// Multi-GPU API pieces that run without a GPU (issue 7): float32 y (the unrounded sum both backends write,
// and the partial the parallel calls sum), the parallel scratch size, the in-process all-to-all, the argument
// checks of moe_run_tp / moe_run_ep (inside the failure agreement), and the NCCL entry points without NCCL.
#include <gtest/gtest.h>

#include <functional>
#include <thread>

#include "fp4moe/parallel.h"
#include "test_util.h"
#include "test_helpers.h"

using namespace fp4moe;
using namespace fp4moe::testutil;

namespace {



struct Small {
  int64_t E = 4, H = 64, I = 64, k = 2, T = 6;
  HostWeights hw = make_weights(4, 64, 64, 91);
  std::vector<uint16_t> x = random_bf16_vec(6 * 64, 92);
  std::vector<float> logits = random_f32_vec(6 * 4, 93, -2.f, 2.f);
  MoeArgs args() {
    MoeArgs a;
    a.x = make_view(x.data(), DType::BF16, {T, H});
    a.routing.method = RoutingMethod::Renormalize;
    a.routing.top_k = k;
    a.routing.logits = make_view(logits.data(), DType::F32, {T, E});
    a.num_experts_total = E;
    a.activation.type = ActivationType::Swiglu;
    a.num_threads = 1;
    return a;
  }
};

// A device communicator stand-in (no device): the CPU backend must refuse it.
class FakeDeviceComm final : public Communicator {
 public:
  int rank() const override { return 0; }
  int world() const override { return 1; }
  Backend device() const override { return Backend::CUDA; }
  void allreduce_sum_f32(float*, int64_t) override {}
  void allgather(const void*, void*, int64_t) override {}
  void reduce_scatter_sum_f32(const float*, float*, int64_t) override {}
  void alltoall(const void*, void*, int64_t) override {}
  void barrier() override {}
};

}  // namespace

// float32 y is the combine's fp32 sum before its one rounding: bf16(y_f32) == y_bf16, bit for bit.
TEST(ParallelApi, Float32YIsTheUnroundedSum) {
  Small s;
  MoeWeights w = prepare_weights(s.hw.desc(), Backend::CPU);
  std::vector<uint16_t> yb(static_cast<size_t>(s.T * s.H));
  std::vector<float> yf(static_cast<size_t>(s.T * s.H));
  MoeArgs a = s.args();
  a.y = make_view(yb.data(), DType::BF16, {s.T, s.H});
  moe_run(w, a);
  a.y = make_view(yf.data(), DType::F32, {s.T, s.H});
  moe_run(w, a);
  int64_t unrounded = 0;
  for (size_t i = 0; i < yb.size(); ++i) {
    EXPECT_EQ(f32_to_bf16_bits(yf[i]), yb[i]) << i;
    unrounded += round_bf16(yf[i]) != yf[i];
  }
  EXPECT_GT(unrounded, 0) << "a float32 y must carry the unrounded sum";
  // Other dtypes are refused naming y.
  std::vector<uint16_t> yh(static_cast<size_t>(s.T * s.H));
  a.y = make_view(yh.data(), DType::F16, {s.T, s.H});
  expect_error([&] { moe_run(w, a); }, "y", ErrorCode::InvalidArgument);
}

// TP with a float32 y: the rank-order fp32 sum itself; its bf16 rounding is the bf16 TP output.
TEST(ParallelApi, TpFloat32YRoundsToTheBf16Result) {
  Small s;
  const WeightsDesc full = s.hw.desc();
  InProcessGroup g(2, 30.0);
  std::vector<std::vector<float>> yf(2);
  std::vector<std::vector<uint16_t>> yb(2);
  run_ranks(2, [&](int r) {
    OwnedWeights sh = shard_weights_tp(full, r, 2);
    MoeWeights w = prepare_weights(sh.desc(), Backend::CPU);
    MoeArgs a = s.args();
    yf[r].assign(static_cast<size_t>(s.T * s.H), 0.f);
    yb[r].assign(static_cast<size_t>(s.T * s.H), 0);
    a.y = make_view(yf[r].data(), DType::F32, {s.T, s.H});
    moe_run_tp(w, a, g.comm(r));
    a.y = make_view(yb[r].data(), DType::BF16, {s.T, s.H});
    moe_run_tp(w, a, g.comm(r));
  });
  EXPECT_EQ(yf[0], yf[1]);
  for (size_t i = 0; i < yf[0].size(); ++i) EXPECT_EQ(f32_to_bf16_bits(yf[0][i]), yb[0][i]) << i;
}

TEST(ParallelApi, WorkspaceSize) {
  // AllReduce: (1 + world) blocks of round64(T*H) + 64 floats.
  EXPECT_EQ(parallel_workspace_size(4, 64, 2), (1 + 2) * (256 + 64) * 4);
  EXPECT_EQ(parallel_workspace_size(0, 64, 2), (1 + 2) * 64 * 4);
  // ReduceScatter: own partial + world chunks of rows*H + world flag blocks.
  EXPECT_EQ(parallel_workspace_size(4, 64, 2, ParallelOutput::ReduceScatter), (256 + 64 + 256 + 2 * 64) * 4);
  EXPECT_EQ(parallel_workspace_size(1, 16, 1) % 256, 0);
  expect_error([] { parallel_workspace_size(-1, 64, 2); }, "T", ErrorCode::InvalidArgument);
  expect_error([] { parallel_workspace_size(3, 64, 2, ParallelOutput::ReduceScatter); }, "T", ErrorCode::InvalidArgument);
  expect_error([] { parallel_workspace_size(4, 0, 2); }, "H", ErrorCode::InvalidArgument);
  expect_error([] { parallel_workspace_size(4, 64, 0); }, "world", ErrorCode::InvalidArgument);
}

TEST(ParallelApi, InProcessAllToAll) {
  InProcessGroup g(3);
  run_ranks(3, [&](int r) {
    // rank r sends value 10*r + q to rank q.
    std::vector<int32_t> in = {10 * r + 0, 10 * r + 1, 10 * r + 2}, out(3, -1);
    g.comm(r).alltoall(in.data(), out.data(), sizeof(int32_t));
    EXPECT_EQ(out, (std::vector<int32_t>{0 + r, 10 + r, 20 + r})) << "rank " << r;
  });
}

TEST(ParallelApi, ArgumentChecksAgreeAcrossRanks) {
  Small s;
  const WeightsDesc full = s.hw.desc();
  // Backend / communicator mismatch: decided identically on every rank, thrown before any collective.
  {
    MoeWeights w = prepare_weights(full, Backend::CPU);
    FakeDeviceComm c;
    MoeArgs a = s.args();
    std::vector<uint16_t> y(static_cast<size_t>(s.T * s.H));
    a.y = make_view(y.data(), DType::BF16, {s.T, s.H});
    expect_error([&] { moe_run_tp(w, a, c); }, "comm", ErrorCode::Unsupported);
    expect_error([&] { moe_run_ep(w, a, c); }, "comm", ErrorCode::Unsupported);
  }
  // Rank-local errors go through the agreement: the failing rank names its argument, the other names comm.
  struct Bad {
    std::string arg;
    std::function<void(MoeArgs&, std::vector<uint8_t>&, ParallelOutput&)> edit;
  };
  std::vector<uint8_t> ws(4096);
  const std::vector<Bad> bads = {
      {"parallel_workspace", [](MoeArgs&, std::vector<uint8_t>&, ParallelOutput&) {}},
      {"y", [](MoeArgs& a, std::vector<uint8_t>&, ParallelOutput&) { a.y.dtype = DType::F64; }},
      {"x", [](MoeArgs&, std::vector<uint8_t>&, ParallelOutput& o) { o = ParallelOutput::ReduceScatter; }},  // T=5 below
      {"output", [](MoeArgs&, std::vector<uint8_t>&, ParallelOutput& o) { o = static_cast<ParallelOutput>(7); }},
  };
  InProcessGroup g(2, 30.0);
  for (const Bad& b : bads) {
    std::vector<std::string> names(2, "-");
    std::vector<std::vector<uint16_t>> ys(2, std::vector<uint16_t>(static_cast<size_t>(s.T * s.H), 0x7fc1));
    run_ranks(2, [&](int r) {
      OwnedWeights sh = shard_weights_tp(full, r, 2);
      MoeWeights w = prepare_weights(sh.desc(), Backend::CPU);
      MoeArgs a = s.args();
      a.y = make_view(ys[r].data(), DType::BF16, {s.T, s.H});
      ParallelOutput out = ParallelOutput::AllReduce;
      TensorView pws;
      if (r == 1) {
        b.edit(a, ws, out);
        if (b.arg == "parallel_workspace") pws = make_view(ws.data(), DType::U8, {4096});
        if (b.arg == "x") {  // ReduceScatter with T = 5 rows on this rank: not divisible by world = 2
          a.x.shape[0] = 5;
          a.routing.logits.shape[0] = 5;
          a.y.shape[0] = 5;
        }
      }
      try {
        moe_run_tp(w, a, g.comm(r), out, pws);
      } catch (const Error& e) {
        names[r] = e.argument();
      }
    });
    EXPECT_EQ(names[1], b.arg);
    EXPECT_EQ(names[0], "comm") << b.arg;
    for (int r = 0; r < 2; ++r)
      EXPECT_EQ(std::count(ys[r].begin(), ys[r].end(), 0x7fc1), s.T * s.H) << b.arg << ": y must stay untouched";
  }
}

// Without NCCL (a CPU-only build, or libnccl not loadable) every NCCL entry point throws Unsupported with the
// reason; with it, a unique id is 128 bytes and a bad id size is refused naming the argument.
TEST(ParallelApi, NcclEntryPointsWithoutNccl) {
  EXPECT_EQ(kNcclUniqueIdBytes, 128u);
  if (!nccl_available()) {
    const std::string why = nccl_unavailable_reason();
    EXPECT_FALSE(why.empty());
    EXPECT_TRUE(why.find("NCCL") != std::string::npos || why.find("nccl") != std::string::npos) << why;
    expect_error([] { nccl_unique_id(); }, "nccl", ErrorCode::Unsupported);
    expect_error([] { NcclGroupComm c(std::vector<uint8_t>(128), 2, 0, 0); }, "nccl", ErrorCode::Unsupported);
    expect_error([] { make_nccl_communicator(nullptr, nullptr); }, "nccl_comm", ErrorCode::Unsupported);
  } else {
    EXPECT_EQ(nccl_unavailable_reason(), "");
    EXPECT_EQ(nccl_unique_id().size(), kNcclUniqueIdBytes);
    expect_error([] { NcclGroupComm c(std::vector<uint8_t>(12), 2, 0, 0); }, "unique_id", ErrorCode::InvalidArgument);
    expect_error([] { NcclGroupComm c(std::vector<uint8_t>(128), 2, 2, 0); }, "rank", ErrorCode::InvalidArgument);
  }
}
