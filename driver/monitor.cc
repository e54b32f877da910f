#include "driver/events.h"
#include "driver/monitor.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/atomic_file.h"
#include "common/mutex.h"
#include "driver/journal.h"
#include "rendezvous/client.h"

namespace elastic::driver {
namespace {

using nlohmann::json;

double Now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

const JsonValue* Find(const JsonFields& fields, const std::string& key) {
  for (const auto& [k, v] : fields) {
    if (k == key) return &v;
  }
  return nullptr;
}

std::string Str(const JsonFields& fields, const std::string& key) {
  const JsonValue* v = Find(fields, key);
  return v && std::holds_alternative<std::string>(*v) ? std::get<std::string>(*v) : "";
}

double Num(const JsonFields& fields, const std::string& key, double dflt = -1) {
  const JsonValue* v = Find(fields, key);
  if (!v) return dflt;
  if (std::holds_alternative<double>(*v)) return std::get<double>(*v);
  if (std::holds_alternative<int64_t>(*v)) return static_cast<double>(std::get<int64_t>(*v));
  return dflt;
}

// Recovery phases are short; the buckets reach from 10 ms to 10 min.
const double kBuckets[] = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 600};

}  // namespace

void Monitor::Update(const JobView& view) {
  MutexLock g(mu_);
  view_ = view;
}

void Monitor::OnDiscoveryRun(bool ok) {
  MutexLock g(mu_);
  counters_["elastic_discovery_runs_total"] += 1;
  if (!ok) counters_["elastic_discovery_failures_total"] += 1;
}

void Monitor::SetDriverRestarts(int64_t n) {
  MutexLock g(mu_);
  counters_["elastic_driver_restarts_total"] = static_cast<double>(n);
}

void Monitor::SetStandbys(int wanted, std::vector<Standby> waiting) {
  MutexLock g(mu_);
  standbys_wanted_ = wanted;
  standbys_ = std::move(waiting);
}

void Monitor::OnEvent(const std::string& name, const JsonFields& fields) {
  MutexLock g(mu_);
  auto start = [&](const std::string& cause) ELASTIC_REQUIRES(mu_) {
    Recovery r;
    r.started = Now();
    r.cause = cause;
    r.slot = Str(fields, "slot");
    recoveries_.push_back(r);
    if (recoveries_.size() > 10) recoveries_.erase(recoveries_.begin());
  };
  if (name == events::kRoundFormed) {
    counters_["elastic_rounds_total"] += 1;
  } else if (name == events::kRoundProposed) {
    if (Num(fields, "round") > 0) counters_["elastic_resets_total"] += 1;
  } else if (name == events::kWorkerStarted) {
    counters_["elastic_workers_started_total"] += 1;
  } else if (name == events::kHostBlacklisted) {
    counters_["elastic_hosts_blacklisted_total"] += 1;
  } else if (name == events::kWorkerLost && Str(fields, "phase") == "detect") {
    counters_["elastic_failures_total{kind=\"exit\"}"] += 1;
    start("worker failed");
  } else if (name == events::kWorkerHung) {
    counters_["elastic_failures_total{kind=\"hang\"}"] += 1;
    start("worker hung: " + Str(fields, "reason").substr(0, 80));
  } else if (name == events::kRoundHung) {
    counters_["elastic_failures_total{kind=\"round_hung\"}"] += 1;
  } else if (name == events::kWorkerLeaving) {
    counters_["elastic_leaves_total"] += 1;
  } else if (name == events::kRecoveryPhase) {
    std::string phase = Str(fields, "phase");
    double secs = Num(fields, "seconds");
    if (secs >= 0 && !phase.empty()) {
      auto& obs = phase_seconds_[phase];
      obs.push_back(secs);
      if (obs.size() > 10000) obs.erase(obs.begin());
      if (!recoveries_.empty() && !recoveries_.back().done) {
        recoveries_.back().phases[phase] = secs;
        if (phase == "first_step") recoveries_.back().done = true;
      }
    }
  }
}

