// Deterministic expert histogram and token permutation (no order-dependent atomics):
//   1. count: each block (one warp) counts its run of (token, slot) entries per local expert;
//   2. scan (one block): per expert, exclusive prefix over blocks; expert offsets; the tile list;
//   3. place: each block walks its entries in order and gives entry i of expert e the next row of e,
//      so rows of an expert are in (token, slot) order whatever the scheduling.
// A chunk of one block's entries runs the three steps in one kernel (permute_one_block_kernel; with LoRA at decode,
// a block of the x shrink's kernel: permute_one_block.cuh); a chunk of kMidPermAbove to kMidPermEntries entries,
// in one block of 32 warps that each count their own run, then place it by the ranks kept (permute_mid_kernel).
// With LoRA, order_by_adapter_kernel then sorts each expert's rows by (adapter slot, entry), so that a GEMM tile's
// 8- or 16-row fragments hold few adapters (the epilogue's expand makes one pass per adapter of a fragment). A row's
// result does not depend on its position, so the order changes no bits.
// Ids outside [0, E_total) are dropped and raise the device error flag (never an out-of-bounds access).
#include <algorithm>

#include "cuda/kernels.h"
#include "cuda/pdl.cuh"
#include "cuda/permute_one_block.cuh"

namespace fp4moe::cuda_backend {
namespace {

using perm::local_expert;
using perm::offsets_and_tiles;
using perm::place_entries;

__global__ void count_kernel(PermuteParams p) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  extern __shared__ int cnt[];
  const int lane = threadIdx.x;
  for (int e = lane; e < p.E_loc; e += 32) cnt[e] = 0;
  __syncwarp();
  const int begin = blockIdx.x * p.entries_per_block;
  const int end = min(begin + p.entries_per_block, p.rows);
  bool bad = false;
  for (int i = begin + lane; i < end; i += 32) {
    const int e = local_expert(p, i);
    if (e >= 0) atomicAdd(&cnt[e], 1);  // integer counts: the result does not depend on the order
    bad |= e == -2;
  }
  if (__any_sync(0xffffffffu, bad) && lane == 0) atomicExch(p.error_flag, 1);
  __syncwarp();
  int32_t* out = p.block_counts + static_cast<int64_t>(blockIdx.x) * p.E_loc;
  for (int e = lane; e < p.E_loc; e += 32) out[e] = cnt[e];
}

constexpr int kScanThreads = 1024;

__global__ void __launch_bounds__(kScanThreads) scan_kernel(PermuteParams p) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  __shared__ int offs[4097];   // expert row offsets (exclusive), then the total
  __shared__ int toffs[4097];  // expert tile offsets
  const int E = p.E_loc;
  // Per expert: exclusive prefix over blocks (in place), total rows. 16 blocks' counts are loaded before any is
  // overwritten: one load at a time (a store between) took kimi_k3_tp8 T=4096's 1024 blocks 35 us, eight at a time
  // T=16384's 4096 blocks 49 us (ncu).
  constexpr int U = 16;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int run = 0;
    int32_t* c = p.block_counts + e;  // block b0's count; 32-bit offsets u * E from it (E * U < 2^31)
    for (int b0 = 0; b0 < p.num_blocks; b0 += U, c += static_cast<int64_t>(U) * E) {
      int v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = b0 + u < p.num_blocks ? c[u * E] : 0;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (b0 + u < p.num_blocks) c[u * E] = run;
        run += v[u];
      }
    }
    offs[e] = run;
  }
  __syncthreads();
  offsets_and_tiles(p, offs, toffs);
}

__global__ void __launch_bounds__(kScanThreads) permute_one_block_kernel(PermuteParams p) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  perm::one_block(p);
}

