// The one host thread pool of the project: fn(i) for i in [0, n) on up to `threads` std::threads, taking
// indices in order; the first exception stops the rest and is rethrown after every thread has joined.
// Callers make each index's work independent, so which thread runs which index changes no result.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace fp4moe {

// Threads to use when the caller has no preference: the machine's, at least 1 and at most `cap`.
inline int default_threads(int cap) {
  return std::max(1, std::min(cap, static_cast<int>(std::thread::hardware_concurrency())));
}

template <class F> void parallel_for(int64_t n, int threads, F&& fn) {
  const int nt = static_cast<int>(std::min<int64_t>(threads, n));
  if (nt <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  std::exception_ptr err;
  std::mutex err_mu;
  auto worker = [&] {
    for (;;) {
      const int64_t i = next.fetch_add(1);
      if (i >= n) return;
      try {
        fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lk(err_mu);
        if (!err) err = std::current_exception();
        next.store(n);
      }
    }
  };
  std::vector<std::thread> pool;
  for (int i = 0; i < nt; ++i) pool.emplace_back(worker);
  for (auto& th : pool) th.join();
  if (err) std::rethrow_exception(err);
}

}  // namespace fp4moe
