#include "fp4moe/build_info.h"

#include <sstream>
#ifdef FP4MOE_WITH_CUDA
#include "cuda/backend.h"
#endif

namespace fp4moe {

BuildInfo build_info() {
  BuildInfo b;
  b.version = FP4MOE_VERSION;
  b.source_hash = FP4MOE_SOURCE_HASH;
  b.cxx_compiler = FP4MOE_CXX_COMPILER;
#ifdef FP4MOE_WITH_CUDA
  b.with_cuda = true;
  b.cuda_compiler = FP4MOE_CUDA_COMPILER;
  std::stringstream ss(FP4MOE_CUDA_ARCHS_STR);
  for (std::string a; std::getline(ss, a, ',');)
    if (!a.empty()) b.cuda_archs.push_back(a);
#endif
  return b;
}

int cuda_device_count() {
#ifdef FP4MOE_WITH_CUDA
  return cuda_backend::device_count();
#else
  return 0;
#endif
}

std::string build_info_report() {
  const BuildInfo b = build_info();
  std::ostringstream os;
  os << "fp4moe " << b.version << "\n"
     << "  source tree hash : " << b.source_hash << "\n"
     << "  C++ compiler     : " << b.cxx_compiler << "\n"
     << "  CUDA backend     : " << (b.with_cuda ? "yes (nvcc " + b.cuda_compiler + ")" : "no (CPU reference only)") << "\n";
  if (b.with_cuda) {
    os << "  architectures    :";
    for (const auto& a : b.cuda_archs) os << " sm_" << a;
    os << "\n";
    os << "  CUDA devices     : " << cuda_device_count() << "\n";
  }
  return os.str();
}

}  // namespace fp4moe