std::string Monitor::StatusJson() const {
  MutexLock g(mu_);
  json j;
  j["phase"] = view_.phase;
  j["round"] = view_.formed_round;
  j["proposed_round"] = view_.round;
  j["size"] = view_.members.size();
  j["min_np"] = view_.min_np;
  j["max_np"] = view_.max_np > 0 ? json(view_.max_np) : json(nullptr);
  j["resets"] = view_.resets;
  j["failures"] = view_.failures;
  j["stragglers"] = view_.stragglers;
  auto restarts = counters_.find("elastic_driver_restarts_total");
  j["driver_restarts"] =
      restarts == counters_.end() ? int64_t{0} : static_cast<int64_t>(restarts->second);
  auto known = [](int64_t v) { return v >= 0 ? json(v) : json(nullptr); };
  json members = json::array();
  for (const auto& m : view_.members) {
    members.push_back({{"rank", m.rank},
                       {"slot", m.slot},
                       {"host", m.host},
                       {"pid", m.pid},
                       {"step", known(m.step)},
                       {"epoch", known(m.epoch)},
                       {"cursor", known(m.cursor)},
                       {"samples", known(m.samples)},
                       {"seconds_since_commit", m.since_commit >= 0 ? json(m.since_commit)
                                                                    : json(nullptr)},
                       {"steps_per_second", m.steps_per_second},
                       {"compute_seconds_per_step",
                        m.step_compute >= 0 ? json(m.step_compute) : json(nullptr)},
                       {"wait_seconds_per_step", m.step_wait >= 0 ? json(m.step_wait) : json(nullptr)},
                       {"straggler", m.straggler}});
  }
  j["members"] = members;
  json black = json::array();
  for (const auto& [host, left] : view_.blacklisted) {
    black.push_back({{"host", host}, {"seconds_left", left >= 0 ? json(left) : json(nullptr)}});
  }
  j["blacklisted"] = black;
  auto slots_json = [](const std::vector<std::pair<std::string, int64_t>>& slots) {
    json out = json::array();
    for (const auto& [slot, pid] : slots) out.push_back({{"slot", slot}, {"pid", pid}});
    return out;
  };
  j["spares"] = slots_json(view_.spares);
  j["newcomers"] = slots_json(view_.newcomers);
  json recs = json::array();
  for (const auto& r : recoveries_) {
    recs.push_back({{"started", r.started},
                    {"cause", r.cause},
                    {"slot", r.slot},
                    {"phases", r.phases},
                    {"done", r.done}});
  }
  j["recoveries"] = recs;
  if (standbys_wanted_ >= 0) {
    json waiting = json::array();
    for (const auto& s : standbys_) {
      waiting.push_back({{"address", s.address}, {"host", s.host}, {"pid", s.pid}});
    }
    j["standbys"] = {{"wanted", standbys_wanted_}, {"waiting", waiting}};
  } else {
    j["standbys"] = nullptr;
  }
  if (view_.checkpoints) {
    j["checkpoint"] = {{"version", known(view_.checkpoint_version)},
                       {"step", known(view_.checkpoint_step)},
                       {"path", view_.checkpoint_path.empty() ? json(nullptr)
                                                               : json(view_.checkpoint_path)},
                       {"seconds", view_.checkpoint_version >= 0 ? json(view_.checkpoint_seconds)
                                                                 : json(nullptr)},
                       {"failures", view_.checkpoint_failures},
                       {"error", view_.checkpoint_error.empty() ? json(nullptr)
                                                                : json(view_.checkpoint_error)}};
  } else {
    j["checkpoint"] = nullptr;
  }
  return j.dump();
}

