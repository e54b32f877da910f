// One process at a time per folder: an exclusive flock on <dir>/LOCK, which holds the owner's
// pid for the message a second one gets. The kernel releases it when the owner dies, however
// it dies. Used for --checkpoint-dir (state/checkpoint.h) and --state-dir (driver/journal.h).
#pragma once

#include <string>

#include "common/status.h"

namespace elastic {

// Creates `dir` (0700) when missing and takes its lock for this process's life: the fd
// (close-on-exec). INTERNAL when the folder or the lock file cannot be made or opened;
// FAILED_PRECONDITION when another process holds it, naming its pid: "<what> <dir> <held>
// (elastic-run pid N); <advice>".
StatusOr<int> LockFolder(const std::string& dir, const std::string& what,
                         const std::string& held, const std::string& advice);

}  // namespace elastic
