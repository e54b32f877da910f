#include "common/process.h"
#include "discovery/discovery.h"

namespace elastic::discovery {

StatusOr<ScriptResult> RunScript(const std::string& script, Duration timeout, size_t max_output) {
  LaunchSpec spec;
  if (script.find_first_of(" \t;|&$<>") != std::string::npos) {
    spec.argv = {"/bin/sh", "-c", script};
  } else {
    spec.argv = {script};
  }
  spec.reap_orphans = true;  // what it leaves behind goes when it exits
  return RunToEnd(spec, timeout, max_output);
}

StatusOr<std::vector<HostSlots>> Discover(const std::string& script, Duration timeout,
                                          size_t max_output, int default_slots,
                                          std::vector<std::string>* warnings) {
  ASSIGN_OR_RETURN(ScriptResult r, RunScript(script, timeout, max_output));
  std::string err = r.err.empty() ? "" : "; its stderr: " + r.err;
  if (r.timed_out) {
    return DeadlineExceeded(
        "discovery script '" + script + "' did not finish within " +
        std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count()) +
        " ms and was killed" + err);
  }
  if (r.truncated) {
    return ResourceExhausted("discovery script '" + script + "' printed more than " +
                             std::to_string(max_output) + " bytes" + err);
  }
  if (r.exit_code != 0) {
    return Unavailable("discovery script '" + script + "' exited with status " +
                       std::to_string(r.exit_code) + err);
  }
  auto hosts = ParseHostLines(r.out, default_slots, warnings);
  if (!hosts.ok()) {
    return hosts.status().WithContext("discovery script '" + script + "' output");
  }
  return hosts;
}

}  // namespace elastic::discovery
