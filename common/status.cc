#include "common/status.h"

#include <grpcpp/support/status.h>

namespace elastic {

const char* CodeName(Code code) {
  switch (code) {
    case Code::kOk:
      return "OK";
    case Code::kCancelled:
      return "CANCELLED";
    case Code::kUnknown:
      return "UNKNOWN";
    case Code::kInvalidArgument:
      return "INVALID_ARGUMENT";
    case Code::kDeadlineExceeded:
      return "DEADLINE_EXCEEDED";
    case Code::kNotFound:
      return "NOT_FOUND";
    case Code::kAlreadyExists:
      return "ALREADY_EXISTS";
    case Code::kPermissionDenied:
      return "PERMISSION_DENIED";
    case Code::kResourceExhausted:
      return "RESOURCE_EXHAUSTED";
    case Code::kFailedPrecondition:
      return "FAILED_PRECONDITION";
    case Code::kAborted:
      return "ABORTED";
    case Code::kOutOfRange:
      return "OUT_OF_RANGE";
    case Code::kUnimplemented:
      return "UNIMPLEMENTED";
    case Code::kInternal:
      return "INTERNAL";
    case Code::kUnavailable:
      return "UNAVAILABLE";
    case Code::kDataLoss:
      return "DATA_LOSS";
    case Code::kUnauthenticated:
      return "UNAUTHENTICATED";
  }
  return "UNKNOWN_CODE";
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return std::string(CodeName(code_)) + ": " + message_;
}

Status Status::WithContext(const std::string& context) const {
  if (ok()) return *this;
  return Status(code_, context + ": " + message_);
}

grpc::Status ToGrpc(const Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), status.message());
}

Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return Status::Ok();
  int code = static_cast<int>(status.error_code());
  if (code < 0 || code > static_cast<int>(Code::kUnauthenticated)) code = 2;
  return Status(static_cast<Code>(code), status.error_message());
}

}  // namespace elastic
