// The driver's journal (--state-dir DIR): what a driver decided, written whole on every
// decision, so that a driver started again on the folder after this one died (SIGKILL, its
// node lost) adopts the job: it listens where the workers dial, with their token, takes the
// rendezvous core's formed round and the policy's state as its own, and watches the workers
// that still run (docs/recovery.md, "A driver that comes back").
//
// The folder is the job's: mode 0700, held by one live driver at a time (a lock its death
// releases); the journal is 0600 (it holds the job token), replaced atomically (a new file
// renamed over the old one), so a reader finds the previous journal or the next, never half.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tls.h"
#include "rendezvous/core.h"

namespace elastic::driver {

struct JournalWorker {
  pid_t pid = 0;
  uint64_t start_ticks = 0;  // /proc/<pid>/stat's start time: the pid is still this process
  bool local = true;
  std::string host;
  std::string stdout_file, stderr_file;  // "" when its output comes through pipes
  // How far the driver had read (and shown) them; -1: unknown. The journal is written at
  // most a second apart while the job is heard from, so a line shown in the driver's last
  // second may be shown again by the one that adopts the job.
  int64_t stdout_offset = -1, stderr_offset = -1;
  // A remote worker that outlives its launch (driver/launch.h): pid is of its host, where it
  // writes to remote_dir/stdout and stderr, the offsets are of those, and remote_group is
  // what `kill` takes for its process group. "" and 0 otherwise.
  std::string remote_dir;
  int64_t remote_group = 0;
  // A local worker's status keeper (common/process.h, LaunchSpec::status_dir), or 0: it
  // records how the worker ended in the state folder's exits/ for the driver that adopts it.
  int64_t keeper_pid = 0;
};

struct Journal {
  std::vector<std::string> argv;  // the driver's command line
  std::string bind, driver_addr;  // where the server listened, what the workers dial
  int port = 0;
  std::string token;
  // The job's TLS credentials (--tls, common/tls.h): a driver that adopts the job presents the
  // same identity to workers that hold the client's. Empty: the job speaks plain text.
  JobCredentials tls;
  int64_t restarts = 0;   // drivers before this journal's that adopted the job
  double written_at = 0;  // wall clock, seconds since the epoch
  rendezvous::CoreSnapshot core;
  std::string policy;                            // SavePolicyState's text
  std::map<std::string, JournalWorker> workers;  // running processes by slot
};

std::string JournalPath(const std::string& state_dir);

// Creates the folder (0700) and takes its lock for this process's life (the fd, close-on-exec).
// FAILED_PRECONDITION naming the pid when a live driver holds it.
StatusOr<int> LockStateDir(const std::string& state_dir);

// Writes the journal atomically (DIR/journal.json.tmp, renamed). An error says why.
Status WriteJournal(const std::string& state_dir, const Journal& j);
// NOT_FOUND when there is none; INVALID_ARGUMENT naming the field when it is damaged.
StatusOr<Journal> ReadJournal(const std::string& state_dir);
void RemoveJournal(const std::string& state_dir);
// The journal as text (JSON), and back; `where` names it in errors (a path, a store's key).
std::string SerializeJournal(const Journal& j);
StatusOr<Journal> ParseJournal(const std::string& text, const std::string& where);

// The start time of a process in clock ticks since boot (/proc/<pid>/stat, field 22); 0 when
// it is gone or unreadable. With the pid, it names one process for the machine's uptime.
uint64_t ProcessStartTicks(pid_t pid);
// The pid still runs the process the journal recorded (not gone, not reused). A remote
// worker with remote_dir is taken to run: the driver's AttachScript finds out on its host.
bool StillRunning(const JournalWorker& w);

}  // namespace elastic::driver
