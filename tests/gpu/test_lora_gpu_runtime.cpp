// Multi-LoRA in the CUDA MoE pipeline around the numbers: adapter ids that live only on the GPU (out of range or
// naming an empty slot) are dropped to base and flagged; a given workspace sized with has_lora, and chunks; CUDA
// graph capture and replay; 64 resident adapters with loads racing the operator; a failing CUDA call and exhausted
// device memory. Each test skips without a GPU. Lines starting with "STAT" are collected by tools/device/.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "cuda/kernels.h"
#include "gpu_harness.h"
#include "lora_harness.h"
#include "runtime/plan.h"

namespace fp4moe::gputest {
namespace {


// ---- adapter ids only on the GPU: out of range or naming an empty slot -> dropped to base and flagged -------
TEST(GpuLoraDeviceErrors, BadAdapterIdsSetFlag) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Case c;
  c.shape = model("qwen3_30b_a3b_tp4");
  c.E_loc = c.E_total = 16;
  c.T = 20;
  c.shared = true;
  c.shared_I = 192;
  auto layer = make_layer(c);
  Registries R(*layer, 4);
  R.load(0, *layer, {LoraLayout::PeftFused, 8, false, true, 401});
  R.load(1, *layer, {LoraLayout::SharedOuter, 16, false, true, 402});
  Inputs in = make_inputs(c);
  LoraCall call{make_gpu_call(c, in, *layer), DevBuf()};
  check_device_errors(0);  // clean start
  std::vector<int32_t> good = cycle_ids(c.T, 2), bad = good;
  bad[3] = 999;
  bad[7] = -7;
  bad[11] = 2;   // empty slot
  bad[15] = 4;   // == num_slots
  for (int64_t t : {3, 7, 11, 15}) good[t] = -1;
  const std::vector<uint16_t> y_bad = call.run(*layer, R.gpu.get(), bad);
  EXPECT_EQ(count_poison(y_bad), 0);
  try {
    check_device_errors(0);
    ADD_FAILURE() << "expected DeviceFault";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::DeviceFault) << e.what();
    EXPECT_EQ(e.argument(), "adapter_ids") << e.what();
  }
  EXPECT_NO_THROW(check_device_errors(0)) << "the flag is cleared once reported";
  // Dropped tokens run as base; every other token is unaffected.
  EXPECT_EQ(call.run(*layer, R.gpu.get(), good), y_bad);
  EXPECT_NO_THROW(check_device_errors(0)) << "a clean call leaves the flag clear";
}

// ---- a given workspace must be sized with has_lora; many tokens run in chunks with LoRA ------------------------
TEST(GpuLoraWorkspace, GivenWorkspaceAndChunks) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Case c;
  c.shape = model("kimi_k3_tp8");
  c.E_loc = c.E_total = 16;
  c.T = 9000;
  c.check_tokens = 8;
  c.seed = 61;
  c.workspace_budget = int64_t(512) << 20;  // three chunks of 3000 tokens
  auto layer = make_layer(c);
  Registries R(*layer, 4);
  R.load(0, *layer, {LoraLayout::PeftFused, 16, false, false, 601});
  R.load(1, *layer, {LoraLayout::PerExpert, 8, false, false, 602});
  R.load(2, *layer, {LoraLayout::SharedOuter, 16, false, false, 603});
  ProblemShape ps = problem_shape(c);
  const size_t no_lora = workspace_size(ps);
  ps.has_lora = true;  // max_lora_rank 0: sized for rank 64
  const size_t with_lora = workspace_size(ps);
  ASSERT_GT(with_lora, no_lora);
  EXPECT_GT(make_plan(ps).num_chunks, 1);
  check_against_reference(c, *layer, R, cycle_ids(c.T, 3), "kimi chunked T=9000");

  Inputs in = make_inputs(c);
  LoraCall call{make_gpu_call(c, in, *layer), DevBuf()};
  const std::vector<int32_t> ids = cycle_ids(c.T, 3);
  const std::vector<uint16_t> y = call.run(*layer, R.gpu.get(), ids);
  DevBuf small(no_lora), big(with_lora);
  call.g->args.workspace = dview(small, DType::U8, {static_cast<int64_t>(small.bytes())});
  try {
    call.run(*layer, R.gpu.get(), ids);
    ADD_FAILURE() << "a workspace sized without LoRA was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "workspace") << e.what();
  }
  call.g->args.workspace = dview(big, DType::U8, {static_cast<int64_t>(big.bytes())});
  EXPECT_EQ(call.run(*layer, R.gpu.get(), ids), y) << "given workspace differs from the internal one";
  call.g->args.workspace = TensorView{};
  // One chunk (the default budget): ~4500 rows an expert, ordered by adapter in three segments (permute.cu).
  ps.workspace_budget = 0;
  EXPECT_EQ(make_plan(ps).num_chunks, 1);
  call.g->args.workspace_budget = 0;
  EXPECT_EQ(call.run(*layer, R.gpu.get(), ids), y) << "one chunk differs from three";
}

