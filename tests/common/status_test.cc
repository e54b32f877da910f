#include <grpcpp/support/status.h>

#include <catch2/catch.hpp>

#include "common/common.h"

namespace elastic {
namespace {

StatusOr<int> ParsePositive(int v) {
  if (v <= 0) return InvalidArgument("not positive: " + std::to_string(v));
  return v;
}

Status Doubled(int v, int* out) {
  ASSIGN_OR_RETURN(int x, ParsePositive(v));
  *out = 2 * x;
  return Status::Ok();
}

Status Chain(int v) {
  int out = 0;
  RETURN_IF_ERROR(Doubled(v, &out));
  return Status::Ok();
}

TEST_CASE("Status carries code and message", "[unit]") {
  Status ok;
  CHECK(ok.ok());
  CHECK(ok.ToString() == "OK");
  Status bad = NotFound("no such key 'x'");
  CHECK_FALSE(bad.ok());
  CHECK(bad.code() == Code::kNotFound);
  CHECK(bad.ToString() == "NOT_FOUND: no such key 'x'");
  CHECK(bad.WithContext("Get").message() == "Get: no such key 'x'");
}

TEST_CASE("StatusOr and the macros propagate errors", "[unit]") {
  int out = 0;
  CHECK(Doubled(21, &out).ok());
  CHECK(out == 42);
  Status s = Chain(-1);
  CHECK(s.code() == Code::kInvalidArgument);
  CHECK(s.message() == "not positive: -1");
  StatusOr<std::string> v = std::string("hi");
  REQUIRE(v.ok());
  CHECK(*v == "hi");
  CHECK(v->size() == 2);
}

TEST_CASE("Status converts to and from grpc::Status", "[unit]") {
  auto code = GENERATE(Code::kOk, Code::kUnauthenticated, Code::kDeadlineExceeded,
                       Code::kResourceExhausted, Code::kUnavailable);
  Status s = code == Code::kOk ? Status::Ok() : Status(code, "why");
  grpc::Status g = ToGrpc(s);
  CHECK(static_cast<int>(g.error_code()) == static_cast<int>(code));
  CHECK(FromGrpc(g) == s);
}

TEST_CASE("InitLogging rejects an unknown level", "[unit]") {
  CHECK(InitLogging("debug", "test").ok());
  Status s = InitLogging("loud", "test");
  CHECK(s.code() == Code::kInvalidArgument);
  CHECK(s.message().find("loud") != std::string::npos);
  CHECK(InitLogging("warn", "test").ok());
}

}  // namespace
}  // namespace elastic
