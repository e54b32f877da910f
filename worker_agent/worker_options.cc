#include "worker_agent/worker_options.h"

#include <cstdlib>
#include <string>

#include "common/etcd.h"
#include "common/process.h"
#include "common/tls.h"

namespace elastic {

const char* const kWorkerVariables[] = {
    "ELASTIC_DRIVER_ADDR",     "ELASTIC_JOB_TOKEN",      "ELASTIC_SLOT",
    "ELASTIC_HOSTNAME",        "ELASTIC_IFACE",          "ELASTIC_WORKER_ID",
    "ELASTIC_RIDE_OUT_FILE",   "ELASTIC_BACKEND",        "ELASTIC_DRIVER_TIMEOUT",
    "ELASTIC_SPARE",           "ELASTIC_CHECKPOINT_DIR", "ELASTIC_CHECKPOINT_INTERVAL",
    "ELASTIC_CHECKPOINT_KEEP", "ELASTIC_STACK_SIGNAL",   "ELASTIC_NCCL_SHRINK",
    "ELASTIC_SHM_ALLREDUCE",   "ELASTIC_SHM_REUSE",      "ELASTIC_SHM_COLLECTIVES",
    "ELASTIC_GLOO_LAZY_PAIRS", "ELASTIC_GLOO_FULL_MESH", "ELASTIC_SHM_SLOT_BYTES",
    "ELASTIC_NCCL_LIBRARY",    "ELASTIC_CUDART_LIBRARY", "ELASTIC_GRPC_BDP_PROBE",
    "ELASTIC_LOG_LEVEL",       "ELASTIC_TEST_HOOKS",     "ELASTIC_STATE_STORE",
    "ELASTIC_JOB_TLS",         "ELASTIC_STATE_STORE_TLS",
};
const size_t kWorkerVariableCount = sizeof kWorkerVariables / sizeof kWorkerVariables[0];

const char* BackendName(Backend b) {
  switch (b) {
    case Backend::kGloo: return "gloo";
    case Backend::kNccl: return "nccl";
    case Backend::kAuto: return "auto";
  }
  return "?";
}

StatusOr<Backend> ParseBackend(const std::string& name) {
  for (Backend b : {Backend::kGloo, Backend::kNccl, Backend::kAuto}) {
    if (name == BackendName(b)) return b;
  }
  return InvalidArgument("unknown backend '" + name + "': use gloo, nccl or auto");
}

namespace {

// The environment, read through these four only: each says what was wrong with a value.
class Reader {
 public:
  // The value, or "" when unset.
  static std::string Text(const char* name) { return Env(name); }
  // 0 or 1; unset or empty: `dflt`.
  static Status Flag(const char* name, bool* out) {
    const std::string v = Text(name);
    if (v.empty()) return Status::Ok();
    if (v != "0" && v != "1") return Bad(name, v, "give 0 or 1");
    *out = v == "1";
    return Status::Ok();
  }
  // A number in [lo, hi]; unset or empty: nullopt. `how` says what to give instead of "a
  // number from lo to hi".
  static Status Number(const char* name, double lo, double hi, std::optional<double>* out,
                       const std::string& how = "") {
    const std::string v = Text(name);
    if (v.empty()) return Status::Ok();
    char* end = nullptr;
    const double d = std::strtod(v.c_str(), &end);
    if (end == v.c_str() || *end != '\0' || !(d >= lo && d <= hi)) {
      return Bad(name, v,
                 how.empty() ? "give a number from " + Format(lo) + " to " + Format(hi) : how);
    }
    *out = d;
    return Status::Ok();
  }
  // A whole number in [lo, hi]; unset or empty: nullopt. `how` says what to give.
  static Status Whole(const char* name, long long lo, long long hi, const std::string& how,
                      std::optional<long long>* out) {
    std::optional<double> d;
    RETURN_IF_ERROR(Number(name, static_cast<double>(lo), static_cast<double>(hi), &d, how));
    if (d && *d != static_cast<double>(static_cast<long long>(*d))) {
      return Bad(name, Text(name), how);
    }
    if (d) *out = static_cast<long long>(*d);
    return Status::Ok();
  }

