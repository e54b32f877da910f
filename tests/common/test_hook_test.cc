// The test hooks (common/test_hook.h) as the worker agent configures them from WorkerOptions:
// a hook fires where its point, slot, round and version match, once; a malformed entry is an
// error naming it, and leaves the hooks as they were.
#include "common/test_hook.h"

#include <catch2/catch.hpp>

#include "common/communicator.h"

namespace elastic {
namespace {

TEST_CASE("a test hook fires once, where point, slot, round and version match", "[unit]") {
  REQUIRE(ConfigureTestHooks("after_save@localhost:1@2+@5=lost;connect@*@*@*=sleep1", "localhost:1")
              .ok());
  SetTestHookRound(1);
  CHECK_NOTHROW(TestHook("after_save", 5));  // round 1 is below 2+
  SetTestHookRound(3);
  CHECK_NOTHROW(TestHook("after_save", 4));   // another version
  CHECK_NOTHROW(TestHook("before_save", 5));  // another point
  CHECK_THROWS_AS(TestHook("after_save", 5), WorkerLostError);
  CHECK_NOTHROW(TestHook("after_save", 5));  // at most once
  CHECK_NOTHROW(TestHook("connect", 0));     // sleeps 1 ms and goes on

  // Another slot's hook never fires here.
  REQUIRE(ConfigureTestHooks("after_save@localhost:0@*@*=lost", "localhost:1").ok());
  CHECK_NOTHROW(TestHook("after_save", 5));
  REQUIRE(ConfigureTestHooks("", "localhost:1").ok());
}

TEST_CASE("a malformed test hook is an error naming it, and changes nothing", "[unit]") {
  REQUIRE(ConfigureTestHooks("after_save@*@*@*=lost", "localhost:0").ok());
  for (const char* bad : {"after_save@*@*=lost", "after_save@*@*@*", "after_save@*@*@*=explode",
                          "after_save@*@*@*=sleep", "after_save@*@*@*=sleep5x",
                          "after_save@*@*@*=sleep99999999999"}) {
    INFO(bad);
    Status s = ConfigureTestHooks(std::string("connect@*@*@*=kill;") + bad, "localhost:0");
    CHECK(s.code() == Code::kInvalidArgument);
    CHECK(s.message().find(std::string("'") + bad + "'") != std::string::npos);
  }
  // The hooks of before the bad specs are still the ones set: the connect=kill never was.
  SetTestHookRound(0);
  CHECK_THROWS_AS(TestHook("after_save", 1), WorkerLostError);
  REQUIRE(ConfigureTestHooks("", "localhost:0").ok());
}

}  // namespace
}  // namespace elastic
