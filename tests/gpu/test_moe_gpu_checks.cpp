// GPU tests of the CUDA backend, the checks around the numbers: values that live only on the GPU (out-of-range
// topk_ids, bad activation parameters, a non-finite routing bias) raise the device error flag and are dropped;
// a given workspace is refused when too small and equals the internal one; the permutation against a CPU sort;
// the kimi_k3_tp8 timings. Each test skips with "no CUDA device" when there is none. Lines starting with "STAT" are
// collected by tools/device/.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cuda/kernels.h"
#include "runtime/plan.h"
#include "gpu_harness.h"

namespace fp4moe::gputest {
namespace {

constexpr double kRelL2A16 = 1e-2;  // vs the Fp32 reference (as test_moe_gpu.cpp)


// ---- bad GPU-only values: out-of-range topk_ids set the error flag and are dropped ------------------
TEST(GpuDeviceErrors, OutOfRangeIdsSetFlag) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Case c;
  c.shape = model("qwen3_30b_a3b_tp4");
  c.E_loc = c.E_total = 16;
  c.T = 20;
  c.precomputed = true;
  auto layer = make_layer(c);
  Inputs in = make_inputs(c);
  check_device_errors(0);  // clean start
  Inputs bad = in;
  bad.ids[3 * in.k + 1] = 9999;
  bad.ids[7 * in.k + 0] = -5;
  bad.ids[19 * in.k + 2] = static_cast<int32_t>(c.E_total);
  auto call = make_gpu_call(c, bad, *layer);
  const auto y = run_gpu(layer->gpu, *call);
  EXPECT_EQ(count_poison(y), 0);
  try {
    check_device_errors(0);
    ADD_FAILURE() << "expected DeviceFault";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::DeviceFault) << e.what();
  }
  EXPECT_NO_THROW(check_device_errors(0)) << "the flag is cleared once reported";
  // Tokens without a bad id are computed as usual.
  std::vector<int64_t> good;
  for (int64_t t = 0; t < c.T; ++t)
    if (t != 3 && t != 7 && t != 19) good.push_back(t);
  const auto ref = run_reference(c, in, *layer, good, Precision::Fp64);
  const Errors e = compare(y, ref, good, in.H);
  EXPECT_LE(e.rel_l2, kRelL2A16);
  // A clean call leaves the flag clear.
  auto ok = make_gpu_call(c, in, *layer);
  run_gpu(layer->gpu, *ok);
  EXPECT_NO_THROW(check_device_errors(0));
}

