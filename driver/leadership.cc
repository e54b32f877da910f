// Leadership of a job in etcd (driver/leadership.h).
#include "driver/leadership.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <random>

namespace elastic::driver {

namespace {

std::string Field(const std::string& value, int index) {
  size_t start = 0;
  for (int i = 0; i < index; ++i) {
    start = value.find('\n', start);
    if (start == std::string::npos) return "";
    ++start;
  }
  return value.substr(start, value.find('\n', start) - start);
}

std::string Nonce() {
  std::random_device rd;
  return fmt::format("{:08x}{:08x}", rd(), rd());
}

std::string HostName() {
  char name[256] = {0};
  gethostname(name, sizeof name - 1);
  return name;
}

// A standby's key under PREFIX/standbys/ (driver/leadership.h), renewed every quarter TTL
// from Take's loop, and revoked when Take returns. An etcd that does not answer is tried
// again at the next turn; a lease that ran out meanwhile is granted again.
class StandbyListing {
 public:
  StandbyListing(Etcd& store, const LeadershipOptions& options)
      : store_(store),
        ttl_(options.ttl_seconds),
        key_(fmt::format("standbys/{}-{}-{}", HostName(), getpid(), Nonce())),
        value_(nlohmann::json{{"address", options.address},
                              {"host", HostName()},
                              {"pid", static_cast<int64_t>(getpid())}}
                   .dump()) {}
  ~StandbyListing() {
    if (lease_ != 0) (void)store_.Revoke(lease_);
  }
  void Renew() {
    const auto now = SteadyClock::now();
    if (lease_ != 0 && now - renewed_ < std::chrono::milliseconds(ttl_ * 250)) return;
    renewed_ = now;
    if (lease_ != 0) {
      auto left = store_.KeepAlive(lease_);
      if (!left.ok() || *left > 0) return;
      lease_ = 0;  // it ran out (etcd was away longer than a TTL): listed again below
    }
    auto lease = store_.Grant(ttl_);
    if (!lease.ok()) return;
    if (store_.Put(key_, value_, *lease).ok()) {
      lease_ = *lease;
    } else {
      (void)store_.Revoke(*lease);
    }
  }

