// Internal parts of the CUDA backend shared by its files: the device copy of an adapter (uploaded by
// weights_upload.cu, read by lora_table.cu) and the LoRA slot table of a registry snapshot.
#pragma once
#include <cuda_runtime.h>

#include <vector>

#include "cuda/kernels.h"
#include "runtime/prepared.h"

namespace fp4moe::cuda_backend {

// An adapter's canonical matrices on one device (PreparedAdapter::device).
struct DeviceAdapter {
  std::vector<void*> allocations;
  const uint16_t *A1 = nullptr, *B1 = nullptr, *A2 = nullptr, *B2 = nullptr;
  const uint16_t *sA1 = nullptr, *sB1 = nullptr, *sA2 = nullptr, *sB2 = nullptr;
  int device_id = 0;
  ~DeviceAdapter() {
    for (void* p : allocations) (void)cudaFree(p);
  }
};

// The kernels' LoraSlot array of an adapter snapshot on device `dev` (current), built once per snapshot and cached
// while it lives; thread-safe (lora_table.cu).
const LoraSlot* lora_table_for(const AdapterSnapshot& snap, int dev, cudaStream_t stream);

}  // namespace fp4moe::cuda_backend
