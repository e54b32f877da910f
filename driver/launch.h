// How a slot on another host is started: the remote shell script that runs the worker, and the
// expansion of --launcher-template around it. Private to driver/; pure string functions, so
// that tests and the fuzzer (tests/fuzz/) call them directly.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/status.h"

namespace elastic::driver {

// The /bin/sh script a remote host runs for one slot. It reads the job token from its stdin's
// first line, the workers' TLS credentials (ELASTIC_JOB_TLS, empty without TLS) from its
// second and etcd's (ELASTIC_STATE_STORE_TLS, empty without) from its third (a secret never
// goes on a command line), starts `command` with `env` in a
// session of its own (setsid, where the host has it), and then watches its stdin: the
// launcher (ssh, or the template's command) keeps it open for as long as the driver wants
// the worker. On a "stop" line, or when it closes (the driver died, the launcher was killed,
// the connection dropped; sshd without a tty sends no signal), the worker's whole process
// group gets SIGTERM, and SIGKILL `grace_seconds` later if anything of it is left, whatever
// the program does (but see the ride-out below). SIGTERM, SIGINT or SIGHUP to the script are passed
// to the worker's group. The script exits with the worker's status (a worker killed by signal N
// kills the script with N).
//
// With GNU tail on the host, the worker's stdout and stderr go to files in a folder of its own
// (mktemp -d under $TMPDIR), relayed to the launcher's stdout and stderr, and the first line
// of the launcher's stderr is kRemoteHeader with the worker's pid, process group and folder
// (ParseRemoteHeader), for the driver's journal. Such a worker outlives a driver that died:
// its stdin closing without a "stop" line first does not end a worker whose agent says it
// rides out the outage (ELASTIC_RIDE_OUT_FILE), and the driver that adopts the job attaches to
// it (AttachScript). "stop" on the stdin is how the driver ends it. Such a worker runs below a
// status keeper, a shell in a session of its own that outlives this script (which may die with
// the driver) and records the worker's status in the folder (DIR/status) for AttachScript.
std::string RemoteScript(const std::string& cwd, const std::map<std::string, std::string>& env,
                         const std::vector<std::string>& command, int grace_seconds);

// The first line of a remote launch's stderr: "elastic-remote: PID GROUP DIR".
inline constexpr const char* kRemoteHeader = "elastic-remote:";
// What the driver learns of a remote worker from that line (and its worker id).
struct RemoteWorker {
  pid_t pid = 0;
  pid_t group = 0;  // what `kill` is given for its process group (-pid with setsid, else pid)
  std::string dir;  // its output folder on the host
  std::string worker_id;
};
// INVALID_ARGUMENT when the line is not a header (a program's own line, say).
StatusOr<RemoteWorker> ParseRemoteHeader(const std::string& line);

// The /bin/sh script a driver that adopted a job runs on a remote worker's host, through the
// same launcher: when the pid still runs the worker (its ELASTIC_WORKER_ID in
// /proc/PID/environ), it relays the worker's files from the offsets given (what was shown)
// and watches its stdin as RemoteScript does, until the worker ends; it then exits with the
// status the worker's keeper recorded (a shell's code: 128+N for signal N), or kAttachUnknown
// when none is known (an older launch, a keeper that was killed). When the worker is gone it
// prints what the files hold past the offsets and exits the same way. A worker that itself
// exits 97 reads as unknown. The first line of its stdin is read and ignored.
inline constexpr int kAttachUnknown = 97;
std::string AttachScript(const RemoteWorker& w, int64_t stdout_offset, int64_t stderr_offset,
                         int grace_seconds);

// Replaces every {host} and {command} of a --launcher-template in one left-to-right pass: the
// text substituted is never scanned again (a command holding "{command}" stays as it is).
// Other braces are kept as written.
std::string ExpandTemplate(const std::string& tmpl, const std::string& host,
                           const std::string& command);

// Checks a --launcher-template: it must contain {command} (else the worker never runs);
// INVALID_ARGUMENT naming what is wrong.
Status CheckTemplate(const std::string& tmpl);

// Checks --driver-address: an IPv4 address or a host name (RFC 1123 labels), without a port
// (that is --port). INVALID_ARGUMENT naming what is wrong and how to fix it.
Status CheckDriverAddress(const std::string& address);

// Whether an address (or "address:port") is this machine's loopback: "localhost" or 127.*.
bool IsLoopback(const std::string& address);

}  // namespace elastic::driver
