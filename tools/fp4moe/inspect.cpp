// fp4moe inspect CHECKPOINT: the checkpoint's MoE layers, their formats, shapes and bytes, and what
// fp4moe would load or refuse: the checks of load (headers, config files, the layer's scalar scales; no weight
// data is read). Exits 1 when a layer would be refused.
#include <cstdio>
#include <cstring>
#include <string>

#include "fp4moe/checkpoint.h"

int run_inspect(int argc, char** argv) {
  if (argc != 1 || !std::strcmp(argv[0], "--help")) {
    std::puts("usage: fp4moe inspect CHECKPOINT_DIR\n"
              "  lists the MoE layers of a safetensors checkpoint (ModelOpt NVFP4, compressed-tensors\n"
              "  nvfp4-pack-quantized, bf16): format, E, H, I, bytes, and what would load or be refused\n"
              "  (the checks of load; exit status 1 when a layer would be refused)");
    return argc == 1 ? 0 : 2;
  }
  const fp4moe::CheckpointInfo info = fp4moe::inspect_checkpoint(argv[0]);
  std::fputs(fp4moe::format_checkpoint_info(info).c_str(), stdout);
  for (const auto& l : info.layers)
    if (!l.loadable) return 1;  // a layer would be refused
  return 0;
}
