// Helper threads kept for the whole process (common/thread_pool.cc): short tasks off the
// caller's path, and a parallel for over a few items.
#pragma once

#include <cstddef>
#include <functional>
#include <vector>

namespace elastic {

// Runs `task` on `helpers` pool threads (started as needed, at most 15 in all).
void PostToHelpers(size_t helpers, const std::function<void()>& task);

// Runs fn(i) for every i in `items`, on the calling thread and up to 15 pool threads at once,
// and rethrows the first exception.
void ForEachInParallel(const std::vector<int>& items, const std::function<void(int)>& fn);

}  // namespace elastic
