// `fp4moe check` options: the usage text and the parser.
#include "check_options.h"

#include <cctype>
#include <cerrno>
#include <cstdlib>

#include "cli.h"
#include "fp4moe/model_shapes.h"

namespace fp4moe::check {
namespace {

using cli::split_list;

bool parse_int(const char* s, int64_t& out) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s, &end, 10);
  if (errno != 0 || end == s || *end != '\0') return false;
  out = v;
  return true;
}

}  // namespace

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

void usage(FILE* f) {
  std::fputs(
      "usage: fp4moe check [--shape NAME ...] [--backend cpu|cuda|auto] [--tokens T] [--experts E]\n"
      "                    [--activations swiglu,situ,...] [--modes a16,a4] [--format nvfp4|mxfp4] [--json FILE]\n"
      "  Runs the validation phases (individual adapters, eight adapters in one batch, mixed adapter and\n"
      "  base requests) and the invariants (zero-B, load/unload, base in a mixed batch, bridges, two\n"
      "  process launches; the gated shared expert of qwen3_next_80b_a3b) per shape, activation and A16/A4\n"
      "  mode, against the CPU reference.\n"
      "  Defaults: shapes qwen3_30b_a3b and kimi_k3_tp8; backend auto (CUDA when a GPU is usable);\n"
      "  CPU: 16 experts and 24 tokens (reduced, to end in about a minute); CUDA: the shape's experts, 64 tokens.\n"
      "  --format mxfp4 gives the experts MXFP4 weights (A16 only).\n"
      "  --child is internal: the re-launched process prints output hashes.\n",
      f);
}

std::string parse_options(int argc, char** argv, Options& o) {
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i] ? argv[i] : "";
    auto value = [&](std::string& dst) -> bool {
      if (i + 1 >= argc || !argv[i + 1]) return false;
      dst = argv[++i];
      return true;
    };
    std::string v;
    if (a == "--shape") {
      if (!value(v)) return "--shape needs a name";
      for (auto& s : split_list(v)) {
        if (!find_model_shape(s)) {
          std::string known;
          for (const auto& m : kModelShapes) known += std::string(known.empty() ? "" : ", ") + std::string(m.name);
          return "unknown shape '" + s + "' (known: " + known + ")";
        }
        o.shapes.push_back(s);
      }
    } else if (a == "--backend") {
      if (!value(v)) return "--backend needs cpu, cuda or auto";
      v = lower(v);
      if (v != "cpu" && v != "cuda" && v != "auto") return "--backend expects cpu, cuda or auto, got '" + v + "'";
      o.backend = v;
    } else if (a == "--tokens" || a == "--experts") {
      int64_t n = 0;
      if (!value(v) || !parse_int(v.c_str(), n) || n <= 0 || n > (1 << 20))
        return a + " expects a positive integer, got '" + v + "'";
      (a == "--tokens" ? o.tokens : o.experts) = n;
    } else if (a == "--json") {
      if (!value(o.json_path) || o.json_path.empty()) return "--json needs a file name";
    } else if (a == "--child") {
      o.child = true;
    } else if (a == "--activations") {
      if (!value(v)) return "--activations needs a list";
      for (auto& s : split_list(lower(v))) {
        if (s == "swiglu") o.activations.push_back(ActivationType::Swiglu);
        else if (s == "situ") o.activations.push_back(ActivationType::Situ);
        else if (s == "swiglubias" || s == "swiglu_bias") o.activations.push_back(ActivationType::SwigluBias);
        else return "--activations: unknown '" + s + "' (swiglu, situ, swiglubias)";
      }
    } else if (a == "--modes") {
      if (!value(v)) return "--modes needs a list";
      for (auto& s : split_list(lower(v))) {
        if (s == "a16") o.modes.push_back(ActMode::A16);
        else if (s == "a4") o.modes.push_back(ActMode::A4);
        else return "--modes: unknown '" + s + "' (a16, a4)";
      }
    } else if (a == "--format") {
      if (!value(v)) return "--format needs nvfp4 or mxfp4";
      v = lower(v);
      if (v == "nvfp4") o.format = WeightFormat::NVFP4;
      else if (v == "mxfp4") o.format = WeightFormat::MXFP4;
      else return "--format expects nvfp4 or mxfp4, got '" + v + "'";
    } else if (a == "--help" || a == "-h") {
      return "help";
    } else {
      return "unknown option '" + a + "'";
    }
  }
  if (o.shapes.empty()) o.shapes = {"qwen3_30b_a3b", "kimi_k3_tp8"};
  const bool mx = o.format == WeightFormat::MXFP4;
  if (o.modes.empty()) o.modes = mx ? std::vector<ActMode>{ActMode::A16} : std::vector<ActMode>{ActMode::A16, ActMode::A4};
  for (ActMode m : o.modes)
    if (mx && m == ActMode::A4) return "--modes a4 takes NVFP4 weights (MXFP4 runs in A16, SPEC §2)";
  return "";
}

}  // namespace fp4moe::check
