// --event-log: one JSON object per line, each with "ts" (seconds since the epoch, as a
// float) and "event". Not thread-safe: the driver's loop is its only writer.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "common/status.h"

namespace elastic::driver {

// std::monostate is JSON null.
using JsonValue = std::variant<std::monostate, int64_t, double, bool, std::string, std::vector<std::string>,
                               std::vector<int64_t>>;
using JsonFields = std::vector<std::pair<std::string, JsonValue>>;

class EventLog {
 public:
  EventLog() = default;
  ~EventLog();
  // Opens (appends to) `path`; "" keeps the log off.
  Status Open(const std::string& path);
  void Write(const std::string& event, const JsonFields& fields = {});

 private:
  FILE* file_ = nullptr;
};

}  // namespace elastic::driver
