// GPU tests of the sigmoid-gated shared expert (SPEC §3.3, shared_expert_gate): the combine's gate has the CPU
// reference's bits. On a layer whose every GEMM product and sum is exact in fp32 (x in {-1, 0, 1}, NVFP4 codes with
// unit scales or bf16 weights in {-1, 0, 1}, Relu, dyadic routing weights, LoRA of entries in {0, +-1/8}), the whole
// output is the reference's bit for bit whatever the K order, so any difference is the gate's (its logit order or its
// sigmoid); the gate vector spans many exponents, so another summation order would show. Also: chunks and CUDA-graph
// replays, a non-finite gate on the GPU (flag, shared term dropped), gates refused on the host, and the
// qwen3_next_80b_a3b shape against the fp64 reference. Each test skips with "no CUDA device" when there is none.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "gpu_harness.h"

namespace fp4moe::gputest {
namespace {

// H 256, I 64, 8 experts top-2, shared I 64, Relu (non-gated): |h| <= 256 * 6 in steps of 1/2, |o| < 2^20 in steps
// of 2^-9 at worst: every sum exact in fp32.
constexpr ModelShape kExact{"gate_exact", 256, 64, 8, 2, RoutingMethod::Renormalize, 1, 1, 1.f, ActivationType::Relu,
                            1.f, 0.f, 0.f, 8, 64, true};

// Unit block and global scales (NVFP4: values e2m1 in [-6, 6]) or weights in {-1, 0, 1} (bf16).
void make_exact(SyntheticLayer& l, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::fill(l.w1_sf.begin(), l.w1_sf.end(), uint8_t(0x38));  // e4m3 1.0
  std::fill(l.w2_sf.begin(), l.w2_sf.end(), uint8_t(0x38));
  std::fill(l.w1_s2.begin(), l.w1_s2.end(), 1.f);
  std::fill(l.w2_s2.begin(), l.w2_s2.end(), 1.f);
  const uint16_t unit[3] = {0xbf80, 0x0000, 0x3f80};
  for (auto* v : {&l.w1_bf16, &l.w2_bf16})
    for (uint16_t& b : *v) b = unit[rng() % 3];
  l.bias1.clear();
  l.bias2.clear();
}

struct ExactLayer {
  SyntheticLayer L, S;
  MoeWeights cpu, gpu, scpu, sgpu;
  ExactLayer(WeightFormat fmt, uint64_t seed) {
    L = make_synthetic_layer(kExact, kExact.E_loc, seed, fmt);
    S = make_synthetic_shared_expert(kExact, kExact.shared_I, seed + 1, fmt);
    make_exact(L, seed + 2);
    make_exact(S, seed + 3);
    cpu = prepare_weights(L.desc(), Backend::CPU);
    gpu = prepare_weights(L.desc(), Backend::CUDA, 0);
    scpu = prepare_weights(S.desc(), Backend::CPU);
    sgpu = prepare_weights(S.desc(), Backend::CUDA, 0);
  }
};

// Host inputs: x in {-1, 0, 1}; two distinct experts a token with weights in {1/4, 1/2, 3/4}; the gate with
// magnitudes 2^-10 .. 1, so its logit's rounding depends on the order of the sum.
struct ExactInputs {
  int64_t T;
  std::vector<uint16_t> x, gate;
  std::vector<int32_t> ids;
  std::vector<float> wts;
  ExactInputs(int64_t T_, uint64_t seed) : T(T_) {
    std::mt19937_64 rng(seed);
    const int64_t H = kExact.H;
    const uint16_t unit[3] = {0xbf80, 0x0000, 0x3f80};
    for (int64_t i = 0; i < T * H; ++i) x.push_back(unit[rng() % 3]);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    std::uniform_int_distribution<int> ex(-10, 0);
    for (int64_t h = 0; h < H; ++h) gate.push_back(f32_to_bf16_bits(std::ldexp(u(rng), ex(rng)) * 0.5f));
    for (int64_t t = 0; t < T; ++t) {
      const int32_t e0 = static_cast<int32_t>(rng() % 8), e1 = static_cast<int32_t>((e0 + 1 + rng() % 7) % 8);
      ids.insert(ids.end(), {e0, e1});
      wts.insert(wts.end(), {0.25f * static_cast<float>(1 + rng() % 3), 0.25f * static_cast<float>(1 + rng() % 3)});
    }
  }
};

// A PEFT-fused adapter on the gate_up projection of the routed experts and of the shared expert, entries in
// {0, +-1/8}, scale 1: every shrink and expand sum is exact too (the down projection is absent: its delta is +0).
struct ExactAdapter {
  std::vector<uint16_t> a, b, sa, sb;
  LoraAdapterDesc desc;
  explicit ExactAdapter(uint64_t seed) {
    std::mt19937_64 rng(seed);
    const uint16_t eighth[3] = {0xbe00, 0x0000, 0x3e00};
    const int64_t r = 8, E = kExact.E_loc, H = kExact.H, I = kExact.I, sI = kExact.shared_I;
    auto fill = [&](std::vector<uint16_t>& v, int64_t n) {
      for (int64_t i = 0; i < n; ++i) v.push_back(eighth[rng() % 3]);
      return v.data();
    };
    desc.layout = LoraLayout::PeftFused;
    desc.rank = r;
    desc.lora_alpha = static_cast<float>(r);
    desc.a_gate_up = make_view(fill(a, E * r * H), DType::BF16, {E, r, H});
    desc.b_gate_up = make_view(fill(b, E * I * r), DType::BF16, {E, I, r});
    desc.shared_a_gate_up = make_view(fill(sa, r * H), DType::BF16, {r, H});
    desc.shared_b_gate_up = make_view(fill(sb, sI * r), DType::BF16, {sI, r});
  }
};

enum class Shared { Gated, Plain, None };  // the shared expert with its gate, with weight 1, or none

// y (f32 or bf16 bytes) of one call on `backend`, with the registry and ids when given.
std::vector<uint8_t> run_exact(const ExactLayer& l, const ExactInputs& in, Backend backend, DType y_dtype,
                               Shared shared = Shared::Gated, const AdapterRegistry* reg = nullptr,
                               const std::vector<int32_t>* aids = nullptr, int64_t budget = 0) {
  const int64_t T = in.T, H = kExact.H, k = kExact.k;
  const bool gpu = backend == Backend::CUDA;
  const size_t ybytes = static_cast<size_t>(T * H) * dtype_size(y_dtype);
  std::vector<uint8_t> y(ybytes, 0xff);
  std::vector<DevBuf> keep;
  auto view = [&](const auto& v, DType t, std::initializer_list<int64_t> s) {
    if (!gpu) return make_view(const_cast<void*>(static_cast<const void*>(v.data())), t, s);
    keep.push_back(DevBuf::from(v));
    return dview(keep.back(), t, s);
  };
  MoeArgs a;
  a.x = view(in.x, DType::BF16, {T, H});
  a.routing.method = kExact.routing;
  a.routing.top_k = k;
  a.routing.topk_ids = view(in.ids, DType::I32, {T, k});
  a.routing.topk_weights = view(in.wts, DType::F32, {T, k});
  a.activation.type = kExact.activation;
  if (shared != Shared::None) a.shared_expert = gpu ? &l.sgpu : &l.scpu;
  if (shared == Shared::Gated) a.shared_expert_gate = view(in.gate, DType::BF16, {1, H});
  if (reg) {
    a.adapters = reg;
    a.adapter_ids = view(*aids, DType::I32, {T});
  }
  a.workspace_budget = budget;
  DevBuf yd(gpu ? ybytes : 0);
  if (gpu) yd.fill_byte(0xff);
  a.y = gpu ? dview(yd, y_dtype, {T, H}) : make_view(y.data(), y_dtype, {T, H});
  a.num_threads = 2;
  moe_run(gpu ? l.gpu : l.cpu, a);
  if (gpu) {
    sync_with_watchdog(nullptr);
    y = yd.download<uint8_t>();
  }
  return y;
}

// The inputs of an exact call on the device and its arguments (bf16 y [T, H], the gate [H] on the device).
struct DeviceCall {
  int64_t T;
  DevBuf x, ids, wts, g, y;
  explicit DeviceCall(const ExactInputs& in)
      : T(in.T), x(DevBuf::from(in.x)), ids(DevBuf::from(in.ids)), wts(DevBuf::from(in.wts)), g(DevBuf::from(in.gate)),
        y(static_cast<size_t>(in.T * kExact.H * 2)) {}
  MoeArgs args(const ExactLayer& l) {
    const int64_t H = kExact.H, k = kExact.k;
    MoeArgs a;
    a.x = dview(x, DType::BF16, {T, H});
    a.routing.method = kExact.routing;
    a.routing.top_k = k;
    a.routing.topk_ids = dview(ids, DType::I32, {T, k});
    a.routing.topk_weights = dview(wts, DType::F32, {T, k});
    a.activation.type = kExact.activation;
    a.shared_expert = &l.sgpu;
    a.shared_expert_gate = dview(g, DType::BF16, {H});
    a.y = dview(y, DType::BF16, {T, H});
    return a;
  }
};

TEST(GpuSharedGate, BitEqualToReferenceOnExactLayer) {
  FP4MOE_SKIP_WITHOUT_GPU();
  for (WeightFormat fmt : {WeightFormat::NVFP4, WeightFormat::BF16}) {
    SCOPED_TRACE(fmt == WeightFormat::NVFP4 ? "nvfp4" : "bf16");
    const ExactLayer l(fmt, 11);
    const ExactInputs in(64, 12);
    for (DType yt : {DType::F32, DType::BF16}) {
      const auto want = run_exact(l, in, Backend::CPU, yt), got = run_exact(l, in, Backend::CUDA, yt);
      EXPECT_EQ(got, want) << "y " << to_string(yt);
    }
    // The layer is exact: without the gate the two agree as well, and the gate changes the output.
    const auto plain = run_exact(l, in, Backend::CUDA, DType::F32, Shared::Plain);
    EXPECT_EQ(plain, run_exact(l, in, Backend::CPU, DType::F32, Shared::Plain));
    EXPECT_NE(plain, run_exact(l, in, Backend::CUDA, DType::F32));
    EXPECT_NO_THROW(check_device_errors(0));
  }
}

TEST(GpuSharedGate, BitEqualToReferenceWithLora) {
  FP4MOE_SKIP_WITHOUT_GPU();
  const ExactLayer l(WeightFormat::NVFP4, 21);
  const ExactInputs in(40, 22);
  ExactAdapter ad(23);
  AdapterRegistry rc(l.cpu, 2, &l.scpu), rg(l.gpu, 2, &l.sgpu);
  rc.load(1, ad.desc);
  rg.load(1, ad.desc);
  std::vector<int32_t> aids;
  for (int64_t t = 0; t < in.T; ++t) aids.push_back(t % 3 == 0 ? -1 : 1);
  const auto want = run_exact(l, in, Backend::CPU, DType::F32, Shared::Gated, &rc, &aids);
  EXPECT_EQ(run_exact(l, in, Backend::CUDA, DType::F32, Shared::Gated, &rg, &aids), want);
  EXPECT_NE(want, run_exact(l, in, Backend::CPU, DType::F32)) << "the adapter must change the output";
  EXPECT_NO_THROW(check_device_errors(0));
}

TEST(GpuSharedGate, ChunksAndGraphReplaysChangeNoBit) {
  FP4MOE_SKIP_WITHOUT_GPU();
  const ExactLayer l(WeightFormat::NVFP4, 31);
  const ExactInputs in(50, 32);
  const auto whole = run_exact(l, in, Backend::CUDA, DType::BF16);
  EXPECT_EQ(run_exact(l, in, Backend::CUDA, DType::BF16, Shared::Gated, nullptr, nullptr, 64 << 10), whole)
      << "in chunks";
  // A graph captured once and replayed: the gate's loads and sums are in the graph, no host step.
  DeviceCall dc(in);
  MoeArgs a = dc.args(l);
  DevBuf ws(workspace_size(l.gpu, a));
  a.workspace = dview(ws, DType::U8, {static_cast<int64_t>(ws.bytes())});
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  a.stream = s;
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  moe_run(l.gpu, a);
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 3; ++rep) {
    dc.y.fill_byte(0xff);
    CUDA_OK(cudaGraphLaunch(exec, s));
    sync_with_watchdog(s);
    const auto bits = dc.y.download<uint8_t>();
    EXPECT_EQ(bits, whole) << "replay " << rep;
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(s));
}

TEST(GpuSharedGate, NonFiniteGateOnTheGpuDropsTheSharedTermAndSetsTheFlag) {
  FP4MOE_SKIP_WITHOUT_GPU();
  const ExactLayer l(WeightFormat::NVFP4, 41);
  ExactInputs in(24, 42);
  check_device_errors(0);  // clean start
  const auto with_gate = run_exact(l, in, Backend::CUDA, DType::F32);
  EXPECT_NO_THROW(check_device_errors(0));
  const auto routed = run_exact(l, in, Backend::CPU, DType::F32, Shared::None);  // the layer is exact: the GPU's bits
  for (uint16_t bad : {uint16_t(0x7fc0), uint16_t(0x7f80), uint16_t(0xff80)}) {
    in.gate[100] = bad;
    const auto got = run_exact(l, in, Backend::CUDA, DType::F32);
    EXPECT_NE(got, with_gate);
    EXPECT_EQ(got, routed) << "every token is its routed sum alone: the shared expert's term dropped";
    expect_device_fault("shared_expert_gate");
  }
}

TEST(GpuSharedGate, BadGatesAreRefusedOnTheHostNamingIt) {
  FP4MOE_SKIP_WITHOUT_GPU();
  const ExactLayer l(WeightFormat::NVFP4, 51);
  const ExactInputs in(4, 52);
  const int64_t T = in.T, H = kExact.H;
  DeviceCall dc(in);
  dc.y.fill_byte(0xff);
  std::vector<uint16_t> host_gate = in.gate;
  auto call = [&](const std::function<void(MoeArgs&)>& edit) {
    MoeArgs a = dc.args(l);
    edit(a);
    try {
      moe_run(l.gpu, a);
      ADD_FAILURE() << "expected an error naming shared_expert_gate";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "shared_expert_gate") << e.what();
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument) << e.what();
    }
  };
  call([&](MoeArgs& a) { a.shared_expert_gate = make_view(host_gate.data(), DType::BF16, {1, H}); });  // on the host
  call([&](MoeArgs& a) { a.shared_expert = nullptr; });
  call([&](MoeArgs& a) { a.shared_expert_gate = dview(dc.g, DType::F32, {1, H / 2}); });
  call([&](MoeArgs& a) { a.shared_expert_gate = dview(dc.g, DType::BF16, {2, H / 2}); });
  EXPECT_EQ(count_poison(dc.y.download<uint16_t>()), T * H) << "y untouched";
}

