// MoE layers read straight from checkpoint directories (safetensors shards, model.safetensors.index.json,
// config.json, hf_quant_config.json): ModelOpt NVFP4 / W4A16_NVFP4 / MIXED_PRECISION and compressed-tensors
// nvfp4-pack-quantized per-expert tensors, gpt-oss's MXFP4 fused experts (quant_method "mxfp4": *_blocks,
// *_scales, *_bias, gate and up rows interleaved), and experts left in bf16 by the quantizer's ignore list. The
// format is read from the files, never guessed; only the tensors of the layer asked for are read.
// docs/checkpoints.md lists the names and what is refused. (The Python loader, fp4moe.checkpoint, also
// reads GPT-OSS-style fused bf16 experts.)
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "fp4moe/moe.h"
#include "fp4moe/quantize.h"
#include "fp4moe/types.h"

namespace fp4moe {

struct CheckpointOptions {
  Backend backend = Backend::CPU;  // where load_moe_layer prepares the weights
  int device_id = 0;
  int tp_rank = 0, tp_world = 1;   // this rank's I/tp_world intermediate rows (a multiple of 16; 32 for MXFP4)
  int ep_rank = 0, ep_world = 1;   // this rank's experts (expert_window of parallel.h)
  bool shared_expert = true;       // read the shared expert when the layer has one (under EP: rank 0 only)
};

// The router and the routing that reproduces it (SPEC §3.1). A config whose routing no method reproduces, or that
// the operator would refuse, is refused at load naming its key, so has_routing_method is true for every layer read.
struct CheckpointRouter {
  std::vector<float> weight;                   // [E, H], empty when the checkpoint has none
  std::vector<float> e_score_correction_bias;  // [E] (DeepSeek-V3 selection bias), or empty
  std::vector<float> bias;                     // [E] added to the logits (gpt-oss's router.bias), or empty
  bool has_routing_method = false;
  RoutingMethod routing_method = RoutingMethod::Renormalize;
  int64_t top_k = 0, num_experts = 0, n_group = 1, topk_group = 1;
  float routed_scaling_factor = 1.f;
};

struct CheckpointLayer {
  int layer = 0;
  std::string architecture;    // "Qwen3-MoE", "Mixtral", "DeepSeek-V3", ...
  std::string quantization;    // the checkpoint's quantization config, in words
  WeightFormat format = WeightFormat::NVFP4;
  OwnedWeights routed;         // this rank's experts as read (linear scales, gate rows first; MXFP4 codes and
                               // E8M0 scales as in the file, rows reordered)
  bool has_shared = false;
  OwnedWeights shared;         // E = 1
  // The shared expert's sigmoid gate (Qwen2-MoE, Qwen3-Next `shared_expert_gate.weight`), bf16 [H], converted from
  // the file's dtype (RNE); empty when the layer has none. Pass it as MoeArgs::shared_expert_gate (a host vector:
  // copy it to the device for the CUDA backend).
  std::vector<uint16_t> shared_expert_gate;
  MoeWeights weights, shared_expert;  // prepared by load_moe_layer (read_moe_layer leaves them empty)
  CheckpointRouter router;
  ActivationType activation = ActivationType::Swiglu;
  ActMode mode = ActMode::A16;        // A4 when every expert carries input scales (W4A4 checkpoints)
  std::string mode_reason;            // why A16 (e.g. the expert whose input_scale is missing); "" in A4
  float fc1_input_scale = 0.f, fc2_input_scale = 0.f;  // dequant scales; the largest over the experts
  int64_t num_experts = 0, local_expert_offset = 0, num_local_experts = 0;
  uint64_t bytes_read = 0;
};

// Reads layer `layer` of the checkpoint at `dir` into host arrays. Throws Error (argument "checkpoint",
// NotFound for missing files or tensors, Unsupported for a quantization fp4moe does not read,
// InvalidArgument otherwise) whose message names the file and the tensor.
CheckpointLayer read_moe_layer(const std::string& dir, int layer, const CheckpointOptions& opt = {});
// read_moe_layer, then prepare_weights of the routed experts (and the shared expert) on opt.backend.
// Inline so that the reader itself links without the operator (the fuzz target builds it alone).
inline CheckpointLayer load_moe_layer(const std::string& dir, int layer, const CheckpointOptions& opt = {}) {
  CheckpointLayer l = read_moe_layer(dir, layer, opt);
  l.weights = prepare_weights(l.routed.desc(), opt.backend, opt.device_id);
  if (l.has_shared) l.shared_expert = prepare_weights(l.shared.desc(), opt.backend, opt.device_id);
  return l;
}

struct CheckpointLayerInfo {
  int layer = 0;
  bool loadable = false;
  std::string reason;  // why it would be refused
  std::string architecture, format, shared;
  int64_t experts = 0, hidden = 0, inter = 0;
  uint64_t bytes = 0;
  bool router = false, correction_bias = false;
  std::string routing;  // the routing method's name, or "" when unknown
  int64_t top_k = 0;
  std::string mode, mode_reason;  // "a4" or "a16", and why A16 (CheckpointLayer's)
};
struct CheckpointInfo {
  std::string path, model_type, quantization;
  std::vector<std::string> files;
  bool index = false;
  int64_t tensors = 0;
  uint64_t bytes = 0;
  std::vector<CheckpointLayerInfo> layers;
};
// The checkpoint's MoE layers and what read_moe_layer would do with each (headers only, no tensor data).
CheckpointInfo inspect_checkpoint(const std::string& dir);
std::string format_checkpoint_info(const CheckpointInfo& info);

}  // namespace fp4moe
