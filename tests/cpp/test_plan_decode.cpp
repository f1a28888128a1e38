// make_plan's decode rules (src/runtime/plan.h): which tile, split, grid order, entry tiles and routing form a
// few tokens get, each rule at the shapes where it was measured.
#include <gtest/gtest.h>

#include <random>
#include <utility>

#include "plan_shapes.h"
#include "runtime/plan.h"

namespace fp4moe {
namespace {
using plantest::cdiv;
using plantest::random_shape;



// The split counts the tiles expected under uniform routing. deepseek_v3_ep8 (32 of 256 experts on the rank) at
// T=1: eight entries, one local in expectation; the grid keeps room for nine m tiles, the split fills the GPU
// with one (measured 2026-12-03 on one H200: 60.8 -> 49.0 us at T=1, 133.9 -> 100.2 at T=8, against the split for
// all nine). On a layer of few experts the expected tiles count too; on other layers the bound does.
TEST(Plan, SplitCountsTheExpectedTiles) {
  ProblemShape s;
  s.T = 1; s.H = 7168; s.I = 2048; s.E_loc = 32; s.E_total = 256; s.k = 8;
  const MoePlan ep = make_plan(s);
  EXPECT_EQ(ep.gemm_config, static_cast<int>(GemmTile::SplitKDecode));
  EXPECT_EQ(ep.num_chunks, 1);
  EXPECT_EQ(ep.max_m_tiles, 9);
  EXPECT_EQ(ep.split_m_tiles, 1);
  EXPECT_GT(ep.split1, 1);
  EXPECT_TRUE(ep.gemm_m_last);  // its tiles with rows first
  s.E_total = 32;  // the rank's experts are the whole layer
  const MoePlan all = make_plan(s);
  EXPECT_EQ(all.split_m_tiles, all.max_m_tiles);
  EXPECT_FALSE(all.gemm_m_last);
  EXPECT_GT(ep.split1, all.split1);
  EXPECT_GE(ep.split2, all.split2);
  EXPECT_EQ(ep.max_m_tiles, all.max_m_tiles);  // the same grid (the partials differ by the layers' K chunks)
  // 16 tokens over 32 of 256 experts: 16 local entries in expectation on ~12.7 distinct experts, 13 tiles.
  s.E_total = 256;
  s.T = 16;
  EXPECT_EQ(make_plan(s).split_m_tiles, 13);
  // Every expert of a layer of 8 with k = 8: each gets every token.
  s.E_loc = s.E_total = 8;
  const MoePlan few = make_plan(s);
  EXPECT_EQ(few.split_m_tiles, 8 * cdiv(16, few.gemm.bm));
}

// The tile counts rows an expert over all the layer's experts: under EP a local expert expects rows / E_total, so
// deepseek_v3_ep8 (32 of 256 experts on the rank, k = 8) keeps the 8-row tile up to 4 expected rows (T = 128) as
// the whole layer on one GPU does (measured 2026-12-03 on one H200: T=32 212.5 -> 170.6 us, T=128 301.2 -> 267.1,
// against the tile of rows / E_loc), then the 16-row tile.
TEST(Plan, EpTileCountsRowsOverAllExperts) {
  ProblemShape s;
  s.H = 7168; s.I = 2048; s.E_loc = 32; s.E_total = 256; s.k = 8;
  for (int64_t T : {1, 32, 128, 192, 256, 512, 1024, 4096}) {
    SCOPED_TRACE(::testing::Message() << "T=" << T);
    s.T = T;
    ProblemShape whole = s;
    whole.E_loc = whole.E_total;
    const MoePlan ep = make_plan(s), one = make_plan(whole);
    EXPECT_EQ(ep.gemm_config, one.gemm_config);
    EXPECT_EQ(ep.gemm_config == static_cast<int>(GemmTile::SplitKDecode), T <= 128);
  }
}

// The 16-row tile takes 5-12 expected rows an expert (rows / E_total), below it the 8-row tile, above it the
// 32-row one (the 64-token WS tile from 32 rows); on a layer of few experts it takes 9-12 rows an expert between the
// 8-row tile and the wgmma tiles, whose 32-token WS form takes mixtral_8x7b's long K up to 20 rows (measured
// 2026-12-03 and 2026-12-07: bench/NOTES.md).
TEST(Plan, SixteenRowTileBetweenTheDecodeTiles) {
  const int t8 = static_cast<int>(GemmTile::SplitKDecode), t16 = static_cast<int>(GemmTile::WeightsAsA16),
            t32 = static_cast<int>(GemmTile::WeightsAsA32), ws32 = static_cast<int>(GemmTile::WgmmaWs32),
            ws64 = static_cast<int>(GemmTile::WgmmaWs64);
  ProblemShape s;
  s.device.wgmma = true;
  s.H = 2880; s.I = 2880; s.E_loc = s.E_total = 128; s.k = 4;  // gpt_oss_120b: rows / 128 = T / 32
  for (auto [T, tile] : {std::pair<int64_t, int>{128, t8}, {160, t16}, {256, t16}, {384, t16}, {416, t32},
                         {512, t32}, {1024, ws64}}) {
    s.T = T;
    EXPECT_EQ(make_plan(s).gemm_config, tile) << "T=" << T;
  }
  s.H = 4096; s.I = 14336; s.E_loc = s.E_total = 8; s.k = 2;  // mixtral_8x7b: rows / 8 = T / 4
  for (auto [T, tile] : {std::pair<int64_t, int>{32, t8}, {36, t16}, {48, t16}, {52, ws32}, {80, ws32}, {84, ws64},
                         {128, ws64}}) {
    s.T = T;
    EXPECT_EQ(make_plan(s).gemm_config, tile) << "T=" << T;
  }
  s.device.wgmma = false;  // without wgmma, the 32-row tile above 12 rows an expert
  s.T = 64;
  EXPECT_EQ(make_plan(s).gemm_config, t32);
}

// Entry tiles: a decode chunk routed from logits in A16 (with or without LoRA), of at most E_loc entries, runs its
// GEMMs one entry a tile with no permutation; the bound it is sized for (max_m_tiles) holds the entries.
TEST(Plan, EntryTilesAtDecodeFromLogits) {
  ProblemShape s;
  s.H = 3584; s.I = 384; s.E_loc = s.E_total = 384; s.k = 8; s.T = 1;  // kimi_k3_tp8
  MoePlan p = make_plan(s);
  EXPECT_TRUE(p.entry_tiles);
  EXPECT_GE(p.max_m_tiles, p.rows);
  ProblemShape o = s;
  o.routing_from_logits = false;  // the caller's ids are checked by the permutation
  EXPECT_FALSE(make_plan(o).entry_tiles);
  o = s;
  o.has_lora = true;  // the LoRA shrinks go by entry, the x shrink's launch permutes nothing
  EXPECT_TRUE(make_plan(o).entry_tiles);
  EXPECT_FALSE(make_plan(o).lora_shrink1_permutes);
  EXPECT_TRUE(make_plan(o).gemms_beside_lora_shrinks);
  EXPECT_FALSE(make_plan(s).gemms_beside_lora_shrinks);  // no LoRA: GEMM1 follows the routing
  o = s;
  o.mode = ActMode::A4;
  EXPECT_FALSE(make_plan(o).entry_tiles);
  o = s;
  o.T = 4096;
  EXPECT_FALSE(make_plan(o).entry_tiles);
  for (int64_t T : {2, 8, 10}) {  // kimi's 384 experts: 64 entries reach ~59.6 distinct ones at T = 8 (7 % more)
    o.T = T;
    EXPECT_TRUE(make_plan(o).entry_tiles) << "T=" << T;
  }
  o.T = 16;
  EXPECT_FALSE(make_plan(o).entry_tiles);
  o = s;
  o.H = 2048; o.I = 768; o.E_loc = o.E_total = 128;  // qwen3_30b_a3b: 10 % more entries than experts at T = 4
  o.T = 4;
  EXPECT_TRUE(make_plan(o).entry_tiles);
  o.T = 8;  // 24 % more (measured 1.11 against the permutation)
  EXPECT_FALSE(make_plan(o).entry_tiles);
  o = s;
  o.H = 4096; o.I = 14336; o.E_loc = o.E_total = 8; o.k = 2;  // mixtral_8x7b: two entries at T = 1, always distinct
  o.T = 1;
  EXPECT_TRUE(make_plan(o).entry_tiles);
  o.T = 4;  // 8 entries on 5.5 experts (measured 1.35)
  EXPECT_FALSE(make_plan(o).entry_tiles);
  std::mt19937_64 rng(91);
  for (int i = 0; i < 3000; ++i) {  // wherever they are on, the grid's entries fit the bound
    const int64_t H = 16 * std::uniform_int_distribution<int64_t>(1, 512)(rng);
    const int64_t I = 16 * std::uniform_int_distribution<int64_t>(1, 512)(rng);
    const ProblemShape r = random_shape(rng, H, I, std::uniform_int_distribution<int64_t>(0, 16)(rng));
    const MoePlan q = make_plan(r);
    if (!q.entry_tiles) continue;
    EXPECT_LE(q.rows, q.max_m_tiles);
    EXPECT_LE(q.rows, r.E_loc);
    EXPECT_TRUE(r.routing_from_logits && r.mode == ActMode::A16);
    EXPECT_FALSE(q.lora_shrink1_permutes || q.lora_shrink_tiled);
  }
}


// A few tokens route on a block a token (an expert a thread) where the method has no sum over the experts and E is
// 129..512, DeepSeekV3's groups included; else a warp a token.
TEST(Plan, RoutingBlockATokenAtFewTokens) {
  ProblemShape s;
  s.H = 3584; s.I = 384; s.E_loc = s.E_total = 384; s.k = 8;  // kimi_k3_tp8 (DeepSeekV3 without groups)
  for (auto [T, warps] : {std::pair<int64_t, int>{1, 12}, {kRoutingBlockTokens, 12}, {kRoutingBlockTokens + 1, 0}}) {
    s.T = T;
    const MoePlan p = make_plan(s);
    EXPECT_EQ(p.routing_warps_per_token, warps) << "T=" << T;
    if (warps > 0) {
      EXPECT_EQ(p.routing_blocks, T);
      EXPECT_EQ(p.routing_smem, static_cast<size_t>(routing_block_smem(384, 8, 12, 1)));
    }
  }
  s.T = 1;
  s.routing_sums_experts = true;  // qwen3_30b_a3b's RenormalizeNaive
  EXPECT_EQ(make_plan(s).routing_warps_per_token, 0);
  s.routing_sums_experts = false;
  s.E_loc = s.E_total = 256; s.n_group = 8;  // deepseek_v3_ep8's groups: a warp a group, then the block's merge
  EXPECT_EQ(make_plan(s).routing_warps_per_token, 8);
  EXPECT_EQ(make_plan(s).routing_smem, static_cast<size_t>(routing_block_smem(256, 8, 8, 8)));
  s.n_group = 1; s.E_loc = s.E_total = 8; s.k = 2;  // mixtral_8x7b: one warp holds every expert
  EXPECT_EQ(make_plan(s).routing_warps_per_token, 0);
  s.E_loc = s.E_total = kRoutingBlockMinExperts; s.k = 4;  // gpt_oss_120b: a warp walks its 128 experts 4 times
  EXPECT_EQ(make_plan(s).routing_warps_per_token, 0);
  s.E_loc = s.E_total = kRoutingBlockMinExperts + 1;
  EXPECT_EQ(make_plan(s).routing_warps_per_token, 5);
  s.E_loc = s.E_total = kRoutingBlockExperts + 16;
  EXPECT_EQ(make_plan(s).routing_warps_per_token, 0);
  s.routing_from_logits = false;
  s.E_loc = s.E_total = 128;
  EXPECT_EQ(make_plan(s).routing_warps_per_token, 0);
}

}  // namespace
}  // namespace fp4moe
