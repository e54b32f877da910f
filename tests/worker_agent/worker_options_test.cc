// WorkerOptions::FromEnvironment (worker_agent/worker_options.h): every variable parsed once,
// one on/off convention, and an error naming the variable and its value.
#include <cstdlib>
#include <string>

#include <catch2/catch.hpp>

#include "worker_agent/worker_options.h"

namespace elastic {
namespace {

// Sets the required variables (and `extra`), clears every other one FromEnvironment reads,
// and puts the environment back as it was afterwards.
class Environment {
 public:
  Environment() {
    for (size_t i = 0; i < kWorkerVariableCount; ++i) {
      const char* name = kWorkerVariables[i];
      if (const char* v = std::getenv(name)) saved_.emplace_back(name, v);
      unsetenv(name);
    }
    Set("ELASTIC_DRIVER_ADDR", "127.0.0.1:1");
    Set("ELASTIC_JOB_TOKEN", "t");
    Set("ELASTIC_SLOT", "h:3");
  }
  ~Environment() {
    for (size_t i = 0; i < kWorkerVariableCount; ++i) unsetenv(kWorkerVariables[i]);
    for (const auto& [name, value] : saved_) setenv(name.c_str(), value.c_str(), 1);
  }
  void Set(const char* name, const char* value) { setenv(name, value, 1); }

 private:
  std::vector<std::pair<std::string, std::string>> saved_;
};

TEST_CASE("worker options: defaults, and each variable read", "[unit]") {
  Environment env;
  auto o = WorkerOptions::FromEnvironment();
  REQUIRE(o.ok());
  CHECK(o->hostname == "h");  // from the slot
  CHECK_FALSE(o->backend.has_value());
  CHECK(o->shm_allreduce);
  CHECK(o->shm_reuse);
  CHECK(o->gloo_lazy_pairs);
  CHECK_FALSE(o->gloo_full_mesh);
  CHECK_FALSE(o->spare);
  CHECK(o->shm_slot_bytes == 0);
  CHECK(o->checkpoint_dir.empty());

  env.Set("ELASTIC_BACKEND", "gloo");
  env.Set("ELASTIC_SHM_REUSE", "0");
  env.Set("ELASTIC_GLOO_FULL_MESH", "1");
  env.Set("ELASTIC_DRIVER_TIMEOUT", "2.5");
  env.Set("ELASTIC_CHECKPOINT_DIR", "/ck");
  env.Set("ELASTIC_CHECKPOINT_INTERVAL", "30");
  env.Set("ELASTIC_CHECKPOINT_KEEP", "4");
  env.Set("ELASTIC_SHM_SLOT_BYTES", "65536");
  env.Set("ELASTIC_STACK_SIGNAL", "12");
  o = WorkerOptions::FromEnvironment();
  REQUIRE(o.ok());
  CHECK(*o->backend == Backend::kGloo);
  CHECK_FALSE(o->shm_reuse);
  CHECK(o->gloo_full_mesh);
  CHECK(*o->driver_timeout == std::chrono::milliseconds(2500));
  CHECK(o->checkpoint_dir == "/ck");
  CHECK(*o->checkpoint_interval == std::chrono::seconds(30));
  CHECK(*o->checkpoint_keep == 4);
  CHECK(o->shm_slot_bytes == 65536);
  CHECK(o->stack_signal == 12);
}

TEST_CASE("worker options: a bad value is an error naming the variable and the value",
          "[unit]") {
  struct Case {
    const char* name;
    const char* value;
  };
  for (Case c : {Case{"ELASTIC_SHM_REUSE", "yes"}, Case{"ELASTIC_SPARE", "true"},
                 Case{"ELASTIC_GLOO_LAZY_PAIRS", "2"}, Case{"ELASTIC_DRIVER_TIMEOUT", "-1"},
                 Case{"ELASTIC_DRIVER_TIMEOUT", "1e9"}, Case{"ELASTIC_CHECKPOINT_KEEP", "0"},
                 Case{"ELASTIC_CHECKPOINT_KEEP", "2.5"}, Case{"ELASTIC_SHM_SLOT_BYTES", "100"},
                 Case{"ELASTIC_SHM_SLOT_BYTES", "12abc"}, Case{"ELASTIC_STACK_SIGNAL", "65"},
                 Case{"ELASTIC_BACKEND", "mpi"}}) {
    Environment env;
    env.Set(c.name, c.value);
    auto o = WorkerOptions::FromEnvironment();
    INFO(c.name << "=" << c.value);
    REQUIRE_FALSE(o.ok());
    CHECK(o.status().code() == Code::kInvalidArgument);
    CHECK_THAT(o.status().message(), Catch::Contains(c.name));
    if (std::string(c.name) != "ELASTIC_BACKEND") {
      CHECK_THAT(o.status().message(), Catch::Contains(std::string("'") + c.value + "'"));
    }
  }
}

TEST_CASE("worker options: a missing required variable says to run under elastic-run",
          "[unit]") {
  for (const char* name : {"ELASTIC_DRIVER_ADDR", "ELASTIC_JOB_TOKEN", "ELASTIC_SLOT"}) {
    Environment env;
    unsetenv(name);
    auto o = WorkerOptions::FromEnvironment();
    REQUIRE_FALSE(o.ok());
    CHECK_THAT(o.status().message(), Catch::Contains(name));
    CHECK_THAT(o.status().message(), Catch::Contains("elastic-run"));
  }
}

}  // namespace
}  // namespace elastic
