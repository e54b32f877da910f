// A file replaced whole: written to <path>.tmp (created with `mode`), then renamed over
// `path`, so that a reader finds the old contents or the new, never part of them. Used for
// the job file (driver/monitor.h) and the driver's journal (driver/journal.h).
#pragma once

#include <sys/types.h>

#include <string>

#include "common/status.h"

namespace elastic {

// INTERNAL naming the file and the system's error when it cannot be written or renamed (the
// temporary file is removed then).
Status WriteFileAtomically(const std::string& path, const std::string& text, mode_t mode);

}  // namespace elastic