// ---- CUDA graphs: capture after a warm call, and the first call after a load captured directly -----------------
TEST(GpuLoraGraphs, CaptureAndReplay) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Case c;
  c.shape = model("qwen3_30b_a3b");
  c.E_loc = c.E_total = 16;
  c.T = 33;
  c.shared = true;
  c.shared_I = 256;
  auto layer = make_layer(c);
  Registries R(*layer, 4);
  R.load(0, *layer, {LoraLayout::PerExpert, 16, false, true, 501});
  R.load(1, *layer, {LoraLayout::SharedOuter, 8, false, true, 502});
  Inputs in = make_inputs(c);
  LoraCall call{make_gpu_call(c, in, *layer), DevBuf()};
  const std::vector<int32_t> ids = cycle_ids(c.T, 3);  // slot 2 loaded below
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  // Captures one call on s (the call's arguments as set); null when the capture failed (recorded).
  auto capture = [&](const char* what) -> cudaGraphExec_t {
    call.g->args.stream = s;
    cudaGraph_t graph = nullptr;
    EXPECT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess) << what;
    std::string err;
    try {
      moe_run(layer->gpu, call.g->args);
    } catch (const Error& e) {
      err = e.what();
    }
    const cudaError_t end = cudaStreamEndCapture(s, &graph);
    EXPECT_TRUE(err.empty()) << what << ": moe_run failed under capture: " << err;
    EXPECT_EQ(end, cudaSuccess) << what << ": " << cudaGetErrorString(end);
    if (!err.empty() || end != cudaSuccess || !graph) {
      (void)cudaGetLastError();
      return nullptr;
    }
    cudaGraphExec_t exec = nullptr;
    EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess) << what;
    (void)cudaGraphDestroy(graph);
    return exec;
  };
  auto replay = [&](cudaGraphExec_t exec, const std::vector<uint16_t>& expect, const char* what) {
    for (int rep = 0; rep < 2; ++rep) {
      call.g->y.fill_byte(0xff);
      ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess) << what;
      sync_with_watchdog(s);
      EXPECT_EQ(call.g->y.download<uint16_t>(), expect) << what << ": replay " << rep;
    }
  };

  // 1. After a warm call (the snapshot's slot table is cached: nothing but launches in the capture).
  const std::vector<uint16_t> y1 = call.run(*layer, R.gpu.get(), ids, s);
  if (cudaGraphExec_t exec = capture("warm snapshot")) {
    replay(exec, y1, "warm snapshot");
    CUDA_OK(cudaGraphExecDestroy(exec));
  }
  // Slot 2 is still empty here, so the tokens that name it ran as base and raised the flag (SPEC §6).
  EXPECT_THROW(check_device_errors(0), Error) << "tokens naming the empty slot 2 must set the error flag";
  // 2. A load makes a new snapshot; the first call that sees it is captured (its slot table is uploaded
  //    during the capture), then replayed against a plain call.
  R.load(2, *layer, {LoraLayout::PeftFused, 32, false, false, 503});
  call.set(R.gpu.get(), ids);
  cudaGraphExec_t exec = capture("first call after a load");
  const std::vector<uint16_t> y2 = call.run(*layer, R.gpu.get(), ids, s);
  EXPECT_NE(y2, y1) << "the adapter loaded into slot 2 changed nothing";
  if (exec) {
    replay(exec, y2, "first call after a load");
    CUDA_OK(cudaGraphExecDestroy(exec));
  }
  EXPECT_NO_THROW(check_device_errors(0));
  CUDA_OK(cudaStreamDestroy(s));
}