 private:
  static std::string Format(double d) {
    std::string s = std::to_string(d);
    s.erase(s.find_last_not_of('0') + 1);
    if (!s.empty() && s.back() == '.') s.pop_back();
    return s;
  }
  static Status Bad(const char* name, const std::string& value, const std::string& how) {
    return InvalidArgument(std::string(name) + "='" + value + "' is not valid: " + how);
  }
};

}  // namespace

StatusOr<WorkerOptions> WorkerOptions::FromEnvironment() {
  WorkerOptions o;
  o.driver_addr = Reader::Text("ELASTIC_DRIVER_ADDR");
  o.token = Reader::Text("ELASTIC_JOB_TOKEN");
  o.slot = Reader::Text("ELASTIC_SLOT");
  o.hostname = Reader::Text("ELASTIC_HOSTNAME");
  o.iface = Reader::Text("ELASTIC_IFACE");
  o.worker_id = Reader::Text("ELASTIC_WORKER_ID");
  o.ride_out_file = Reader::Text("ELASTIC_RIDE_OUT_FILE");
  if (std::string tls = Reader::Text("ELASTIC_JOB_TLS"); !tls.empty()) {
    auto id = DecodeTlsIdentity(tls);
    if (!id.ok()) return id.status().WithContext("ELASTIC_JOB_TLS");
    if (id->ca.empty() || id->cert.empty() || id->key.empty()) {
      return InvalidArgument("ELASTIC_JOB_TLS: it needs the CA, the certificate and the key");
    }
    o.tls = *id;
  }
  if (std::string store = Reader::Text("ELASTIC_STATE_STORE"); !store.empty()) {
    auto url = ParseEtcdUrl(store);
    if (!url.ok()) return url.status().WithContext("ELASTIC_STATE_STORE");
    auto tls = DecodeTlsIdentity(Reader::Text("ELASTIC_STATE_STORE_TLS"));
    if (!tls.ok()) return tls.status().WithContext("ELASTIC_STATE_STORE_TLS");
    url->tls = *tls;
    o.state_store = *url;
  }
  for (auto [name, value] :
       {std::pair<const char*, std::string*>{"ELASTIC_DRIVER_ADDR", &o.driver_addr},
        {"ELASTIC_JOB_TOKEN", &o.token},
        {"ELASTIC_SLOT", &o.slot}}) {
    if (value->empty()) {
      return InvalidArgument(std::string(name) +
                             " is not set: start this program under elastic-run, e.g. "
                             "`elastic-run -np 2 ./train`");
    }
  }
  if (o.hostname.empty()) o.hostname = o.slot.substr(0, o.slot.rfind(':'));
  if (std::string b = Reader::Text("ELASTIC_BACKEND"); !b.empty()) {
    auto parsed = ParseBackend(b);
    if (!parsed.ok()) return parsed.status().WithContext("ELASTIC_BACKEND");
    o.backend = *parsed;
  }
  std::optional<double> n;
  RETURN_IF_ERROR(Reader::Number("ELASTIC_DRIVER_TIMEOUT", 0, 86400, &n));
  if (n) o.driver_timeout = FromSeconds(*n);
  RETURN_IF_ERROR(Reader::Flag("ELASTIC_SPARE", &o.spare));
  o.checkpoint_dir = Reader::Text("ELASTIC_CHECKPOINT_DIR");
  n.reset();
  RETURN_IF_ERROR(Reader::Number("ELASTIC_CHECKPOINT_INTERVAL", 0, 1e7, &n));
  if (n) o.checkpoint_interval = FromSeconds(*n);
  std::optional<long long> w;
  RETURN_IF_ERROR(Reader::Whole("ELASTIC_CHECKPOINT_KEEP", 1, 1000,
                                "give a whole number from 1 to 1000", &w));
  if (w) o.checkpoint_keep = static_cast<int>(*w);
  w.reset();
  RETURN_IF_ERROR(Reader::Whole("ELASTIC_STACK_SIGNAL", 0, 64, "give a signal number from 0 to 64",
                                &w));
  if (w) o.stack_signal = static_cast<int>(*w);
  for (auto [name, flag] : {std::pair<const char*, bool*>{"ELASTIC_NCCL_SHRINK", &o.nccl_shrink},
                            {"ELASTIC_SHM_ALLREDUCE", &o.shm_allreduce},
                            {"ELASTIC_SHM_REUSE", &o.shm_reuse},
                            {"ELASTIC_SHM_COLLECTIVES", &o.shm_collectives},
                            {"ELASTIC_GLOO_LAZY_PAIRS", &o.gloo_lazy_pairs},
                            {"ELASTIC_GLOO_FULL_MESH", &o.gloo_full_mesh},
                            {"ELASTIC_GRPC_BDP_PROBE", &o.grpc_bdp_probe}}) {
    RETURN_IF_ERROR(Reader::Flag(name, flag));
  }
  w.reset();
  const std::string slot_how = "give a whole number of bytes from 4096 to " +
                               std::to_string(256 << 20) + " (0: the default)";
  RETURN_IF_ERROR(Reader::Whole("ELASTIC_SHM_SLOT_BYTES", 0, 256 << 20, slot_how, &w));
  if (w && *w != 0 && *w < 4096) {
    return InvalidArgument("ELASTIC_SHM_SLOT_BYTES='" + Reader::Text("ELASTIC_SHM_SLOT_BYTES") +
                           "' is not valid: " + slot_how);
  }
  if (w) o.shm_slot_bytes = static_cast<size_t>(*w);
  o.nccl_library = Reader::Text("ELASTIC_NCCL_LIBRARY");
  o.cudart_library = Reader::Text("ELASTIC_CUDART_LIBRARY");
  o.log_level = Reader::Text("ELASTIC_LOG_LEVEL");
  o.test_hooks = Reader::Text("ELASTIC_TEST_HOOKS");
  return o;
}

}  // namespace elastic
