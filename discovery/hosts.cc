#include <algorithm>
#include <cmath>
#include <sstream>

#include "discovery/discovery.h"

namespace elastic::discovery {

bool ValidHostName(const std::string& host) {
  if (host.empty() || host.size() > 253) return false;
  for (char c : host) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '-' || c == '.' || c == '_';
    if (!ok) return false;
  }
  return host.front() != '-' && host.front() != '.';
}

namespace {

std::string Trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t\r");
  return s.substr(b, e - b + 1);
}

Status ParseOne(const std::string& item, int default_slots, HostSlots* out) {
  std::string host = item;
  int slots = default_slots;
  size_t colon = item.rfind(':');
  if (colon != std::string::npos) {
    host = item.substr(0, colon);
    std::string count = item.substr(colon + 1);
    if (count.empty() || count.size() > 5 ||
        !std::all_of(count.begin(), count.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      return InvalidArgument("slot count '" + count + "' is not a number");
    }
    slots = std::stoi(count);
  }
  if (!ValidHostName(host)) {
    return InvalidArgument("'" + host +
                           "' is not a valid host name (letters, digits, '-', '.', '_')");
  }
  if (slots < 1 || slots > kMaxSlotsPerHost) {
    return InvalidArgument("slot count " + std::to_string(slots) + " is outside 1.." +
                           std::to_string(kMaxSlotsPerHost));
  }
  out->host = host;
  out->slots = slots;
  return Status::Ok();
}

void Merge(std::vector<HostSlots>* hosts, const HostSlots& h, std::vector<std::string>* warnings) {
  for (auto& existing : *hosts) {
    if (existing.host == h.host) {
      if (warnings) {
        warnings->push_back("host '" + h.host + "' is listed more than once; using " +
                            std::to_string(h.slots) + " slots");
      }
      existing.slots = h.slots;
      return;
    }
  }
  hosts->push_back(h);
}

}  // namespace

StatusOr<std::vector<HostSlots>> ParseHostLines(const std::string& text, int default_slots,
                                                std::vector<std::string>* warnings) {
  std::vector<HostSlots> hosts;
  std::istringstream in(text);
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    size_t hash = line.find('#');
    std::string item = Trim(hash == std::string::npos ? line : line.substr(0, hash));
    if (item.empty()) continue;
    HostSlots h;
    Status s = ParseOne(item, default_slots, &h);
    if (!s.ok()) {
      std::string shown = line.size() > 80 ? line.substr(0, 80) + "..." : line;
      return InvalidArgument("line " + std::to_string(number) + " ('" + shown +
                             "'): " + s.message());
    }
    Merge(&hosts, h, warnings);
    if (hosts.size() > kMaxHosts) return InvalidArgument("more than 65536 hosts");
  }
  return hosts;
}

StatusOr<std::vector<HostSlots>> ParseHostList(const std::string& list, int default_slots) {
  std::vector<HostSlots> hosts;
  std::stringstream in(list);
  std::string item;
  while (std::getline(in, item, ',')) {
    item = Trim(item);
    HostSlots h;
    Status s = ParseOne(item, default_slots, &h);
    if (!s.ok()) return InvalidArgument("in host list '" + list + "': " + s.message());
    Merge(&hosts, h, nullptr);
  }
  if (hosts.empty()) return InvalidArgument("the host list is empty");
  return hosts;
}

HostTable::HostTable(HostTableOptions options) : options_(options), rng_(options.seed) {}

HostChange HostTable::Update(const std::vector<HostSlots>& listed) {
  HostChange change;
  std::map<std::string, int> now;
  for (const auto& h : listed) now[h.host] = h.slots;
  for (auto& [name, e] : hosts_) {
    if (e.listed && now.count(name) == 0) {
      e.listed = false;
      change.removed.push_back(name);
    }
  }
  for (const auto& h : listed) {
    auto it = hosts_.find(h.host);
    if (it == hosts_.end()) {
      order_.push_back(h.host);
      Entry e;
      e.slots = h.slots;
      e.listed = true;
      hosts_[h.host] = e;
      change.added.push_back(h.host);
      continue;
    }
    Entry& e = it->second;
    if (!e.listed) {
      e.listed = true;
      change.added.push_back(h.host);
    } else if (e.slots != h.slots) {
      change.changed.push_back(h.host);
    }
    e.slots = h.slots;
  }
  return change;
}