// Per-expert activation parameters that live on the GPU are checked there: a bad value raises the flag naming its
// argument, every (token, slot) routed to that expert is dropped, and every other slot is computed as usual.
TEST(GpuDeviceErrors, BadActivationParamsDropTheirExpert) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Case c;
  c.shape = model("kimi_k3_tp8");  // Situ: alpha, beta > 0
  c.E_loc = c.E_total = 16;
  c.T = 24;
  c.precomputed = true;
  auto layer = make_layer(c);
  const Inputs in = make_inputs(c);
  constexpr int kBad = 3;
  int routed_to_bad = 0;
  for (int32_t id : in.ids) routed_to_bad += id == kBad;
  ASSERT_GT(routed_to_bad, 0);
  check_device_errors(0);  // clean start
  struct Sub {
    const char* argument;
    int which;  // 0 alpha, 1 beta, 2 clamp_limit
    float value;
  };
  for (const Sub sub : {Sub{"activation.alpha", 0, -1.f}, Sub{"activation.beta", 1, 0.f},
                        Sub{"activation.alpha", 0, INFINITY}, Sub{"activation.clamp_limit", 2, NAN},
                        Sub{"activation.clamp_limit", 2, -2.f}}) {
    SCOPED_TRACE(std::string(sub.argument) + " = " + std::to_string(sub.value));
    std::vector<float> good[3] = {std::vector<float>(c.E_loc, 4.f), std::vector<float>(c.E_loc, 25.f),
                                  std::vector<float>(c.E_loc, 1e4f)};
    std::vector<float> bad[3] = {good[0], good[1], good[2]};
    bad[sub.which][kBad] = sub.value;
    DevBuf dg[3] = {DevBuf::from(good[0]), DevBuf::from(good[1]), DevBuf::from(good[2])};
    DevBuf db[3] = {DevBuf::from(bad[0]), DevBuf::from(bad[1]), DevBuf::from(bad[2])};
    auto with_params = [&](GpuCall& g, DevBuf* p) {
      g.args.activation.alpha = dview(p[0], DType::F32, {c.E_loc});
      g.args.activation.beta = dview(p[1], DType::F32, {c.E_loc});
      g.args.activation.clamp_limit = dview(p[2], DType::F32, {c.E_loc});
    };
    auto call = make_gpu_call(c, in, *layer);
    with_params(*call, db);
    const auto y = run_gpu(layer->gpu, *call);
    EXPECT_EQ(count_poison(y), 0) << "every output element is written";
    try {
      check_device_errors(0);
      ADD_FAILURE() << "expected DeviceFault";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::DeviceFault) << e.what();
      EXPECT_EQ(e.argument(), sub.argument) << e.what();
    }
    EXPECT_NO_THROW(check_device_errors(0)) << "the flag is cleared once reported";
    // Tokens not routed to the bad expert: bit for bit a clean call's.
    auto clean = make_gpu_call(c, in, *layer);
    with_params(*clean, dg);
    const auto y_clean = run_gpu(layer->gpu, *clean);
    EXPECT_NO_THROW(check_device_errors(0)) << "a clean call leaves the flag clear";
    std::vector<int64_t> all;
    for (int64_t t = 0; t < c.T; ++t) {
      all.push_back(t);
      bool hit = false;
      for (int64_t j = 0; j < in.k; ++j) hit |= in.ids[t * in.k + j] == kBad;
      if (!hit) EXPECT_TRUE(std::equal(y.begin() + t * in.H, y.begin() + (t + 1) * in.H, y_clean.begin() + t * in.H)) << t;
    }
    // Every token: the reference with the bad expert's slots weighted 0 (dropped).
    Inputs dropped = in;
    for (size_t i = 0; i < dropped.ids.size(); ++i)
      if (dropped.ids[i] == kBad) dropped.weights[i] = 0.f;
    layer->L.alpha = good[0];
    layer->L.beta = good[1];
    layer->L.clamp = good[2];
    const auto ref = run_reference(c, dropped, *layer, all, Precision::Fp64);
    EXPECT_LE(compare(y, ref, all, in.H).rel_l2, kRelL2A16);
  }
}

// The routing bias lives on the GPU only: a value that is not finite raises the flag naming routing.bias; the
// experts chosen stay in range, so every output element is still written and nothing is read out of bounds.
TEST(GpuDeviceErrors, NonFiniteRoutingBiasSetsFlag) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Case c;
  c.shape = model("deepseek_v3_ep8");
  c.E_loc = c.E_total = 16;  // 8 groups of 2
  c.T = 12;
  auto layer = make_layer(c);
  Inputs in = make_inputs(c);
  check_device_errors(0);
  for (const float v : {NAN, INFINITY, -INFINITY}) {
    Inputs bad = in;
    bad.bias[5] = v;
    auto call = make_gpu_call(c, bad, *layer);
    const auto y = run_gpu(layer->gpu, *call);
    EXPECT_EQ(count_poison(y), 0);
    try {
      check_device_errors(0);
      ADD_FAILURE() << "expected DeviceFault for bias " << v;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::DeviceFault) << e.what();
      EXPECT_EQ(e.argument(), "routing.bias") << e.what();
    }
  }
  auto ok = make_gpu_call(c, in, *layer);
  run_gpu(layer->gpu, *ok);
  EXPECT_NO_THROW(check_device_errors(0));
}

