// `fp4moe check`: the validation harness. For each model shape and each (activation, A16/A4) config
// it runs the phases of the original release (individual adapters 8/8, eight adapters in one batch
// 8/8, mixed adapter and base requests 12/12) against an oracle, plus the SPEC §4/§5 invariants
// (zero-B adapters, load/unload, base tokens in a mixed batch, bridges, two process launches), and for a shape
// with a shared expert (qwen3_next_80b_a3b) its weight sigmoid(x . g) in the oracle.
//
// Oracle: the CPU reference on the same synthetic weights and adapters; Precision::Fp32 when the
// backend under test is CUDA, Precision::Fp64 (an independent, unrounded run) when it is the CPU
// reference itself. Tolerances: docs/numerics.md, "Validation harness".
//
// This file is the driver: options, each shape's setup and configs, the re-launched child process, and the
// summary. check_options.cpp parses the options, check_setup.cpp makes the problem, check_executor.cpp runs
// one call, check_case.cpp runs one config's phases and invariants, check_report.cpp compares and reports.
#include "check.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "check_case.h"
#include "check_executor.h"
#include "check_options.h"
#include "check_report.h"
#include "check_setup.h"
#include "fp4moe/build_info.h"
#include "fp4moe/model_shapes.h"
#include "fp4moe/moe.h"

