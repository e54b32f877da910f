#include "common/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#include "common/mutex.h"

namespace elastic {
namespace {

// Threads kept for PostToHelpers and ForEachInParallel: created on first use and never joined (they sleep on a
// condition variable between uses). Creating and joining threads for every round cost more
// than the work they did when dozens of workers share a few cores.
class HelperPool {
 public:
  static HelperPool& Get() {
    static auto* pool = new HelperPool();  // never destroyed: its threads outlive main()
    return *pool;
  }
  // Runs `task` on up to `helpers` pool threads (started as needed, at most kMax in all).
  void Post(size_t helpers, const std::function<void()>& task) {
    MutexLock g(mu_);
    for (size_t i = 0; i < helpers; ++i) queue_.push_back(task);
    while (threads_ < kMax && threads_ - busy_ < queue_.size()) {
      ++threads_;
      std::thread([this] { Loop(); }).detach();
    }
    // One wake-up per task: waking every idle thread for each post made them all contend for
    // the lock (hundreds of needless context switches per round with a hundred workers on a
    // few cores).
    for (size_t i = 0; i < helpers; ++i) cv_.notify_one();
  }

 private:
  static constexpr size_t kMax = 15;
  void Loop() {
    MutexLock lock(mu_);
    while (true) {
      cv_.wait(lock.native(), [&]() ELASTIC_REQUIRES(mu_) { return !queue_.empty(); });
      std::function<void()> task = std::move(queue_.front());
      queue_.pop_front();
      ++busy_;
      lock.Unlock();
      task();
      task = nullptr;
      lock.Lock();
      --busy_;
    }
  }
  Mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_ ELASTIC_GUARDED_BY(mu_);
  size_t threads_ ELASTIC_GUARDED_BY(mu_) = 0;
  size_t busy_ ELASTIC_GUARDED_BY(mu_) = 0;
};

}  // namespace

void PostToHelpers(size_t helpers, const std::function<void()>& task) {
  HelperPool::Get().Post(helpers, task);
}

// Gloo's TCP pairs block their caller on the device loop's
// next tick (up to 10 ms) when they connect (the active side) and when they close: one pair
// after another, the ticks add up; together they share a tick.
void ForEachInParallel(const std::vector<int>& items, const std::function<void(int)>& fn) {
  if (items.size() <= 1) {
    for (int i : items) fn(i);
    return;
  }
  struct Job {
    std::vector<int> items;
    std::function<void(int)> fn;
    std::atomic<size_t> next{0};
    Mutex mu;
    std::condition_variable cv;
    size_t done ELASTIC_GUARDED_BY(mu) = 0;
    std::exception_ptr first ELASTIC_GUARDED_BY(mu);
    void Work() {
      for (size_t k = next++; k < items.size(); k = next++) {
        std::exception_ptr error;
        try {
          fn(items[k]);
        } catch (...) {
          error = std::current_exception();
        }
        MutexLock g(mu);
        if (error && !first) first = error;
        if (++done == items.size()) cv.notify_all();
      }
    }
  };
  // Shared with the helpers: one that starts after the items are all done finds none left.
  auto job = std::make_shared<Job>();
  job->items = items;
  job->fn = fn;
  PostToHelpers(std::min<size_t>(items.size(), 16) - 1, [job] { job->Work(); });
  job->Work();
  MutexLock lock(job->mu);
  job->cv.wait(lock.native(),
               [&]() ELASTIC_REQUIRES(job->mu) { return job->done == job->items.size(); });
  if (job->first) std::rethrow_exception(job->first);
}


}  // namespace elastic
