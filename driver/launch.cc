#include "driver/launch.h"

#include <arpa/inet.h>

#include "common/process.h"

namespace elastic::driver {

std::string RemoteScript(const std::string& cwd, const std::map<std::string, std::string>& env,
                         const std::vector<std::string>& command, int grace_seconds) {
  std::string run = "env";
  for (const auto& [k, v] : env) run += " " + ShellQuote(k + "=" + v);
  for (const auto& a : command) run += " " + ShellQuote(a);
  const std::string grace = std::to_string(grace_seconds > 0 ? grace_seconds : 1);
  // Why each piece is there:
  // * fd 3 keeps the launcher's stdin: an asynchronous list gets /dev/null as its stdin
  //   unless a redirection says otherwise.
  // * The worker runs in a session of its own, so that the launcher's process group (which
  //   the driver signals) holds only this script; and the watcher too, so that a SIGKILL of
  //   the launcher's group cannot take the watcher with it.
  // * The watcher reads until EOF, then ends the worker's group; the script kills the
  //   watcher when the worker ends first.
  // * `wait` returns early when a trapped signal arrives: it is repeated while the worker
  //   lives.
  std::string s;
  s += "cd " + ShellQuote(cwd) + " || exit 1\n";
  s += "IFS= read -r ELASTIC_JOB_TOKEN || { echo 'elastic-run: no job token on stdin' >&2; "
       "exit 1; }\n";
  s += "export ELASTIC_JOB_TOKEN\n";
  s += "S=; command -v setsid >/dev/null 2>&1 && S=setsid\n";
  s += "exec 3<&0\n";
  s += "$S " + run + " &\n";
  s += "p=$!; g=$p; [ -n \"$S\" ] && g=-$p\n";
  s += "trap 'kill -TERM $g 2>/dev/null' TERM INT HUP\n";
  s += "$S sh -c 'while IFS= read -r _; do :; done; kill -TERM $0 2>/dev/null; i=0; "
       "while [ $i -lt " + grace + " ] && kill -0 $0 2>/dev/null; do sleep 1; i=$((i+1)); "
       "done; kill -KILL $0 2>/dev/null' \"$g\" <&3 >/dev/null 2>&1 &\n";
  s += "w=$!\n";
  s += "exec 3<&-\n";
  s += "wait $p; c=$?\n";
  s += "while kill -0 $p 2>/dev/null; do wait $p; c=$?; done\n";
  s += "kill $w 2>/dev/null\n";
  // A worker killed while its host's shared-memory segment was still named leaves it behind
  // (worker_agent/shm_group.cc names them elastic-<pid>-<token>).
  s += "rm -f /dev/shm/elastic-$p-* 2>/dev/null\n";
  s += "trap - TERM INT HUP\n";
  s += "[ $c -gt 128 ] && [ $c -lt 160 ] && kill -$((c - 128)) $$\n";
  s += "exit $c\n";
  return s;
}

std::string ExpandTemplate(const std::string& tmpl, const std::string& host,
                           const std::string& command) {
  static const std::string kHost = "{host}", kCommand = "{command}";
  std::string out;
  out.reserve(tmpl.size() + command.size() + host.size());
  for (size_t i = 0; i < tmpl.size();) {
    if (tmpl.compare(i, kHost.size(), kHost) == 0) {
      out += host;
      i += kHost.size();
    } else if (tmpl.compare(i, kCommand.size(), kCommand) == 0) {
      out += command;
      i += kCommand.size();
    } else {
      out += tmpl[i++];
    }
  }
  return out;
}

Status CheckTemplate(const std::string& tmpl) {
  if (tmpl.find("{command}") == std::string::npos) {
    return InvalidArgument("--launcher-template '" + tmpl +
                           "' has no {command}: the worker's command would never run (e.g. "
                           "'ip netns exec {host} sh -c {command}')");
  }
  return Status::Ok();
}

Status CheckDriverAddress(const std::string& address) {
  auto bad = [&](const std::string& why) {
    return InvalidArgument("--driver-address '" + address + "': " + why +
                           "; give an IPv4 address or a host name the workers' hosts resolve "
                           "to this machine (e.g. 10.0.0.5 or head-node)");
  };
  if (address.empty()) return bad("empty");
  if (address.size() > 253) return bad("longer than 253 characters");
  in_addr v4;
  if (inet_pton(AF_INET, address.c_str(), &v4) == 1) return Status::Ok();
  in6_addr v6;
  std::string bare = address;
  if (bare.size() > 2 && bare.front() == '[' && bare.back() == ']') {
    bare = bare.substr(1, bare.size() - 2);
  }
  if (inet_pton(AF_INET6, bare.c_str(), &v6) == 1) {
    return bad("IPv6 addresses are not supported yet");
  }
  size_t colon = address.rfind(':');
  if (colon != std::string::npos) {
    return bad("a port does not go here (the driver's port is --port)");
  }
  size_t label = 0;
  for (size_t i = 0; i <= address.size(); ++i) {
    char c = i < address.size() ? address[i] : '.';
    if (c == '.') {
      if (label == 0) return bad("an empty label (two dots, or a dot at an end)");
      if (address[i - 1] == '-') return bad("a label ends with '-'");
      label = 0;
      continue;
    }
    bool alnum = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
    if (!alnum && c != '-' && c != '_') {
      std::string shown = c == ' ' ? "a space" : std::string("'") + c + "'";
      return bad(shown + " is not allowed in a host name");
    }
    if (label == 0 && c == '-') return bad("a label starts with '-'");
    if (++label > 63) return bad("a label is longer than 63 characters");
  }
  return Status::Ok();
}

}  // namespace elastic::driver
