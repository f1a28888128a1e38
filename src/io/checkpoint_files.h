// The checkpoint reader's files (src/io/checkpoint_files.cpp): a checkpoint directory's config files, its
// quantization config and tensor table, checked tensor headers and the tensors of one linear; and what its
// config.json says of routing and activation (checkpoint_config.cpp). Used by checkpoint.cpp, which plans and
// reads MoE layers from them (include/fp4moe/checkpoint.h).
#pragma once
#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fp4moe/checkpoint.h"
#include "fp4moe/types.h"
#include "io/json.h"
#include "io/safetensors.h"

namespace fp4moe::ckpt {

namespace fs = std::filesystem;
namespace st = safetensors;

inline constexpr const char* kArg = "checkpoint";

[[noreturn]] void fail(const std::string& what, ErrorCode code = ErrorCode::InvalidArgument);
// A message of a lower layer without its "argument '...': " prefix (we name our own argument).
std::string bare(const Error& e);

const json::Value* member(const json::Value* v, const char* key);
std::string str_of(const json::Value* v, const std::string& dflt = "");
double num_of(const json::Value* v, double dflt);
bool bool_of(const json::Value* v, bool dflt);

// The checkpoint's quantization config (hf_quant_config.json or config.json quantization_config).
struct Quant {
  std::string method = "none";  // "modelopt" | "compressed-tensors" | "mxfp4" (gpt-oss experts) | "none"
  std::string algo, source;
  bool a4 = false;
  std::vector<std::string> exclude, targets;
  bool mixed = false;
  std::map<std::string, std::string> layers;

  std::string describe() const;
  // Whether the config says `module` (a linear's name, without .weight) is NVFP4.
  bool quantized(const std::string& module) const;
};

// A checkpoint directory: config files, quantization config, {tensor: file} and the opened shards.
struct Store {
  fs::path root;
  std::optional<json::Value> config, hfq;
  std::map<std::string, std::string> where;  // tensor -> file name
  std::map<std::string, std::unique_ptr<st::File>> files;
  bool index = false;
  Quant quant;

  explicit Store(const std::string& dir);
  const st::File& file(const std::string& fname);
  bool has(const std::string& name) const { return where.count(name) != 0; }
  std::string path_of(const std::string& name) const { return (root / where.at(name)).string(); }
  const st::TensorInfo& info(const std::string& name);
  std::string model_type() const;
  const json::Value* text_config() const;

 private:
  void detect_quant();
};

std::string shape_str(const std::vector<int64_t>& s);
// A checked tensor: one of `dtypes`, of `shape` (-1 entries match anything).
const st::TensorInfo& expect(Store& s, const std::string& name, std::initializer_list<const char*> dtypes,
                             const std::vector<int64_t>& shape, const std::string& where = "");
const st::TensorInfo& expect_scalar(Store& s, const std::string& name);

// The tensors of one [n, k] linear: NVFP4 (weight, block scale, scale2, input scale) or float.
struct Linear {
  std::string module;
  bool nvfp4 = false;
  std::string w, scale, scale2, input;  // tensor names ("" when absent)
  std::string input_name;               // the input scale's name (NVFP4), present or not
  bool inverse = false;                 // compressed-tensors stores encode scales
  uint64_t bytes = 0;
};
// Finds and checks module's tensors; the format comes from the tensors and must agree with the config.
Linear plan_linear(Store& s, const std::string& module, int64_t n, int64_t k);

// ---- the config (checkpoint_config.cpp) ----------------------------------------------------------------------
// The routing (SPEC §3.1) that reproduces the model's router, from config.json, for a layer of E experts; what no
// routing method reproduces or the operator would refuse is refused naming the config key.
void routing_of(Store& s, int64_t E, CheckpointRouter& r);
// The experts' activation from config.json's hidden_act.
ActivationType activation_of(Store& s);

}  // namespace fp4moe::ckpt
