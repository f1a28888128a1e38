// fp4moe command-line tool: demo (the built-in default layer), info (build information),
// check and bench (validation harness and benchmarks; see their issues), inspect (a checkpoint's MoE layers).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "fp4moe/fp4moe.h"
#include "fp4moe/synthetic.h"
#include "bench.h"
#include "check.h"
#ifdef FP4MOE_WITH_CUDA
#include <cuda_runtime.h>
#endif

using namespace fp4moe;

int run_inspect(int argc, char** argv);  // inspect.cpp

namespace {

void progress(const char* fmt, const std::string& s = "") {
  std::printf(fmt, s.c_str());
  std::fflush(stdout);
}

int usage() {
  std::puts(
      "usage: fp4moe <command> [options]\n"
      "  demo [--tokens N] [--experts N] [--cpu]   run the default layer (kimi_k3_tp8, SiTU, eight rank-16 adapters)\n"
      "                                             on the GPU when there is one, else on the CPU reference\n"
      "  info                                       build information\n"
      "  check [--help]                             validation harness: LoRA phases and invariants vs the CPU reference\n"
      "  bench [--help]                             benchmarks: time, bandwidth, TFLOP/s vs ceilings measured in the same run\n"
      "  inspect CHECKPOINT_DIR                     a checkpoint's MoE layers: formats, shapes, bytes, what would load");
  return 2;
}

struct Stats {
  double rel_l2 = 0, max_abs = 0, cosine = 0;
};

Stats compare(const std::vector<uint16_t>& got, const std::vector<uint16_t>& ref) {
  double num = 0, den = 0, dot = 0, ng = 0;
  Stats s;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = bf16_bits_to_f32(got[i]), r = bf16_bits_to_f32(ref[i]);
    num += (g - r) * (g - r);
    den += r * r;
    dot += g * r;
    ng += g * g;
    s.max_abs = std::max(s.max_abs, std::fabs(g - r));
  }
  s.rel_l2 = std::sqrt(num / std::max(den, 1e-30));
  s.cosine = dot / std::sqrt(std::max(ng * den, 1e-30));
  return s;
}

