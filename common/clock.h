// Clock: all time in elastic-run goes through this interface so tests can drive cooldowns and
// deadlines with a FakeClock.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <set>

#include "common/mutex.h"

namespace elastic {

using SteadyClock = std::chrono::steady_clock;
using TimePoint = SteadyClock::time_point;
using Duration = SteadyClock::duration;
using Millis = std::chrono::milliseconds;

// `s` seconds (a count from outside: a flag, a variable) as a Duration.
inline Duration FromSeconds(double s) {
  return std::chrono::duration_cast<Duration>(std::chrono::duration<double>(s));
}

class Clock {
 public:
  virtual ~Clock() = default;
  virtual TimePoint Now() const = 0;
  // Waits on `cv` (whose mutex `lock` holds) until `pred()` is true or this clock reaches
  // `deadline`. Returns pred()'s final value. Thread-safe. `lock` is a MutexLock's native()
  // (common/mutex.h); `pred` runs with that mutex held.
  virtual bool WaitUntil(std::unique_lock<std::mutex>& lock, std::condition_variable& cv,
                         TimePoint deadline, const std::function<bool()>& pred) = 0;
};

// The process-wide real steady clock. Never null, never destroyed.
Clock* RealClock();

// A clock that moves only when Advance() is called. Waiters are woken on every Advance();
// they also re-check every few real milliseconds, so a wake-up racing with Advance is not lost.
class FakeClock : public Clock {
 public:
  explicit FakeClock(TimePoint start = TimePoint() + std::chrono::hours(1)) : now_(start) {}
  TimePoint Now() const override;
  bool WaitUntil(std::unique_lock<std::mutex>& lock, std::condition_variable& cv,
                 TimePoint deadline, const std::function<bool()>& pred) override;
  void Advance(Duration d);

 private:
  mutable Mutex mu_;
  TimePoint now_ ELASTIC_GUARDED_BY(mu_);
  std::set<std::condition_variable*> cvs_ ELASTIC_GUARDED_BY(mu_);  // waiters to wake on Advance
};

}  // namespace elastic
