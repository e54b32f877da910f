#include "common/test_hook.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "common/communicator.h"
#include "common/mutex.h"

namespace elastic {
namespace {

struct Hook {
  std::string point, slot, round, version, action;
  bool fired = false;
};

std::atomic<int64_t> g_round{-1};
Mutex g_mu;
std::vector<Hook>* const g_hooks ELASTIC_PT_GUARDED_BY(g_mu) =
    new std::vector<Hook>();  // never freed
std::string* const g_slot ELASTIC_PT_GUARDED_BY(g_mu) = new std::string();

bool KnownAction(const std::string& a) {
  if (a == "kill" || a == "lost" || a == "stop") return true;
  // sleepMS: 1 to 9 digits (the sleep is capped at 60 s when it fires).
  if (a.compare(0, 5, "sleep") != 0 || a.size() == 5 || a.size() > 5 + 9) return false;
  return std::all_of(a.begin() + 5, a.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// "*": anything; "N+": a number N or above; else the value itself.
bool Matches(const std::string& pattern, const std::string& value) {
  if (pattern == "*" || pattern == value) return true;
  if (pattern.size() < 2 || pattern.back() != '+') return false;
  char* end = nullptr;
  long long low = std::strtoll(pattern.c_str(), &end, 10);
  if (end != pattern.c_str() + pattern.size() - 1) return false;
  long long v = std::strtoll(value.c_str(), &end, 10);
  return end != value.c_str() && *end == '\0' && v >= low;
}

}  // namespace

Status ConfigureTestHooks(const std::string& spec, const std::string& slot) {
  std::vector<Hook> hooks;
  std::stringstream all(spec);
  std::string item;
  while (std::getline(all, item, ';')) {
    if (item.empty()) continue;
    const size_t eq = item.rfind('=');
    Hook h;
    std::vector<std::string> parts;
    if (eq != std::string::npos) {
      h.action = item.substr(eq + 1);
      std::stringstream fields(item.substr(0, eq));
      std::string f;
      while (std::getline(fields, f, '@')) parts.push_back(f);
    }
    if (parts.size() != 4 || !KnownAction(h.action)) {
      return InvalidArgument("ELASTIC_TEST_HOOKS='" + spec + "' is not valid: entry '" + item +
                             "' is not POINT@SLOT@ROUND@VERSION=kill|lost|stop|sleepMS "
                             "(docs/testing.md)");
    }
    h.point = parts[0];
    h.slot = parts[1];
    h.round = parts[2];
    h.version = parts[3];
    hooks.push_back(std::move(h));
  }
  MutexLock g(g_mu);
  *g_hooks = std::move(hooks);
  *g_slot = slot;
  return Status::Ok();
}

void SetTestHookRound(int64_t round) { g_round.store(round); }

void TestHook(const char* point, int64_t version) {
  std::string action;
  {
    MutexLock g(g_mu);
    if (g_hooks->empty()) return;
    for (Hook& h : *g_hooks) {
      if (h.fired || h.point != point || !Matches(h.slot, *g_slot) ||
          !Matches(h.round, std::to_string(g_round.load())) ||
          !Matches(h.version, std::to_string(version))) {
        continue;
      }
      h.fired = true;
      action = h.action;
      break;
    }
  }
  if (action.empty()) return;
  std::string msg = std::string("test hook ") + point + " fired: " + action + "\n";
  ssize_t ignored = write(2, msg.data(), msg.size());
  (void)ignored;
  if (action == "kill") {
    kill(getpid(), SIGKILL);
    pause();
  }
  if (action == "lost") throw WorkerLostError(std::string("test hook at ") + point);
  if (action == "stop") kill(getpid(), SIGSTOP);  // a hung worker, until a SIGCONT or SIGKILL
  // sleepMS: a slow worker there (it goes on by itself); at most 60 s.
  if (action.compare(0, 5, "sleep") == 0) {
    int ms = std::atoi(action.c_str() + 5);
    if (ms > 0) usleep(static_cast<useconds_t>(std::min(ms, 60000)) * 1000);
  }
}

}  // namespace elastic