std::string Monitor::Prometheus() const {
  MutexLock g(mu_);
  std::ostringstream o;
  auto gauge = [&](const char* name, const char* help, double v) {
    o << "# HELP " << name << " " << help << "\n# TYPE " << name << " gauge\n"
      << name << " " << v << "\n";
  };
  gauge("elastic_world_size", "Workers in the current round.",
        static_cast<double>(view_.members.size()));
  gauge("elastic_round", "The current (formed) round.", static_cast<double>(view_.formed_round));
  if (standbys_wanted_ >= 0) {
    gauge("elastic_standby_drivers", "Standby drivers waiting to take over (--drivers).",
          static_cast<double>(standbys_.size()));
    gauge("elastic_standby_drivers_wanted", "Standby drivers the leader keeps (--drivers - 1).",
          static_cast<double>(standbys_wanted_));
  }
  gauge("elastic_blacklisted_hosts", "Hosts blacklisted now.",
        static_cast<double>(view_.blacklisted.size()));
  gauge("elastic_warm_spares", "Warm spares (--spares) started and waiting for a place.",
        static_cast<double>(view_.spares.size()));
  int64_t step = -1, samples = -1;
  double rate = 0;
  for (const auto& m : view_.members) {
    step = std::max(step, m.step);
    samples = std::max(samples, m.samples);
    rate = std::max(rate, m.steps_per_second);
  }
  gauge("elastic_committed_step", "The newest committed step (commits made).",
        static_cast<double>(std::max<int64_t>(step, 0)));
  gauge("elastic_committed_samples", "Samples the newest commit has consumed.",
        static_cast<double>(std::max<int64_t>(samples, 0)));
  gauge("elastic_steps_per_second", "Commits per second of the fastest member.", rate);
  o << "# HELP elastic_step_seconds A member's time per step in its last measured stretch, by "
       "part: compute (between collectives) and wait (in them).\n"
       "# TYPE elastic_step_seconds gauge\n";
  for (const auto& m : view_.members) {
    if (m.step_compute < 0) continue;
    o << "elastic_step_seconds{slot=\"" << m.slot << "\",part=\"compute\"} " << m.step_compute
      << "\nelastic_step_seconds{slot=\"" << m.slot << "\",part=\"wait\"} " << m.step_wait << "\n";
  }
  o << "# HELP elastic_stragglers_total Workers named stragglers.\n"
       "# TYPE elastic_stragglers_total counter\nelastic_stragglers_total "
    << view_.stragglers << "\n";
  if (view_.checkpoints) {
    gauge("elastic_checkpoint_version", "The version of the newest checkpoint written (-1: none).",
          static_cast<double>(view_.checkpoint_version));
    gauge("elastic_checkpoint_seconds", "How long the newest checkpoint took to write.",
          view_.checkpoint_seconds);
    o << "# HELP elastic_checkpoint_failures_total Checkpoint writes that failed.\n"
         "# TYPE elastic_checkpoint_failures_total counter\n"
         "elastic_checkpoint_failures_total " << view_.checkpoint_failures << "\n";
  }
  // Counters: one HELP/TYPE per family.
  const std::map<std::string, const char*> help = {
      {"elastic_rounds_total", "Rounds formed."},
      {"elastic_resets_total", "Membership changes (rounds proposed after the first)."},
      {"elastic_failures_total", "Workers lost, by kind (exit, hang, round_hung)."},
      {"elastic_workers_started_total", "Worker processes started."},
      {"elastic_hosts_blacklisted_total", "Blacklistings."},
      {"elastic_leaves_total", "Workers that left of their own accord."},
      {"elastic_discovery_runs_total", "Discovery script runs."},
      {"elastic_discovery_failures_total", "Discovery script runs that failed."},
      {"elastic_driver_restarts_total",
       "Drivers that adopted this job from the journal of one that died (--state-dir)."}};
  for (const auto& [family, text] : help) {
    o << "# HELP " << family << " " << text << "\n# TYPE " << family << " counter\n";
    bool any = false;
    for (const auto& [name, v] : counters_) {
      if (name == family || name.rfind(family + "{", 0) == 0) {
        o << name << " " << v << "\n";
        any = true;
      }
    }
    if (!any) o << family << " 0\n";
  }
  o << "# HELP elastic_recovery_phase_seconds Recovery phases (fence, rendezvous, rebuild, sync, "
       "first_step).\n# TYPE elastic_recovery_phase_seconds histogram\n";
  for (const auto& [phase, obs] : phase_seconds_) {
    double sum = 0;
    for (double v : obs) sum += v;
    for (double b : kBuckets) {
      size_t n = 0;
      for (double v : obs) n += v <= b;
      o << "elastic_recovery_phase_seconds_bucket{phase=\"" << phase << "\",le=\"" << b << "\"} "
        << n << "\n";
    }
    o << "elastic_recovery_phase_seconds_bucket{phase=\"" << phase << "\",le=\"+Inf\"} "
      << obs.size() << "\n";
    o << "elastic_recovery_phase_seconds_sum{phase=\"" << phase << "\"} " << sum << "\n";
    o << "elastic_recovery_phase_seconds_count{phase=\"" << phase << "\"} " << obs.size() << "\n";
  }
  return o.str();
}

std::string DefaultJobDir() {
  const char* runtime = std::getenv("XDG_RUNTIME_DIR");
  if (runtime && *runtime) return std::string(runtime) + "/elastic-run";
  return "/tmp/elastic-run-" + std::to_string(getuid());
}

