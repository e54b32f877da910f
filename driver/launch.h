// How a slot on another host is started: the remote shell script that runs the worker, and the
// expansion of --launcher-template around it. Private to driver/; pure string functions, so
// that tests and the fuzzer (tests/fuzz/) call them directly.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "common/status.h"

namespace elastic::driver {

// The /bin/sh script a remote host runs for one slot. It reads the job token from its stdin's
// first line (a secret never goes on a command line), starts `command` with `env` in a
// session of its own (setsid, where the host has it), and then watches its stdin: the
// launcher (ssh, or the template's command) keeps it open for as long as the driver wants
// the worker. When it closes (the driver died, the launcher was killed, the connection
// dropped; sshd without a tty sends no signal) the worker's whole process group gets
// SIGTERM, and SIGKILL `grace_seconds` later if anything of it is left, whatever the program
// does. SIGTERM, SIGINT or SIGHUP to the script are passed to the worker's group. The script
// exits with the worker's status (a worker killed by signal N kills the script with N).
std::string RemoteScript(const std::string& cwd, const std::map<std::string, std::string>& env,
                         const std::vector<std::string>& command, int grace_seconds);

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

}  // namespace elastic::driver
