// fp4moe_soak's host side: memory readings, the staging buffer of y, and the thread that churns adapters.
#include <algorithm>
#include <cstdio>
#include <new>
#include <stdexcept>
#include <string>

#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "soak.h"
#ifdef FP4MOE_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace fp4moe::soak {

// ---- memory -----------------------------------------------------------------------------------------
#ifdef FP4MOE_WITH_CUDA
void cuda_ok(int e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorString(static_cast<cudaError_t>(e)));
}
#endif

int64_t host_rss_bytes() {
#if defined(__GLIBC__)
  malloc_trim(0);  // freed heap pages go back first: what stays resident is what is live or fragmented
#endif
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return -1;
  long long size = 0, resident = 0;
  const int n = std::fscanf(f, "%lld %lld", &size, &resident);
  std::fclose(f);
  return n == 2 ? resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE)) : -1;
}

int64_t device_used_bytes(Backend b) {
  if (b != Backend::CUDA) return 0;
#ifdef FP4MOE_WITH_CUDA
  cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  size_t free_b = 0, total_b = 0;
  cuda_ok(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  return static_cast<int64_t>(total_b - free_b);
#else
  return 0;
#endif
}

const uint8_t* read_back(const DeviceBuffer& b, size_t n, void* stream, void* staging) {
  if (b.where() == Backend::CPU) return b.as<const uint8_t>();
  b.download_to(staging, n, stream);
  return static_cast<const uint8_t*>(staging);
}

Staging::Staging(Backend b, size_t bytes) : cuda_(b == Backend::CUDA) {
#ifdef FP4MOE_WITH_CUDA
  if (cuda_) {
    cuda_ok(cudaMallocHost(&p_, std::max<size_t>(bytes, 256)), "cudaMallocHost");
    return;
  }
#endif
  cuda_ = false;
  p_ = ::operator new(std::max<size_t>(bytes, 256));
}

Staging::~Staging() {
#ifdef FP4MOE_WITH_CUDA
  if (cuda_) {
    (void)cudaFreeHost(p_);
    return;
  }
#endif
  ::operator delete(p_);
}

// ---- the churn thread ---------------------------------------------------------------------------------
void Churn::pause() {
  std::unique_lock<std::mutex> lk(mu_);
  want_pause_ = true;
  cv_.notify_all();
  cv_.wait(lk, [&] { return paused_ || done_; });
}

void Churn::resume() {
  std::lock_guard<std::mutex> lk(mu_);
  want_pause_ = false;
  cv_.notify_all();
}

void Churn::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    cv_.notify_all();
  }
  if (th_.joinable()) th_.join();
}

std::string Churn::first_error() {
  std::lock_guard<std::mutex> lk(mu_);
  return first_error_;
}

void Churn::note(const std::string& e) {
  ++errors;
  std::lock_guard<std::mutex> lk(mu_);
  if (first_error_.empty()) first_error_ = e;
}

void Churn::clear(std::vector<char>& loaded) {
  for (int s = 0; s < n_; ++s) {
    if (!loaded[s]) continue;
    try {
      reg_.unload(first_ + s);
      ++unloads;
    } catch (const std::exception& e) {
      note(std::string("unload: ") + e.what());
    }
    loaded[s] = 0;
  }
}

void Churn::loop() {
  std::mt19937_64 rng(seed_);
  std::vector<char> loaded(n_, 0);
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (stop_ || want_pause_) {
        lk.unlock();
        clear(loaded);
        lk.lock();
        if (stop_) {
          done_ = true;
          cv_.notify_all();
          return;
        }
        paused_ = true;
        cv_.notify_all();
        cv_.wait(lk, [&] { return !want_pause_ || stop_; });
        paused_ = false;
        continue;
      }
    }
    const int op = static_cast<int>(rng() % 16);
    const int s = static_cast<int>(rng() % n_);
    try {
      if (op < 6 || (op < 12 && !loaded[s])) {
        if (op >= 6 && rng() % 4 == 0) {
          // An empty slot: unload must refuse it (NotFound) and change nothing.
          try {
            reg_.unload(first_ + s);
            note("unload of empty slot " + std::to_string(first_ + s) + " did not throw");
          } catch (const Error& e) {
            if (e.code() != ErrorCode::NotFound) note(std::string("unload of an empty slot: ") + e.what());
            else ++empty_unloads_refused;
          }
        }
        reg_.load(first_ + s, pool_[rng() % pool_.size()].desc());  // new, or replaces what the slot held
        loaded[s] = 1;
        ++loads;
      } else if (op < 12) {
        reg_.unload(first_ + s);
        loaded[s] = 0;
        ++unloads;
      } else {
        const size_t i = rng() % stable_.size();
        reg_.load(static_cast<int>(i), stable_[i].desc());  // the same content: must be invisible
        ++loads;
        ++stable_reloads;
      }
    } catch (const std::exception& e) {
      note(e.what());
    }
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait_for(lk, sleep_, [&] { return stop_ || want_pause_; });
  }
}

}  // namespace fp4moe::soak
