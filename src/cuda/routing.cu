// Routing from logits (SPEC §3.1), one warp per token (routing.cuh); at small batches route_permute.cu runs the
// same routing and the permutation in one block.
#include "cuda/pdl.cuh"
#include "cuda/routing.cuh"

namespace fp4moe::cuda_backend {
namespace {

__global__ void routing_kernel(RoutingParams p) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  extern __shared__ float smem[];
  const int warp = threadIdx.x >> 5;
  const int t = blockIdx.x * (blockDim.x >> 5) + warp;
  if (t >= p.T) return;
  float* sel = smem + warp * routing_floats_per_warp(p.E);
  routing_dev::route_token(p, t, sel, reinterpret_cast<uint32_t*>(sel + p.E), sel + 2 * p.E);
}

}  // namespace

void launch_routing(const RoutingParams& p, int warps_per_block, size_t smem, cudaStream_t stream) {
  if (p.T <= 0) return;
  const int blocks = (p.T + warps_per_block - 1) / warps_per_block;
  if (smem > 48 * 1024)
    check_cuda(cudaFuncSetAttribute(routing_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
               "cudaFuncSetAttribute(routing_kernel)");
  launch_pdl(routing_kernel, dim3(blocks), dim3(32 * warps_per_block), smem, stream, "routing_kernel", p);
}

}  // namespace fp4moe::cuda_backend
