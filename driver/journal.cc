#include "driver/journal.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/atomic_file.h"
#include "common/folder_lock.h"

namespace elastic::driver {

using json = nlohmann::json;

namespace {

constexpr int kFormat = 1;
constexpr size_t kMaxJournalBytes = 64u << 20;

std::string Errno(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + strerror(errno);
}

json PutAssignment(const rendezvous::Assignment& a) {
  return {{"round", a.round},
          {"rank", a.rank},
          {"size", a.size},
          {"local_rank", a.local_rank},
          {"local_size", a.local_size},
          {"cross_rank", a.cross_rank},
          {"cross_size", a.cross_size},
          {"sync_required", a.sync_required}};
}

// Reads `key` of `j` into `out`, or says which field is missing or of the wrong type.
template <typename T>
void Get(const json& j, const std::string& key, T* out, const std::string& path) {
  auto it = j.find(key);
  if (it == j.end()) throw std::runtime_error(path + "." + key + " is missing");
  try {
    *out = it->template get<T>();
  } catch (const json::exception&) {
    throw std::runtime_error(path + "." + key + " has the wrong type");
  }
}

rendezvous::Assignment GetAssignment(const json& j, const std::string& path) {
  rendezvous::Assignment a;
  Get(j, "round", &a.round, path);
  Get(j, "rank", &a.rank, path);
  Get(j, "size", &a.size, path);
  Get(j, "local_rank", &a.local_rank, path);
  Get(j, "local_size", &a.local_size, path);
  Get(j, "cross_rank", &a.cross_rank, path);
  Get(j, "cross_size", &a.cross_size, path);
  Get(j, "sync_required", &a.sync_required, path);
  return a;
}

}  // namespace

std::string JournalPath(const std::string& state_dir) { return state_dir + "/journal.json"; }

StatusOr<int> LockStateDir(const std::string& dir) {
  struct stat st;
  if (stat(dir.c_str(), &st) == 0 && !S_ISDIR(st.st_mode)) {
    return InvalidArgument(dir + " is not a folder");
  }
  if (stat(dir.c_str(), &st) == 0 && st.st_uid != geteuid()) {
    return InvalidArgument("the state folder " + dir + " belongs to uid " +
                           std::to_string(st.st_uid) + ", not to this user: use a folder of "
                           "your own (it holds the job token)");
  }
  ASSIGN_OR_RETURN(int fd, LockFolder(dir, "state folder", "is held by a running driver",
                                      "a job has one driver at a time"));
  chmod(dir.c_str(), 0700);  // it holds the job token
  return fd;
}

std::string SerializeJournal(const Journal& j) {
  json core = {{"formed_round", j.core.formed_round},
               {"newest_committed", j.core.newest_committed},
               {"worker_ids", j.core.worker_ids},
               {"known_slots", j.core.known_slots},
               {"removed", j.core.removed}};
  json members = json::object();
  for (const auto& [slot, a] : j.core.formed_members) members[slot] = PutAssignment(a);
  core["formed_members"] = members;
  json workers = json::object();
  for (const auto& [slot, w] : j.workers) {
    workers[slot] = {{"pid", w.pid},
                     {"start_ticks", w.start_ticks},
                     {"local", w.local},
                     {"host", w.host},
                     {"stdout_file", w.stdout_file},
                     {"stderr_file", w.stderr_file},
                     {"stdout_offset", w.stdout_offset},
                     {"stderr_offset", w.stderr_offset},
                     {"remote_dir", w.remote_dir},
                     {"remote_group", w.remote_group},
                     {"keeper_pid", w.keeper_pid}};
  }
  json doc = {{"format", kFormat},      {"argv", j.argv},
              {"bind", j.bind},         {"driver_addr", j.driver_addr},
              {"port", j.port},         {"token", j.token},
              {"restarts", j.restarts}, {"written_at", j.written_at},
              {"core", core},           {"policy", json::parse(j.policy)},
              {"workers", workers}};
  if (!j.tls.server.empty()) {
    doc["tls"] = {{"server", EncodeTlsIdentity(j.tls.server)},
                  {"client", EncodeTlsIdentity(j.tls.client)}};
  }
  return doc.dump();
}

Status WriteJournal(const std::string& dir, const Journal& j) {
  Status wrote = WriteFileAtomically(JournalPath(dir), SerializeJournal(j), 0600);
  return wrote.ok() ? wrote : wrote.WithContext("the journal");
}

namespace {

// The journal's text, when its file is one only this user could have written: the journal
// names the processes a driver adopts, and --fresh kills. Bounded.
StatusOr<std::string> ReadTrustedText(const std::string& dir, const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return NotFound("no journal in " + dir);
    return InvalidArgument(Errno("cannot read", path));
  }
  if (!S_ISREG(st.st_mode) || st.st_uid != geteuid() || (st.st_mode & 022) != 0) {
    char mode[8];
    snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return InvalidArgument(path + " is not a file only this user can write (owner uid " +
                           std::to_string(st.st_uid) + ", mode " + mode +
                           "): a journal names the processes a driver adopts, so it is not "
                           "trusted; remove it, or use a folder of your own");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return InvalidArgument(Errno("cannot read", path));
  std::stringstream buf;
  buf << in.rdbuf();
  std::string text = buf.str();
  if (text.size() > kMaxJournalBytes) {
    return InvalidArgument(path + " is over " + std::to_string(kMaxJournalBytes >> 20) +
                           " MiB: not a journal this driver wrote");
  }
  return text;
}

// journal.core: the rendezvous core's snapshot. Throws std::runtime_error naming the field.
void ParseCore(const json& doc, rendezvous::CoreSnapshot* out) {
  json core;
  Get(doc, "core", &core, "journal");
  Get(core, "formed_round", &out->formed_round, "journal.core");
  Get(core, "newest_committed", &out->newest_committed, "journal.core");
  Get(core, "worker_ids", &out->worker_ids, "journal.core");
  Get(core, "known_slots", &out->known_slots, "journal.core");
  Get(core, "removed", &out->removed, "journal.core");
  json members;
  Get(core, "formed_members", &members, "journal.core");
  if (!members.is_object()) throw std::runtime_error("journal.core.formed_members is no map");
  for (const auto& [slot, a] : members.items()) {
    out->formed_members[slot] = GetAssignment(a, "journal.core.formed_members." + slot);
  }
}

// One of journal.workers (`at` names it). Throws std::runtime_error naming the field.
void ParseWorker(const json& w, const std::string& at, JournalWorker* out) {
  Get(w, "pid", &out->pid, at);
  if (out->pid <= 1) throw std::runtime_error(at + ".pid is out of range");
  Get(w, "start_ticks", &out->start_ticks, at);
  Get(w, "local", &out->local, at);
  Get(w, "host", &out->host, at);
  Get(w, "stdout_file", &out->stdout_file, at);
  Get(w, "stderr_file", &out->stderr_file, at);
  Get(w, "stdout_offset", &out->stdout_offset, at);
  Get(w, "stderr_offset", &out->stderr_offset, at);
  Get(w, "remote_dir", &out->remote_dir, at);
  Get(w, "remote_group", &out->remote_group, at);
  // Absent from the journals of drivers before status keepers.
  if (w.contains("keeper_pid")) Get(w, "keeper_pid", &out->keeper_pid, at);
  if (out->keeper_pid < 0 || out->keeper_pid > std::numeric_limits<pid_t>::max()) {
    throw std::runtime_error(at + ".keeper_pid is out of range");
  }
  if (!out->remote_dir.empty()) {
    if (out->local || out->remote_dir[0] != '/' || out->remote_dir.size() > 1000) {
      throw std::runtime_error(at + ".remote_dir is out of range");
    }
    if (out->remote_group != out->pid && out->remote_group != -int64_t{out->pid}) {
      throw std::runtime_error(at + ".remote_group is not the pid's group");
    }
  }
}

}  // namespace

StatusOr<Journal> ReadJournal(const std::string& dir) {
  const std::string path = JournalPath(dir);
  ASSIGN_OR_RETURN(std::string text, ReadTrustedText(dir, path));
  return ParseJournal(text, path);
}

StatusOr<Journal> ParseJournal(const std::string& text, const std::string& path) {
  Journal j;
  try {
    json doc = json::parse(text);
    if (!doc.is_object()) throw std::runtime_error("the journal is not a JSON object");
    int format = 0;
    Get(doc, "format", &format, "journal");
    if (format != kFormat) {
      throw std::runtime_error("journal.format is " + std::to_string(format) +
                               ", this driver reads " + std::to_string(kFormat));
    }
    Get(doc, "argv", &j.argv, "journal");
    Get(doc, "bind", &j.bind, "journal");
    Get(doc, "driver_addr", &j.driver_addr, "journal");
    Get(doc, "port", &j.port, "journal");
    if (j.port <= 0 || j.port > 65535) throw std::runtime_error("journal.port is out of range");
    Get(doc, "token", &j.token, "journal");
    if (doc.contains("tls")) {  // absent: plain text (and journals from before --tls)
      for (auto [name, id] : {std::pair<const char*, TlsIdentity*>{"server", &j.tls.server},
                              {"client", &j.tls.client}}) {
        std::string line;
        Get(doc["tls"], name, &line, "journal.tls");
        auto decoded = DecodeTlsIdentity(line);
        if (!decoded.ok() || decoded->empty()) {
          throw std::runtime_error(std::string("journal.tls.") + name + ": " +
                                   (decoded.ok() ? "empty" : decoded.status().message()));
        }
        *id = *decoded;
      }
    }
    Get(doc, "restarts", &j.restarts, "journal");
    Get(doc, "written_at", &j.written_at, "journal");
    ParseCore(doc, &j.core);
    json policy;
    Get(doc, "policy", &policy, "journal");
    j.policy = policy.dump();
    json workers;
    Get(doc, "workers", &workers, "journal");
    if (!workers.is_object()) throw std::runtime_error("journal.workers is no map");
    for (const auto& [slot, w] : workers.items()) {
      ParseWorker(w, "journal.workers." + slot, &j.workers[slot]);
    }
  } catch (const std::exception& e) {
    return InvalidArgument(path + ": " + e.what());
  }
  return j;
}

void RemoveJournal(const std::string& dir) {
  unlink(JournalPath(dir).c_str());
  unlink((JournalPath(dir) + ".tmp").c_str());
}

uint64_t ProcessStartTicks(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(in, line)) return 0;
  // The command (field 2) is in parentheses and may hold spaces: count from the last ')'.
  size_t close = line.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream rest(line.substr(close + 1));
  std::string field;
  char state = 0;
  rest >> state;                               // field 3
  if (state == 'Z' || state == 'X') return 0;  // gone, not yet reaped
  for (int i = 4; i <= 22; ++i) {
    if (!(rest >> field)) return 0;
  }
  return std::strtoull(field.c_str(), nullptr, 10);
}

bool StillRunning(const JournalWorker& w) {
  if (!w.local && !w.remote_dir.empty()) return w.pid > 1;
  return w.pid > 1 && w.start_ticks != 0 && ProcessStartTicks(w.pid) == w.start_ticks;
}

}  // namespace elastic::driver