Status WriteJobFile(const std::string& path, const std::string& address,
                    const std::string& token, const TlsIdentity& tls) {
  size_t slash = path.rfind('/');
  if (slash != std::string::npos && slash > 0) {
    std::string dir = path.substr(0, slash);
    if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
      return InvalidArgument("cannot create " + dir + ": " + strerror(errno));
    }
  }
  json j = {{"address", address}, {"token", token}, {"pid", getpid()}};
  if (!tls.empty()) j["tls"] = EncodeTlsIdentity(tls);
  std::string text = j.dump() + "\n";
  Status wrote = WriteFileAtomically(path, text, 0600);
  if (!wrote.ok()) return InvalidArgument("cannot write job file " + path + ": " + wrote.message());
  return Status::Ok();
}

StatusOr<JobFile> ParseJobFile(const std::string& text) {
  if (text.size() > kMaxJobFileBytes) {
    return InvalidArgument("over " + std::to_string(kMaxJobFileBytes) + " bytes");
  }
  json job = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (job.is_discarded() || !job.is_object()) return InvalidArgument("not a JSON object");
  auto field = [&](const char* name) -> StatusOr<std::string> {
    auto it = job.find(name);
    if (it == job.end() || !it->is_string() || it->get<std::string>().empty()) {
      return InvalidArgument(std::string("no ") + name);
    }
    return it->get<std::string>();
  };
  JobFile out;
  ASSIGN_OR_RETURN(out.address, field("address"));
  ASSIGN_OR_RETURN(out.token, field("token"));
  if (job.contains("tls")) {
    ASSIGN_OR_RETURN(std::string line, field("tls"));
    auto tls = DecodeTlsIdentity(line);
    if (!tls.ok()) return tls.status();
    out.tls = *tls;
  }
  return out;
}

namespace {

// The live job files in `dir` (their driver still runs).
std::vector<std::string> LiveJobFiles(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = opendir(dir.c_str());
  if (!d) return out;
  while (dirent* e = readdir(d)) {
    std::string name = e->d_name;
    if (name.size() < 6 || name.substr(name.size() - 5) != ".json") continue;
    pid_t pid = std::atoi(name.c_str());
    // Running: a killed driver whose parent has not reaped it yet (a zombie) answers
    // kill(pid, 0) but is gone.
    if (pid > 0 && ProcessStartTicks(pid) != 0) out.push_back(dir + "/" + name);
  }
  closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

std::string Fixed(const json& v, int decimals) {
  if (v.is_null()) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v.get<double>());
  return buf;
}

std::string Int(const json& v) { return v.is_null() ? "-" : std::to_string(v.get<int64_t>()); }

}  // namespace

