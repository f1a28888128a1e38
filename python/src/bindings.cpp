// fp4moe._C: nanobind bindings over the C++ API (include/fp4moe/*.h).
//
// Tensors come in through DLPack (nb::ndarray): anything with __dlpack__ (PyTorch, CuPy, JAX, NumPy)
// becomes a fp4moe::TensorView without a copy. The Python layer (python/fp4moe/) passes tensors as a
// dict {name: array or (array, dtype_hint)}; the hint reinterprets a same-width integer view (NumPy has
// no DLPack code for ml_dtypes' bfloat16 / float8_e4m3fn, so those arrive as uint16 / uint8 views).
// Every error is a fp4moe::Error, raised in Python as fp4moe.Fp4MoeError (set by _set_error_class).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "fp4moe/build_info.h"
#include "fp4moe/moe.h"
#include "fp4moe/nvfp4.h"
#include "fp4moe/parallel.h"
#include "fp4moe/peft.h"
#include "runtime/plan.h"
#include "fp4moe/quantize.h"
#include "fp4moe/types.h"
#include "runtime/problem_shape.h"

#include "bindings_tensors.h"

#ifdef FP4MOE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace nb = nanobind;
using namespace fp4moe;
using namespace fp4moe::py;

namespace {

// The Python exception class (fp4moe.Fp4MoeError); leaked on purpose so that nothing is released
// after the interpreter has finalized.
PyObject* g_error_class = nullptr;

MoeWeights py_prepare_weights(const nb::dict& t, int format, int order, int scale_layout, bool gated, int64_t E,
                              int64_t H, int64_t I, int backend, int device_id) {
  static constexpr ViewField<WeightsDesc> kFields[] = {
      {"w1", &WeightsDesc::w1},       {"w1_scale", &WeightsDesc::w1_scale}, {"w1_scale2", &WeightsDesc::w1_scale2},
      {"w2", &WeightsDesc::w2},       {"w2_scale", &WeightsDesc::w2_scale}, {"w2_scale2", &WeightsDesc::w2_scale2},
      {"bias1", &WeightsDesc::bias1}, {"bias2", &WeightsDesc::bias2}};
  Keep keep;
  WeightsDesc d;
  read_views(t, kFields, "prepare_weights", keep, d);
  d.format = static_cast<WeightFormat>(format);
  d.order = static_cast<GateUpOrder>(order);
  d.scale_layout = static_cast<ScaleLayout>(scale_layout);
  d.gated = gated;
  d.num_experts = E;
  d.hidden = H;
  d.inter = I;
  nb::gil_scoped_release release;
  return prepare_weights(d, static_cast<Backend>(backend), device_id);
}

nb::dict py_quantize_weights(const nb::dict& t, int format, int order, bool gated, bool per_half_scale2,
                             int scale_layout) {
  check_keys(t, {"w1", "w2", "bias1", "bias2"}, "quantize_weights");
  Keep keep;
  const TensorView w1 = get(t, "w1", keep), w2 = get(t, "w2", keep);
  const TensorView b1 = get(t, "bias1", keep), b2 = get(t, "bias2", keep);
  QuantizeOptions opt;
  opt.format = static_cast<WeightFormat>(format);
  opt.order = static_cast<GateUpOrder>(order);
  opt.gated = gated;
  opt.per_half_scale2 = per_half_scale2;
  opt.scale_layout = static_cast<ScaleLayout>(scale_layout);
  OwnedWeights q;
  {
    nb::gil_scoped_release release;
    q = quantize_weights(w1, w2, opt, b1, b2);
  }
  const size_t E = static_cast<size_t>(q.E), H = static_cast<size_t>(q.H), I = static_cast<size_t>(q.I),
               N1 = static_cast<size_t>(q.n1());
  nb::dict out;
  if (q.format == WeightFormat::NVFP4) {
    const bool swz = q.scale_layout == ScaleLayout::Swizzled128x4;
    const size_t s1 = static_cast<size_t>(nvfp4::swizzled_size(q.n1(), q.H / 16));
    const size_t s2 = static_cast<size_t>(nvfp4::swizzled_size(q.H, q.I / 16));
    const size_t n_s2 = q.w1_scale2.size() / E;
    out["w1"] = numpy_from(std::move(q.w1), {E, N1, H / 2});
    out["w1_scale"] = swz ? numpy_from(std::move(q.w1_scale), {E, s1}) : numpy_from(std::move(q.w1_scale), {E, N1, H / 16});
    out["w1_scale2"] = n_s2 == 2 ? numpy_from(std::move(q.w1_scale2), {E, 2}) : numpy_from(std::move(q.w1_scale2), {E});
    out["w2"] = numpy_from(std::move(q.w2), {E, H, I / 2});
    out["w2_scale"] = swz ? numpy_from(std::move(q.w2_scale), {E, s2}) : numpy_from(std::move(q.w2_scale), {E, H, I / 16});
    out["w2_scale2"] = numpy_from(std::move(q.w2_scale2), {E});
  } else if (q.format == WeightFormat::MXFP4) {
    out["w1"] = numpy_from(std::move(q.w1), {E, N1, H / 2});
    out["w1_scale"] = numpy_from(std::move(q.w1_scale), {E, N1, H / 32});
    out["w2"] = numpy_from(std::move(q.w2), {E, H, I / 2});
    out["w2_scale"] = numpy_from(std::move(q.w2_scale), {E, H, I / 32});
  } else {
    out["w1"] = numpy_from(std::move(q.w1_bf16), {E, N1, H});  // bf16 bits (uint16)
    out["w2"] = numpy_from(std::move(q.w2_bf16), {E, H, I});
  }
  if (!q.bias1.empty()) out["bias1"] = numpy_from(std::move(q.bias1), {E, N1});
  if (!q.bias2.empty()) out["bias2"] = numpy_from(std::move(q.bias2), {E, H});
  return out;
}

void py_load(AdapterRegistry& reg, int slot, const nb::dict& t, int layout, int64_t rank, float lora_alpha,
             bool use_rslora) {
  using L = LoraAdapterDesc;
  static constexpr ViewField<L> kFields[] = {
      {"a_gate", &L::a_gate},       {"a_up", &L::a_up},
      {"b_gate", &L::b_gate},       {"b_up", &L::b_up},
      {"a_gate_up", &L::a_gate_up}, {"b_gate_up", &L::b_gate_up},
      {"a_down", &L::a_down},       {"b_down", &L::b_down},
      {"shared_a_gate_up", &L::shared_a_gate_up}, {"shared_b_gate_up", &L::shared_b_gate_up},
      {"shared_a_down", &L::shared_a_down},       {"shared_b_down", &L::shared_b_down}};
  Keep keep;
  LoraAdapterDesc d;
  d.layout = static_cast<LoraLayout>(layout);
  d.rank = rank;
  d.lora_alpha = lora_alpha;
  d.use_rslora = use_rslora;
  read_views(t, kFields, "AdapterRegistry.load", keep, d);
  nb::gil_scoped_release release;
  reg.load(slot, d);
}

// The MoeArgs of one call from the Python layer's arguments (tensors kept alive in `keep`).
MoeArgs make_moe_args(const nb::dict& t, Keep& keep, int routing_method, int64_t top_k, int64_t n_group,
                      int64_t topk_group, float routed_scaling_factor, int activation, int64_t num_experts_total,
                      int64_t local_expert_offset, int mode, float fc1_input_scale, float fc2_input_scale,
                      bool per_token_x_scale, const MoeWeights* shared_expert, float shared_alpha, float shared_beta,
                      float shared_clamp_limit, bool shared_params_given, const AdapterRegistry* adapters,
                      uintptr_t stream, int precision, int num_threads, int gemm_tile,
                      int64_t workspace_budget) {
  MoeArgs a;
  a.x = get(t, "x", keep);
  a.routing.method = static_cast<RoutingMethod>(routing_method);
  a.routing.top_k = top_k;
  a.routing.logits = get(t, "routing_logits", keep);
  a.routing.bias = get(t, "routing_bias", keep);
  a.routing.n_group = n_group;
  a.routing.topk_group = topk_group;
  a.routing.routed_scaling_factor = routed_scaling_factor;
  a.routing.topk_ids = get(t, "topk_ids", keep);
  a.routing.topk_weights = get(t, "topk_weights", keep);
  a.num_experts_total = num_experts_total;
  a.local_expert_offset = local_expert_offset;
  a.activation.type = static_cast<ActivationType>(activation);
  a.activation.alpha = get(t, "gemm1_alpha", keep);
  a.activation.beta = get(t, "gemm1_beta", keep);
  a.activation.clamp_limit = get(t, "gemm1_clamp_limit", keep);
  a.mode = static_cast<ActMode>(mode);
  a.fc1_input_scale = fc1_input_scale;
  a.fc2_input_scale = fc2_input_scale;
  a.per_token_x_scale = per_token_x_scale;
  a.shared_expert = shared_expert;
  a.shared_alpha = shared_alpha;
  a.shared_beta = shared_beta;
  a.shared_clamp_limit = shared_clamp_limit;
  a.shared_params_given = shared_params_given;
  a.shared_expert_gate = get(t, "shared_expert_gate", keep);
  a.adapters = adapters;
  a.adapter_ids = get(t, "adapter_ids", keep);
  a.gate_up_lora_delta = get(t, "gate_up_lora_delta", keep);
  a.activation_out = get(t, "activation_out", keep, /*writable=*/true);
  a.y = get(t, "y", keep, /*writable=*/true);
  a.workspace = get(t, "workspace", keep, /*writable=*/true);
  a.stream = reinterpret_cast<void*>(stream);
  a.precision = static_cast<Precision>(precision);
  a.num_threads = num_threads;
  a.gemm_tile = static_cast<GemmTile>(gemm_tile);
  a.workspace_budget = workspace_budget;
  return a;
}

#define FP4MOE_MOE_PARAMS                                                                                          \
  int routing_method, int64_t top_k, int64_t n_group, int64_t topk_group, float routed_scaling_factor,            \
      int activation, int64_t num_experts_total, int64_t local_expert_offset, int mode, float fc1_input_scale,   \
      float fc2_input_scale, bool per_token_x_scale, const MoeWeights *shared_expert, float shared_alpha,         \
      float shared_beta, float shared_clamp_limit, bool shared_params_given, const AdapterRegistry *adapters,     \
      uintptr_t stream, int precision, int num_threads, int gemm_tile, int64_t workspace_budget
#define FP4MOE_MOE_ARGS                                                                                            \
  routing_method, top_k, n_group, topk_group, routed_scaling_factor, activation, num_experts_total,              \
      local_expert_offset, mode, fc1_input_scale, fc2_input_scale, per_token_x_scale, shared_expert, shared_alpha, \
      shared_beta, shared_clamp_limit, shared_params_given, adapters, stream, precision, num_threads, gemm_tile, \
      workspace_budget

void py_moe_run(const MoeWeights& weights, const nb::dict& t, FP4MOE_MOE_PARAMS) {
  check_keys(t, {"x", "routing_logits", "routing_bias", "topk_ids", "topk_weights", "gemm1_alpha", "gemm1_beta",
                 "gemm1_clamp_limit", "shared_expert_gate", "adapter_ids", "gate_up_lora_delta", "activation_out", "y",
                 "workspace"},
             "moe");
  Keep keep;
  MoeArgs a = make_moe_args(t, keep, FP4MOE_MOE_ARGS);
  nb::gil_scoped_release release;
  moe_run(weights, a);
}

// moe_run_tp ("tp") / moe_run_ep ("ep") over a communicator (include/fp4moe/parallel.h).
void py_moe_run_parallel(const std::string& kind, NcclGroupComm& comm, int output, const MoeWeights& weights,
                         const nb::dict& t, FP4MOE_MOE_PARAMS) {
  if (kind != "tp" && kind != "ep") bad("kind", "expected 'tp' or 'ep', got '" + kind + "'");
  check_keys(t, {"x", "routing_logits", "routing_bias", "topk_ids", "topk_weights", "gemm1_alpha", "gemm1_beta",
                 "gemm1_clamp_limit", "shared_expert_gate", "adapter_ids", "gate_up_lora_delta", "activation_out", "y",
                 "workspace", "parallel_workspace"},
             kind == "tp" ? "moe_tp" : "moe_ep");
  Keep keep;
  MoeArgs a = make_moe_args(t, keep, FP4MOE_MOE_ARGS);
  const TensorView pws = get(t, "parallel_workspace", keep, /*writable=*/true);
  Communicator& c = comm.comm();
  nb::gil_scoped_release release;
  if (kind == "tp") moe_run_tp(weights, a, c, static_cast<ParallelOutput>(output), pws);
  else moe_run_ep(weights, a, c, static_cast<ParallelOutput>(output), pws);
}

void py_route(const nb::dict& t, int method, int64_t top_k, int64_t n_group, int64_t topk_group,
              float routed_scaling_factor, int64_t num_experts_total) {
  check_keys(t, {"routing_logits", "routing_bias", "topk_ids_out", "topk_weights_out"}, "route");
  Keep keep;
  RoutingArgs r;
  r.method = static_cast<RoutingMethod>(method);
  r.top_k = top_k;
  r.logits = get(t, "routing_logits", keep);
  r.bias = get(t, "routing_bias", keep);
  r.n_group = n_group;
  r.topk_group = topk_group;
  r.routed_scaling_factor = routed_scaling_factor;
  TensorView ids = get(t, "topk_ids_out", keep, true), w = get(t, "topk_weights_out", keep, true);
  nb::gil_scoped_release release;
  route(r, num_experts_total, ids, w);
}

// The CUDA backend's workspace size for a call on `weights` described by its sizes (fp4moe.workspace_size): a
// call of shape-only views, through the same problem_shape as moe_run.
size_t py_workspace_size(const MoeWeights& weights, int64_t T, int64_t top_k, bool routing_from_logits,
                         int64_t num_experts_total, int64_t n_group, int activation, int mode,
                         const MoeWeights* shared_expert, int64_t max_lora_rank, int64_t workspace_budget, int gemm_tile) {
  if (weights.backend() != Backend::CUDA) return 0;
  MoeArgs a;
  const int64_t E_total = num_experts_total == 0 ? weights.num_experts() : num_experts_total;
  a.x = make_view(nullptr, DType::BF16, {T, weights.hidden()});
  if (routing_from_logits) a.routing.logits = make_view(nullptr, DType::F32, {T, E_total});
  else a.routing.topk_ids = make_view(nullptr, DType::I32, {T, top_k});
  a.routing.top_k = top_k;
  a.routing.method = n_group > 1 ? RoutingMethod::DeepSeekV3 : RoutingMethod::Renormalize;
  a.routing.n_group = n_group;
  a.num_experts_total = num_experts_total;
  a.activation.type = static_cast<ActivationType>(activation);
  a.mode = static_cast<ActMode>(mode);
  a.shared_expert = shared_expert;
  a.workspace_budget = workspace_budget;
  a.gemm_tile = static_cast<GemmTile>(gemm_tile);
  return call_workspace_size(weights.impl(), a, max_lora_rank > 0, max_lora_rank);
}

// A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) -> one MoE layer's expert LoRA
// (include/fp4moe/peft.h) as NumPy arrays: bf16 bits (uint16), PeftFused layout, plus rank and scale fields.
nb::dict py_read_peft_experts_lora(const std::string& dir, const std::string& module_prefix, int64_t num_experts,
                                   int64_t expert_offset, int64_t num_local_experts) {
  PeftReadOptions opt;
  opt.module_prefix = module_prefix;
  opt.num_experts = num_experts;
  opt.expert_offset = expert_offset;
  opt.num_local_experts = num_local_experts;
  PeftExpertsLora l;
  {
    nb::gil_scoped_release release;
    l = read_peft_experts_lora(dir, opt);
  }
  const size_t E = static_cast<size_t>(l.E), H = static_cast<size_t>(l.H), I = static_cast<size_t>(l.I),
               N1 = static_cast<size_t>(l.N1), r = static_cast<size_t>(l.rank);
  nb::dict d;
  d["E"] = l.E;
  d["H"] = l.H;
  d["I"] = l.I;
  d["N1"] = l.N1;
  d["rank"] = l.rank;
  d["lora_alpha"] = l.lora_alpha;
  d["use_rslora"] = l.use_rslora;
  if (l.has_gate_up) {
    d["a_gate_up"] = numpy_from(std::move(l.a_gate_up), {E, r, H});
    d["b_gate_up"] = numpy_from(std::move(l.b_gate_up), {E, N1, r});
  }
  if (l.has_down) {
    d["a_down"] = numpy_from(std::move(l.a_down), {E, r, I});
    d["b_down"] = numpy_from(std::move(l.b_down), {E, H, r});
  }
  return d;
}

nb::dict py_read_peft_config(const std::string& path) {
  PeftConfig c;
  {
    nb::gil_scoped_release release;
    c = read_peft_config(path);
  }
  nb::dict d;
  d["r"] = c.r;
  d["lora_alpha"] = c.lora_alpha;
  d["use_rslora"] = c.use_rslora;
  d["target_parameters"] = c.target_parameters;
  return d;
}

nb::dict py_build_info() {
  const BuildInfo b = build_info();
  nb::dict d;
  d["version"] = b.version;
  d["source_hash"] = b.source_hash;
  d["cxx_compiler"] = b.cxx_compiler;
  d["cuda_compiler"] = b.cuda_compiler;
  d["cuda_archs"] = b.cuda_archs;
  d["with_cuda"] = b.with_cuda;
  return d;
}

// (major, minor) of a CUDA device, read without creating a context.
std::pair<int, int> device_compute_capability(int device_id) {
#ifdef FP4MOE_WITH_CUDA
  int major = 0, minor = 0;
  cudaError_t e1 = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_id);
  cudaError_t e2 = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device_id);
  if (e1 != cudaSuccess || e2 != cudaSuccess)
    throw Error(ErrorCode::CudaError, "device_id",
                std::string("cannot read the compute capability: ") + cudaGetErrorString(e1 != cudaSuccess ? e1 : e2));
  return {major, minor};
