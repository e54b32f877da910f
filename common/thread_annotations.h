// Clang's thread-safety annotations (https://clang.llvm.org/docs/ThreadSafetyAnalysis.html),
// spelled once. Under clang with -Wthread-safety the compiler checks that every member marked
// ELASTIC_GUARDED_BY(mu) is touched only with `mu` held, and that a function marked
// ELASTIC_REQUIRES(mu) is called only with it held; other compilers see nothing.
// scripts/thread-safety.sh runs that check over the whole tree (scripts/test.sh calls it).
// The mutex these annotate is common/mutex.h's elastic::Mutex: std::mutex carries none.
#pragma once

#if defined(__clang__)
#define ELASTIC_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define ELASTIC_THREAD_ANNOTATION(x)
#endif

// A class that is a lock (elastic::Mutex).
#define ELASTIC_CAPABILITY(name) ELASTIC_THREAD_ANNOTATION(capability(name))
// A class whose constructor takes a lock and whose destructor lets it go (elastic::MutexLock).
#define ELASTIC_SCOPED_CAPABILITY ELASTIC_THREAD_ANNOTATION(scoped_lockable)
// A member read or written only with the lock held.
#define ELASTIC_GUARDED_BY(mu) ELASTIC_THREAD_ANNOTATION(guarded_by(mu))
// A pointer member whose pointee is read or written only with the lock held.
#define ELASTIC_PT_GUARDED_BY(mu) ELASTIC_THREAD_ANNOTATION(pt_guarded_by(mu))
// A function its caller calls with the lock held.
#define ELASTIC_REQUIRES(...) ELASTIC_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
// A function its caller must not call with the lock held (it takes it itself).
#define ELASTIC_EXCLUDES(...) ELASTIC_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
// A function that takes the lock and returns with it held, or lets a held one go.
#define ELASTIC_ACQUIRE(...) ELASTIC_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define ELASTIC_RELEASE(...) ELASTIC_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define ELASTIC_TRY_ACQUIRE(...) ELASTIC_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
// A function returning a reference to a lock.
#define ELASTIC_RETURN_CAPABILITY(x) ELASTIC_THREAD_ANNOTATION(lock_returned(x))
// A function the analysis skips; every use says why in a comment.
#define ELASTIC_NO_THREAD_SAFETY_ANALYSIS ELASTIC_THREAD_ANNOTATION(no_thread_safety_analysis)
