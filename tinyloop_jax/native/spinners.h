// A pool of helper threads that spin for a while after each job before they sleep (a job: any
// type with `work()`, run by every helper that wakes for it).
// Included by qmatmul.cc only (one translation unit: its anonymous namespace).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <sched.h>
#include <thread>

namespace {

// Helper threads of our own that spin (yielding the core to anything runnable) for a while
// after each call before they sleep: a decode step makes ~120 calls of tens of microseconds
// each, about as long as waking a sleeping pool thread takes, so pool helpers came too late to
// share the work. A helper that starts on a finished call's job finds no unit left and returns.
template <class Job>
class Spinners {
 public:
  explicit Spinners(int64_t n) {
    for (int64_t i = 0; i < n; ++i) std::thread([this] { loop(); }).detach();
  }
  void submit(const std::shared_ptr<Job>& job) {
    std::atomic_store(&job_, job);
    gen_.fetch_add(1);
    if (sleeping_.load()) {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_all();
    }
  }

 private:
  static constexpr auto kSpin = std::chrono::microseconds(200);
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      auto start = std::chrono::steady_clock::now();
      while (gen_.load() == seen) {
        sched_yield();
        if (std::chrono::steady_clock::now() - start > kSpin) {
          std::unique_lock<std::mutex> lock(mu_);
          sleeping_.fetch_add(1);
          cv_.wait(lock, [&] { return gen_.load() != seen; });
          sleeping_.fetch_sub(1);
        }
      }
      seen = gen_.load();
      if (auto job = std::atomic_load(&job_)) job->work();
    }
  }
  std::shared_ptr<Job> job_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> sleeping_{0};
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace
