// libFuzzer target for fp4moe's readers of untrusted files: the JSON parser, the safetensors reader and
// the PEFT adapter reader (config + tensors -> per-expert LoRA). Any input must end in a result or an
// fp4moe::Error; a crash, a sanitizer report, a hang or any other exception is a bug.
//
// One input feeds all three:
//   1. the whole input as JSON text;
//   2. the whole input as a safetensors image (every tensor read raw and as bf16);
//   3. a PEFT adapter: byte 0 = read options, bytes 1-2 = little-endian length L of the
//      adapter_config.json text that follows, the rest = adapter_model.safetensors. Small inputs are
//      also written to a directory and read through the public file API (read_peft_experts_lora).
//   4. the same split as a checkpoint directory (options bit 0x40): config.json (and, with bit 0x20,
//      hf_quant_config.json) = the JSON text, model.safetensors = the image; inspect_checkpoint and
//      read_moe_layer of each layer it lists.
// Build and run: tools/fuzz/run_fuzz.sh.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "fp4moe/checkpoint.h"
#include "fp4moe/peft.h"
#include "fp4moe/types.h"
#include "io/json.h"
#include "io/peft.h"
#include "io/safetensors.h"

namespace {

using fp4moe::Error;
namespace st = fp4moe::safetensors;

// Touches every field the reader produced, so that the sanitizers see reads of all of it.
void consume(const fp4moe::PeftExpertsLora& l) {
  volatile uint64_t sink = 0;
  for (const auto* v : {&l.a_gate_up, &l.b_gate_up, &l.a_down, &l.b_down})
    for (uint16_t x : *v) sink = sink + x;
  const fp4moe::LoraAdapterDesc d = l.desc();
  sink = sink + static_cast<uint64_t>(d.rank) + (d.a_gate_up.present() ? d.a_gate_up.numel() : 0) +
         (d.a_down.present() ? d.a_down.numel() : 0);
  (void)sink;
}

void exercise_file(const st::File& f) {
  volatile uint64_t sink = 0;
  for (const st::TensorInfo& t : f.tensors()) {
    const std::vector<uint8_t> raw = f.read(t);
    if (raw.size() != t.end - t.begin) std::abort();  // the reader's own contract
    if (f.find(t.name) == nullptr) std::abort();
    try {
      const std::vector<uint16_t> b = f.read_bf16(t);
      if (static_cast<int64_t>(b.size()) != t.numel()) std::abort();
      for (uint16_t x : b) sink = sink + x;
    } catch (const Error&) {
    }
  }
  for (const auto& [k, v] : f.metadata()) sink = sink + k.size() + v.size();
  (void)sink;
}

void read_peft(const st::File& f, const fp4moe::PeftConfig& cfg, uint8_t opt_byte) {
  std::vector<std::string> modules = fp4moe::peft::list_expert_modules(f);
  modules.push_back("");  // also a prefix that usually names nothing
  fp4moe::PeftReadOptions opt;
  opt.num_experts = (opt_byte & 3) == 3 ? 0 : (opt_byte & 3);
  opt.expert_offset = (opt_byte >> 2) & 3;
  opt.num_local_experts = (opt_byte >> 4) & 3;
  int tried = 0;
  for (const std::string& m : modules) {
    if (++tried > 4) break;
    opt.module_prefix = m;
    try {
      consume(fp4moe::peft::read_experts_lora(f, cfg, opt));
    } catch (const Error&) {
    }
  }
}

// The public path: files on disk (only for small inputs, to keep the fuzzer fast).
void read_peft_from_disk(std::string_view config, const uint8_t* st_data, size_t st_size, uint8_t opt_byte) {
  static const std::string dir = [] {
    char tmpl[] = "/tmp/fp4moe_fuzz_XXXXXX";
    const char* d = mkdtemp(tmpl);
    if (!d) std::abort();
    return std::string(d);
  }();
  auto write = [](const std::string& path, const void* p, size_t n) {
    FILE* f = std::fopen(path.c_str(), "wb");
    if (!f) std::abort();
    if (n && std::fwrite(p, 1, n, f) != n) std::abort();
    std::fclose(f);
  };
  write(dir + "/adapter_config.json", config.data(), config.size());
  write(dir + "/adapter_model.safetensors", st_data, st_size);
  try {
    const fp4moe::PeftConfig cfg = fp4moe::read_peft_config(dir + "/adapter_config.json");
    for (const std::string& m : fp4moe::list_peft_expert_modules(dir)) {
      fp4moe::PeftReadOptions opt;
      opt.module_prefix = m;
      opt.expert_offset = (opt_byte >> 2) & 1;
      consume(fp4moe::read_peft_experts_lora(dir, opt));
      break;
    }
  } catch (const Error&) {
  }
}

// A checkpoint directory on disk (small inputs only): the MoE layer reader over config files and one shard.
void read_checkpoint_from_disk(std::string_view config, const uint8_t* st_data, size_t st_size, uint8_t opt_byte) {
  static const std::string dir = [] {
    char tmpl[] = "/tmp/fp4moe_fuzz_ckpt_XXXXXX";
    const char* d = mkdtemp(tmpl);
    if (!d) std::abort();
    return std::string(d);
  }();
  auto write = [](const std::string& path, const void* p, size_t n) {
    FILE* f = std::fopen(path.c_str(), "wb");
    if (!f) std::abort();
    if (n && std::fwrite(p, 1, n, f) != n) std::abort();
    std::fclose(f);
  };
  write(dir + "/config.json", config.data(), config.size());
  const std::string hq = dir + "/hf_quant_config.json";
  if (opt_byte & 0x20) write(hq, config.data(), config.size());
  else std::remove(hq.c_str());
  write(dir + "/model.safetensors", st_data, st_size);
  try {
    const fp4moe::CheckpointInfo info = fp4moe::inspect_checkpoint(dir);
    (void)fp4moe::format_checkpoint_info(info);
    for (const auto& l : info.layers) {
      try {
        fp4moe::CheckpointOptions o;
        o.tp_world = (opt_byte & 1) ? 2 : 1;
        o.ep_world = (opt_byte & 2) ? 2 : 1;
        const fp4moe::CheckpointLayer r = fp4moe::read_moe_layer(dir, l.layer, o);
        volatile uint64_t sink = r.routed.w1.size() + r.routed.w1_bf16.size() + r.router.weight.size();
        (void)sink;
      } catch (const Error&) {
      }
    }
  } catch (const Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > (1u << 20)) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data), size);

  // 1. JSON.
  try {
    const fp4moe::json::Value v = fp4moe::json::parse(text, "fuzz");
    (void)fp4moe::json::find(v, "r");
  } catch (const Error&) {
  }

  // 2. The whole input as a safetensors image.
  try {
    exercise_file(st::File::from_bytes(std::vector<uint8_t>(data, data + size), "fuzz"));
  } catch (const Error&) {
  }

  // 3. PEFT: [options][u16 L][config (L bytes)][safetensors image].
  if (size >= 3) {
    const uint8_t opt_byte = data[0];
    const size_t len = std::min<size_t>(data[1] | (static_cast<size_t>(data[2]) << 8), size - 3);
    const std::string_view config(reinterpret_cast<const char*>(data + 3), len);
    const uint8_t* st_data = data + 3 + len;
    const size_t st_size = size - 3 - len;
    try {
      const fp4moe::PeftConfig cfg = fp4moe::peft::parse_config(config, "fuzz");
      const st::File f = st::File::from_bytes(std::vector<uint8_t>(st_data, st_data + st_size), "fuzz");
      read_peft(f, cfg, opt_byte);
    } catch (const Error&) {
    }
    if (size <= 4096 && (opt_byte & 0x80)) read_peft_from_disk(config, st_data, st_size, opt_byte);
    if (size <= 8192 && (opt_byte & 0x40)) read_checkpoint_from_disk(config, st_data, st_size, opt_byte);
  }
  return 0;
}