// count, scan and place of a chunk of entries in one block of kMidWarps warps (plan.h kMidPermEntries): warp w counts
// its own run of entries in order (as count_kernel's blocks do), each entry's rank among its expert's entries of the
// run kept beside its expert; then, with the runs' counts scanned, every entry's row is known and its warp writes it.
// The [kMidWarps][E_loc] table holds each warp's counts, then the rows of each expert before the warp's run.
// Dynamic shared memory: mid_smem_bytes.
constexpr int kMidWarps = 32, kMidMaxRows = 32767;  // rows in int16
constexpr int kMidIdLoads = 8;                       // ids a thread loads before it stores any (one latency, not 8)
size_t mid_smem_bytes(int rows, int E) {
  return static_cast<size_t>(2 * (E + 1)) * sizeof(int) + static_cast<size_t>(kMidWarps * E + 2 * rows) * sizeof(int16_t);
}
__global__ void __launch_bounds__(kMidWarps * 32) permute_mid_kernel(PermuteParams p) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  extern __shared__ int mid_smem[];
  constexpr int nt = kMidWarps * 32;
  const int E = p.E_loc, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int* offs = mid_smem;                                        // [E + 1] rows an expert, then its first row
  int* toffs = offs + E + 1;                                   // [E + 1] tile offsets
  int16_t* table = reinterpret_cast<int16_t*>(toffs + E + 1);  // [kMidWarps][E] counts, then rows before the warp's
  int16_t* s_exp = table + kMidWarps * E;                      // [rows] each entry's local expert (-1: none)
  int16_t* s_rank = s_exp + p.rows;                            // [rows] its rank in its expert's entries of its run
  for (int i = threadIdx.x; i < kMidWarps * E; i += nt) table[i] = 0;
  for (int c = threadIdx.x; c < p.num_counters; c += nt) p.zero_counters[c] = 0;
  bool bad = false;
  for (int i0 = threadIdx.x; i0 < p.rows; i0 += kMidIdLoads * nt) {
    int e[kMidIdLoads];
#pragma unroll
    for (int u = 0; u < kMidIdLoads; ++u) e[u] = i0 + u * nt < p.rows ? local_expert(p, i0 + u * nt) : -1;
#pragma unroll
    for (int u = 0; u < kMidIdLoads; ++u) {
      if (i0 + u * nt < p.rows) s_exp[i0 + u * nt] = static_cast<int16_t>(max(e[u], -1));
      bad |= e[u] == -2;
    }
  }
  if (bad) atomicExch(p.error_flag, 1);
  __syncthreads();
  const int run = (p.rows + nt - 1) / nt * 32;  // entries a warp, a multiple of 32
  const int begin = min(p.rows, warp * run), end = min(p.rows, begin + run);
  int16_t* mine = table + warp * E;
  const unsigned lt = (1u << lane) - 1u;
  const int bits = perm::expert_bits(E);
  for (int i0 = begin; i0 < end; i0 += 32) {
    const int i = i0 + lane;
    const int key = i < end ? static_cast<int>(s_exp[i]) : -1;
    const unsigned peers = perm::match_key(key, bits);
    const int before = key >= 0 ? mine[key] : 0;
    __syncwarp();
    if (key >= 0) {
      s_rank[i] = static_cast<int16_t>(before + __popc(peers & lt));
      if ((peers >> lane) == 1u) mine[key] = static_cast<int16_t>(before + __popc(peers));  // the group's highest lane
    }
    __syncwarp();
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += nt) {  // per expert: the rows before each warp's, and the total
    int rows = 0;
    for (int w = 0; w < kMidWarps; ++w) {
      const int n = table[w * E + e];
      table[w * E + e] = static_cast<int16_t>(rows);
      rows += n;
    }
    offs[e] = rows;
  }
  __syncthreads();
  offsets_and_tiles(p, offs, toffs);
  for (int i = begin + lane; i < end; i += 32) {  // each warp places its own run's entries
    const int key = s_exp[i];
    if (key >= 0) p.row_entry[offs[key] + mine[key] + s_rank[i]] = i;
  }
}

__global__ void place_kernel(PermuteParams p) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  extern __shared__ int next[];
  const int32_t* base = p.block_counts + static_cast<int64_t>(blockIdx.x) * p.E_loc;
  for (int e = threadIdx.x; e < p.E_loc; e += 32) next[e] = p.expert_offsets[e] + base[e];
  __syncwarp();
  const int begin = blockIdx.x * p.entries_per_block;
  place_entries(p, next, begin, min(begin + p.entries_per_block, p.rows), nullptr);
}