TEST(GpuSharedGate, Qwen3NextShapeMatchesFp64Reference) {
  FP4MOE_SKIP_WITHOUT_GPU();
  // qwen3_next_80b_a3b with its H, I, k and shared I; experts reduced 512 -> 64.
  Case c;
  c.shape = model("qwen3_next_80b_a3b");
  c.E_loc = c.E_total = 64;
  c.T = 48;
  c.shared = true;
  c.shared_I = c.shape.shared_I;
  auto layer = make_layer(c);
  const Inputs in = make_inputs(c);
  const std::vector<uint16_t> gate = random_bf16(c.shape.H, 61, 0.05f);
  auto call = make_gpu_call(c, in, *layer);
  DevBuf g = DevBuf::from(gate);
  call->args.shared_expert_gate = dview(g, DType::BF16, {c.shape.H});
  const auto y = run_gpu(layer->gpu, *call);
  // The fp64 reference of every token, with the same gate.
  MoeArgs a = base_args(c, in);
  std::vector<uint16_t> x = in.x, gh = gate;
  std::vector<float> logits = in.logits;
  std::vector<double> ref(static_cast<size_t>(c.T * in.H));
  a.x = make_view(x.data(), DType::BF16, {c.T, in.H});
  a.routing.logits = make_view(logits.data(), DType::F32, {c.T, in.E_total});
  a.shared_expert = &layer->scpu;
  a.shared_expert_gate = make_view(gh.data(), DType::BF16, {c.shape.H});
  a.precision = Precision::Fp64;
  a.y = make_view(ref.data(), DType::F64, {c.T, in.H});
  moe_run(layer->cpu, a);
  std::vector<int64_t> all;
  for (int64_t t = 0; t < c.T; ++t) all.push_back(t);
  const Errors e = compare(y, ref, all, in.H);
  EXPECT_EQ(e.nonfinite, 0);
  EXPECT_LE(e.rel_l2, 1e-2);
  // Without the gate the output moves well beyond that.
  auto plain = make_gpu_call(c, in, *layer);
  EXPECT_GT(compare(run_gpu(layer->gpu, *plain), ref, all, in.H).rel_l2, 5e-2);
}

}  // namespace
}  // namespace fp4moe::gputest
