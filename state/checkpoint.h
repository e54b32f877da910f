// Durable checkpoints of committed state: one folder per version, written off the training
// thread, found again after a restart. The layout (docs/checkpoints.md):
//
//   DIR/LOCK                      held (flock) by the driver of the job that uses DIR
//   DIR/v00000000000000000042/    version 42
//       manifest.json             version, step, epoch, cursor, samples, world size, time, and
//                                 each file's name, kind, size and CRC-32
//       <one file per value>      the bytes of each registered value or tracked buffer
//   DIR/.tmp-v...-PID/            a version being written (never read)
//
// A version is written under a temporary name, each file and the manifest fsynced, then
// renamed into place and the folder fsynced: a folder named v<digits> with a manifest whose
// files all have their size and checksum is complete. Anything else is skipped when reading.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"

namespace elastic {

// One file of a checkpoint. `data`/`size` point into `keep`, which holds them alive for as
// long as the write needs them (a committed snapshot, shared, not copied).
struct CheckpointFile {
  std::string name;  // the value's name in the state
  std::string kind;  // "value" (a serialised registered value) or "tracked" (raw bytes)
  std::shared_ptr<const void> keep;
  const char* data = nullptr;
  size_t size = 0;
};

struct CheckpointEntry {
  std::string name, kind, file;  // file: its name inside the version's folder
  uint64_t size = 0;
  uint32_t crc32 = 0;
};

struct CheckpointInfo {
  int64_t version = 0;
  int64_t step = 0;
  int64_t epoch = -1;
  int64_t cursor = -1;
  int64_t samples = -1;
  int64_t world_size = 0;
  double time = 0;   // seconds since the epoch, when the write began
  std::string path;  // the version's folder
  std::vector<CheckpointEntry> files;
};

// The file name a value's bytes get: its kind, then the name with every byte outside
// [A-Za-z0-9._-] written as %XX ("tracked.w", "value.sampler").
std::string CheckpointFileName(const std::string& kind, const std::string& name);

// Writes `files` as version `meta.version` under `dir` (created when missing), then removes all
// but the `keep` newest complete versions. On success *written has the folder and the files.
Status WriteCheckpoint(const std::string& dir, const CheckpointInfo& meta,
                       const std::vector<CheckpointFile>& files, int keep,
                       CheckpointInfo* written);

// Reads a version's manifest (not its data). Bounded: a manifest over 16 MiB, a file list over
// 100,000 entries or a name that leaves the folder is refused.
Status ReadManifest(const std::string& folder, CheckpointInfo* out);

// Reads one file of a checkpoint whole, checking its size and CRC-32 against the manifest.
Status ReadCheckpointFile(const CheckpointInfo& info, const CheckpointEntry& entry,
                          std::string* out);

// The versions under `dir`, newest first, whose manifests read (data unchecked); the reason
// for each folder skipped goes to `skipped`.
std::vector<CheckpointInfo> ListCheckpoints(const std::string& dir,
                                            std::vector<std::string>* skipped = nullptr);

// Removes `dir`'s unfinished writes (.tmp-*), left by a process that died while writing.
void RemoveUnfinishedCheckpoints(const std::string& dir);

// Takes DIR/LOCK (flock, held until the returned descriptor is closed), creating `dir` when
// missing. Fails with a message naming the pid that holds it, when another process does.
StatusOr<int> LockCheckpointDir(const std::string& dir);

// The background writer of one process: Submit hands it a version; a version submitted while
// another is being written is skipped, never queued. The callback runs on the writer's thread.
class Checkpointer {
 public:
  struct Options {
    std::string dir;
    std::chrono::duration<double> interval{60.0};
    int keep = 2;
  };
  using Done = std::function<void(const Status&, const CheckpointInfo&, double seconds)>;

  Checkpointer(Options options, Done done);
  ~Checkpointer();  // waits for a write in progress
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // True when the interval has passed since the last write began (or none did) and none runs.
  bool Due() const;
  // Starts writing; false (nothing done) when a write is still running.
  bool Submit(CheckpointInfo meta, std::vector<CheckpointFile> files);
  // Waits (at most `timeout`) for the write in progress; true when none runs.
  bool Wait(std::chrono::duration<double> timeout);
  const Options& options() const { return options_; }

 private:
  void Loop();
  Options options_;
  Done done_;
  mutable Mutex mu_;
  std::condition_variable cv_;
  bool busy_ ELASTIC_GUARDED_BY(mu_) = false;
  bool stop_ ELASTIC_GUARDED_BY(mu_) = false;
  std::optional<std::chrono::steady_clock::time_point> last_start_ ELASTIC_GUARDED_BY(mu_);
  CheckpointInfo meta_ ELASTIC_GUARDED_BY(mu_);
  std::vector<CheckpointFile> files_ ELASTIC_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace elastic
