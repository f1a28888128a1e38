// `fp4moe bench` options: the usage text and the parser.
#include "bench_options.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench.h"
#include "runtime/plan.h"

namespace fp4moe::bench {

int usage() {
  std::fputs(
      "usage: fp4moe bench [options]\n"
      "  --shapes a,b        model shapes of SPEC §1 (default: all): kimi_k3_tp8, qwen3_30b_a3b, qwen3_30b_a3b_tp4,\n"
      "                      deepseek_v3_ep8, mixtral_8x7b, gpt_oss_120b, qwen3_next_80b_a3b (gated shared expert)\n"
      "  --tokens 1,64       token counts (default 1,8,64,256,1024,4096,16384)\n"
      "  --runs N            timed replays per case, at least (default 50; the median needs >= 50 to be reported\n"
      "                      as the suite's number)\n"
      "  --max-runs N        upper bound when short cases repeat to reach --min-time (default 400)\n"
      "  --min-time S        keep repeating (up to --max-runs) until S seconds of op time are measured (default 0.05)\n"
      "  --sets N            input sets (x, logits) rotated between replays (default 3)\n"
      "  --format nvfp4|mxfp4|bf16 expert weight format (default nvfp4; mxfp4 runs A16 only)\n"
      "  --no-lora           skip the LoRA rows\n"
      "  --lora-only         only the LoRA rows (for profiling the LoRA kernels)\n"
      "  --lora-cases a,b    the LoRA rows to run (default: all), rank 16 each: per_expert8 (eight PEFT-fused\n"
      "                      adapters, token t on t % 8), shared_outer8 (the same, shared-outer adapters),\n"
      "                      one_adapter (one PEFT-fused adapter on every token), half_base (eight PEFT-fused\n"
      "                      adapters on the even tokens, the odd tokens base)\n"
      "  --activation A      run every shape with activation A instead of its own: swiglu, situ (alpha 4, beta 25)\n"
      "                      or swiglubias (1.702, 1, clamp 7); the shape's name gets +A\n"
      "  --mode a16|a4       activation mode (default a16); a4: FC1/FC2 input scales 1/448 and 12/2688 (x is N(0,1)),\n"
      "                      the shape's name gets +a4\n"
      "  --tile NAME         force a GEMM tile (GemmTile: SplitKDecode, WeightsAsA32, TokensAsA64, Wgmma64,\n"
      "                      WeightsAsA16, WgmmaWs128, WgmmaWs64, WgmmaWs32, or 0..7), default: the plan's choice\n"
      "  --workspace-budget M  workspace budget in MiB (MoeArgs::workspace_budget; default: the library's, plan.h)\n"
      "  --quick             tokens 1,64,1024 and no extra repeats\n"
      "  --json FILE         write the results as JSON\n"
      "  --device N          CUDA device (default 0)\n",
      stderr);
  return 2;
}

Options parse_options(int argc, char** argv) {
  Options o;
  bool tokens_given = false, max_runs_given = false, lora_cases_given = false;
  std::string activation;
  auto need = [&](int& i) -> std::string {
    if (i + 1 >= argc) throw std::invalid_argument(std::string(argv[i]) + ": expected a value");
    return argv[++i];
  };
  auto as_int = [](const std::string& opt, const std::string& v, int64_t lo, int64_t hi) {
    std::vector<int64_t> x;
    try {
      x = bench::parse_int_list(v);
    } catch (const std::invalid_argument&) {
      throw std::invalid_argument(opt + ": expected an integer, got '" + v + "'");
    }
    if (x.size() != 1 || x[0] < lo || x[0] > hi)
      throw std::invalid_argument(opt + ": expected an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                                  "], got '" + v + "'");
    return x[0];
  };
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--shapes") {
      for (const std::string& n : bench::split_list(need(i))) {
        const ModelShape* s = find_model_shape(n);
        if (!s) throw std::invalid_argument("--shapes: unknown model shape '" + n + "'");
        o.shapes.push_back(s);
      }
    } else if (a == "--tokens") {
      const std::string v = need(i);
      try {
        o.tokens = bench::parse_int_list(v);
      } catch (const std::invalid_argument& e) {
        throw std::invalid_argument("--tokens: " + std::string(e.what()));
      }
      for (int64_t t : o.tokens)
        if (t < 1 || t > (int64_t{1} << 20)) throw std::invalid_argument("--tokens: expected 1..1048576, got " + std::to_string(t));
      tokens_given = true;
    } else if (a == "--runs") {
      o.runs = static_cast<int>(as_int(a, need(i), 1, 100000));
    } else if (a == "--max-runs") {
      o.max_runs = static_cast<int>(as_int(a, need(i), 1, 100000));
      max_runs_given = true;
    } else if (a == "--sets") {
      o.sets = static_cast<int>(as_int(a, need(i), 1, 16));
    } else if (a == "--device") {
      o.device = static_cast<int>(as_int(a, need(i), 0, 1024));
    } else if (a == "--min-time") {
      const std::string v = need(i);
      char* end = nullptr;
      o.min_time_s = std::strtod(v.c_str(), &end);
      if (end == v.c_str() || *end || !(o.min_time_s >= 0 && o.min_time_s <= 60))
        throw std::invalid_argument("--min-time: expected seconds in [0, 60], got '" + v + "'");
    } else if (a == "--format") {
      const std::string v = need(i);
      if (v == "nvfp4") o.format = WeightFormat::NVFP4;
      else if (v == "bf16") o.format = WeightFormat::BF16;
      else if (v == "mxfp4") o.format = WeightFormat::MXFP4;
      else throw std::invalid_argument("--format: expected nvfp4, mxfp4 or bf16, got '" + v + "'");
    } else if (a == "--no-lora") {
      o.lora = false;
    } else if (a == "--lora-only") {
      o.base = false;
    } else if (a == "--lora-cases") {
      try {
        o.lora_cases = bench::parse_lora_cases(need(i));
      } catch (const std::invalid_argument& e) {
        throw std::invalid_argument("--lora-cases: " + std::string(e.what()));
      }
      lora_cases_given = true;
    } else if (a == "--activation") {
      activation = need(i);
      ModelShape probe{};
      if (!bench::activation_variant(activation, probe))
        throw std::invalid_argument("--activation: expected swiglu, situ or swiglubias, got '" + activation + "'");
    } else if (a == "--mode") {
      const std::string v = need(i);
      if (v == "a16") o.mode = ActMode::A16;
      else if (v == "a4") o.mode = ActMode::A4;
      else throw std::invalid_argument("--mode: expected a16 or a4, got '" + v + "'");
    } else if (a == "--tile") {
      const std::string v = need(i);  // a GemmTile name or its value
      o.gemm_tile = -1;
      for (int t = 0; t < kNumGemmConfigs; ++t)
        if (v == to_string(static_cast<GemmTile>(t))) o.gemm_tile = t;
      if (o.gemm_tile < 0) o.gemm_tile = static_cast<int>(as_int(a, v, 0, kNumGemmConfigs - 1));
    } else if (a == "--workspace-budget") {
      o.workspace_budget = as_int(a, need(i), 1, int64_t{1} << 20) << 20;
    } else if (a == "--quick") {
      o.quick = true;
    } else if (a == "--json") {
      o.json_path = need(i);
    } else {
      throw std::invalid_argument("unknown option '" + a + "'");
    }
  }
  if (o.shapes.empty())
    for (const auto& s : kModelShapes) o.shapes.push_back(&s);
  if (!activation.empty() || o.mode == ActMode::A4) {
    for (const ModelShape*& sp : o.shapes) {
      ModelShape v = *sp;
      std::string name(v.name);
      if (!activation.empty()) {
        bench::activation_variant(activation, v);
        name += "+" + activation;
      }
      if (o.mode == ActMode::A4) name += "+a4";
      o.variant_names.push_back(name);
      v.name = o.variant_names.back();
      o.variants.push_back(v);
      sp = &o.variants.back();
    }
  }
  if (o.quick) {
    if (!tokens_given) o.tokens = {1, 64, 1024};
    if (!max_runs_given) o.max_runs = o.runs;
  }
  o.max_runs = std::max(o.max_runs, o.runs);
  if (!o.lora && !o.base) throw std::invalid_argument("--no-lora and --lora-only: nothing left to run");
  if (o.format == WeightFormat::MXFP4 && o.mode == ActMode::A4)
    throw std::invalid_argument("--format mxfp4 and --mode a4: A4 takes NVFP4 or bf16 weights (SPEC §2)");
  if (!o.lora && lora_cases_given) throw std::invalid_argument("--no-lora and --lora-cases: choose one");
  return o;
}

}  // namespace fp4moe::bench
