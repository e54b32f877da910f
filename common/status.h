// Status and StatusOr<T>: how every fallible function across a module boundary reports failure.
// Codes are gRPC's, so a Status crosses the wire unchanged (see ToGrpc/FromGrpc).
#pragma once

#include <cassert>
#include <optional>
#include <string>
#include <utility>

namespace grpc {
class Status;
}

namespace elastic {

// Same numeric values as grpc::StatusCode.
enum class Code : int {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
  kUnauthenticated = 16,
};

const char* CodeName(Code code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  // "CODE_NAME: message", or "OK".
  std::string ToString() const;
  // Returns a copy whose message is "context: message".
  Status WithContext(const std::string& context) const;

  bool operator==(const Status& other) const {
    return code_ == other.code_ && message_ == other.message_;
  }

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string m) {
  return Status(Code::kInvalidArgument, std::move(m));
}
inline Status NotFound(std::string m) { return Status(Code::kNotFound, std::move(m)); }
inline Status FailedPrecondition(std::string m) {
  return Status(Code::kFailedPrecondition, std::move(m));
}
inline Status DeadlineExceeded(std::string m) {
  return Status(Code::kDeadlineExceeded, std::move(m));
}
inline Status Unavailable(std::string m) { return Status(Code::kUnavailable, std::move(m)); }
inline Status Internal(std::string m) { return Status(Code::kInternal, std::move(m)); }
inline Status ResourceExhausted(std::string m) {
  return Status(Code::kResourceExhausted, std::move(m));
}
inline Status PermissionDenied(std::string m) {
  return Status(Code::kPermissionDenied, std::move(m));
}
inline Status Cancelled(std::string m) { return Status(Code::kCancelled, std::move(m)); }
inline Status Aborted(std::string m) { return Status(Code::kAborted, std::move(m)); }
inline Status Unauthenticated(std::string m) {
  return Status(Code::kUnauthenticated, std::move(m));
}

// Holds either a value or a non-OK Status. Accessing value() of an error is a programmer error.
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(const Status& status) : status_(status) {  // NOLINT: implicit by design
    assert(!status_.ok() && "StatusOr built from an OK Status without a value");
    if (status_.ok()) status_ = Internal("StatusOr constructed from OK status without a value");
  }
  StatusOr(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  T& value() & {
    assert(ok());
    return *value_;
  }
  const T& value() const& {
    assert(ok());
    return *value_;
  }
  T&& value() && {
    assert(ok());
    return std::move(*value_);
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  Status status_;
  std::optional<T> value_;
};

// Conversion to and from gRPC's Status (defined in grpc_status.cc; links gRPC).
grpc::Status ToGrpc(const Status& status);
Status FromGrpc(const grpc::Status& status);

}  // namespace elastic

#define ELASTIC_CONCAT_INNER(a, b) a##b
#define ELASTIC_CONCAT(a, b) ELASTIC_CONCAT_INNER(a, b)

#define RETURN_IF_ERROR(expr)                          \
  do {                                                 \
    ::elastic::Status _elastic_status = (expr);        \
    if (!_elastic_status.ok()) return _elastic_status; \
  } while (0)

#define ELASTIC_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return tmp.status();                 \
  lhs = std::move(tmp).value()

#define ASSIGN_OR_RETURN(lhs, expr) \
  ELASTIC_ASSIGN_OR_RETURN_IMPL(ELASTIC_CONCAT(_elastic_statusor_, __LINE__), lhs, expr)
