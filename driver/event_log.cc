#include "driver/event_log.h"

#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>
#include <type_traits>

namespace elastic::driver {

EventLog::~EventLog() {
  if (file_) fclose(file_);
}

Status EventLog::Open(const std::string& path) {
  if (path.empty()) return Status::Ok();
  file_ = fopen(path.c_str(), "a");
  if (!file_) {
    return InvalidArgument("cannot open event log '" + path + "': " + strerror(errno));
  }
  return Status::Ok();
}

void EventLog::Write(const std::string& event, const JsonFields& fields) {
  if (!file_) return;
  nlohmann::json j;
  j["ts"] =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  j["event"] = event;
  for (const auto& field : fields) {
    const std::string& k = field.first;
    const JsonValue& v = field.second;
    std::visit(
        [&j, &k](const auto& x) {
          if constexpr (std::is_same_v<std::decay_t<decltype(x)>, std::monostate>) {
            j[k] = nullptr;
          } else {
            j[k] = x;
          }
        },
        v);
  }
  std::string line = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  fwrite(line.data(), 1, line.size(), file_);
  fflush(file_);
}

}  // namespace elastic::driver
