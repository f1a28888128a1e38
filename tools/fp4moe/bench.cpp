// `fp4moe bench`: times the CUDA backend on the model shapes of SPEC §1 (docs/api.md, "Benchmarks").
//
// Method: the copy and bf16-GEMM ceilings are measured in the same run;
// each case is one moe_run captured in a CUDA graph (one graph per input set: the sets differ in x and
// logits, so in routing) and replayed; CUDA events bracket the replay alone. Before every timed replay a
// read-only pass over a 256 MB buffer (cublasSasum) evicts the weights from the 60 MB L2: a read leaves
// clean lines, so the op pays no write-back for the flush (a memset flush would leave ~60 MB of dirty
// lines to be written back during the op). At least --runs replays per case (default 50), more for short
// cases up to a measured-time target; median, p10, p90 reported.
//
// This file is the driver: options, the device, the ceilings, then every shape and token count in turn.
// bench_options.cpp parses the options, bench_ceilings.cpp measures the ceilings, bench_case.cpp runs and
// times one case, bench_report.cpp writes the table and the JSON.
#include "bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bench_options.h"
#include "fp4moe/model_shapes.h"
#include "fp4moe/moe.h"
#include "fp4moe/synthetic.h"
#ifdef FP4MOE_WITH_CUDA
#include <cuda_runtime.h>

#include "bench_case.h"
#include "bench_ceilings.h"
#include "bench_device.h"
#include "bench_report.h"
#endif

