// `fp4moe check` options: shapes, backend, problem size, activations and modes, and the JSON file.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "fp4moe/types.h"

namespace fp4moe::check {

struct Options {
  std::vector<std::string> shapes;
  std::string backend = "auto";
  int64_t tokens = 0, experts = 0;  // 0: the backend's default
  std::string json_path;
  bool child = false;
  std::vector<ActivationType> activations;  // empty: the shape's own plus SwiGLU/SiTU
  std::vector<ActMode> modes;               // empty: A16 and A4 (A16 alone for MXFP4)
  WeightFormat format = WeightFormat::NVFP4;  // the synthetic experts' format: NVFP4 or MXFP4
};

void usage(FILE* f);
// Returns "" on success, else the problem. "help" for --help.
std::string parse_options(int argc, char** argv, Options& o);

// ASCII lower case.
std::string lower(std::string s);

}  // namespace fp4moe::check
