// The bench's report: the markdown table printed at the end and the JSON document of --json.
#pragma once
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "bench_case.h"
#include "bench_ceilings.h"
#include "bench_options.h"

namespace fp4moe::bench {

// What the JSON says of the machine, read once at the start of the run.
struct Machine {
  cudaDeviceProp prop{};
  int sm_khz = 0, mem_khz = 0, bus = 0, drv = 0, rt = 0;
};

std::string markdown_table(const std::vector<CaseResult>& rs);

// Writes the JSON document to o.json_path (true without one); complete is false while cases are still to come.
bool write_json(const Options& o, const Machine& m, const std::string& flush_method, const Ceilings& ceil,
                const std::vector<CaseResult>& results, bool complete);

}  // namespace fp4moe::bench