int demo(int argc, char** argv) {
  bool force_cpu = false;
  int64_t tokens = -1, experts = -1;
  for (int i = 0; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--cpu")) force_cpu = true;
    else if (!std::strcmp(argv[i], "--tokens") && i + 1 < argc) tokens = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--experts") && i + 1 < argc) experts = std::atoll(argv[++i]);
    else return usage();
  }
  const ModelShape& shape = *find_model_shape("kimi_k3_tp8");
  const bool gpu = !force_cpu && cuda_device_count() > 0;
  // The CPU reference decodes every touched expert: a reduced layer keeps the demo to seconds.
  if (experts <= 0) experts = gpu ? shape.E : 32;
  if (tokens < 0) tokens = gpu ? 64 : 8;
  const int64_t T = tokens, H = shape.H, k = shape.k, E = experts;
  std::printf("fp4moe demo: %s layer (H=%lld, I=%lld, k=%lld, %s routing, %s alpha=%g beta=%g)\n",
              std::string(shape.name).c_str(), (long long)H, (long long)shape.I, (long long)k, to_string(shape.routing),
              to_string(shape.activation), shape.alpha, shape.beta);
  std::printf("  backend: %s; %lld experts, %lld tokens, 8 rank-16 adapters (token t uses adapter t%%9-1, -1 = base)\n",
              gpu ? "CUDA" : "CPU reference", (long long)E, (long long)T);
  if (!gpu && E < shape.E)
    std::printf("  note: no GPU, so the CPU reference runs a reduced layer (%lld of %lld experts, %lld tokens) to end in seconds\n",
                (long long)E, (long long)shape.E, (long long)T);

  auto t0 = std::chrono::steady_clock::now();
  progress("  [1/4] synthetic NVFP4 weights ...");
  SyntheticLayer layer = make_synthetic_layer(shape, E, 1234);
  WeightsDesc desc = layer.desc();
  MoeWeights w_cpu = prepare_weights(desc, Backend::CPU);
  std::vector<SyntheticAdapter> adapters;
  AdapterRegistry reg_cpu(w_cpu, 64);
  for (int a = 0; a < 8; ++a) {
    adapters.push_back(make_synthetic_adapter(layer, 16, 100 + a));
    reg_cpu.load(a, adapters.back().desc());
  }
  progress(" done\n");

  std::vector<uint16_t> x = random_bf16(T * H, 7);
  std::vector<float> logits = random_f32(T * E, 8);
  std::vector<float> bias = random_f32(E, 9, 0.1f);
  std::vector<int32_t> ids(T);
  for (int64_t t = 0; t < T; ++t) ids[t] = static_cast<int32_t>(t % 9) - 1;

  auto make_args = [&](void* xp, void* lp, void* bp, void* ip, void* ap, void* bta, void* yp, Backend dev) {
    MoeArgs a;
    a.x = make_view(xp, DType::BF16, {T, H}, dev);
    a.routing.method = shape.routing;
    a.routing.top_k = k;
    a.routing.logits = make_view(lp, DType::F32, {T, E}, dev);
    a.routing.bias = make_view(bp, DType::F32, {E}, dev);
    a.routing.n_group = 1;
    a.routing.topk_group = 1;
    a.activation.type = shape.activation;
    a.activation.alpha = make_view(ap, DType::F32, {E}, dev);
    a.activation.beta = make_view(bta, DType::F32, {E}, dev);
    a.adapter_ids = make_view(ip, DType::I32, {T}, dev);
    a.y = make_view(yp, DType::BF16, {T, H}, dev);
    return a;
  };

  progress("  [2/4] CPU reference run ...");
  std::vector<uint16_t> y_ref(T * H, 0x7fc0);
  MoeArgs a_cpu = make_args(x.data(), logits.data(), bias.data(), ids.data(), layer.alpha.data(), layer.beta.data(),
                            y_ref.data(), Backend::CPU);
  a_cpu.adapters = &reg_cpu;
  auto r0 = std::chrono::steady_clock::now();
  moe_run(w_cpu, a_cpu);
  const double ref_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - r0).count();
  std::printf(" done (%.1f ms)\n", ref_ms);

  double sum = 0, sq = 0;
  for (uint16_t v : y_ref) { const double f = bf16_bits_to_f32(v); sum += f; sq += f * f; }
  std::printf("  reference output: rms %.4f, sum %.4f\n", std::sqrt(sq / (T * H)), sum);

  if (!gpu) {
    progress("  [3/4] GPU run ... skipped (no CUDA device)\n");
    progress("  [4/4] done\n");
    std::printf("demo finished in %.2f s on the CPU reference\n",
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    return 0;
  }
#ifdef FP4MOE_WITH_CUDA
  progress("  [3/4] GPU: prepare weights and adapters ...");
  MoeWeights w_gpu = prepare_weights(desc, Backend::CUDA, 0);
  AdapterRegistry reg_gpu(w_gpu, 64);
  for (int a = 0; a < 8; ++a) reg_gpu.load(a, adapters[a].desc());
  progress(" done\n");
  auto dev_copy = [](const void* src, size_t bytes) {
    void* p = nullptr;
    if (cudaMalloc(&p, bytes) != cudaSuccess || cudaMemcpy(p, src, bytes, cudaMemcpyHostToDevice) != cudaSuccess)
      throw Error(ErrorCode::CudaError, "", "demo: device allocation/copy failed");
    return p;
  };
  void* dx = dev_copy(x.data(), x.size() * 2);
  void* dl = dev_copy(logits.data(), logits.size() * 4);
  void* db = dev_copy(bias.data(), bias.size() * 4);
  void* di = dev_copy(ids.data(), ids.size() * 4);
  void* dal = dev_copy(layer.alpha.data(), E * 4);
  void* dbe = dev_copy(layer.beta.data(), E * 4);
  std::vector<uint16_t> y_gpu(T * H, 0x7fc0);
  void* dy = dev_copy(y_gpu.data(), y_gpu.size() * 2);
  MoeArgs a_gpu = make_args(dx, dl, db, di, dal, dbe, dy, Backend::CUDA);
  a_gpu.adapters = &reg_gpu;
  moe_run(w_gpu, a_gpu);
  cudaDeviceSynchronize();
  check_device_errors(0);
  cudaMemcpy(y_gpu.data(), dy, y_gpu.size() * 2, cudaMemcpyDeviceToHost);
  const Stats st = compare(y_gpu, y_ref);
  std::printf("  GPU vs CPU reference: relative L2 %.3e, cosine %.6f, max |diff| %.3e\n", st.rel_l2, st.cosine, st.max_abs);
  progress("  [4/4] timing (median of 50 after 5 warm-up) ...");
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<float> times;
  for (int it = 0; it < 55; ++it) {
    cudaEventRecord(e0);
    moe_run(w_gpu, a_gpu);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    if (it >= 5) times.push_back(ms);
  }
  std::sort(times.begin(), times.end());
  std::printf(" %.1f us per layer call (T=%lld)\n", times[times.size() / 2] * 1000.0, (long long)T);
  for (void* p : {dx, dl, db, di, dal, dbe, dy}) cudaFree(p);
  const bool ok = st.rel_l2 <= 1e-2 && std::isfinite(st.rel_l2);
  std::printf("demo %s\n", ok ? "passed (GPU matches the reference)" : "FAILED: GPU differs from the reference");
  return ok ? 0 : 1;
#else
  return 1;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return usage();
  const std::string cmd = argv[1];
  try {
    if (cmd == "demo") return demo(argc - 2, argv + 2);
    if (cmd == "info") {
      std::fputs(build_info_report().c_str(), stdout);
      return 0;
    }
    if (cmd == "check") return run_check(argc - 2, argv + 2);
    if (cmd == "bench") return run_bench(argc - 2, argv + 2);
    if (cmd == "inspect") return run_inspect(argc - 2, argv + 2);
    return usage();
  } catch (const Error& e) {
    std::fprintf(stderr, "fp4moe %s: error (%s): %s\n", cmd.c_str(), to_string(e.code()), e.what());
    return 1;
  }
}
