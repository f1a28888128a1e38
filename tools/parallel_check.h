// fp4moe_parallel_check's parts: the launcher (parallel_check_launch.cpp) and each rank (parallel_check.cpp).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace fp4moe::parallel_check {

struct Options {
  int world = 2;
  std::vector<std::string> shapes = {"kimi_k3", "qwen3_30b_a3b"};
  std::vector<int64_t> tokens = {1, 64, 1024};
  int64_t check_tokens = 64, ref_tokens = 4, kimi_experts = 64;
  int iters = 20, warmup = 5, timeout = 240;
  double tol = 5e-3, ref_tol = 1e-2;
  bool cpu_ref = true, timing = true;
  std::string json;
};

// One forked rank: rank 0 sends the ncclUniqueId through write_fds, the others read it from read_fd.
int rank_main(const Options& o, int rank, const std::vector<int>& write_fds, int read_fd);

}  // namespace fp4moe::parallel_check