namespace {

// The job file to ask: `job_file`, else the only running job's. 0, or the exit status when
// there is none or more than one (said on stderr).
int FindJobFile(const std::string& job_file, std::string* out,
                const char* who = "elastic-run status") {
  std::string path = job_file;
  if (path.empty()) {
    std::string dir = DefaultJobDir();
    auto live = LiveJobFiles(dir);
    if (live.empty()) {
      std::fprintf(stderr, "%s: no running job found in %s (give --job-file)\n", who,
                   dir.c_str());
      return 1;
    }
    if (live.size() > 1) {
      std::fprintf(stderr, "%s: %zu jobs run; pick one with --job-file:\n", who, live.size());
      for (const auto& f : live) std::fprintf(stderr, "  %s\n", f.c_str());
      return 2;
    }
    path = live[0];
  }
  *out = path;
  return 0;
}

// The job file at `path`, read bounded and parsed.
StatusOr<JobFile> ReadJobFileAt(const std::string& path) {
  std::ifstream f(path);
  const bool opened = f.is_open();
  std::string text;
  if (opened) {
    // Bounded: a job file is a line; a wrong path must not read gigabytes. A short file ends
    // the read with eof (and failbit): what came is in gcount().
    text.resize(kMaxJobFileBytes + 1);
    f.read(text.data(), static_cast<std::streamsize>(text.size()));
    text.resize(static_cast<size_t>(f.gcount()));
  }
  return opened && !f.bad() ? ParseJobFile(text)
                            : StatusOr<JobFile>(InvalidArgument("cannot read it"));
}

// The members' table, stragglers marked.
void PrintMembers(const json& s) {
  std::printf("\n%4s  %-24s %-16s %8s %8s %6s %10s %12s %8s %13s\n", "RANK", "SLOT", "HOST",
              "PID", "STEP", "EPOCH", "CURSOR", "LAST COMMIT", "STEPS/S", "COMPUTE/STEP");
  std::vector<std::string> stragglers;
  for (const auto& m : s["members"]) {
    std::string since = m["seconds_since_commit"].is_null()
                            ? "-"
                            : Fixed(m["seconds_since_commit"], 1) + " s ago";
    const bool straggler = m.value("straggler", false);
    std::string compute = m.contains("compute_seconds_per_step") &&
                                  m["compute_seconds_per_step"].is_number()
                              ? Fixed(m["compute_seconds_per_step"], 4) + " s"
                              : "-";
    if (straggler) {
      compute += "*";
      stragglers.push_back(m["slot"].get<std::string>());
    }
    std::printf("%4d  %-24s %-16s %8s %8s %6s %10s %12s %8s %13s\n", m["rank"].get<int>(),
                m["slot"].get<std::string>().c_str(), m["host"].get<std::string>().c_str(),
                Int(m["pid"]).c_str(), Int(m["step"]).c_str(), Int(m["epoch"]).c_str(),
                Int(m["cursor"]).c_str(), since.c_str(), Fixed(m["steps_per_second"], 1).c_str(),
                compute.c_str());
  }
  if (!stragglers.empty()) {
    std::string names;
    for (const auto& slot : stragglers) names += (names.empty() ? "" : " ") + slot;
    std::printf("\n* straggler(s) now: %s (their peers wait for them; docs/recovery.md, "
                "\"Stragglers\")\n",
                names.c_str());
  }
}

// Spares, newcomers, the newest checkpoint and the blacklist.
void PrintSparesCheckpointsBlacklist(const json& s) {
  for (const auto& [key, title] :
       {std::pair<const char*, const char*>{"spares", "warm spares (waiting for a place)"},
        {"newcomers", "new workers starting (the job re-forms with each once it is ready)"}}) {
    if (!s.contains(key) || s[key].empty()) continue;
    std::printf("\n%s:\n", title);
    for (const auto& sp : s[key]) {
      std::printf("  %-24s pid %s\n", sp["slot"].get<std::string>().c_str(),
                  Int(sp["pid"]).c_str());
    }
  }
  if (s.contains("checkpoint") && s["checkpoint"].is_object()) {
    const json& c = s["checkpoint"];
    if (c["version"].is_null()) {
      std::printf("\ncheckpoint: none written yet");
    } else {
      std::printf("\ncheckpoint: version %s (step %s) in %s, written in %s s",
                  Int(c["version"]).c_str(), Int(c["step"]).c_str(),
                  c["path"].is_string() ? c["path"].get<std::string>().c_str() : "-",
                  Fixed(c["seconds"], 3).c_str());
    }
    if (c["failures"].get<int64_t>() > 0) {
      std::printf("; %s failed write(s)%s%s", Int(c["failures"]).c_str(),
                  c["error"].is_string() ? ", failing now: " : "",
                  c["error"].is_string() ? c["error"].get<std::string>().c_str() : "");
    }
    std::printf("\n");
  }
  if (s.contains("standbys") && s["standbys"].is_object()) {
    const json& sb = s["standbys"];
    std::printf("\nstandby drivers: %zu waiting, %s wanted (--drivers)\n", sb["waiting"].size(),
                Int(sb["wanted"]).c_str());
    for (const auto& w : sb["waiting"]) {
      std::printf("  %-24s pid %s on %s\n", w.value("address", std::string("-")).c_str(),
                  Int(w["pid"]).c_str(), w.value("host", std::string("-")).c_str());
    }
  }
  if (!s["blacklisted"].empty()) {
    std::printf("\nblacklisted hosts:\n");
    for (const auto& b : s["blacklisted"]) {
      std::printf("  %-24s %s\n", b["host"].get<std::string>().c_str(),
                  b["seconds_left"].is_null()
                      ? "for good"
                      : ("back in " + Fixed(b["seconds_left"], 1) + " s").c_str());
    }
  }
}

void PrintRecoveries(const json& s) {
  if (!s["recoveries"].empty()) {
    std::printf("\nrecent recoveries (seconds from the failure):\n");
    for (const auto& r : s["recoveries"]) {
      std::string phases;
      for (const char* p : {"fence", "rendezvous", "rebuild", "sync", "first_step"}) {
        if (r["phases"].contains(p)) phases += std::string(" ") + p + "=" + Fixed(r["phases"][p], 3);
      }
      std::printf("  %s (%s):%s%s\n", r["cause"].get<std::string>().c_str(),
                  r["slot"].get<std::string>().c_str(), phases.c_str(),
                  r["done"].get<bool>() ? "" : " (in progress)");
    }
  }
}

}  // namespace

