// What this binary is (SPEC §7): version, source-tree hash, compilers, architectures.
#pragma once
#include <string>
#include <vector>

namespace fp4moe {

struct BuildInfo {
  std::string version;
  std::string source_hash;     // git tree hash of src/ at build time
  std::string cxx_compiler;
  std::string cuda_compiler;   // empty when built without CUDA
  std::vector<std::string> cuda_archs;  // e.g. {"90a"}
  bool with_cuda = false;
};
BuildInfo build_info();
// A multi-line human-readable report, including the GPUs seen (if any).
std::string build_info_report();
// CUDA devices this process can use (0 without a GPU, a driver, or the CUDA backend).
int cuda_device_count();

}  // namespace fp4moe
