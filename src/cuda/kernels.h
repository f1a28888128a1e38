// Internal interface of the CUDA backend: the prepared device weights and the parameter blocks and
// host launchers of each kernel. Layering (CUTLASS-like):
//   nvfp4_device.cuh, mma.cuh   tile math: decode, quantize, tensor-core fragments
//   gemm_mainloop.cuh           one block tile: cp.async pipeline + decode + mma.sync
//   gemm_grouped.cuh            scheduling (tile -> expert, rows) and the epilogues
//   *.cu                        host launchers (this header), backend.cu orchestrates a call.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "common/activation.h"
#include "fp4moe/plan.h"
#include "fp4moe/types.h"

namespace fp4moe::cuda_backend {

// ---- prepared weights on the device ------------------------------------------------------------
// Kernel layout of one [N, K] weight matrix per expert, K padded to Kp = roundup(K, 64) with zeros and
// stored k-block-major, so that one block tile (bn rows x 64 K) is a contiguous run of bytes:
//   NVFP4 data  [E][Kp/64][N][32 bytes]   within a row's 32 bytes, lane t of a quad finds its mma B
//                                          fragments for the 4 k16 steps at bytes t*8 .. t*8+7:
//                                          new[t*8 + s*2 + h] = old[s*8 + t + 4h]
//   NVFP4 scale [E][Kp/64][N][4]          the 4 E4M3 block scales of the row's 64 K
//   BF16 data   [E][Kp/64][N][64 elems]   new[t*16 + s*4 + q] = old[s*16 + 2t + {0,1,8,9}[q]]
// Gated W1 rows are interleaved: prepared row 2j = gate row j, 2j+1 = up row j (whatever the weights'
// half order), so one thread's accumulator pair (c0, c1) holds the gate and up of the same j.
struct DeviceMatrix {
  const uint8_t* data = nullptr;
  const uint8_t* sf = nullptr;  // NVFP4 only
  int64_t N = 0, K = 0, Kp = 0;
  int64_t expert_data_bytes = 0, expert_sf_bytes = 0;
};

struct DeviceWeights {
  int device_id = 0;
  WeightFormat format = WeightFormat::NVFP4;
  GateUpOrder order = GateUpOrder::GateFirst;
  bool gated = true;
  int64_t E = 0, H = 0, I = 0, N1 = 0;
  DeviceMatrix w1, w2;
  const float* s1_even = nullptr;  // [E] scale of prepared W1 rows 2j (gate; the only half when not gated)
  const float* s1_odd = nullptr;   // [E] scale of prepared W1 rows 2j+1 (up)
  const float* s2 = nullptr;       // [E]
  const float* bias1 = nullptr;    // [E][N1] in prepared row order, or null
  const float* bias2 = nullptr;    // [E][H], or null
  std::vector<void*> allocations;
  ~DeviceWeights();
};

// ---- kernel parameter blocks --------------------------------------------------------------------
struct RoutingParams {
  const void* logits = nullptr;  // [T, E_total] f32 or bf16 (chunk-offset)
  bool logits_bf16 = false;
  const float* bias = nullptr;   // [E_total] or null
  int method = 0;
  int T = 0, E = 0, k = 0;
  int n_group = 1, topk_group = 1;
  float routed_scaling_factor = 1.f;
  int32_t* ids = nullptr;        // [T, k] out
  float* weights = nullptr;      // [T, k] out
};

struct PermuteParams {
  const int32_t* ids = nullptr;  // [rows] (token, slot) entries, global expert ids
  int rows = 0;                  // entries in this chunk
  int E_total = 0, E_loc = 0, local_offset = 0;
  int entries_per_block = 0, num_blocks = 0;
  int bm = 0, max_tiles = 0;
  int32_t* block_counts = nullptr;    // [num_blocks, E_loc]
  int32_t* expert_offsets = nullptr;  // [E_loc + 1]
  int32_t* tile_info = nullptr;       // [max_tiles, 2] + count
  int32_t* row_entry = nullptr;       // [rows]
  int* error_flag = nullptr;
};

// A grouped GEMM: C[r, :] = A[row(r), :] . B_e^T for the rows r of each tile; see gemm_grouped.cuh.
struct GemmProblem {
  const uint16_t* A = nullptr;     // bf16 rows
  int64_t lda = 0;                 // elements
  int K = 0;                       // valid K (multiple of 16); A columns beyond it read as 0
  const int32_t* row_entry = nullptr;  // permuted row -> entry (null: dense, entry = row)
  int gather_k = 0;                // A row = entry / gather_k (0: A row = permuted row)
  const int32_t* tile_info = nullptr;  // routed tiles (null: dense tiles over dense_rows)
  const int32_t* expert_offsets = nullptr;
  int max_tiles = 0;
  int dense_rows = 0;
  DeviceMatrix B;
};

// GEMM1 epilogue: h = acc * s_half[e] * row_scale[token] (+bias) (+delta); a = act(g, u); bf16.
struct Epilogue1Params {
  const float* s_even = nullptr;
  const float* s_odd = nullptr;
  const float* row_scale = nullptr;  // per token (A4 x dequant scale) or null (1)
  int token_div = 1;                 // token = entry / token_div
  const float* bias = nullptr;       // [E][N1] prepared order
  const uint16_t* delta = nullptr;   // bf16 [entries][N1] in the weights' half order, or null
  bool gate_first = true;
  const float* alpha = nullptr;      // per expert activation parameters or null (defaults)
  const float* beta = nullptr;
  const float* limit = nullptr;
  act::Params defaults;
  uint16_t* out = nullptr;           // bf16 [rows][I] by permuted row
  uint16_t* act_out = nullptr;       // bf16 [entries][I] bridge or null
  int I = 0, N1 = 0;
};

// GEMM2 epilogue: o = acc * (s2[e] * in_scale) (+bias) + 0, f32 [entries][H].
struct Epilogue2Params {
  const float* s2 = nullptr;
  float in_scale = 1.f;
  const float* bias = nullptr;  // [E][H]
  float* out = nullptr;
  int H = 0;
};

struct QuantizeParams {
  const uint16_t* x = nullptr;   // bf16 [rows, K] input (may equal out)
  int64_t ldx = 0;
  uint16_t* out = nullptr;       // bf16 [rows, K]: e2m1 * e4m3 values
  float* out_scale = nullptr;    // [rows] dequant scale per row (x quantization) or null
  int rows = 0, K = 0;
  const int32_t* row_count = nullptr;  // rows at or beyond *row_count are skipped (null: all rows)
  bool per_row_scale = false;    // gs from each row's amax, else gs
  float gs = 1.f, scale2 = 1.f;
};

struct CombineParams {
  const int32_t* ids = nullptr;  // [T, k]
  const float* weights = nullptr;
  const float* out = nullptr;    // [T*k, H]
  const float* shared_out = nullptr;  // [T, H] or null
  uint16_t* y = nullptr;         // bf16 [T, H]
  int T = 0, k = 0, H = 0, E_loc = 0, local_offset = 0;
  int blocks_per_token = 0, threads = 0;
};

// ---- launchers (all on `stream`, each checked) ---------------------------------------------------
void launch_routing(const RoutingParams& p, int warps_per_block, size_t smem, cudaStream_t stream);
void launch_permute(const PermuteParams& p, cudaStream_t stream);
void launch_gemm1(int config, WeightFormat fmt, ActivationType act, const GemmProblem& g, const Epilogue1Params& e,
                  int n_tiles, int m_tiles, cudaStream_t stream);
void launch_gemm2(int config, WeightFormat fmt, const GemmProblem& g, const Epilogue2Params& e, int n_tiles,
                  int m_tiles, cudaStream_t stream);
void launch_quantize(const QuantizeParams& p, cudaStream_t stream);
void launch_combine(const CombineParams& p, cudaStream_t stream);

// Throws Error(CudaError naming `what`; OutOfMemory for allocation failures) when e != cudaSuccess.
void check_cuda(cudaError_t e, const char* what);
// The last launch's error (cudaGetLastError), checked.
void check_launch(const char* kernel);
// The per-device error flag buffer (allocated on first use).
int* device_error_flag(int device_id);

}  // namespace fp4moe::cuda_backend
