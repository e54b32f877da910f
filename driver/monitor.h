// What people and monitoring see of a running job: the document `elastic-run status` prints
// and the Prometheus text of --metrics-port. The driver's loop feeds it (the job view and every
// event it writes); the gRPC and HTTP threads read it. Thread-safe.
#pragma once

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "common/tls.h"
#include "driver/event_log.h"
#include "driver/policy.h"

namespace elastic::driver {

class Monitor {
 public:
  void Update(const JobView& view);
  void OnEvent(const std::string& name, const JsonFields& fields);
  void OnDiscoveryRun(bool ok);
  // Drivers that adopted this job from a journal, this one included (driver/journal.h).
  void SetDriverRestarts(int64_t n);
  // --drivers: the standbys wanted (drivers - 1) and those that wait now, each as
  // {address, host, pid} (driver/placement.h).
  struct Standby {
    std::string address, host;
    int64_t pid = 0;
  };
  void SetStandbys(int wanted, std::vector<Standby> waiting);

  // The status document (schema in the README, "elastic-run status").
  std::string StatusJson() const;
  // Prometheus text exposition format, version 0.0.4.
  std::string Prometheus() const;

 private:
  struct Recovery {
    double started = 0;  // seconds since the epoch
    std::string cause;   // the event that began it (events::kWorkerLost, kWorkerHung, ...)
    std::string slot;
    std::map<std::string, double> phases;  // phase -> seconds
    bool done = false;
  };
  mutable Mutex mu_;
  JobView view_ ELASTIC_GUARDED_BY(mu_);
  // metric name (with labels) -> value
  std::map<std::string, double> counters_ ELASTIC_GUARDED_BY(mu_);
  // recovery phase -> observations
  std::map<std::string, std::vector<double>> phase_seconds_ ELASTIC_GUARDED_BY(mu_);
  std::vector<Recovery> recoveries_ ELASTIC_GUARDED_BY(mu_);  // the last few, oldest first
  int standbys_wanted_ ELASTIC_GUARDED_BY(mu_) = -1;  // -1: not counted (no --drivers)
  std::vector<Standby> standbys_ ELASTIC_GUARDED_BY(mu_);
};

// The job file that lets `elastic-run status` find a driver: {"address", "token", "pid"}, mode
// 0600 in a folder only the user can enter. Default place: $XDG_RUNTIME_DIR/elastic-run/, else
// /tmp/elastic-run-<uid>/, as <driver pid>.json.
std::string DefaultJobDir();
// `tls`: the client identity `elastic-run status` presents (common/tls.h); empty: plain text.
Status WriteJobFile(const std::string& path, const std::string& address, const std::string& token,
                    const TlsIdentity& tls = {});

// `elastic-run status [--job-file F] [--json]`: prints the job's status; returns the exit code
// (0; 1 when no driver answers; 2 for a bad or ambiguous job file).
int RunStatusCommand(const std::string& job_file, bool json);

// `elastic-run credentials [--job-file F] --out DIR`: writes the job's token and, when it runs
// TLS, the CA, client certificate and key a client of /metrics beyond loopback presents
// (docs/security.md), each mode 0600 in DIR (made 0700 when missing). The exit code: 0; 1 when
// a file cannot be written; 2 for a bad or ambiguous job file.
int RunCredentialsCommand(const std::string& job_file, const std::string& out_dir);

// What a job file says (WriteJobFile): where the driver listens and its token.
struct JobFile {
  std::string address, token;
  TlsIdentity tls;
};
constexpr size_t kMaxJobFileBytes = 64 << 10;
// INVALID_ARGUMENT naming what is missing when `text` is not a job file.
StatusOr<JobFile> ParseJobFile(const std::string& text);

}  // namespace elastic::driver