#else
  (void)device_id;
  throw Error(ErrorCode::Unsupported, "device", "this build of fp4moe has no CUDA backend");
#endif
}

void translate_error(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const Error& e) {
    if (g_error_class) {
      // Build fp4moe.Fp4MoeError(message, code, argument); fall back to ValueError if that fails.
      PyObject* inst = PyObject_CallFunction(g_error_class, "sis", e.what(), static_cast<int>(e.code()),
                                             e.argument().c_str());
      if (inst) {
        PyErr_SetObject(g_error_class, inst);
        Py_DECREF(inst);
        return;
      }
      PyErr_Clear();
    }
    PyErr_SetString(PyExc_ValueError, e.what());
  }
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "fp4moe native extension (use the fp4moe package, not this module directly)";
  nb::register_exception_translator(translate_error);
  // Prepared weights are legitimately alive at interpreter exit (held by torch.compile caches, CUDA graphs,
  // module globals); nanobind's leak report would be noise, not a reference-counting bug.
  nb::set_leak_warnings(false);

  m.def("_set_error_class", [](nb::handle cls) {
    Py_XINCREF(cls.ptr());
    g_error_class = cls.ptr();  // leaked on purpose (see g_error_class)
  });
  m.def("_describe", &describe, nb::arg("tensor"),
        "How a tensor converts to a fp4moe TensorView: dtype, device, shape, strides (elements).");
  m.def("_raise_test_error", [](int code, const std::string& arg, const std::string& msg) {
    throw Error(static_cast<ErrorCode>(code), arg, msg);
  });

  nb::class_<MoeWeights>(m, "MoeWeights", "Expert weights prepared for one backend (immutable).")
      .def_prop_ro("backend", [](const MoeWeights& w) { return static_cast<int>(w.backend()); })
      .def_prop_ro("format", [](const MoeWeights& w) { return static_cast<int>(w.format()); })
      .def_prop_ro("order", [](const MoeWeights& w) { return static_cast<int>(w.order()); })
      .def_prop_ro("gated", &MoeWeights::gated)
      .def_prop_ro("num_experts", &MoeWeights::num_experts)
      .def_prop_ro("hidden", &MoeWeights::hidden)
      .def_prop_ro("inter", &MoeWeights::inter);

  nb::class_<AdapterRegistry>(m, "AdapterRegistry")
      .def(nb::init<const MoeWeights&, int, const MoeWeights*>(), nb::arg("weights"), nb::arg("num_slots") = 64,
           nb::arg("shared_expert").none() = nb::none())  // the registry keeps its own (shared) references
      .def_prop_ro("num_slots", &AdapterRegistry::num_slots)
      .def("_load", &py_load, nb::arg("slot"), nb::arg("tensors"), nb::arg("layout"), nb::arg("rank"),
           nb::arg("lora_alpha"), nb::arg("use_rslora"))
      .def("unload", &AdapterRegistry::unload, nb::arg("slot"), nb::call_guard<nb::gil_scoped_release>())
      .def("loaded", &AdapterRegistry::loaded, nb::arg("slot"));

  m.def("prepare_weights", &py_prepare_weights, nb::arg("tensors"), nb::arg("format"), nb::arg("order"),
        nb::arg("scale_layout"), nb::arg("gated"), nb::arg("num_experts"), nb::arg("hidden"), nb::arg("inter"),
        nb::arg("backend"), nb::arg("device_id"));
  m.def("quantize_weights", &py_quantize_weights, nb::arg("tensors"), nb::arg("format"), nb::arg("order"),
        nb::arg("gated"), nb::arg("per_half_scale2"), nb::arg("scale_layout"));
  m.def("moe_run", &py_moe_run, nb::arg("weights"), nb::arg("tensors"), nb::arg("routing_method"), nb::arg("top_k"),
        nb::arg("n_group"), nb::arg("topk_group"), nb::arg("routed_scaling_factor"), nb::arg("activation"),
        nb::arg("num_experts_total"), nb::arg("local_expert_offset"), nb::arg("mode"), nb::arg("fc1_input_scale"),
        nb::arg("fc2_input_scale"), nb::arg("per_token_x_scale"), nb::arg("shared_expert").none(),
        nb::arg("shared_alpha"), nb::arg("shared_beta"), nb::arg("shared_clamp_limit"),
        nb::arg("shared_params_given"), nb::arg("adapters").none(), nb::arg("stream"), nb::arg("precision"),
        nb::arg("num_threads"), nb::arg("gemm_tile"), nb::arg("workspace_budget"));
  // ---- multi-GPU (fp4moe.distributed) ----
  m.def("nccl_available", &nccl_available, "Whether this build has the NCCL path and libnccl could be opened.");
  m.def("nccl_unavailable_reason", &nccl_unavailable_reason);
  m.def("nccl_unique_id", [] {
    std::vector<uint8_t> id;
    {
      nb::gil_scoped_release release;
      id = nccl_unique_id();
    }
    return nb::bytes(reinterpret_cast<const char*>(id.data()), id.size());
  }, "A new ncclUniqueId (128 bytes); raises Unsupported without NCCL.");
  nb::class_<NcclGroupComm>(m, "NcclComm", "An NCCL communicator of one rank (ncclCommInitRank; destroyed with the object).")
      .def("__init__", [](NcclGroupComm* self, nb::bytes unique_id, int world, int rank, int device) {
             std::vector<uint8_t> id(static_cast<const uint8_t*>(unique_id.data()),
                                     static_cast<const uint8_t*>(unique_id.data()) + unique_id.size());
             nb::gil_scoped_release release;  // ncclCommInitRank waits for the other ranks
             new (self) NcclGroupComm(id, world, rank, device);
           },
           nb::arg("unique_id"), nb::arg("world"), nb::arg("rank"), nb::arg("device"))
      .def_prop_ro("rank", &NcclGroupComm::rank)
      .def_prop_ro("world", &NcclGroupComm::world)
      .def_prop_ro("device", &NcclGroupComm::device)
      .def_prop_ro("nccl_comm", [](const NcclGroupComm& c) { return reinterpret_cast<uintptr_t>(c.nccl_comm()); })
      .def("destroy", &NcclGroupComm::destroy, nb::call_guard<nb::gil_scoped_release>());
  m.def("moe_run_parallel", &py_moe_run_parallel, nb::arg("kind"), nb::arg("comm"), nb::arg("output"),
        nb::arg("weights"), nb::arg("tensors"), nb::arg("routing_method"), nb::arg("top_k"), nb::arg("n_group"),
        nb::arg("topk_group"), nb::arg("routed_scaling_factor"), nb::arg("activation"), nb::arg("num_experts_total"),
        nb::arg("local_expert_offset"), nb::arg("mode"), nb::arg("fc1_input_scale"), nb::arg("fc2_input_scale"),
        nb::arg("per_token_x_scale"), nb::arg("shared_expert").none(), nb::arg("shared_alpha"), nb::arg("shared_beta"),
        nb::arg("shared_clamp_limit"), nb::arg("shared_params_given"), nb::arg("adapters").none(), nb::arg("stream"),
        nb::arg("precision"), nb::arg("num_threads"), nb::arg("gemm_tile"), nb::arg("workspace_budget"));
  m.def("parallel_workspace_size", [](int64_t T, int64_t H, int world, int output) {
    return parallel_workspace_size(T, H, world, static_cast<ParallelOutput>(output));
  }, nb::arg("num_tokens"), nb::arg("hidden"), nb::arg("world"), nb::arg("output") = 0);
  m.def("expert_window", [](int64_t E, int rank, int world) {
    const ExpertWindow w = expert_window(E, rank, world);
    return std::make_pair(w.offset, w.count);
  }, nb::arg("num_experts_total"), nb::arg("rank"), nb::arg("world"));

  m.def("route", &py_route, nb::arg("tensors"), nb::arg("routing_method"), nb::arg("top_k"), nb::arg("n_group"),
        nb::arg("topk_group"), nb::arg("routed_scaling_factor"), nb::arg("num_experts_total"));
  m.def("check_device_errors", &check_device_errors, nb::arg("device_id") = 0,
        nb::call_guard<nb::gil_scoped_release>());
  m.def("workspace_size", &py_workspace_size, nb::arg("weights"), nb::arg("T"), nb::arg("top_k"),
        nb::arg("routing_from_logits"), nb::arg("num_experts_total"), nb::arg("n_group"), nb::arg("activation"),
        nb::arg("mode"), nb::arg("shared_expert").none(), nb::arg("max_lora_rank"), nb::arg("workspace_budget"),
        nb::arg("gemm_tile"), "Bytes of workspace the CUDA backend needs for a call of these sizes.");
  m.def("read_peft_experts_lora", &py_read_peft_experts_lora, nb::arg("dir"), nb::arg("module_prefix"),
        nb::arg("num_experts") = 0, nb::arg("expert_offset") = 0, nb::arg("num_local_experts") = 0);
  m.def("list_peft_expert_modules", [](const std::string& dir) {
    std::vector<std::string> r;
    {
      nb::gil_scoped_release release;
      r = list_peft_expert_modules(dir);
    }
    return r;
  }, nb::arg("dir"));
  m.def("read_peft_config", &py_read_peft_config, nb::arg("path"));
  m.def("build_info", &py_build_info);
  m.def("build_info_report", &build_info_report);
  m.def("cuda_device_count", &cuda_device_count);
  m.def("device_compute_capability", &device_compute_capability, nb::arg("device_id"));
}