namespace fp4moe {
namespace check {
namespace {

// Re-runs this executable as `check --child ...` and returns its stdout ("" plus `err` on failure).
std::string relaunch(const std::vector<std::string>& args, std::string& err) {
  char exe[4096];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) {
    err = "cannot read /proc/self/exe";
    return "";
  }
  exe[n] = '\0';
  int fds[2];
  if (pipe(fds) != 0) {
    err = "pipe failed";
    return "";
  }
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) {
    err = "fork failed";
    close(fds[0]);
    close(fds[1]);
    return "";
  }
  if (pid == 0) {
    dup2(fds[1], STDOUT_FILENO);
    close(fds[0]);
    close(fds[1]);
    std::vector<char*> av;
    av.push_back(exe);
    for (const auto& a : args) av.push_back(const_cast<char*>(a.c_str()));
    av.push_back(nullptr);
    execv(exe, av.data());
    _exit(127);
  }
  close(fds[1]);
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t r = read(fds[0], buf, sizeof buf);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    out.append(buf, static_cast<size_t>(r));
  }
  close(fds[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    err = "child exited with status " + std::to_string(WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    return "";
  }
  return out;
}

std::string act_list(const std::vector<ActivationType>& acts) {
  std::string s;
  for (auto a : acts) s += std::string(s.empty() ? "" : ",") + lower(to_string(a));
  return s;
}

// ", shared expert I=512 sigmoid-gated" for a shape with one, else "".
std::string shared_note(const ModelShape& s) {
  if (s.shared_I <= 0) return "";
  return ", shared expert I=" + std::to_string(s.shared_I) + (s.shared_gate ? " sigmoid-gated" : "");
}

void run_shape(const Context& ctx, const ModelShape& shape) {
  ShapeSetup S = make_setup(shape, ctx.experts > 0 ? ctx.experts : shape.E_loc, ctx.tokens, ctx.opt.format);
  const bool cpu = ctx.backend == Backend::CPU;
  const std::vector<ActivationType> acts = activations_of(shape, ctx.opt);
  if (!ctx.opt.child) {
    const std::string reduced = S.E_loc < shape.E_loc ? " (reduced from " + std::to_string(shape.E_loc) + ")" : "";
    std::printf("== %s: H=%lld I=%lld k=%lld, %lld local experts%s, router over %lld (local window at %lld), T=%lld tokens, "
                "%s routing, %s weights%s, backend %s vs the CPU reference (%s)\n",
                std::string(shape.name).c_str(), (long long)S.H, (long long)S.I, (long long)S.k, (long long)S.E_loc,
                reduced.c_str(), (long long)S.E_total, (long long)S.offset, (long long)S.T,
                to_string(shape.routing),
                (std::string(S.layer.order == GateUpOrder::UpFirst ? "up-first " : "gate-first ") +
                 (S.layer.format == WeightFormat::MXFP4 ? "MXFP4" : "NVFP4")).c_str(),
                shared_note(shape).c_str(), cpu ? "CPU reference (fp32)" : "CUDA", cpu ? "fp64" : "fp32");
    std::fflush(stdout);
  }
  const Executor dut(ctx.backend, Precision::Fp32, S);
  std::unique_ptr<Executor> oracle;
  if (!ctx.opt.child) oracle = std::make_unique<Executor>(Backend::CPU, cpu ? Precision::Fp64 : Precision::Fp32, S);

  std::vector<Config> configs;
  for (ActivationType a : acts)
    for (ActMode m : ctx.opt.modes) configs.push_back(make_config(S, a, m));

  const Registries regs = make_registries(S, dut, oracle.get());
  if (ctx.opt.child) {
    for (const Config& c : configs) {
      std::string line = "hash " + c.name + " ";
      try {
        line += hex64(child_outputs(ctx, S, dut, regs, c).hash());
      } catch (const std::exception& e) {
        line += std::string("error ") + e.what();
      }
      std::printf("%s\n", line.c_str());
    }
    return;
  }

  // Identical output across two process launches: the child recomputes the hashed runs first (so
  // that each config's tally below includes this invariant).
  std::vector<std::string> args{"check", "--child", "--shape", std::string(shape.name), "--backend", cpu ? "cpu" : "cuda",
                                "--tokens", std::to_string(S.T), "--experts", std::to_string(S.E_loc),
                                "--activations", act_list(acts), "--format",
                                ctx.opt.format == WeightFormat::MXFP4 ? "mxfp4" : "nvfp4", "--modes", ""};
  for (ActMode m : ctx.opt.modes) args.back() += std::string(args.back().empty() ? "" : ",") + (m == ActMode::A4 ? "a4" : "a16");
  std::string relaunch_err;
  std::map<std::string, std::string> child_hash;
  {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string child_out = relaunch(args, relaunch_err);
    std::istringstream is(child_out);
    for (std::string line; std::getline(is, line);) {
      if (line.rfind("hash ", 0) != 0) continue;
      const size_t sp = line.rfind(' ');  // "hash <config name with spaces> <hex>"
      child_hash[line.substr(5, sp - 5)] = line.substr(sp + 1);
    }
    std::printf("-- re-launched process (check --child) done in %.1f s%s\n",
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                relaunch_err.empty() ? "" : (": " + relaunch_err).c_str());
    std::fflush(stdout);
  }

  for (const Config& c : configs) {
    const auto t0 = std::chrono::steady_clock::now();
    const LaunchOutputs o = run_config(ctx, S, dut, *oracle, regs, c);
    const std::string name = "identical output across two process launches";
    auto other = child_hash.find(c.name);
    if (!relaunch_err.empty()) {
      ctx.rep.add(c.name, "invariants", name, false, "error: " + relaunch_err);
    } else if (o.base.empty() || o.requests.empty()) {
      ctx.rep.add(c.name, "invariants", name, false, "error: this process's runs failed");
    } else if (other == child_hash.end()) {
      ctx.rep.add(c.name, "invariants", name, false, "error: the child printed no hash for this config");
    } else {
      const std::string mine = hex64(o.hash());
      ctx.rep.add(c.name, "invariants", name, mine == other->second,
                  "hash of base + 12-request outputs: this process " + mine + ", re-launched process " + other->second);
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("-- %s: without LoRA %s, individual adapters %s, eight adapters in one batch %s, mixed adapter and "
                "base requests %s, invariants %s (%.1f s)\n",
                c.name.c_str(), ctx.rep.tally(c.name, "without LoRA").c_str(),
                ctx.rep.tally(c.name, "individual adapters").c_str(),
                ctx.rep.tally(c.name, "eight adapters in one batch").c_str(),
                ctx.rep.tally(c.name, "mixed adapter and base requests").c_str(),
                ctx.rep.tally(c.name, "invariants").c_str(), secs);
    std::fflush(stdout);
  }
}

}  // namespace
}  // namespace check

int run_check_with_hooks(int argc, char** argv, const CheckHooks& hooks) {
  using namespace check;
  Options opt;
  const std::string perr = parse_options(argc, argv, opt);
  if (perr == "help") {
    usage(stdout);
    return 0;
  }
  if (!perr.empty()) {
    std::fprintf(stderr, "fp4moe check: %s\n", perr.c_str());
    usage(stderr);
    return 2;
  }
  const bool have_gpu = cuda_device_count() > 0;
  Backend backend = Backend::CPU;
  if (opt.backend == "cuda" || (opt.backend == "auto" && have_gpu)) {
    if (!have_gpu) {
      std::fprintf(stderr, "fp4moe check: --backend cuda, but %s\n",
                   build_info().with_cuda ? "no CUDA device is usable" : "this build has no CUDA backend");
      return 2;
    }
    backend = Backend::CUDA;
  }
  const bool cpu = backend == Backend::CPU;
  const int64_t tokens = opt.tokens > 0 ? opt.tokens : (cpu ? 24 : 64);
  const int64_t experts = opt.experts > 0 ? opt.experts : (cpu ? 16 : 0);  // 0: the shape's
  if (tokens < kNumRequests) {
    std::fprintf(stderr, "fp4moe check: --tokens must be >= %d (one token per request of phase 3), got %lld\n",
                 kNumRequests, (long long)tokens);
    return 2;
  }
  for (const auto& name : opt.shapes) {
    const ModelShape& s = *find_model_shape(name);
    const int64_t e = experts > 0 ? std::min(experts, s.E_loc) : s.E_loc;
    const int64_t et = e * (s.E / s.E_loc);
    if (s.k > et || (s.n_group > 1 && (et % s.n_group != 0 || et / s.n_group < 2 || s.k > s.topk_group * (et / s.n_group)))) {
      std::fprintf(stderr, "fp4moe check: --experts %lld is too few for %s (top-%lld, %lld groups)\n", (long long)e,
                   name.c_str(), (long long)s.k, (long long)s.n_group);
      return 2;
    }
  }

  Reporter rep(opt.child);
  const Context ctx{opt, hooks, backend, experts, tokens, rep};
  const auto t0 = std::chrono::steady_clock::now();
  if (!opt.child) {
    std::printf("fp4moe check: backend %s, %s, %lld tokens; oracle: CPU reference in %s\n",
                cpu ? "cpu (the reference in fp32)" : "cuda",
                experts > 0 ? ("reduced to " + std::to_string(experts) + " experts per shape (--experts)").c_str()
                            : "each shape's own expert count",
                (long long)tokens, cpu ? "fp64 (Precision::Fp64)" : "fp32");
    const Tolerance a4 = cpu ? kTolA4VsFp64 : kTolA4VsFp32;
    std::printf("tolerances: A16 rel_l2 <= %g and cos >= %g; A4 (vs the %s A4 reference) rel_l2 <= %g and cos >= %g; "
                "adapter effect vs base >= %g; invariants bit for bit\n",
                kTolA16.rel_l2, kTolA16.cosine, cpu ? "fp64" : "fp32", a4.rel_l2, a4.cosine, kMinEffect);
    std::fflush(stdout);
  }
  for (const auto& name : opt.shapes) {
    try {
      run_shape(ctx, *find_model_shape(name));
    } catch (const std::exception& e) {
      // Setup failed (weights, adapters): one failing check stands for the whole shape.
      if (opt.child) {
        std::printf("error %s\n", e.what());
        return 1;
      }
      rep.add(name, "setup", "prepare weights and adapters", false, std::string("error: ") + e.what());
    }
  }
  if (opt.child) return 0;

  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("fp4moe check finished in %.1f s\n", secs);
  if (!opt.json_path.empty() && !write_json(opt.json_path, rep, cpu ? "cpu" : "cuda", experts, tokens))
    rep.add("harness", "output", "write --json " + opt.json_path, false, "cannot write the file");
  std::printf("%d passed, %d failed\n", rep.passed(), rep.failed());
  std::fflush(stdout);
  return rep.failed() == 0 && rep.passed() > 0 ? 0 : 1;
}

int run_check(int argc, char** argv) { return run_check_with_hooks(argc, argv, CheckHooks{}); }

}  // namespace fp4moe