// ---- the permutation's three forms against a stable counting sort on the CPU ------------------------
// Each expert's rows in (token, slot) order, the expert offsets and the tile list, exactly, from the three kernels
// and from one block of 32 warps (PermuteParams::mid); ids of other ranks skipped, out-of-range ids raise the flag.
TEST(GpuPermute, FormsEqualStableSort) {
  FP4MOE_SKIP_WITHOUT_GPU();
  struct Shape { int rows, E_loc, E_total, offset, bm; bool bad; };
  const Shape shapes[] = {{1500, 128, 128, 0, 128, false}, {16384, 512, 512, 0, 64, false},
                          {5000, 32, 256, 64, 16, true},   {3001, 384, 384, 0, 32, true},
                          {600, 128, 128, 0, 64, true}};
  std::mt19937 rng(7);
  for (const Shape& sh : shapes) {
    std::vector<int32_t> ids(sh.rows);
    std::uniform_int_distribution<int32_t> pick(0, sh.E_total - 1);
    for (auto& v : ids) v = pick(rng);
    if (sh.bad) ids[17] = -3, ids[sh.rows - 2] = sh.E_total + 5;
    // The CPU's stable counting sort.
    std::vector<int> count(sh.E_loc, 0), offs(sh.E_loc + 1, 0), next(sh.E_loc, 0);
    for (int32_t id : ids)
      if (id >= sh.offset && id < sh.offset + sh.E_loc) ++count[id - sh.offset];
    for (int e = 0; e < sh.E_loc; ++e) offs[e + 1] = offs[e] + count[e];
    std::vector<int32_t> want_rows(offs[sh.E_loc]);
    for (int i = 0; i < sh.rows; ++i)
      if (ids[i] >= sh.offset && ids[i] < sh.offset + sh.E_loc) {
        const int e = ids[i] - sh.offset;
        want_rows[offs[e] + next[e]++] = i;
      }
    std::vector<int32_t> want_tiles;
    for (int e = 0; e < sh.E_loc; ++e)
      for (int r = 0; r < count[e]; r += sh.bm) want_tiles.push_back(e), want_tiles.push_back(offs[e] + r);
    const int max_tiles = sh.rows / sh.bm + sh.E_loc;
    const int per_block = 256, blocks = (sh.rows + per_block - 1) / per_block;

    DevBuf ids_d = DevBuf::from(ids), counts(static_cast<size_t>(blocks) * sh.E_loc * 4), offs_d((sh.E_loc + 1) * 4),
           tiles((2 * max_tiles + 1) * 4), rows_d(sh.rows * 4), zero_d(64 * 4), flag_d(4);
    for (const bool mid : {false, true}) {
      rows_d.fill_byte(0xff);
      tiles.fill_byte(0xff);
      zero_d.fill_byte(0x11);
      flag_d.fill_byte(0);
      cuda_backend::PermuteParams pp;
      pp.ids = ids_d.as<int32_t>();
      pp.rows = sh.rows;
      pp.E_total = sh.E_total;
      pp.E_loc = sh.E_loc;
      pp.local_offset = sh.offset;
      pp.entries_per_block = per_block;
      pp.num_blocks = blocks;
      pp.mid = mid;
      pp.bm = sh.bm;
      pp.max_tiles = max_tiles;
      pp.block_counts = counts.as<int32_t>();
      pp.expert_offsets = offs_d.as<int32_t>();
      pp.tile_info = tiles.as<int32_t>();
      pp.row_entry = rows_d.as<int32_t>();
      pp.error_flag = flag_d.as<int>();
      pp.zero_counters = zero_d.as<int32_t>();
      pp.num_counters = mid ? 64 : 0;
      cuda_backend::launch_permute(pp, nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      const auto got_offs = offs_d.download<int32_t>();
      auto got_tiles = tiles.download<int32_t>();
      const auto got_rows = rows_d.download<int32_t>(want_rows.size());
      const auto zero = zero_d.download<int32_t>();
      const int flag = flag_d.download<int>()[0];
      const std::string what = std::string(mid ? "one block of 32 warps" : "three kernels") + ", rows " +
                               std::to_string(sh.rows) + ", E_loc " + std::to_string(sh.E_loc);
      EXPECT_EQ(got_offs, offs) << what;
      EXPECT_EQ(got_rows, want_rows) << what;
      EXPECT_EQ(got_tiles[2 * max_tiles], static_cast<int>(want_tiles.size() / 2)) << what;
      got_tiles.resize(want_tiles.size());
      EXPECT_EQ(got_tiles, want_tiles) << what;
      EXPECT_EQ(flag != 0, sh.bad) << what;
      if (mid) EXPECT_EQ(std::count(zero.begin(), zero.end(), 0), 64) << what << ": the split-K counters";
    }
  }
}

// ---- workspace: too small is refused (naming it), a given one equals the internal one ---------------
TEST(GpuWorkspace, GivenWorkspace) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Case c;
  c.shape = model("gpt_oss_120b");
  c.E_loc = c.E_total = 8;
  c.T = 33;
  auto layer = make_layer(c);
  Inputs in = make_inputs(c);
  auto call = make_gpu_call(c, in, *layer);
  const auto y = run_gpu(layer->gpu, *call);
  const size_t need = workspace_size(problem_shape(c));
  DevBuf small(need - 256), exact(need);
  call->args.workspace = dview(small, DType::U8, {static_cast<int64_t>(small.bytes())});
  try {
    moe_run(layer->gpu, call->args);
    ADD_FAILURE() << "expected a refusal";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "workspace") << e.what();
  }
  call->args.workspace = dview(exact, DType::U8, {static_cast<int64_t>(exact.bytes())});
  EXPECT_EQ(run_gpu(layer->gpu, *call), y);
}