 private:
  Etcd& store_;
  int ttl_;
  std::string key_, value_;
  int64_t lease_ = 0;
  TimePoint renewed_{};
};

}  // namespace

StatusOr<std::vector<StandbyView>> ListStandbys(Etcd& store) {
  ASSIGN_OR_RETURN(auto kvs, store.List("standbys/", 1000));
  std::vector<StandbyView> out;
  for (const auto& [key, kv] : kvs) {
    try {
      auto j = nlohmann::json::parse(kv.value);
      StandbyView v;
      v.address = j.value("address", std::string());
      v.host = j.value("host", std::string());
      v.pid = j.value("pid", int64_t{0});
      out.push_back(std::move(v));
    } catch (const std::exception&) {
      spdlog::debug("the state store: {} is not a standby's listing; ignored", key);
    }
  }
  return out;
}

std::string DescribeLeader(const std::string& value) {
  std::string address = Field(value, 0);
  return fmt::format("{} (pid {} on {})", address.empty() ? "an address not yet said" : address,
                     Field(value, 1), Field(value, 2));
}

namespace {
int64_t Ns(TimePoint t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}
}  // namespace

Leadership::Leadership(const LeadershipOptions& options, int64_t lease, std::string value)
    : options_(options),
      // A write that etcd does not answer holds the driver's loop: at most a quarter TTL.
      store_(options.store,
             std::min<Duration>(std::chrono::seconds(2),
                                std::chrono::milliseconds(options.ttl_seconds * 250))),
      lease_(lease),
      value_(std::move(value)) {
  renewed_ns_.store(Ns(SteadyClock::now()));
}

bool Leadership::Leads(std::string* why) {
  {
    MutexLock g(mu_);
    if (!lost_.empty()) {
      if (why) *why = lost_;
      return false;
    }
  }
  const auto ttl = std::chrono::milliseconds(options_.ttl_seconds * 1000);
  const int64_t age = Ns(SteadyClock::now()) - renewed_ns_.load();
  if (std::chrono::nanoseconds(age) < ttl * 7 / 8) return true;
  if (why) {
    *why = fmt::format("its lease was last renewed {:.1f} s ago, and its TTL is {} s", age / 1e9,
                       options_.ttl_seconds);
  }
  return false;
}

Leadership::~Leadership() {
  {
    MutexLock g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (keeper_.joinable()) keeper_.join();
}

StatusOr<std::unique_ptr<Leadership>> Leadership::Take(const LeadershipOptions& options,
                                                       const std::function<bool()>& stop,
                                                       std::optional<Ended>* ended) {
  Etcd store(options.store);
  const std::string where = options.store.text;
  std::string said;   // the leader a standby last said it waits for
  bool waited = false;
  std::optional<StandbyListing> listed;
  if (options.standby) listed.emplace(store, options);
  while (true) {
    if (listed) listed->Renew();
    auto leader = store.Get("leader");
    if (!leader.ok() && leader.status().code() == Code::kUnavailable && options.standby) {
      // A standby outlasts an etcd that is down: it may be needed once etcd is back.
      if (said != "!") {
        spdlog::warn("standby: {}; trying again until it answers", leader.status().message());
        said = "!";
      }
      for (int i = 0; i < 10; ++i) {
        if (stop()) return Cancelled("stopped while standing by");
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      continue;
    }
    if (!leader.ok()) return leader.status().WithContext("--state-store");
    StatusOr<std::optional<Etcd::Kv>> journal = std::optional<Etcd::Kv>();
    if (options.standby) {
      // The job ended when its end is recorded and no journal follows it: a driver that
      // takes the lead removes the record in the same transaction (below).
      auto done = store.Get("done");
      journal = store.Get("journal");
      if (!done.ok()) return done.status().WithContext("--state-store");
      if (!journal.ok()) return journal.status().WithContext("--state-store");
      if (done->has_value() && !journal->has_value()) {
        Ended e;
        try {
          auto j = nlohmann::json::parse((*done)->value);
          e.code = j.value("code", 1);
          e.message = j.value("message", std::string());
        } catch (const std::exception&) {
          e.code = 1;
          e.message = "(unreadable)";
        }
        *ended = e;
        return std::unique_ptr<Leadership>();
      }
    }
    if (!leader->has_value()) {
      bool may = true;
      if (options.standby) {
        may = journal->has_value();  // a standby adopts a job, it never starts one
        if (may && options.check_journal) {
          RETURN_IF_ERROR(options.check_journal((*journal)->value));
        }
        if (!may && said != "-") {
          spdlog::info("standby: no job runs under {} yet; waiting for one to stand by for",
                       where);
          said = "-";
        }
      }
      if (may) {
        ASSIGN_OR_RETURN(int64_t lease, store.Grant(options.ttl_seconds));
        std::string value = "\n" + std::to_string(getpid()) + "\n" + HostName() + "\n" + Nonce();
        auto won = store.WriteIfAbsent("leader", {{"leader", value, lease, false},
                                                  {"done", "", 0, true}});
        if (won.ok() && *won) {
          if (waited) spdlog::warn("standby: the leader is gone; this driver leads the job now");
          return std::unique_ptr<Leadership>(new Leadership(options, lease, value));
        }
        (void)store.Revoke(lease);  // else it runs out by itself
        if (!won.ok()) return won.status().WithContext("--state-store");
        continue;  // another took it first: look again
      }
    } else if (!options.standby) {
      return FailedPrecondition(fmt::format(
          "--state-store {}: the driver at {} leads this job; start this command with --standby "
          "to take over when it goes, or give another prefix for another job",
          where, DescribeLeader((*leader)->value)));
    } else if ((*leader)->value != said) {
      said = (*leader)->value;
      spdlog::info("standby: the driver at {} leads the job; this one takes over when its lease "
                   "({} s) runs out",
                   DescribeLeader(said), options.ttl_seconds);
    }
    waited = true;
    for (int i = 0; i < 2; ++i) {
      if (stop()) return Cancelled("stopped while standing by");
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
}

void Leadership::KeepAlive(std::function<void(const std::string&)> lost) {
  keeper_ = std::thread([this, lost = std::move(lost)] {
    const auto ttl = std::chrono::seconds(options_.ttl_seconds);
    const auto period = std::chrono::milliseconds(options_.ttl_seconds * 1000 / 4);
    // The lease runs at least until a whole TTL after a renewal was sent: past that without
    // one that got through, this driver may no longer lead.
    auto renewed = TimePoint(std::chrono::nanoseconds(renewed_ns_.load()));
    // Each endpoint gets an eighth of the TTL; a renewal that failed is tried again after
    // 100 ms, not a whole period (etcd electing a new leader answers nobody for a moment).
    Etcd store(options_.store, std::max<Duration>(std::chrono::milliseconds(200),
                                                  std::chrono::milliseconds(
                                                      options_.ttl_seconds * 1000 / 8)));
    std::string why;
    Duration wait = period;
    bool warned = false;  // about this outage
    while (true) {
      {
        MutexLock g(mu_);
        cv_.wait_for(g.native(), wait, [&]() ELASTIC_REQUIRES(mu_) { return stop_; });
        if (stop_) return;
      }
      wait = period;
      auto sent = SteadyClock::now();
      auto left = store.KeepAlive(lease_);
      if (left.ok() && *left <= 0) {
        why = "etcd says its lease expired";
      } else if (left.ok()) {
        renewed = sent;
        renewed_ns_.store(Ns(sent));
        if (warned) spdlog::info("the state store answers again; the lease is renewed");
        warned = false;
        continue;
      } else if (SteadyClock::now() - renewed >= ttl - period / 2) {
        why = fmt::format("no renewal of its lease got through for {} s ({})",
                          options_.ttl_seconds, left.status().message());
      } else {
        if (!warned) {
          spdlog::warn("the state store: {}; trying to renew the leader's lease every 0.1 s",
                       left.status().message());
        }
        warned = true;
        wait = std::chrono::milliseconds(100);
        continue;
      }
      {
        MutexLock g(mu_);
        lost_ = why;
      }
      lost(why);
      return;
    }
  });
}

Status Leadership::Announce(const std::string& address) {
  std::string next = address + value_.substr(value_.find('\n'));
  RETURN_IF_ERROR(Fenced({{"leader", next, lease_, false}}, "the leader's address"));
  value_ = next;
  return Status::Ok();
}

StatusOr<std::optional<std::string>> Leadership::ReadJournal() {
  ASSIGN_OR_RETURN(auto kv, store_.Get("journal"));
  if (!kv) return std::optional<std::string>();
  return std::optional<std::string>(kv->value);
}

Status Leadership::Fenced(const std::vector<Etcd::Write>& writes, const char* what) {
  auto ran = store_.WriteIfHolds("leader", value_, writes);
  if (!ran.ok()) return ran.status().WithContext(std::string("writing ") + what);
  if (!*ran) {
    return FailedPrecondition(std::string("not written (") + what +
                              "): this driver no longer leads the job (its lease expired)");
  }
  return Status::Ok();
}

Status Leadership::WriteJournal(const std::string& text) {
  return Fenced({{"journal", text, 0, false}}, "the journal");
}

Status Leadership::RemoveJournal() { return Fenced({{"journal", "", 0, true}}, "the journal"); }

Status Leadership::Finish(int code, const std::string& message) {
  nlohmann::json done = {{"code", code}, {"message", message}, {"leader", value_}};
  Status s = Fenced({{"done", done.dump(), 0, false}, {"journal", "", 0, true}}, "the job's end");
  {
    MutexLock g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (keeper_.joinable()) keeper_.join();
  (void)store_.Revoke(lease_);  // else it runs out by itself: a standby sees the end first
  return s;
}

}  // namespace elastic::driver