int RunStatusCommand(const std::string& job_file, bool as_json) {
  std::string path;
  if (int code = FindJobFile(job_file, &path); code != 0) return code;
  auto job = ReadJobFileAt(path);
  if (!job.ok()) {
    std::fprintf(stderr, "elastic-run status: %s is not a job file (%s)\n", path.c_str(),
                 job.status().message().c_str());
    return 2;
  }
  rendezvous::ClientOptions co;
  co.address = job->address;
  co.token = job->token;
  co.tls = job->tls;
  rendezvous::Client client(co);
  auto got = client.JobStatus(std::chrono::seconds(5));
  if (!got.ok()) {
    std::fprintf(stderr, "elastic-run status: the driver at %s does not answer: %s\n",
                 co.address.c_str(), got.status().message().c_str());
    return 1;
  }
  if (as_json) {
    std::printf("%s\n", got->c_str());
    return 0;
  }
  json s = json::parse(*got, nullptr, false);
  if (s.is_discarded()) {
    std::fprintf(stderr, "elastic-run status: the driver sent a document that is not JSON\n");
    return 1;
  }
  std::printf(
      "job: %s, round %s, %zu worker(s) (--min-np %d, --max-np %s), %d reset(s), %d "
      "failure(s)\n",
      s["phase"].get<std::string>().c_str(), Int(s["round"]).c_str(), s["members"].size(),
      s["min_np"].get<int>(), s["max_np"].is_null() ? "none" : Int(s["max_np"]).c_str(),
      s["resets"].get<int>(), s["failures"].get<int>());
  PrintMembers(s);
  PrintSparesCheckpointsBlacklist(s);
  PrintRecoveries(s);
  return 0;
}

int RunCredentialsCommand(const std::string& job_file, const std::string& out_dir) {
  const char* who = "elastic-run credentials";
  std::string path;
  if (int code = FindJobFile(job_file, &path, who); code != 0) return code;
  auto job = ReadJobFileAt(path);
  if (!job.ok()) {
    std::fprintf(stderr, "%s: %s is not a job file (%s)\n", who, path.c_str(),
                 job.status().message().c_str());
    return 2;
  }
  if (mkdir(out_dir.c_str(), 0700) != 0 && errno != EEXIST) {
    std::fprintf(stderr, "%s: cannot make %s: %s\n", who, out_dir.c_str(), std::strerror(errno));
    return 1;
  }
  std::vector<std::pair<std::string, std::string>> files = {{"token", job->token}};
  if (!job->tls.empty()) {
    files.insert(files.end(),
                 {{"ca.pem", job->tls.ca}, {"client.pem", job->tls.cert}, {"client.key", job->tls.key}});
  }
  for (const auto& [name, text] : files) {
    // 0600: the key and the token are the job's secrets.
    Status wrote = WriteFileAtomically(out_dir + "/" + name, text, 0600);
    if (!wrote.ok()) {
      std::fprintf(stderr, "%s: %s\n", who, wrote.message().c_str());
      return 1;
    }
  }
  std::printf("wrote the job's %s to %s/ (mode 0600)\n",
              job->tls.empty() ? "token (the job runs without TLS)"
                               : "token, CA, client certificate and key",
              out_dir.c_str());
  if (!job->tls.empty()) {
    std::printf(
        "a --metrics-address beyond loopback serves HTTPS for the name %s; e.g.\n"
        "  curl --cacert %s/ca.pem --cert %s/client.pem --key %s/client.key \\\n"
        "       -H \"Authorization: Bearer $(cat %s/token)\" \\\n"
        "       --connect-to %s:<port>:<metrics address>:<port> https://%s:<port>/metrics\n",
        kTlsServerName, out_dir.c_str(), out_dir.c_str(), out_dir.c_str(), out_dir.c_str(),
        kTlsServerName, kTlsServerName);
  }
  return 0;
}

}  // namespace elastic::driver
