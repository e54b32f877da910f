#include "driver/policy_state.h"

#include <nlohmann/json.hpp>

namespace elastic::driver {
namespace {

using nlohmann::json;

// Bounds on what a loaded state may hold (it comes from a file).
constexpr size_t kMaxEntries = 1u << 20;

// A time point as nanoseconds from `now` (positive: in the past), or "never" / "max".
json Time(TimePoint t, TimePoint now) {
  if (t == TimePoint{}) return "never";
  if (t == TimePoint::max()) return "max";
  return static_cast<int64_t>((now - t).count());
}

// Writing: one overload per field type.
struct Writer {
  TimePoint now;
  json Put(bool v) const { return v; }
  json Put(int v) const { return v; }
  json Put(int64_t v) const { return v; }
  json Put(double v) const { return v; }
  json Put(const std::string& v) const { return v; }
  json Put(TimePoint t) const { return Time(t, now); }
  json Put(Duration d) const { return static_cast<int64_t>(d.count()); }
  template <typename T>
  json Put(const std::vector<T>& v) const {
    json out = json::array();
    for (const auto& x : v) out.push_back(Put(x));
    return out;
  }
  template <typename T>
  json Put(const std::set<T>& v) const {
    json out = json::array();
    for (const auto& x : v) out.push_back(Put(x));
    return out;
  }
  template <typename V>
  json Put(const std::map<std::string, V>& m) const {
    json out = json::object();
    for (const auto& [k, v] : m) out[k] = Put(v);
    return out;
  }
  // The structs, field by field (FIELDS below).
  json Put(const discovery::HostSlots& v) const;
  json Put(const discovery::HostTable::Entry& v) const;
  json Put(const discovery::HostTable::State& v) const;
  json Put(const WorkerState& v) const;
  json Put(const PolicyState& v) const;
};

// Reading: throws Bad naming the field's path; LoadPolicyState turns it into a Status.
struct Bad {
  std::string what;
};

struct Reader {
  TimePoint now;
  int format = 0;  // of the text: fields added after it may be missing (their defaults)
  const json& At(const json& j, const char* key, const std::string& path) const {
    if (!j.is_object()) throw Bad{path + " is not an object"};
    auto it = j.find(key);
    if (it == j.end()) throw Bad{path + "." + key + " is missing"};
    return *it;
  }
  void Get(const json& j, const std::string& path, bool* v) const {
    if (!j.is_boolean()) throw Bad{path + " is not true or false"};
    *v = j.get<bool>();
  }
  void Get(const json& j, const std::string& path, int64_t* v) const {
    if (!j.is_number_integer()) throw Bad{path + " is not an integer"};
    *v = j.get<int64_t>();
  }
  void Get(const json& j, const std::string& path, int* v) const {
    int64_t x = 0;
    Get(j, path, &x);
    if (x < INT32_MIN || x > INT32_MAX) throw Bad{path + " is out of range"};
    *v = static_cast<int>(x);
  }
  void Get(const json& j, const std::string& path, double* v) const {
    if (!j.is_number()) throw Bad{path + " is not a number"};
    *v = j.get<double>();
  }
  void Get(const json& j, const std::string& path, std::string* v) const {
    if (!j.is_string()) throw Bad{path + " is not a string"};
    *v = j.get<std::string>();
  }
  void Get(const json& j, const std::string& path, TimePoint* t) const {
    if (j.is_string() && j.get<std::string>() == "never") {
      *t = TimePoint{};
    } else if (j.is_string() && j.get<std::string>() == "max") {
      *t = TimePoint::max();
    } else if (j.is_number_integer()) {
      *t = now - Duration(j.get<int64_t>());
    } else {
      throw Bad{path + " is not a time (nanoseconds before the save, \"never\" or \"max\")"};
    }
  }
  void Get(const json& j, const std::string& path, Duration* d) const {
    int64_t x = 0;
    Get(j, path, &x);
    *d = Duration(x);
  }
  template <typename T>
  void Get(const json& j, const std::string& path, std::vector<T>* v) const {
    if (!j.is_array()) throw Bad{path + " is not a list"};
    if (j.size() > kMaxEntries) throw Bad{path + " has too many entries"};
    v->clear();
    for (size_t i = 0; i < j.size(); ++i) {
      T x{};
      Get(j[i], path + "[" + std::to_string(i) + "]", &x);
      v->push_back(std::move(x));
    }
  }
  template <typename T>
  void Get(const json& j, const std::string& path, std::set<T>* v) const {
    std::vector<T> list;
    Get(j, path, &list);
    v->clear();
    v->insert(list.begin(), list.end());
  }
  template <typename V>
  void Get(const json& j, const std::string& path, std::map<std::string, V>* m) const {
    if (!j.is_object()) throw Bad{path + " is not an object"};
    if (j.size() > kMaxEntries) throw Bad{path + " has too many entries"};
    m->clear();
    for (auto it = j.begin(); it != j.end(); ++it) {
      V x{};
      Get(it.value(), path + "." + it.key(), &x);
      (*m)[it.key()] = std::move(x);
    }
  }
  void Get(const json& j, const std::string& path, discovery::HostSlots* v) const;
  void Get(const json& j, const std::string& path, discovery::HostTable::Entry* v) const;
  void Get(const json& j, const std::string& path, discovery::HostTable::State* v) const;
  void Get(const json& j, const std::string& path, WorkerState* v) const;
  void Get(const json& j, const std::string& path, PolicyState* v) const;
};

// clang-format off
// Every saved field of each struct, once: X(name); each is saved under its own name.
#define HOST_SLOTS_FIELDS(X) X(host) X(slots)
#define ENTRY_FIELDS(X)                                                                       \
  X(slots) X(listed) X(failures) X(times_blacklisted) X(blacklisted) X(until) X(end_told)
#define TABLE_FIELDS(X) X(order) X(hosts) X(rng) X(last_cooldown)
#define WORKER_FIELDS(X)                                                                      \
  X(slot) X(host) X(local) X(running) X(dropped) X(removed) X(finished) X(leaving) X(spare)   \
  X(joiner) X(ready) X(paid) X(rescued) X(lost_at) X(watches) X(stale_closes) X(round)        \
  X(rank) X(pid) X(step) X(version) X(commit_at) X(logged_round) X(heard_at) X(launched_at)   \
  X(moved_at) X(heard_round) X(collectives) X(in_collective) X(stack_signal) X(epoch)         \
  X(cursor) X(samples) X(epoch_size) X(rate) X(failed_round) X(failure) X(exit_hung)          \
  X(start_failed)
// Fields added in format 2 (straggler detection): a state of format 1 loads without them.
#define WORKER_FIELDS_2(X)                                                                    \
  X(window_round) X(window_step) X(window_compute) X(window_wait) X(step_compute)             \
  X(step_wait) X(slow_windows) X(fast_windows) X(straggler) X(evicted_until)
#define POLICY_FIELDS(X)                                                                        \
  X(hosts) X(workers) X(members) X(round) X(formed) X(formed_members) X(failure_order) X(kept) \
  X(aborted) X(withdrawn) X(incident_round) X(resets) X(failures) X(spare_failures)             \
  X(formed_at) X(next_progress) X(progress_samples) X(progress_step) X(progress_at)             \
  X(longest_interval) X(finishing) X(finisher) X(finishing_at) X(shutting_down) X(exit_code)    \
  X(final_message) X(kill_at) X(wait_until) X(recovery_start) X(recovering) X(round_broken)     \
  X(first_commit_logged) X(started) X(restore_round) X(lost_committed) X(lost_round)             \
  X(checkpoint_version) X(checkpoint_step) X(checkpoint_failures) X(checkpoint_seconds) X(checkpoint_path)            \
  X(checkpoint_error) X(last_listed) X(last_listed_order)
#define POLICY_FIELDS_2(X) X(stragglers) X(evicted_at)
// Fields added later (newcomer cohorts): loaded when present, in any format.
#define WORKER_FIELDS_OPT(X) X(cohort)
#define POLICY_FIELDS_OPT(X) X(cohorts) X(gather_until) X(resumed_version)

// Writer::Put and Reader::Get of `Type`, from its field list.
#define PUT_FIELD(name) out[#name] = Put(v.name);
#define GET_FIELD(name) Get(At(j, #name, path), path + "." #name, &v->name);
#define GET_FIELD_2(name) \
  if (format >= 2 || j.contains(#name)) GET_FIELD(name)
#define GET_FIELD_OPT(name) \
  if (j.contains(#name)) GET_FIELD(name)
#define SAVED_STRUCT(Type, FIELDS)                                                  \
  json Writer::Put(const Type& v) const {                                           \
    json out = json::object();                                                      \
    FIELDS(PUT_FIELD)                                                               \
    return out;                                                                     \
  }                                                                                 \
  void Reader::Get(const json& j, const std::string& path, Type* v) const {         \
    FIELDS(GET_FIELD)                                                               \
  }
// A struct with fields added in format 2 (required in a text of format 2, optional before)
// and fields added since (optional in any format).
#define SAVED_STRUCT_2(Type, FIELDS, FIELDS_2, FIELDS_OPT)                          \
  json Writer::Put(const Type& v) const {                                           \
    json out = json::object();                                                      \
    FIELDS(PUT_FIELD)                                                               \
    FIELDS_2(PUT_FIELD)                                                             \
    FIELDS_OPT(PUT_FIELD)                                                           \
    return out;                                                                     \
  }                                                                                 \
  void Reader::Get(const json& j, const std::string& path, Type* v) const {         \
    FIELDS(GET_FIELD)                                                               \
    FIELDS_2(GET_FIELD_2)                                                           \
    FIELDS_OPT(GET_FIELD_OPT)                                                       \
  }
// clang-format on

SAVED_STRUCT(discovery::HostSlots, HOST_SLOTS_FIELDS)
SAVED_STRUCT(discovery::HostTable::Entry, ENTRY_FIELDS)
SAVED_STRUCT(discovery::HostTable::State, TABLE_FIELDS)
SAVED_STRUCT_2(WorkerState, WORKER_FIELDS, WORKER_FIELDS_2, WORKER_FIELDS_OPT)
SAVED_STRUCT_2(PolicyState, POLICY_FIELDS, POLICY_FIELDS_2, POLICY_FIELDS_OPT)

// 2: straggler detection's fields (WORKER_FIELDS_2, POLICY_FIELDS_2). A state of format 1
// (an older elastic-run's journal) loads too, without them.
constexpr int kFormat = 2;

}  // namespace

std::string SavePolicyState(const PolicyState& s, TimePoint now) {
  json out = Writer{now}.Put(s);
  out["format"] = kFormat;
  return out.dump();
}

StatusOr<PolicyState> LoadPolicyState(const std::string& text, TimePoint now) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgument("the driver's saved state is not valid JSON");
  PolicyState s;
  Reader r{now};
  try {
    int format = 0;
    r.Get(r.At(j, "format", "state"), "state.format", &format);
    if (format < 1 || format > kFormat) {
      return InvalidArgument("the driver's saved state has format " + std::to_string(format) +
                             "; this elastic-run reads formats 1 to " +
                             std::to_string(kFormat) +
                             " (was it written by a newer elastic-run?)");
    }
    r.format = format;
    r.Get(j, "state", &s);
  } catch (const Bad& b) {
    return InvalidArgument("the driver's saved state: " + b.what);
  }
  Status table = discovery::HostTable(discovery::HostTableOptions{}).Restore(s.hosts);
  if (!table.ok()) return table.WithContext("the driver's saved state");
  for (const auto& [slot, w] : s.workers) {
    if (w.slot != slot) {
      return InvalidArgument("the driver's saved state: worker '" + slot + "' names slot '" +
                             w.slot + "'");
    }
  }
  return s;
}

}  // namespace elastic::driver