bool HostTable::RecordFailure(const std::string& host) {
  auto it = hosts_.find(host);
  if (it == hosts_.end() || options_.failure_limit <= 0) return false;
  Entry& e = it->second;
  if (e.blacklisted && !Blacklisted(host)) e.blacklisted = false;  // cooldown over
  if (++e.failures < options_.failure_limit) return false;
  e.failures = 0;
  e.blacklisted = true;
  ++e.times_blacklisted;
  if (options_.cooldown_max <= Duration::zero()) {
    e.until = TimePoint::max();
    last_cooldown_ = Duration::max();
    return true;
  }
  // Exponential backoff from the range's minimum, capped at its maximum, with jitter.
  double base = std::chrono::duration<double>(options_.cooldown_min).count();
  double cap = std::chrono::duration<double>(options_.cooldown_max).count();
  double backoff = std::min(cap, base * std::pow(2.0, e.times_blacklisted - 1));
  std::uniform_real_distribution<double> jitter(backoff,
                                                std::max(backoff, std::min(cap, backoff * 1.5)));
  double secs = jitter(rng_);
  last_cooldown_ = FromSeconds(secs);
  e.until = options_.clock->Now() + last_cooldown_;
  e.end_told = false;
  return true;
}

bool HostTable::Blacklisted(const std::string& host) const {
  auto it = hosts_.find(host);
  if (it == hosts_.end() || !it->second.blacklisted) return false;
  return it->second.until == TimePoint::max() || options_.clock->Now() < it->second.until;
}

std::vector<HostSlots> HostTable::Available() const {
  std::vector<HostSlots> out;
  for (const auto& name : order_) {
    const Entry& e = hosts_.at(name);
    if (e.listed && !Blacklisted(name)) out.push_back({name, e.slots});
  }
  return out;
}

std::vector<HostSlots> HostTable::AvailableEventually() const {
  std::vector<HostSlots> out;
  for (const auto& name : order_) {
    const Entry& e = hosts_.at(name);
    if (e.listed && !(e.blacklisted && e.until == TimePoint::max())) out.push_back({name, e.slots});
  }
  return out;
}

std::vector<std::pair<std::string, TimePoint>> HostTable::Blacklist() const {
  std::vector<std::pair<std::string, TimePoint>> out;
  for (const auto& name : order_) {
    if (Blacklisted(name)) out.emplace_back(name, hosts_.at(name).until);
  }
  return out;
}

bool HostTable::TakeEndedCooldowns() {
  bool any = false;
  TimePoint now = options_.clock->Now();
  for (auto& [name, e] : hosts_) {
    if (e.blacklisted && !e.end_told && e.until <= now) {
      e.end_told = true;
      any = true;
    }
  }
  return any;
}

TimePoint HostTable::NextCooldownEnd() const {
  TimePoint next = TimePoint::max();
  TimePoint now = options_.clock->Now();
  for (const auto& [name, e] : hosts_) {
    if (e.blacklisted && e.until != TimePoint::max() && e.until > now)
      next = std::min(next, e.until);
  }
  return next;
}

HostTable::State HostTable::state() const {
  State s;
  s.order = order_;
  s.hosts = hosts_;
  std::ostringstream rng;
  rng << rng_;
  s.rng = rng.str();
  s.last_cooldown = last_cooldown_;
  return s;
}

Status HostTable::Restore(const State& s) {
  if (s.order.size() != s.hosts.size()) {
    return InvalidArgument("the host table lists " + std::to_string(s.order.size()) +
                           " host(s) in order but has " + std::to_string(s.hosts.size()) +
                           " entries");
  }
  for (const auto& name : s.order) {
    if (s.hosts.count(name) == 0) return InvalidArgument("host '" + name + "' has no entry");
  }
  std::mt19937_64 rng;
  std::istringstream in(s.rng);
  in >> rng;
  if (in.fail()) return InvalidArgument("the host table's random generator state is not valid");
  order_ = s.order;
  hosts_ = s.hosts;
  rng_ = rng;
  last_cooldown_ = s.last_cooldown;
  return Status::Ok();
}

}  // namespace elastic::discovery
