#include "common/clock.h"

namespace elastic {
namespace {

class SystemClock : public Clock {
 public:
  TimePoint Now() const override { return SteadyClock::now(); }
  bool WaitUntil(std::unique_lock<std::mutex>& lock, std::condition_variable& cv,
                 TimePoint deadline, const std::function<bool()>& pred) override {
    return cv.wait_until(lock, deadline, pred);
  }
};

}  // namespace

Clock* RealClock() {
  static SystemClock* clock = new SystemClock();
  return clock;
}

TimePoint FakeClock::Now() const {
  MutexLock g(mu_);
  return now_;
}

bool FakeClock::WaitUntil(std::unique_lock<std::mutex>& lock, std::condition_variable& cv,
                          TimePoint deadline, const std::function<bool()>& pred) {
  {
    MutexLock g(mu_);
    cvs_.insert(&cv);
  }
  bool result = false;
  while (true) {
    if (pred()) {
      result = true;
      break;
    }
    if (Now() >= deadline) break;
    // Real-time slice only so that an Advance racing with this check is never missed.
    cv.wait_for(lock, std::chrono::milliseconds(5));
  }
  MutexLock g(mu_);
  cvs_.erase(&cv);
  return result;
}

void FakeClock::Advance(Duration d) {
  MutexLock g(mu_);
  now_ += d;
  for (auto* cv : cvs_) cv->notify_all();
}

}  // namespace elastic
