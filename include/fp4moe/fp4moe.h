// fp4moe: fused NVFP4 Mixture-of-Experts with multi-LoRA. Umbrella header.
#pragma once
#include "fp4moe/build_info.h"
#include "fp4moe/moe.h"
#include "fp4moe/nvfp4.h"
#include "fp4moe/types.h"