// ---- 64 resident adapters at the full qwen3_30b_a3b layer, and load/unload racing the operator ---------------
// 64 adapters (mixed layouts, ranks 1..64) stay resident; one batch names every one of them and is checked
// against the reference. Then one thread loads and unloads two other slots over and over while this thread
// runs the operator on a non-blocking stream: every output must equal the first bit for bit (SPEC §5:
// a running batch holds its snapshot), and nothing may crash.
TEST(GpuLoraResident, SixtyFourAdaptersAndConcurrentLoads) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Case c;
  c.shape = model("qwen3_30b_a3b");
  c.E_loc = c.E_total = c.shape.E;  // the full layer: 128 experts
  c.T = 192;
  c.check_tokens = 24;
  c.seed = 71;
  auto layer = make_layer(c);
  constexpr int kResident = 64, kSlots = kResident + 2;
  Registries R(*layer, kSlots);
  size_t free0 = 0, total = 0;
  CUDA_OK(cudaMemGetInfo(&free0, &total));
  const LoraLayout layouts[3] = {LoraLayout::PeftFused, LoraLayout::PerExpert, LoraLayout::SharedOuter};
  const int64_t ranks[6] = {16, 1, 64, 8, 32, 4};
  for (int i = 0; i < kResident; ++i)
    R.load(i, *layer, {layouts[i % 3], ranks[i % 6], false, false, static_cast<uint64_t>(700 + i)});
  size_t free1 = 0;
  CUDA_OK(cudaMemGetInfo(&free1, &total));
  std::printf("STAT lora resident: %d adapters on the GPU, %.1f MB of device memory\n", kResident,
              (static_cast<double>(free0) - static_cast<double>(free1)) / 1e6);
  std::vector<int32_t> ids(static_cast<size_t>(c.T));
  for (int64_t t = 0; t < c.T; ++t) ids[t] = t % 3 == 2 ? -1 : static_cast<int32_t>((t * 7) % kResident);
  check_against_reference(c, *layer, R, ids, "qwen full E=128, 64 resident adapters");

  Inputs in = make_inputs(c);
  LoraCall call{make_gpu_call(c, in, *layer), DevBuf()};
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const std::vector<uint16_t> y0 = call.run(*layer, R.gpu.get(), ids, s);
  std::atomic<bool> stop{false};
  std::atomic<int> loads{0};
  std::string writer_error;
  // The writer owns its adapters' storage only for the duration of a load (the registry copies).
  std::thread writer([&] {
    try {
      for (uint64_t i = 0; !stop.load(); ++i) {
        const int slot = kResident + static_cast<int>(i % 2);
        R.gpu->load(slot, make_adapter(*layer, {layouts[i % 3], ranks[i % 6], false, false, 900 + i})->desc());
        R.gpu->unload(slot);
        loads.fetch_add(1);
      }
    } catch (const std::exception& e) {
      writer_error = e.what();
    }
  });
  int differing = 0, calls = 0;
  const auto t_end = std::chrono::steady_clock::now() + std::chrono::seconds(repeats(8, 2));
  while (std::chrono::steady_clock::now() < t_end || loads.load() < 4) {
    differing += call.run(*layer, R.gpu.get(), ids, s) != y0;
    ++calls;
    if (calls > 100000) break;
  }
  stop = true;
  writer.join();
  std::printf("STAT lora concurrent: %d calls while %d load+unload pairs ran in another thread, %d differing\n", calls,
              loads.load(), differing);
  EXPECT_TRUE(writer_error.empty()) << writer_error;
  EXPECT_GE(loads.load(), 4);
  EXPECT_EQ(differing, 0) << "a load/unload in another thread changed a running batch's output";
  EXPECT_NO_THROW(check_device_errors(0));
  CUDA_OK(cudaStreamDestroy(s));
}

// ---- faults: a failing CUDA call, exhausted device memory ---------------------------------------------
// Every checked CUDA call of a LoRA call (a fresh slot table each time: a reload of the same adapter before it) is
// made to fail in turn: the call reports CudaError, and afterwards the registry and the weights still give the
// clean call's bits.
TEST(GpuFaults, EveryCheckedCudaCallFailsInTurn) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Case c;
  c.shape = model("qwen3_30b_a3b_tp4");
  c.E_loc = c.E_total = 16;
  c.T = 48;
  c.shared = true;
  c.shared_I = 64;
  c.seed = 71;
  auto layer = make_layer(c);
  Registries R(*layer, 4);
  const AdapterSpec spec0{LoraLayout::PeftFused, 16, false, true, 711};
  R.load(0, *layer, spec0);
  R.load(1, *layer, {LoraLayout::SharedOuter, 8, false, false, 712});
  auto a0 = make_adapter(*layer, spec0);
  const std::vector<int32_t> ids = cycle_ids(c.T, 2);
  Inputs in = make_inputs(c);
  LoraCall call{make_gpu_call(c, in, *layer), DevBuf()};
  const std::vector<uint16_t> y0 = call.run(*layer, R.gpu.get(), ids);
  check_device_errors(0);
  int failures = 0, n = 0;
  for (;; ++n) {
    ASSERT_LT(n, 10000) << "the countdown never ran out";
    cuda_backend::fail_checked_cuda_call(n);
    bool threw = false;
    try {
      R.gpu->load(0, a0->desc());  // a new snapshot: the next call uploads its slot table
      call.run(*layer, R.gpu.get(), ids);
    } catch (const Error& e) {
      threw = true;
      EXPECT_EQ(e.code(), ErrorCode::CudaError) << e.what();
    }
    const bool pending = cuda_backend::checked_cuda_failure_pending();
    cuda_backend::fail_checked_cuda_call(-1);
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(threw, !pending) << "call " << n << ": an injected failure must be reported, and only then";
    if (!threw) break;  // n is past the last checked call of a load + call
    ++failures;
    EXPECT_TRUE(R.gpu->loaded(0) && R.gpu->loaded(1));
    EXPECT_EQ(call.run(*layer, R.gpu.get(), ids), y0) << "after a failure at checked call " << n;
    EXPECT_NO_THROW(check_device_errors(0));
  }
  EXPECT_GT(failures, 10);
  std::printf("GpuFaults: %d checked CUDA calls in a load + LoRA call, each failed once; all recovered\n", failures);
}

