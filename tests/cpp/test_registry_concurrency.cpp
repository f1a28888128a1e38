// SPEC §5 / issue "multi-LoRA": a load or unload in one thread while another runs the operator neither crashes nor
// changes the running batch's result (CPU backend; the CUDA variant lives in tests/gpu).
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "fp4moe/fp4moe.h"
#include "fp4moe/synthetic.h"

using namespace fp4moe;

TEST(RegistryConcurrency, LoadUnloadWhileRunningChangesNothing) {
  constexpr ModelShape kShape = {"small", 256, 64, 8, 2, RoutingMethod::Renormalize, 1, 1, 1.f,
                                 ActivationType::Swiglu, 1.f, 0.f, 0.f, 8};
  const int64_t T = 12, H = kShape.H, E = kShape.E;
  SyntheticLayer layer = make_synthetic_layer(kShape, 0, 5);
  MoeWeights w = prepare_weights(layer.desc(), Backend::CPU);
  AdapterRegistry reg(w, 8);
  std::vector<SyntheticAdapter> adapters;
  for (int a = 0; a < 4; ++a) adapters.push_back(make_synthetic_adapter(layer, 4 + 4 * a, 900 + a));
  reg.load(0, adapters[0].desc());

  std::vector<uint16_t> x = random_bf16(T * H, 6);
  std::vector<float> logits = random_f32(T * E, 7);
  std::vector<int32_t> ids(T);
  for (int64_t t = 0; t < T; ++t) ids[t] = (t % 3 == 0) ? -1 : 0;  // base and slot 0 only
  auto run = [&](std::vector<uint16_t>& y) {
    MoeArgs a;
    a.x = make_view(x.data(), DType::BF16, {T, H});
    a.routing.method = kShape.routing;
    a.routing.top_k = kShape.k;
    a.routing.logits = make_view(logits.data(), DType::F32, {T, E});
    a.activation.type = kShape.activation;
    a.adapters = &reg;
    a.adapter_ids = make_view(ids.data(), DType::I32, {T});
    a.y = make_view(y.data(), DType::BF16, {T, H});
    a.num_threads = 1;
    moe_run(w, a);
  };
  std::vector<uint16_t> first(T * H, 0x7fc1);
  run(first);

  std::atomic<bool> stop{false};
  std::atomic<int> churn{0};
  std::thread loader([&] {
    for (int i = 0; !stop.load(); ++i) {
      const int slot = 1 + i % 3;
      if (reg.loaded(slot)) reg.unload(slot);
      else reg.load(slot, adapters[1 + i % 3].desc());
      // Slot 0 is replaced by an identical copy too: a run must see one consistent snapshot either way.
      if (i % 5 == 0) reg.load(0, adapters[0].desc());
      churn.fetch_add(1);
    }
  });
  int runs = 0;
  for (; runs < 40 || churn.load() < 20; ++runs) {
    std::vector<uint16_t> y(T * H, 0x7fc1);
    run(y);
    ASSERT_EQ(y, first) << "run " << runs << " differs while adapters were loaded and unloaded";
    if (runs > 2000) break;
  }
  stop = true;
  loader.join();
  EXPECT_GE(churn.load(), 20) << "the loader thread barely ran; the test proved little";
}
