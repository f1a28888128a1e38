// The bench's report (bench_report.h).
#ifdef FP4MOE_WITH_CUDA
#include "bench_report.h"

#include <cmath>
#include <cstdio>
#include <ctime>
#include <string>
#include <utility>
#include <vector>

#include "bench.h"
#include "fp4moe/build_info.h"
#include "io/json_write.h"
#include "runtime/plan.h"

namespace fp4moe::bench {
namespace {

// ---- JSON output (a writer only; values are numbers, strings, booleans) --------------------------------
std::string jnum(double v) {
  if (!std::isfinite(v)) return "null";
  char b[40];
  std::snprintf(b, sizeof b, "%.6g", v);
  return b;
}
std::string jint(int64_t v) { return std::to_string(v); }
std::string jbool(bool v) { return v ? "true" : "false"; }

struct JObj {
  std::vector<std::pair<std::string, std::string>> kv;
  JObj& add(const std::string& k, const std::string& raw) {
    kv.emplace_back(k, raw);
    return *this;
  }
  std::string dump() const {
    std::string r = "{";
    for (size_t i = 0; i < kv.size(); ++i) r += (i ? ", " : "") + json::quote(kv[i].first) + ": " + kv[i].second;
    return r + "}";
  }
};

std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

std::string case_json(const CaseResult& r) {
  JObj o;
  o.add("shape", json::quote(r.shape)).add("T", jint(r.T)).add("lora", jbool(r.lora)).add("lora_case", json::quote(r.lora_case));
  o.add("status", json::quote(r.status));
  if (!r.message.empty()) o.add("message", json::quote(r.message));
  if (r.status == "ok") {
    o.add("graph", jbool(r.graph)).add("runs", jint(r.runs));
    o.add("median_us", jnum(r.median_us)).add("p10_us", jnum(r.p10_us)).add("p90_us", jnum(r.p90_us));
    o.add("min_us", jnum(r.min_us)).add("mean_us", jnum(r.mean_us));
    o.add("local_slots", jnum(r.local_slots)).add("touched_experts", jnum(r.touched_experts));
    if (r.lora) {
      o.add("adapted_slots", jnum(r.adapted_slots)).add("touched_adapter_experts", jnum(r.touched_pairs));
      o.add("adapted_tokens", jnum(r.adapted_tokens)).add("touched_adapters", jnum(r.touched_adapters));
    }
    o.add("weight_bytes", jnum(r.weight_bytes)).add("lora_bytes", jnum(r.lora_bytes)).add("io_bytes", jnum(r.io));
    o.add("flops", jnum(r.flops));
    o.add("gbps", jnum(r.m.gbps)).add("ratio_copy", jnum(r.m.ratio_copy));
    o.add("tflops", jnum(r.m.tflops)).add("ratio_gemm", jnum(r.m.ratio_gemm));
    o.add("floor_mem_us", jnum(r.m.floor_mem_us)).add("floor_compute_us", jnum(r.m.floor_compute_us));
    o.add("floor_us", jnum(r.m.floor_us)).add("time_over_floor", jnum(r.m.time_over_floor));
    o.add("output_check", json::quote(r.output_check));
    JObj plan;
    plan.add("tile", json::quote(to_string(static_cast<GemmTile>(r.plan.gemm_config))));
    plan.add("chunks", jint(r.plan.num_chunks)).add("max_m_tiles", jint(r.plan.max_m_tiles));
    plan.add("split_m_tiles", jint(r.plan.split_m_tiles)).add("split1", jint(r.plan.split1));
    plan.add("split2", jint(r.plan.split2)).add("m_last", jbool(r.plan.gemm_m_last));
    plan.add("entry_tiles", jbool(r.plan.entry_tiles));
    o.add("plan", plan.dump());
  }
  return o.dump();
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char b[32];
  std::strftime(b, sizeof b, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return b;
}

}  // namespace

std::string markdown_table(const std::vector<CaseResult>& rs) {
  std::string t =
      "| shape | T | LoRA | median us | p10 | p90 | weights MB | LoRA MB | GB/s | /copy | TFLOP/s | /gemm | floor us |"
      " x floor | / base |\n"
      "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const auto& r : rs) {
    t += "| " + r.shape + " | " + std::to_string(r.T) + " | " + (r.lora ? r.lora_case : "-") + " | ";
    if (r.status != "ok") {
      t += r.status + " | | | | | | | | | | | |\n";
      continue;
    }
    const double mb = (r.weight_bytes + r.lora_bytes) / 1e6, over = bench::lora_over_base(rs, r);
    t += fmt("%.1f", r.median_us) + " | " + fmt("%.1f", r.p10_us) + " | " + fmt("%.1f", r.p90_us) + " | " +
         fmt("%.1f", mb) + " | " + (r.lora ? fmt("%.1f", r.lora_bytes / 1e6) : std::string("-")) + " | " +
         fmt("%.0f", r.m.gbps) + " | " + fmt("%.2f", r.m.ratio_copy) + " | " +
         fmt("%.1f", r.m.tflops) + " | " + fmt("%.2f", r.m.ratio_gemm) + " | " + fmt("%.1f", r.m.floor_us) + " | " +
         fmt("%.2f", r.m.time_over_floor) + " | " + (over > 0 ? fmt("%.3f", over) : std::string("-")) + " |\n";
  }
  return t;
}

bool write_json(const Options& o, const Machine& m, const std::string& flush_method, const Ceilings& ceil,
                const std::vector<CaseResult>& results, bool complete) {
  const cudaDeviceProp& prop = m.prop;
  const int sm_khz = m.sm_khz, mem_khz = m.mem_khz, bus = m.bus, drv = m.drv, rt = m.rt;
  if (o.json_path.empty()) return true;
  const BuildInfo bi = build_info();
  std::string archs;
  for (const auto& a : bi.cuda_archs) archs += (archs.empty() ? "" : ",") + a;
  JObj machine;
  machine.add("gpu", json::quote(prop.name)).add("sms", jint(prop.multiProcessorCount)).add("l2_bytes", jint(prop.l2CacheSize));
  machine.add("memory_bytes", jint(static_cast<int64_t>(prop.totalGlobalMem)));
  machine.add("compute_capability", json::quote(std::to_string(prop.major) + "." + std::to_string(prop.minor)));
  machine.add("sm_clock_mhz", jint(sm_khz / 1000)).add("memory_clock_mhz", jint(mem_khz / 1000)).add("memory_bus_bits", jint(bus));
  machine.add("driver", jint(drv)).add("runtime", jint(rt));
  JObj build;
  build.add("version", json::quote(bi.version)).add("source_hash", json::quote(bi.source_hash)).add("cxx", json::quote(bi.cxx_compiler));
  build.add("cuda", json::quote(bi.cuda_compiler)).add("archs", json::quote(archs));
  JObj method;
  method.add("timing", json::quote("CUDA events around one CUDA-graph replay of moe_run"));
  method.add("l2", json::quote(flush_method)).add("runs_min", jint(o.runs)).add("runs_max", jint(o.max_runs));
  method.add("min_time_s", jnum(o.min_time_s)).add("input_sets", jint(o.sets)).add("warmup", jint(2 * o.sets));
  method.add("format", json::quote(o.format == WeightFormat::NVFP4 ? "nvfp4" : o.format == WeightFormat::MXFP4 ? "mxfp4" : "bf16")).add("mode", json::quote(o.mode == ActMode::A4 ? "A4" : "A16"));
  method.add("gemm_tile", json::quote(to_string(static_cast<GemmTile>(o.gemm_tile))));
  method.add("workspace_budget", jint(o.workspace_budget > 0 ? o.workspace_budget : kDefaultWorkspaceBudget));
  method.add("lora", json::quote("rank 16, by lora_case: per_expert8: 8 PEFT-fused adapters, adapter_ids = t % 8; "
                                  "shared_outer8: 8 shared-outer adapters, t % 8; one_adapter: 1 PEFT-fused adapter, "
                                  "id 0 on every token; half_base: 8 PEFT-fused adapters, (t / 2) % 8 on even t, "
                                  "-1 (base) on odd t; each layout in a registry of its own"));
  std::string cases_run;
  if (o.lora)
    for (LoraCase lc : o.lora_cases) cases_run += (cases_run.empty() ? "" : ", ") + json::quote(lora_case_name(lc));
  method.add("lora_cases", "[" + cases_run + "]");
  method.add("weight_bytes", json::quote("per local expert routed to at least once: W1 + W2 (NVFP4: codes + e4m3 scales + fp32 "
                                  "global scales; bf16: 2 bytes an element); LoRA rows add lora_bytes"));
  method.add("lora_bytes", json::quote("bf16 adapter matrices touched: PEFT-fused, A1 B1 A2 B2 of every (adapter, expert) "
                                "pair routed to; shared-outer, A1 and B2 once per adapter used and B1 A2 of every pair"));
  method.add("floor", json::quote("max((weight + io bytes) / copy ceiling, flops / gemm ceiling)"));
  JObj ceilings;
  ceilings.add("copy_gbps", jnum(ceil.copy_gbps)).add("copy_bytes", jint(ceil.copy_bytes));
  ceilings.add("copy", json::quote("cudaMemcpyAsync device to device, bytes read + written, median of 10"));
  ceilings.add("gemm_tflops", jnum(ceil.gemm_tflops)).add("gemm", json::quote(ceil.gemm_method));
  std::string cases = "[\n";
  for (size_t i = 0; i < results.size(); ++i) cases += "    " + case_json(results[i]) + (i + 1 < results.size() ? ",\n" : "\n");
  cases += "  ]";
  const std::string doc = "{\n  \"tool\": \"fp4moe bench\",\n  \"date\": " + json::quote(utc_now()) + ",\n  \"complete\": " + jbool(complete) +
                          ",\n  \"machine\": " +
                          machine.dump() + ",\n  \"build\": " + build.dump() + ",\n  \"method\": " + method.dump() +
                          ",\n  \"ceilings\": " + ceilings.dump() + ",\n  \"cases\": " + cases + "\n}\n";
  FILE* f = std::fopen(o.json_path.c_str(), "w");
  const bool ok = f && std::fwrite(doc.data(), 1, doc.size(), f) == doc.size();
  if (f && std::fclose(f) != 0) return false;
  return ok;
}

}  // namespace fp4moe::bench
#endif  // FP4MOE_WITH_CUDA
