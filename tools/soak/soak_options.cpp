// fp4moe_soak's command line.
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "../fp4moe/cli.h"
#include "soak.h"

namespace fp4moe::soak {

void usage(FILE* f) {
  std::fputs(
      "usage: fp4moe_soak [--backend cpu|cuda] [--shape NAME] [--hidden H] [--inter I] [--experts E] [--topk K]\n"
      "                   [--calls N] [--seconds S] [--max-tokens T] [--small-tokens T] [--small-fraction F]\n"
      "                   [--specs N] [--slots N] [--stable N] [--bad-every N] [--threads N] [--seed N]\n"
      "                   [--warmup N] [--rss-bound-mib M] [--dev-bound-mib M] [--churn-sleep-ms MS]\n"
      "                   [--no-workspace-fraction F] [--chunked-fraction F] [--a4] [--up-first]\n"
      "                   [--skip-bad KIND,...] [--progress S] [--json FILE]\n"
      "  Soaks moe_run: N calls (or S seconds, whichever ends first) over a pool of batch specs, every good\n"
      "  output compared bit for bit with the spec's reference (computed once on a fresh registry), adapters\n"
      "  loaded and unloaded meanwhile from another thread, one bad call in --bad-every. Exits 0 only when\n"
      "  every good call matched, every bad call erred as expected with y untouched, and host RSS and device\n"
      "  memory grew by at most their bounds after warm-up.\n"
      "  Defaults: cpu H=256 I=128 E=16 k=4, T <= 96 (70 % in 1..16), 24 specs; cuda H=1024 I=256 E=64 k=6,\n"
      "  T <= 4096 (70 % in 1..64), 64 specs. Slots: --stable resident adapters in 0..stable-1, churn slots\n"
      "  after them, the last slot always empty. --shape takes a SPEC shape (--experts may reduce it). Warm-up:\n"
      "  every spec once (per workspace variant on CUDA), then up to max(200, 5 % of --calls) calls or 5 % of\n"
      "  --seconds. Bad-call kinds (--skip-bad): x_shape x_dtype x_strides x_device y_shape y_dtype logits_shape\n"
      "  top_k_above_E top_k_zero adapter_ids_dtype adapter_ids_shape adapter_ids_without_registry adapter_id_range\n"
      "  adapter_id_negative adapter_slot_empty topk_id_range logits_and_topk a4_scale gemm_tile num_threads\n"
      "  workspace expert_window activation_type alpha_shape foreign_registry.\n",
      f);
}

namespace {

using cli::split_list;

bool parse_i64(const std::string& s, int64_t& out) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || end == s.c_str() || *end != '\0') return false;
  out = v;
  return true;
}
bool parse_f64(const std::string& s, double& out) {
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s.c_str(), &end);
  if (errno != 0 || end == s.c_str() || *end != '\0' || !std::isfinite(v)) return false;
  out = v;
  return true;
}

}  // namespace

std::string parse_options(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    std::string v;
    auto value = [&]() -> bool {
      if (i + 1 >= argc) return false;
      v = argv[++i];
      return true;
    };
    auto int_opt = [&](int64_t lo, int64_t hi, auto& dst) -> std::string {
      int64_t n = 0;
      if (!value() || !parse_i64(v, n) || n < lo || n > hi)
        return a + " expects an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got '" + v + "'";
      dst = static_cast<std::remove_reference_t<decltype(dst)>>(n);
      return "";
    };
    auto f64_opt = [&](double lo, double hi, double& dst) -> std::string {
      double d = 0;
      if (!value() || !parse_f64(v, d) || d < lo || d > hi)
        return a + " expects a number in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got '" + v + "'";
      dst = d;
      return "";
    };
    std::string err;
    if (a == "--help" || a == "-h") return "help";
    if (a == "--backend") {
      if (!value() || (v != "cpu" && v != "cuda")) return "--backend expects cpu or cuda";
      o.backend = v;
    } else if (a == "--shape") {
      if (!value() || !find_model_shape(v)) {
        std::string known;
        for (const auto& m : kModelShapes) known += std::string(known.empty() ? "" : ", ") + std::string(m.name);
        return "unknown shape '" + v + "' (known: " + known + ")";
      }
      o.shape = v;
    } else if (a == "--hidden") err = int_opt(16, 1 << 16, o.hidden);
    else if (a == "--inter") err = int_opt(16, 1 << 16, o.inter);
    else if (a == "--experts") err = int_opt(1, 4096, o.experts);
    else if (a == "--topk") err = int_opt(1, 64, o.topk);
    else if (a == "--calls") err = int_opt(1, int64_t(1) << 40, o.calls);
    else if (a == "--seconds") err = f64_opt(0.001, 1e7, o.seconds);
    else if (a == "--max-tokens") err = int_opt(2, 1 << 20, o.max_tokens);
    else if (a == "--small-tokens") err = int_opt(1, 1 << 20, o.small_tokens);
    else if (a == "--small-fraction") err = f64_opt(0, 1, o.small_fraction);
    else if (a == "--specs") err = int_opt(2, 100000, o.specs);
    else if (a == "--slots") err = int_opt(3, 1 << 16, o.slots);
    else if (a == "--stable") err = int_opt(1, 1 << 16, o.stable);
    else if (a == "--bad-every") err = int_opt(0, 1 << 30, o.bad_every);
    else if (a == "--threads") err = int_opt(0, 1024, o.threads);
    else if (a == "--seed") err = int_opt(0, int64_t(1) << 62, o.seed);
    else if (a == "--warmup") err = int_opt(0, int64_t(1) << 40, o.warmup);
    else if (a == "--rss-bound-mib") err = f64_opt(0, 1e9, o.rss_bound_mib);
    else if (a == "--dev-bound-mib") err = f64_opt(0, 1e9, o.dev_bound_mib);
    else if (a == "--churn-sleep-ms") err = f64_opt(0, 1e6, o.churn_sleep_ms);
    else if (a == "--no-workspace-fraction") err = f64_opt(0, 1, o.no_ws_fraction);
    else if (a == "--chunked-fraction") err = f64_opt(0, 1, o.chunked_fraction);
    else if (a == "--progress") err = f64_opt(0, 1e7, o.progress_s);
    else if (a == "--a4") o.a4 = true;
    else if (a == "--up-first") o.up_first = true;
    else if (a == "--skip-bad") {
      if (!value()) return "--skip-bad needs a list of kinds";
      for (auto& s : split_list(v)) o.skip_bad.push_back(s);
    } else if (a == "--json") {
      if (!value() || v.empty()) return "--json needs a file name";
      o.json = v;
    } else {
      return "unknown option '" + a + "'";
    }
    if (!err.empty()) return err;
  }
  if (o.stable + 2 > o.slots) return "--slots must leave room for at least one churn slot and the empty slot after --stable";
  if (o.no_ws_fraction + o.chunked_fraction > 1) return "--no-workspace-fraction plus --chunked-fraction exceeds 1";
  return "";
}

}  // namespace fp4moe::soak
