#include "common/logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdlib>  // rand

namespace elastic {

Status InitLogging(const std::string& level, const std::string& prefix) {
  const std::string name = level.empty() ? "info" : level;
  auto parsed = spdlog::level::from_str(name);
  if (parsed == spdlog::level::off && name != "off") {
    return InvalidArgument("unknown log level '" + name +
                           "' (use trace, debug, info, warn, error, critical or off)");
  }
  auto logger = spdlog::stderr_color_mt("elastic-" + prefix + "-" + std::to_string(rand()));
  logger->set_pattern("[%H:%M:%S.%e] [" + prefix + "] [%^%l%$] %v");
  logger->set_level(parsed);
  spdlog::set_default_logger(logger);
  return Status::Ok();
}

}  // namespace elastic
