// Conversions between the wire messages and the core's plain structs (private to rendezvous/).
#pragma once

#include <optional>

#include "proto/elastic.pb.h"
#include "rendezvous/types.h"

namespace elastic::rendezvous {

void ToProto(const Assignment& a, v1::Assignment* out);
Assignment FromProto(const v1::Assignment& a);
// The kinds, value by value (nullopt: a wire value this version does not know, or
// KIND_UNSPECIFIED).
v1::Event::Kind ToProto(EventKind k);
std::optional<EventKind> FromProto(v1::Event::Kind k);
v1::ReportRequest::Kind ToProto(ReportKind k);
std::optional<ReportKind> FromProto(v1::ReportRequest::Kind k);
void ToProto(const Event& e, v1::Event* out);
// Returns false when the kind is unknown.
bool FromProto(const v1::Event& e, Event* out);
void ToProto(const Report& r, v1::ReportRequest* out);
// Returns false when the kind is unknown.
bool FromProto(const v1::ReportRequest& r, Report* out);

}  // namespace elastic::rendezvous
