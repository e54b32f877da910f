#include "driver/launch.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cstdio>
#include <limits>

#include "common/process.h"

namespace elastic::driver {

namespace {

// The watcher of a kept stdin, run as `sh -c WATCHER GROUP DIR` with the launcher's stdin
// (GROUP empty: the one the worker's keeper names in DIR/group, waited for up to 3 s). A
// "stop" line, or the end of the stdin, ends the worker's group (SIGTERM, SIGKILL after the
// grace period); but at the end of the stdin without "stop", a worker whose agent rides out a
// lost driver (it made DIR/ride-out, worker_agent/worker_agent.h) is left running: the driver
// died, and the worker exits by itself past --driver-timeout, or is adopted. The agent makes
// the file when its own stream to the driver breaks, at about the moment the stdin closes:
// the watcher looks for it for 2 s, and marks the worker adoptable (DIR/adoptable) when it
// leaves it running. Once it has ended the worker, it removes DIR (the
// worker's output files) when the script that started it is gone (the script, alive, reads
// the worker's recorded status there and removes it): nothing will read them again, and a
// relay still reading keeps its open descriptor. The watcher runs in a session of its own, so this holds when SIGKILL took
// the launcher's group, the script and its relays with it.
std::string Watcher(int grace_seconds) {
  const std::string grace = std::to_string(grace_seconds > 0 ? grace_seconds : 1);
  return "l=; while IFS= read -r l; do [ \"$l\" = stop ] && break; done; "
         "if [ \"$l\" != stop ] && [ -n \"$1\" ]; then i=0; "
         "while [ $i -lt 20 ] && [ ! -e \"$1/ride-out\" ]; do sleep 0.1; i=$((i+1)); done; "
         "[ -e \"$1/ride-out\" ] && { : >\"$1/adoptable\"; exit 0; }; fi; "
         "g=$0; i=0; while [ -z \"$g\" ] && [ $i -lt 300 ]; do "
         "g=$(cat \"$1/group\" 2>/dev/null); [ -z \"$g\" ] && sleep 0.01; i=$((i+1)); done; "
         "kill -TERM $g 2>/dev/null; i=0; "
         "while [ $i -lt " +
         grace +
         " ] && kill -0 $g 2>/dev/null; do sleep 1; i=$((i+1)); "
         "done; kill -KILL $g 2>/dev/null; "
         "[ -n \"$1\" ] && ! kill -0 $PPID 2>/dev/null && rm -rf \"$1\"";
}

// Sets $c to the status the worker's keeper recorded in $D/status (waited for up to 2 s:
// it writes it once it has reaped the worker), when there is one; $c is left as it was
// otherwise.
std::string KeptStatus() {
  return "i=0; while [ ! -e \"$D/status\" ] && [ -e \"$D/pid\" ] && [ $i -lt 200 ]; do "
         "sleep 0.01; i=$((i+1)); done; r=$(cat \"$D/status\" 2>/dev/null); "
         "case \"$r\" in ''|*[!0-9]*) ;; *) [ \"$r\" -lt 256 ] && c=$r;; esac";
}

// Starts the Watcher on the launcher's stdin (fd 3) in a session of its own, as $w, for the
// group `group` (a shell word; '' for the one the keeper names), and closes fd 3 in the
// script when `close` says so.
// With a folder, the watcher's pid goes to $D/watcher: a driver that adopts the worker later
// (AttachScript) ends it, so that only the watcher of the driver that leads now decides (a
// driver paused while a standby took over would otherwise end the worker when it dies at
// last: its stdin closes after the agent has removed the ride-out file).
std::string StartWatcher(int grace_seconds, const std::string& group = "\"$g\"",
                         bool close = true) {
  return "$S sh -c " + ShellQuote(Watcher(grace_seconds)) + " " + group +
         " \"$D\" <&3 >/dev/null 2>&1 &\nw=$!\n" +
         "[ -n \"$D\" ] && echo $w >\"$D/watcher\"\n" + (close ? "exec 3<&-\n" : "");
}

// Ends the watcher that $D/watcher names, if it still is one of this worker's (its command
// line names the folder: a pid that was reused is left alone). The worker is marked adoptable
// first, as that watcher would have marked it (it may still be looking for the ride-out
// file): the launch script, if it outlived its driver, then leaves the folder, and the
// status recorded there, to this attach script.
std::string EndOldWatcher() {
  return ": >\"$D/adoptable\"; o=$(cat \"$D/watcher\" 2>/dev/null); "
         "case \"$o\" in ''|*[!0-9]*) ;; *) "
         "tr '\\0' '\\n' </proc/$o/cmdline 2>/dev/null | grep -qxF \"$D\" && "
         "kill -KILL $o 2>/dev/null;; esac\n";
}

// Relays the worker's output files from byte offsets (shell expressions) to this script's
// stdout and stderr until the worker ($p) ends; $t1 and $t2 are the relays. A relay whose
// reader is gone (the driver died) dies of SIGPIPE; the worker, writing to its files, is
// not harmed.
std::string Relays(const std::string& out_from, const std::string& err_from) {
  // Polling (---disable-inotify, every 0.1 s): it reads the files once more after the writer
  // ended, whatever the timing.
  return "tail ---disable-inotify -c +" + out_from +
         " -s 0.1 -f --pid=$p \"$D/stdout\" 2>/dev/null & t1=$!\n"
         "tail ---disable-inotify -c +" +
         err_from + " -s 0.1 -f --pid=$p \"$D/stderr\" >&2 2>/dev/null & t2=$!\n";
}

// The worker's status keeper, run as `sh -c KEEPER elastic-keeper DIR COMMAND...` in a
// session of its own: it starts the command, names its pid in DIR/pid, waits for it, and
// records its status ($? of `wait`: 128+N for signal N) in DIR/status before it exits with
// it. A session of its own, because the script that starts it may die with the driver (a
// launcher such as `ip netns exec H sh -c` is the driver's child, and dies with it); the
// keeper then still knows how the worker ended, for the driver that adopts the job
// (AttachScript). Signals that reach its group are ignored (a trap, which the command does
// not inherit). It names the worker's process group (what `kill` takes) in DIR/group first,
// for the watcher, which is started before it.
std::string Keeper() {
  return "D=$1; shift; trap : HUP INT TERM; \"$@\" & p=$!; g=$p; [ \"$1\" = setsid ] && g=-$p; "
         "echo $g >\"$D/group.tmp\" && mv \"$D/group.tmp\" \"$D/group\"; "
         "echo $p >\"$D/pid.tmp\" && mv \"$D/pid.tmp\" \"$D/pid\"; "
         "wait $p; c=$?; while kill -0 $p 2>/dev/null; do wait $p; c=$?; done; "
         "echo $c >\"$D/status.tmp\" && mv \"$D/status.tmp\" \"$D/status\"; exit $c";
}

}  // namespace

std::string RemoteScript(const std::string& cwd, const std::map<std::string, std::string>& env,
                         const std::vector<std::string>& command, int grace_seconds) {
  std::string run = "env";
  for (const auto& [k, v] : env) run += " " + ShellQuote(k + "=" + v);
  for (const auto& a : command) run += " " + ShellQuote(a);
  // Why each piece is there:
  // * fd 3 keeps the launcher's stdin: an asynchronous list gets /dev/null as its stdin
  //   unless a redirection says otherwise.
  // * The worker runs in a session of its own, so that the launcher's process group (which
  //   the driver signals) holds only this script; and the watcher too, so that a SIGKILL of
  //   the launcher's group cannot take the watcher with it.
  // * With GNU tail (its --pid, and polling) the worker writes to files in a folder of its own,
  // relayed
  //   to the launcher's stdout and stderr, and the first line of stderr names the worker
  //   for the driver's journal (kRemoteHeader); without, the worker writes to the launcher's
  //   pipes and cannot ride out a lost driver.
  // * The watcher (Watcher above) ends the worker's group on "stop" or at the end of its
  //   stdin, unless the worker rides out a lost driver; the script kills the watcher when
  //   the worker ends first.
  // * With the folder, the worker runs below a keeper (Keeper above) in a session of its
  //   own, which records its status there ($D/status) even when this script died with the
  //   driver; the script waits for the keeper, whose status is the worker's.
  // * `wait` returns early when a trapped signal arrives: it is repeated while the worker
  //   lives.
  // * The folder goes when the worker has ended: here, or by the watcher when it ended the
  //   worker (SIGKILL of the launcher's group takes this script and the relays with it).
  //   Only a worker that rode out a lost driver, whose relays were cut, leaves it, for the
  //   driver that adopts it (AttachScript: it reads the rest of the output and the recorded
  //   status, then removes it) or for the user. That it rode out is what the watcher marked
  //   (DIR/adoptable) when it let it run: the ride-out file alone does not say, its agent
  //   removes it once it has re-attached (this script outlives a launcher that died with the
  //   driver, and removed the folder before the adopting driver's attach script had read the
  //   status: tests/python/test_driver_adoption.py).
  std::string s;
  s += "cd " + ShellQuote(cwd) + " || exit 1\n";
  s += "IFS= read -r ELASTIC_JOB_TOKEN || { echo 'elastic-run: no job token on stdin' >&2; "
       "exit 1; }\n";
  s += "IFS= read -r ELASTIC_JOB_TLS || { echo 'elastic-run: no TLS line on stdin' >&2; "
       "exit 1; }\n";
  s += "export ELASTIC_JOB_TOKEN\n";
  s += "IFS= read -r ELASTIC_STATE_STORE_TLS || { echo 'elastic-run: no etcd TLS line on "
       "stdin' >&2; exit 1; }\n";
  s += "if [ -n \"$ELASTIC_JOB_TLS\" ]; then export ELASTIC_JOB_TLS; fi\n";
  s += "if [ -n \"$ELASTIC_STATE_STORE_TLS\" ]; then export ELASTIC_STATE_STORE_TLS; fi\n";
  s += "S=; command -v setsid >/dev/null 2>&1 && S=setsid\n";
  s += "D=; if tail --version 2>/dev/null | grep -q GNU && "
       "tail ---disable-inotify -n 0 /dev/null 2>/dev/null; then "
       "D=$(mktemp -d \"${TMPDIR:-/tmp}/elastic-run.XXXXXX\" 2>/dev/null) || D=; fi\n";
  // The header is one line of words: a folder whose name holds anything else is not used.
  s += "case \"$D\" in *[!A-Za-z0-9_./-]*) rm -rf \"$D\"; D=;; esac\n";
  s += "exec 3<&0\n";
  s += "if [ -n \"$D\" ]; then\n";
  // Made here, not by the worker's redirections, which run in the background: the relays
  // must find them.
  s += "  : >\"$D/stdout\"; : >\"$D/stderr\"\n";
  // The watcher first: the launcher may be killed at any moment from now on (the driver
  // gave up on the launch), and the worker must then not outlive the stdin.
  s += "  " + StartWatcher(grace_seconds, "''", false);
  s += "  $S sh -c " + ShellQuote(Keeper()) +
       " elastic-keeper \"$D\" $S env ELASTIC_RIDE_OUT_FILE=\"$D/ride-out\" " + run +
       " >>\"$D/stdout\" 2>>\"$D/stderr\" &\n";
  s += "  k=$!; i=0\n";
  s += "  while [ ! -s \"$D/pid\" ] && kill -0 $k 2>/dev/null && [ $i -lt 3000 ]; do sleep 0.01; "
       "i=$((i+1)); done\n";
  s += "  p=$(cat \"$D/pid\" 2>/dev/null)\n";
  s += "  case \"$p\" in ''|*[!0-9]*) echo 'elastic-run: the worker did not start on this host' "
       ">&2; kill -KILL $k $w 2>/dev/null; rm -rf \"$D\"; exit 1;; esac\n";
  s += "else\n";
  s += "  $S " + run + " &\n";
  s += "  p=$!; k=$p\n";
  s += "fi\n";
  s += "g=$p; [ -n \"$S\" ] && g=-$p\n";
  s += "trap 'kill -TERM $g 2>/dev/null' TERM INT HUP\n";
  s += "a=1; b=1\n";
  s += "if [ -n \"$D\" ]; then\n";
  s += "  echo \"" + std::string(kRemoteHeader) + " $p $g $D\" >&2\n";
  s += Relays("1", "1");
  s += "fi\n";
  s += "if [ -n \"$D\" ]; then exec 3<&-; else\n";
  s += StartWatcher(grace_seconds);
  s += "fi\n";
  s += "wait $k; c=$?\n";
  s += "while kill -0 $k 2>/dev/null; do wait $k; c=$?; done\n";
  s += "if [ -n \"$D\" ]; then wait $t1; a=$?; wait $t2; b=$?; fi\n";
  s += "kill $w 2>/dev/null\n";
  // A worker killed while its host's shared-memory segment was still named leaves it behind
  // (worker_agent/shm_group.cc names them elastic-<pid>-<token>).
  s += "rm -f /dev/shm/elastic-$p-* 2>/dev/null\n";
  s += "[ -n \"$D\" ] && { { [ $a -eq 0 ] && [ $b -eq 0 ]; } || "
       "{ [ ! -e \"$D/ride-out\" ] && [ ! -e \"$D/adoptable\" ]; }; } && "
       "rm -rf \"$D\"\n";
  s += "trap - TERM INT HUP\n";
  s += "[ $c -gt 128 ] && [ $c -lt 160 ] && kill -$((c - 128)) $$\n";
  s += "exit $c\n";
  return s;
}

std::string AttachScript(const RemoteWorker& w, int64_t stdout_offset, int64_t stderr_offset,
                         int grace_seconds) {
  auto from = [](int64_t offset) { return std::to_string(std::max<int64_t>(offset, 0) + 1); };
  std::string s;
  s += "IFS= read -r _ || exit 1\n";
  s += "p=" + std::to_string(w.pid) + "; g=" + std::to_string(w.group) +
       "; D=" + ShellQuote(w.dir) + "\n";
  // The pid must still be the worker the journal names: the same launch of the slot.
  s += "if ! kill -0 $p 2>/dev/null || ! tr '\\0' '\\n' </proc/$p/environ 2>/dev/null | "
       "grep -qx " +
       ShellQuote("ELASTIC_WORKER_ID=" + w.worker_id) + "; then\n";
  s += "  c=" + std::to_string(kAttachUnknown) + "\n";
  s += "  if [ -d \"$D\" ]; then tail -c +" + from(stdout_offset) +
       " \"$D/stdout\" 2>/dev/null; tail -c +" + from(stderr_offset) +
       " \"$D/stderr\" >&2 2>/dev/null; " + KeptStatus() + "; rm -rf \"$D\"; fi\n";
  s += "  exit $c\n";
  s += "fi\n";
  s += "S=; command -v setsid >/dev/null 2>&1 && S=setsid\n";
  s += "exec 3<&0\n";
  s += Relays(from(stdout_offset), from(stderr_offset));
  s += EndOldWatcher();
  s += StartWatcher(grace_seconds);
  s += "trap 'kill -TERM $g 2>/dev/null' TERM INT HUP\n";
  s += "while kill -0 $p 2>/dev/null; do sleep 0.2; done\n";
  s += "wait $t1; a=$?; wait $t2; b=$?\n";
  s += "kill $w 2>/dev/null\n";
  s += "rm -f /dev/shm/elastic-$p-* 2>/dev/null\n";
  s += "c=" + std::to_string(kAttachUnknown) + "; " + KeptStatus() + "\n";
  s += "[ $a -eq 0 ] && [ $b -eq 0 ] && rm -rf \"$D\"\n";
  s += "exit $c\n";
  return s;
}

StatusOr<RemoteWorker> ParseRemoteHeader(const std::string& line) {
  auto bad = [&] {
    return InvalidArgument("not a remote worker's header: '" + line.substr(0, 200) + "'");
  };
  const std::string prefix = std::string(kRemoteHeader) + " ";
  if (line.compare(0, prefix.size(), prefix) != 0) return bad();
  RemoteWorker w;
  char dir[1024] = {0};
  long long pid = 0, group = 0;
  int used = 0;
  if (std::sscanf(line.c_str() + prefix.size(), "%lld %lld %1023s%n", &pid, &group, dir, &used) !=
          3 ||
      prefix.size() + static_cast<size_t>(used) != line.size() || pid <= 1 ||
      pid > std::numeric_limits<pid_t>::max() ||
      (group != pid && group != -pid) || dir[0] != '/') {
    return bad();
  }
  w.pid = static_cast<pid_t>(pid);
  w.group = static_cast<pid_t>(group);
  w.dir = dir;
  return w;
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

bool IsLoopback(const std::string& address) {
  return address == "localhost" || address.rfind("localhost:", 0) == 0 ||
         address.rfind("127.", 0) == 0;
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
