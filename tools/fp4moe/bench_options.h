// `fp4moe bench` options: the shapes, token counts and variants to run, and how long to time each case.
#pragma once
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "bench.h"
#include "fp4moe/model_shapes.h"
#include "fp4moe/types.h"

namespace fp4moe::bench {

inline const std::vector<int64_t> kDefaultTokens = {1, 8, 64, 256, 1024, 4096, 16384};
inline constexpr int kLoraAdapters = 8;
inline constexpr int64_t kLoraRank = 16;

struct Options {
  std::vector<const ModelShape*> shapes;
  std::vector<int64_t> tokens = kDefaultTokens;
  int runs = 50, max_runs = 400, sets = 3, device = 0, gemm_tile = -1;
  int64_t workspace_budget = 0;  // bytes, 0 = the library's default
  double min_time_s = 0.05;
  bool lora = true, base = true, quick = false;
  std::vector<LoraCase> lora_cases{std::begin(kAllLoraCases), std::end(kAllLoraCases)};  // run when lora
  WeightFormat format = WeightFormat::NVFP4;
  std::string json_path;
  ActMode mode = ActMode::A16;
  std::deque<ModelShape> variants;  // shapes with --activation / --mode applied (o.shapes points here then)
  std::deque<std::string> variant_names;
};

// Prints the usage to stderr and returns 2, the exit status of a usage error.
int usage();
// Throws std::invalid_argument with a message naming the option.
Options parse_options(int argc, char** argv);

}  // namespace fp4moe::bench
