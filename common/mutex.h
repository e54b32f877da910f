// elastic::Mutex and elastic::MutexLock: std::mutex and std::unique_lock with clang's
// thread-safety annotations (common/thread_annotations.h), so that which member a mutex guards
// is checked by the compiler rather than said in a comment. Every mutex outside tests/ is one
// (scripts/thread-safety.sh checks that too).
//
//   Mutex mu_;
//   int count_ ELASTIC_GUARDED_BY(mu_);
//   ...
//   MutexLock lock(mu_);
//   cv_.wait(lock.native(), [&]() ELASTIC_REQUIRES(mu_) { return count_ > 0; });
//
// A condition variable waits on lock.native(). The wait lets the mutex go and takes it back
// before it returns, so to the analysis the mutex is held throughout, which is what the code
// after the wait may assume. A predicate lambda reads guarded members and says so with
// ELASTIC_REQUIRES: the condition variable calls it with the mutex held.
#pragma once

#include <mutex>

#include "common/thread_annotations.h"

namespace elastic {

class ELASTIC_CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void lock() ELASTIC_ACQUIRE() { mu_.lock(); }
  void unlock() ELASTIC_RELEASE() { mu_.unlock(); }
  bool try_lock() ELASTIC_TRY_ACQUIRE(true) { return mu_.try_lock(); }

 private:
  friend class MutexLock;
  std::mutex mu_;
};

// Holds a Mutex for its scope; Unlock() and Lock() let it go and take it again inside that
// scope, and the analysis follows both.
class ELASTIC_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) ELASTIC_ACQUIRE(mu) : lock_(mu.mu_) {}
  ~MutexLock() ELASTIC_RELEASE() {}
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  void Unlock() ELASTIC_RELEASE() { lock_.unlock(); }
  void Lock() ELASTIC_ACQUIRE() { lock_.lock(); }

  // The std::unique_lock that a std::condition_variable, or Clock::WaitUntil, waits on.
  std::unique_lock<std::mutex>& native() { return lock_; }

 private:
  std::unique_lock<std::mutex> lock_;
};

}  // namespace elastic
