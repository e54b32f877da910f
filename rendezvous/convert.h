// Conversions between the wire messages and the core's plain structs (private to rendezvous/).
#pragma once

#include "proto/elastic.pb.h"
#include "rendezvous/types.h"

namespace elastic::rendezvous {

void ToProto(const Assignment& a, v1::Assignment* out);
Assignment FromProto(const v1::Assignment& a);
void ToProto(const Event& e, v1::Event* out);
Event FromProto(const v1::Event& e);
void ToProto(const Report& r, v1::ReportRequest* out);
// Returns false when the kind is unknown.
bool FromProto(const v1::ReportRequest& r, Report* out);

}  // namespace elastic::rendezvous