// Device memory exhausted by another allocation: a call whose workspace cannot be allocated reports OutOfMemory
// with y untouched, an adapter that cannot be uploaded leaves its slot as it was, and once memory is back the
// same call gives the same bits.
TEST(GpuFaults, DeviceMemoryExhausted) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Case c;
  c.shape = model("kimi_k3_tp8");
  c.E_loc = c.E_total = 32;
  c.T = 16384;  // ~1 GB of workspace
  c.check_tokens = 4;
  c.seed = 72;
  auto layer = make_layer(c);
  Registries R(*layer, 4);
  R.load(0, *layer, {LoraLayout::PerExpert, 16, false, false, 721});
  const std::vector<int32_t> ids = cycle_ids(c.T, 1);
  Inputs in = make_inputs(c);
  LoraCall call{make_gpu_call(c, in, *layer), DevBuf()};
  const std::vector<uint16_t> y0 = call.run(*layer, R.gpu.get(), ids);
  auto big = make_adapter(*layer, {LoraLayout::PerExpert, 64, false, false, 722});
  // Take all but ~24 MB of the device (the stream-ordered pool trimmed first, so it holds nothing in reserve).
  CUDA_OK(cudaDeviceSynchronize());
  cudaMemPool_t pool;
  CUDA_OK(cudaDeviceGetDefaultMemPool(&pool, 0));
  CUDA_OK(cudaMemPoolTrimTo(pool, 0));
  std::vector<void*> filler;
  // Allocates until at most `keep` bytes are free (in chunks down to 64 KB); returns the bytes left free.
  auto fill_to = [&](size_t keep) -> size_t {
    for (size_t chunk = size_t(1) << 32; chunk >= (size_t(1) << 16);) {
      size_t free_b = 0, total_b = 0;
      EXPECT_EQ(cudaMemGetInfo(&free_b, &total_b), cudaSuccess);
      if (free_b < keep + chunk) { chunk /= 2; continue; }
      void* p = nullptr;
      if (cudaMalloc(&p, chunk) != cudaSuccess) { (void)cudaGetLastError(); chunk /= 2; continue; }
      filler.push_back(p);
    }
    size_t free_b = 0, total_b = 0;
    EXPECT_EQ(cudaMemGetInfo(&free_b, &total_b), cudaSuccess);
    return free_b;
  };
  std::printf("STAT memory test: %.1f MB free for the call\n", fill_to(size_t(24) << 20) / 1e6);
  call.g->y.fill_byte(0xff);
  try {
    moe_run(layer->gpu, call.g->args);
    ADD_FAILURE() << "expected OutOfMemory";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::OutOfMemory) << e.what();
  }
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(count_poison(call.g->y.download<uint16_t>()), c.T * c.shape.H) << "y untouched";
  // The failed call may have returned memory of its own: the load gets at most 2 MB.
  std::printf("STAT memory test: %.1f MB free for the load\n", fill_to(size_t(2) << 20) / 1e6);
  try {
    R.gpu->load(2, big->desc());  // 32 experts x rank 64: ~60 MB of matrices
    ADD_FAILURE() << "expected OutOfMemory";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::OutOfMemory) << e.what();
  }
  EXPECT_FALSE(R.gpu->loaded(2)) << "a failed load leaves the slot as it was";
  for (void* p : filler) CUDA_OK(cudaFree(p));
  EXPECT_EQ(call.run(*layer, R.gpu.get(), ids), y0) << "the next call after memory came back";
  EXPECT_NO_THROW(check_device_errors(0));
}

}  // namespace
}  // namespace fp4moe::gputest