// One block per (local expert, segment of kMaxOrderRows rows): the segment's rows re-ordered in place by (token
// slot, entry); the rank of a row is the number of the segment's rows before it in that order. A larger expert's
// segments are ordered each on its own: its GEMM tiles (rows from a multiple of bm, which divides kMaxOrderRows)
// still mostly hold one adapter (in entry order, every tile of a large expert held all its adapters and the expand
// ran a pass per adapter: bench/NOTES.md).
constexpr int kMaxOrderRows = 2048;
constexpr bool every_tile_divides_order_rows() {
  for (const GemmConfig& c : kGemmConfigs)
    if (kMaxOrderRows % c.bm != 0) return false;
  return true;
}
static_assert(every_tile_divides_order_rows(), "a GEMM tile would straddle two ordered segments");
__global__ void __launch_bounds__(256) order_by_adapter_kernel(PermuteParams p) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  __shared__ int s_entry[kMaxOrderRows], s_key[kMaxOrderRows];
  const int e = static_cast<int>(blockIdx.x);
  const int lo0 = p.expert_offsets[e], n_all = p.expert_offsets[e + 1] - lo0;
  for (int seg = static_cast<int>(blockIdx.y); seg * kMaxOrderRows < n_all; seg += static_cast<int>(gridDim.y)) {
    const int lo = lo0 + seg * kMaxOrderRows, n = min(kMaxOrderRows, n_all - seg * kMaxOrderRows);
    if (n <= 1) return;  // the last segment
    __syncthreads();     // the previous segment's ranks are done with s_key
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const int entry = p.row_entry[lo + i];
      s_entry[i] = entry;
      s_key[i] = p.token_slot[entry / p.k];  // -1 (base) first
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const int key = s_key[i];
      int rank = 0;
      for (int j = 0; j < n; ++j) rank += s_key[j] < key || (s_key[j] == key && j < i);
      p.row_entry[lo + rank] = s_entry[i];
    }
  }
}

}  // namespace

void launch_order_by_adapter(const PermuteParams& p, cudaStream_t stream) {
  if (p.rows <= 0 || !p.token_slot) return;
  // Blocks an expert: as many as the chunk's rows could make segments of one expert, within about 4096 blocks in
  // all (most experts have far fewer rows; their extra blocks return at once) and 64 an expert; a block takes every
  // gridDim.y-th segment.
  const int64_t segments = std::clamp<int64_t>(
      std::min<int64_t>((p.rows + kMaxOrderRows - 1) / kMaxOrderRows, 4096 / std::max(p.E_loc, 1)), 1, 64);
  launch_pdl(order_by_adapter_kernel, dim3(static_cast<unsigned>(p.E_loc), static_cast<unsigned>(segments)), dim3(256), 0,
             stream, "order_by_adapter_kernel", p);
}

void launch_permute(const PermuteParams& p, cudaStream_t stream) {
  if (p.rows <= 0) return;
  if (p.mid && p.rows <= kMidMaxRows && p.E_loc <= kMidPermExperts) {
    const size_t smem = mid_smem_bytes(p.rows, p.E_loc);
    if (smem > 48 * 1024)
      check_cuda(cudaFuncSetAttribute(permute_mid_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
                 "cudaFuncSetAttribute(permute_mid_kernel)");
    launch_pdl(permute_mid_kernel, dim3(1), dim3(kMidWarps * 32), smem, stream, "permute_mid_kernel", p);
    return;
  }
  if (p.num_blocks == 1) {
    const int threads = p.rows <= 256 && p.E_loc <= 1024 ? 256 : kScanThreads;
    launch_pdl(permute_one_block_kernel, dim3(1), dim3(threads), 0, stream, "permute_one_block_kernel", p);
    return;
  }
  const size_t smem = static_cast<size_t>(p.E_loc) * sizeof(int);
  launch_pdl(count_kernel, dim3(p.num_blocks), dim3(32), smem, stream, "count_kernel", p);
  launch_pdl(scan_kernel, dim3(1), dim3(kScanThreads), 0, stream, "scan_kernel", p);
  launch_pdl(place_kernel, dim3(p.num_blocks), dim3(32), smem, stream, "place_kernel", p);
}

}  // namespace fp4moe::cuda_backend
