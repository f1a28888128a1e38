// Routing and permutation in one block, for a chunk of few tokens routed from logits (plan: route_permute_fused):
// at decode the two were two dependent launches of one busy warp or block each. Warp w routes token w (routing.cuh),
// then the block permutes the chunk's entries (permute.cuh): the same ids, weights, rows and tiles as the two
// kernels, bit for bit.
#include <stdexcept>

#include "cuda/pdl.cuh"
#include "cuda/permute.cuh"
#include "cuda/routing.cuh"

namespace fp4moe::cuda_backend {
namespace {

__global__ void __launch_bounds__(permute_dev::kScanThreads) route_permute_kernel(RoutingParams rp, PermuteParams pp) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  extern __shared__ float smem[];
  const int warp = threadIdx.x >> 5;
  if (warp < rp.T) {
    float* sel = smem + warp * routing_floats_per_warp(rp.E);
    routing_dev::route_token(rp, warp, sel, reinterpret_cast<uint32_t*>(sel + rp.E), sel + 2 * rp.E);
  }
  __syncthreads();  // the block's ids (global memory) are visible to all its threads
  permute_dev::permute_in_one_block(pp);
}

}  // namespace

void launch_route_permute(const RoutingParams& rp, const PermuteParams& pp, int threads, size_t smem,
                          cudaStream_t stream) {
  if (rp.T <= 0) return;
  // make_plan's promise (tests/cpp/test_plan.cpp): a warp a token, all entries in one block.
  if (rp.T * 32 > threads || pp.num_blocks != 1 || pp.ids != rp.ids)
    throw std::logic_error("route_permute_kernel: the plan does not fit one block");
  if (smem > 48 * 1024)
    check_cuda(cudaFuncSetAttribute(route_permute_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)),
               "cudaFuncSetAttribute(route_permute_kernel)");
  launch_pdl(route_permute_kernel, dim3(1), dim3(threads), smem, stream, "route_permute_kernel", rp, pp);
}

}  // namespace fp4moe::cuda_backend
