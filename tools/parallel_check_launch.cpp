// fp4moe_parallel_check's launcher: parses the options, forks one process per rank and waits (no CUDA here).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "parallel_check.h"

using namespace fp4moe::parallel_check;

namespace {

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) if (!item.empty()) v.push_back(item);
  return v;
}

void usage() {
  std::printf(
      "usage: fp4moe_parallel_check [--world N] [--shapes kimi_k3,qwen3_30b_a3b] [--tokens 1,64,1024]\n"
      "       [--check-tokens 64] [--ref-tokens 4] [--kimi-experts 64] [--iters 20] [--warmup 5] [--tol 5e-3]\n"
      "       [--no-cpu-ref] [--no-timing] [--timeout 240] [--json FILE]\n");
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) {
        usage();
        std::exit(64);
      }
      return argv[++i];
    };
    if (a == "--world") o.world = std::stoi(val());
    else if (a == "--shapes") o.shapes = split(val());
    else if (a == "--tokens") {
      o.tokens.clear();
      for (const auto& t : split(val())) o.tokens.push_back(std::stoll(t));
    } else if (a == "--check-tokens") o.check_tokens = std::stoll(val());
    else if (a == "--ref-tokens") o.ref_tokens = std::stoll(val());
    else if (a == "--kimi-experts") o.kimi_experts = std::stoll(val());
    else if (a == "--iters") o.iters = std::stoi(val());
    else if (a == "--warmup") o.warmup = std::stoi(val());
    else if (a == "--tol") o.tol = std::stod(val());
    else if (a == "--timeout") o.timeout = std::stoi(val());
    else if (a == "--json") o.json = val();
    else if (a == "--no-cpu-ref") o.cpu_ref = false;
    else if (a == "--no-timing") o.timing = false;
    else if (a == "-h" || a == "--help") {
      usage();
      return 0;
    } else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      usage();
      return 64;
    }
  }
  if (o.world < 2 || o.iters < 1 || o.tokens.empty() || o.check_tokens < 1) {
    usage();
    return 64;
  }
  // NVLink SHARP (NVLS) stays off: the GPUs' host is shared (docs/api.md "Multi-GPU").
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  // No CUDA call before the fork: every rank initialises CUDA itself.
  std::vector<int> rd(o.world, -1), wr(o.world, -1);
  for (int r = 1; r < o.world; ++r) {
    int p[2];
    if (pipe(p) != 0) {
      std::perror("pipe");
      return 2;
    }
    rd[r] = p[0];
    wr[r] = p[1];
  }
  std::fflush(stdout);
  std::vector<pid_t> pids;
  for (int r = 0; r < o.world; ++r) {
    const pid_t pid = fork();
    if (pid < 0) {
      std::perror("fork");
      for (pid_t q : pids) kill(q, SIGKILL);
      return 2;
    }
    if (pid == 0) {
      std::vector<int> mine_w;
      for (int q = 1; q < o.world; ++q) {
        if (r == 0) mine_w.push_back(wr[q]);
        else close(wr[q]);
        if (q != r) close(rd[q]);
      }
      std::_Exit(rank_main(o, r, mine_w, r > 0 ? rd[r] : -1) & 0xff);
    }
    pids.push_back(pid);
  }
  for (int r = 1; r < o.world; ++r) {
    close(rd[r]);
    close(wr[r]);
  }
  // Wait; when one rank fails, the others are given a few seconds and then killed (never a hang).
  int worst = 0, alive = o.world;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(o.timeout + 10);
  bool killing = false;
  std::vector<bool> done(o.world, false);
  while (alive > 0) {
    int st = 0;
    const pid_t p = waitpid(-1, &st, WNOHANG);
    if (p > 0) {
      const int r = static_cast<int>(std::find(pids.begin(), pids.end(), p) - pids.begin());
      if (r < o.world) done[r] = true;
      --alive;
      const int rc = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      if (rc != 0) {
        std::fprintf(stderr, "rank %d exited with %d%s\n", r, rc, WIFSIGNALED(st) ? " (signal: watchdog or crash)" : "");
        worst = std::max(worst, rc);
        if (!killing && rc >= 2) {
          killing = true;
          deadline = std::min(deadline, std::chrono::steady_clock::now() + std::chrono::seconds(10));
        }
      }
      continue;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      for (int r = 0; r < o.world; ++r)
        if (!done[r]) {
          std::fprintf(stderr, "killing rank %d (hang)\n", r);
          kill(pids[r], SIGKILL);
        }
      worst = std::max(worst, 124);
      deadline = std::chrono::steady_clock::now() + std::chrono::hours(1);
    }
    usleep(20000);
  }
  return worst;
}
