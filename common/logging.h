// Logging set-up on spdlog. Every module logs through spdlog's default logger.
#pragma once

#include <string>

#include "common/status.h"

namespace elastic {

// Sets the level of the default logger from `level` ("trace", "debug", "info", "warn",
// "error", "critical", "off"; empty: "info"). The caller reads $ELASTIC_LOG_LEVEL (the driver's
// main, a worker's WorkerOptions). Returns INVALID_ARGUMENT naming the bad level. `prefix` (e.g.
// "driver") starts each line.
Status InitLogging(const std::string& level, const std::string& prefix);

}  // namespace elastic