namespace fp4moe {
namespace bench {
namespace {

#ifdef FP4MOE_WITH_CUDA
// Probes the backend for this layout, then loads kLoraAdapters synthetic adapters of it (generated on threads, the
// bulk of the setup; they need only the layer's dimensions) into a registry of their own; set.status says why not.
void load_adapters(AdapterSet& set, const ShapeCtx& c, const SyntheticLayer& L, LoraLayout layout, uint64_t seed,
                   const Options& o) {
  set.status = probe_lora(*c.shape, o.format, o.device, layout);
  if (!set.status.empty()) return;
  SyntheticLayer dims;
  dims.E = L.E; dims.H = L.H; dims.I = L.I; dims.gated = L.gated; dims.format = L.format; dims.order = L.order;
  std::vector<std::future<SyntheticAdapter>> fa;
  for (int a = 0; a < kLoraAdapters; ++a)
    fa.push_back(std::async(std::launch::async, [&dims, a, seed, layout] {
      return make_synthetic_adapter(dims, kLoraRank, seed + a, layout);
    }));
  set.registry = std::make_unique<AdapterRegistry>(c.w, kLoraAdapters);
  for (int a = 0; a < kLoraAdapters; ++a) {
    SyntheticAdapter ad = fa[a].get();
    set.registry->load(a, ad.desc());
  }
}

int run_bench_cuda(const Options& o) {
  const auto t_start = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count(); };
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    (void)cudaGetLastError();
    std::fprintf(stderr, "fp4moe bench: no CUDA device\n");
    return 2;
  }
  if (o.device >= ndev) {
    std::fprintf(stderr, "fp4moe bench: --device %d: only %d CUDA device(s)\n", o.device, ndev);
    return 2;
  }
  Device d(o.device);
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, o.device));
  int sm_khz = 0, mem_khz = 0, bus = 0, drv = 0, rt = 0;
  (void)cudaDeviceGetAttribute(&sm_khz, cudaDevAttrClockRate, o.device);
  (void)cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, o.device);
  (void)cudaDeviceGetAttribute(&bus, cudaDevAttrGlobalMemoryBusWidth, o.device);
  (void)cudaDriverGetVersion(&drv);
  (void)cudaRuntimeGetVersion(&rt);
  (void)cudaGetLastError();
  std::printf("fp4moe bench: %s, %d SMs, L2 %.0f MB, %.0f GB, SM clock %d MHz, memory clock %d MHz\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize / 1e6, prop.totalGlobalMem / 1e9, sm_khz / 1000, mem_khz / 1000);
  std::fflush(stdout);

  // Synthetic layers: generated on host threads while the ceilings are measured.
  std::vector<std::future<SyntheticLayer>> layers;
  for (size_t i = 0; i < o.shapes.size(); ++i) {
    const ModelShape* s = o.shapes[i];
    layers.push_back(std::async(std::launch::async, [s, i, &o] {
      return make_synthetic_layer(*s, s->E_loc, 1000 + i, o.format);
    }));
  }

  // Random pools: x windows per case and set; the GEMM ceiling's operands.
  int64_t max_x = 0, max_logits = 0;
  for (const ModelShape* s : o.shapes)
    for (int64_t T : o.tokens) {
      max_x = std::max(max_x, T * s->H);
      max_logits = std::max(max_logits, T * s->E);
    }
  Pools pools;
  pools.set_shift_x = 8 * 1031;  // 16-byte aligned shifts: every set sees other values
  pools.set_shift_logits = 4 * 1031;
  pools.x_elems = std::max<int64_t>(max_x + o.sets * pools.set_shift_x, int64_t(2) * 8192 * 8192);
  pools.x = DeviceBuffer::from(parallel_random<uint16_t>(pools.x_elems, 11, [](int64_t n, uint64_t sd) { return random_bf16(n, sd); }));
  pools.logits_host = parallel_random<float>(max_logits + o.sets * pools.set_shift_logits, 12,
                                             [](int64_t n, uint64_t sd) { return random_f32(n, sd); });
  pools.logits = DeviceBuffer::from(pools.logits_host);

  Ceilings ceil;
  ceil.copy_gbps = measure_copy(d, ceil.copy_bytes);
  ceil.gemm_tflops = measure_gemm(d, pools.x, ceil.gemm_method);
  std::printf("ceilings: copy %.0f GB/s (read+write, %lld MB buffers), bf16 GEMM %.0f TFLOP/s; L2 flush: %s [%.1f s]\n",
              ceil.copy_gbps, (long long)(ceil.copy_bytes >> 20), ceil.gemm_tflops, d.flush_method.c_str(), elapsed());
  std::fflush(stdout);

  std::vector<CaseResult> results;
  // The JSON is rewritten after every shape ("complete": false until the end), so a run cut short keeps its cases.
  const Machine machine{prop, sm_khz, mem_khz, bus, drv, rt};
  // The JSON is rewritten after every shape ("complete": false until the end), so a run cut short keeps its cases.
  auto save_json = [&](bool complete) { return write_json(o, machine, d.flush_method, ceil, results, complete); };
  if (!save_json(false)) {
    std::fprintf(stderr, "fp4moe bench: cannot write %s\n", o.json_path.c_str());
    return 2;
  }
  DeviceBuffer ws;
  for (size_t si = 0; si < o.shapes.size(); ++si) {
    const ModelShape& s = *o.shapes[si];
    ShapeCtx c;
    c.shape = &s;
    c.E_loc = s.E_loc;
    c.E_total = s.E;
    c.gated = is_gated(s.activation);
    {
      SyntheticLayer L = layers[si].get();
      c.w = prepare_weights(L.desc(), Backend::CUDA, o.device);
      c.alpha = DeviceBuffer::from(L.alpha);
      c.beta = DeviceBuffer::from(L.beta);
      if (!L.clamp.empty()) c.clamp = DeviceBuffer::from(L.clamp);
      if (s.shared_I > 0) {
        SyntheticLayer S = make_synthetic_shared_expert(s, s.shared_I, 3000 + si, o.format);
        c.shared = prepare_weights(S.desc(), Backend::CUDA, o.device);
        // A gate of std 0.05: with N(0, 1) x the logits x . g spread ~2.3 over H = 2048, gates from ~0.1 to ~0.9.
        if (s.shared_gate) c.shared_gate = DeviceBuffer::from(random_bf16(s.H, 4000 + si, 0.05f));
      }
      // Only the layouts of the chosen cases are probed and loaded (a probe's kernels would show up in a profile).
      bool want_fused = false, want_shared = false;
      if (o.lora)
        for (LoraCase lc : o.lora_cases) (lora_case_shared_outer(lc) ? want_shared : want_fused) = true;
      if (want_fused) load_adapters(c.peft_fused, c, L, LoraLayout::PeftFused, 5000 + 100 * si, o);
      if (want_shared) load_adapters(c.shared_outer, c, L, LoraLayout::SharedOuter, 7000 + 100 * si, o);
    }  // host copy of the synthetic layer freed here
    // A small routing bias (std 0.01): with N(0, 1) logits, sigmoid scores spread ~0.2, so the selection stays close
    // to uniform over experts, as the SPEC's floors assume (a 0.1 bias concentrated kimi_k3_tp8's T=1024 batch on
    // ~240 of 384 experts in the 2026-11-30 run).
    c.bias_host = random_f32(c.E_total, 2000 + si, 0.01f);
    c.bias = DeviceBuffer::from(c.bias_host);
    int64_t maxT = 0;
    for (int64_t T : o.tokens) maxT = std::max(maxT, T);
    for (LoraCase lc : kAllLoraCases)
      c.adapter_ids[static_cast<size_t>(lc)] = DeviceBuffer::from(lora_case_adapter_ids(lc, maxT, kLoraAdapters));
    std::string lora_note;
    if (!c.peft_fused.status.empty()) lora_note += " LoRA (PEFT-fused): " + c.peft_fused.status;
    if (!c.shared_outer.status.empty()) lora_note += " LoRA (shared-outer): " + c.shared_outer.status;
    std::printf("== %s (H=%lld I=%lld E=%lld E_loc=%lld k=%lld %s %s)%s [%.1f s]\n", std::string(s.name).c_str(),
                (long long)s.H, (long long)s.I, (long long)s.E, (long long)s.E_loc, (long long)s.k, to_string(s.routing),
                to_string(s.activation), lora_note.c_str(), elapsed());
    std::fflush(stdout);

    for (int64_t T : o.tokens) {
      std::vector<std::vector<int32_t>> routings;  // one per input set
      for (int k = 0; k < o.sets; ++k) routings.push_back(host_route(c, T, pools.logits_host.data() + k * pools.set_shift_logits));
      auto run_one = [&](std::optional<LoraCase> lora) {
        const std::vector<int32_t> aids = lora ? lora_case_adapter_ids(*lora, T, kLoraAdapters) : std::vector<int32_t>{};
        std::vector<bench::Touch> touches;
        for (const auto& ids : routings) touches.push_back(bench::count_touch(ids, T, s.k, 0, c.E_loc, aids));
        CaseResult r = run_case(d, c, pools, T, lora, o, ws, touches);
        if (r.status == "ok") {
          r.m = bench::derive_metrics(r.median_us, r.weight_bytes + r.lora_bytes, r.io, r.flops, ceil.copy_gbps, ceil.gemm_tflops);
          std::printf("  T=%-6lld %-13s %10.1f us  p10 %9.1f  p90 %9.1f  %6.0f GB/s (%.2f of copy)  %6.1f TFLOP/s (%.2f of gemm)  "
                      "floor %8.1f us  x%.2f  %s%s\n",
                      (long long)T, r.lora_case.c_str(), r.median_us, r.p10_us, r.p90_us, r.m.gbps, r.m.ratio_copy, r.m.tflops,
                      r.m.ratio_gemm, r.m.floor_us, r.m.time_over_floor, r.output_check.c_str(), r.graph ? "" : " (no graph)");
        } else {
          std::printf("  T=%-6lld %-13s %s: %s\n", (long long)T, r.lora_case.c_str(), r.status.c_str(), r.message.c_str());
        }
        std::fflush(stdout);
        results.push_back(std::move(r));
      };
      if (o.base) run_one(std::nullopt);
      if (o.lora)
        for (LoraCase lc : o.lora_cases) run_one(lc);
    }
    if (!save_json(false)) std::fprintf(stderr, "fp4moe bench: cannot write %s\n", o.json_path.c_str());
  }

  std::printf("\n%s", markdown_table(results).c_str());
  std::printf("\n(time per moe_run: median of >= %d CUDA-graph replays, L2 flushed before each; weights MB: touched weight\n"
              "bytes incl. LoRA, LoRA MB: the touched adapter matrices among them; /copy and /gemm: ratios to the ceilings\n"
              "measured above; floor: max(bytes / copy, FLOPs / gemm), each case with its own bytes and FLOPs;\n"
              "/ base: a LoRA row's median over the same shape and T without LoRA, in this run)\n",
              o.runs);
  std::printf("bench finished in %.1f s\n", elapsed());

  int failed = 0;
  for (const auto& r : results)
    if (r.status == "error" || (r.status == "ok" && r.output_check != "ok")) ++failed;
  if (!o.json_path.empty()) {
    if (!save_json(true)) {
      std::fprintf(stderr, "fp4moe bench: cannot write %s\n", o.json_path.c_str());
      return 1;
    }
    std::printf("wrote %s\n", o.json_path.c_str());
  }
  return failed ? 1 : 0;
}
#endif  // FP4MOE_WITH_CUDA

}  // namespace
}  // namespace bench

int run_bench(int argc, char** argv) {
  using namespace bench;
  for (int i = 0; i < argc; ++i)
    if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) {
      usage();
      return 0;
    }
  Options o;
  try {
    o = parse_options(argc, argv);
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "fp4moe bench: %s\n", e.what());
    return usage();
  }
#ifdef FP4MOE_WITH_CUDA
  try {
    return run_bench_cuda(o);
  } catch (const Error& e) {
    std::fprintf(stderr, "fp4moe bench: error (%s): %s\n", to_string(e.code()), e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fp4moe bench: error: %s\n", e.what());
    return 1;
  }
#else
  (void)o;
  std::fprintf(stderr, "fp4moe bench: this build has no CUDA backend (configure with nvcc and FP4MOE_WITH_CUDA=ON)\n");
  return 2;
#endif
}

}  // namespace fp4moe
