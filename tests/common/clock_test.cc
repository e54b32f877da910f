#include "common/clock.h"

#include <catch2/catch.hpp>
#include <thread>

namespace elastic {
namespace {

TEST_CASE("FakeClock moves only when advanced and wakes waiters", "[unit]") {
  FakeClock clock;
  TimePoint t0 = clock.Now();
  CHECK(clock.Now() == t0);
  clock.Advance(std::chrono::seconds(5));
  CHECK(clock.Now() - t0 == std::chrono::seconds(5));

  std::mutex mu;
  std::condition_variable cv;
  bool woke_by_deadline = false;
  TimePoint deadline = clock.Now() + std::chrono::seconds(60);
  std::thread waiter([&] {
    std::unique_lock<std::mutex> lock(mu);
    woke_by_deadline = !clock.WaitUntil(lock, cv, deadline, [] { return false; });
  });
  // The waiter returns only once fake time passes its deadline, however long that takes.
  clock.Advance(std::chrono::seconds(30));
  clock.Advance(std::chrono::seconds(31));
  waiter.join();
  CHECK(woke_by_deadline);
}

TEST_CASE("FakeClock wait returns early when the predicate holds", "[unit]") {
  FakeClock clock;
  std::mutex mu;
  std::condition_variable cv;
  bool flag = false;
  bool result = false;
  TimePoint deadline = clock.Now() + std::chrono::hours(1);
  std::thread waiter([&] {
    std::unique_lock<std::mutex> lock(mu);
    result = clock.WaitUntil(lock, cv, deadline, [&] { return flag; });
  });
  {
    std::lock_guard<std::mutex> g(mu);
    flag = true;
  }
  cv.notify_all();
  waiter.join();
  CHECK(result);
}

}  // namespace
}  // namespace elastic