// ---- timings of kimi_k3_tp8 (E=384) ------------------------------------------------------------------------
TEST(GpuPerf, KimiTimings) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Case c;
  c.shape = model("kimi_k3_tp8");
  c.E_loc = c.E_total = 384;
  c.T = 4096;
  auto layer = std::make_unique<Layer>();
  layer->L = make_synthetic_layer(c.shape, c.E_loc, 9, c.format);
  layer->gpu = prepare_weights(layer->L.desc(), Backend::CUDA, 0);
  layer->alpha = DevBuf::from(layer->L.alpha);
  layer->beta = DevBuf::from(layer->L.beta);
  for (int64_t T : {1, 64, 4096}) {
    c.T = T;
    Inputs in = make_inputs(c);
    auto call = make_gpu_call(c, in, *layer);
    cudaStream_t s;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    ProblemShape ps;
    ps.T = T; ps.H = 3584; ps.I = 384; ps.E_loc = 384; ps.k = 8; ps.activation = c.shape.activation;
    DevBuf ws(workspace_size(ps));
    call->args.workspace = dview(ws, DType::U8, {static_cast<int64_t>(ws.bytes())});
    call->args.stream = s;
    for (int i = 0; i < 3; ++i) moe_run(layer->gpu, call->args);
    sync_with_watchdog(s);
    cudaEvent_t a, b;
    CUDA_OK(cudaEventCreate(&a));
    CUDA_OK(cudaEventCreate(&b));
    const int iters = T >= 4096 ? 10 : 50;
    CUDA_OK(cudaEventRecord(a, s));
    for (int i = 0; i < iters; ++i) moe_run(layer->gpu, call->args);
    CUDA_OK(cudaEventRecord(b, s));
    sync_with_watchdog(s);
    float ms = 0;
    CUDA_OK(cudaEventElapsedTime(&ms, a, b));
    const double per = ms / iters;
    const double flops = 2.0 * T * 8 * (3.0 * 3584 * 384);
    std::printf("STAT perf kimi_k3_tp8 E=384 T=%-5lld %.3f ms/call  %.1f TFLOP/s\n", static_cast<long long>(T), per,
                flops / (per * 1e-3) / 1e12);
    CUDA_OK(cudaEventDestroy(a));
    CUDA_OK(cudaEventDestroy(b));
    CUDA_OK(cudaStreamDestroy(s));
  }
}

}  // namespace
}  // namespace fp4moe::gputest
