// The wire's enums and the core's, mapped value by value (rendezvous/convert.cc): every value
// the .proto declares (but KIND_UNSPECIFIED) has its own, both ways, and a value this version
// does not know is refused rather than cast.
#include <catch2/catch.hpp>

#include <set>

#include "rendezvous/convert.h"

namespace elastic::rendezvous {
namespace {

// Every value of the wire's enum `Wire` (but `unspecified`) maps to one of ours and back, no
// two to the same one of ours.
template <typename Wire>
void CheckEveryKind(const google::protobuf::EnumDescriptor* d, Wire unspecified) {
  std::set<int> ours;
  for (int i = 0; i < d->value_count(); ++i) {
    auto wire = static_cast<Wire>(d->value(i)->number());
    auto kind = FromProto(wire);
    if (wire == unspecified) {
      CHECK_FALSE(kind.has_value());
      continue;
    }
    INFO(d->value(i)->name());
    REQUIRE(kind.has_value());
    CHECK(ToProto(*kind) == wire);
    ours.insert(static_cast<int>(*kind));
  }
  CHECK(ours.size() == static_cast<size_t>(d->value_count() - 1));
  CHECK_FALSE(FromProto(static_cast<Wire>(99)).has_value());
}

TEST_CASE("convert: every event kind of the wire maps to one of ours and back", "[unit]") {
  CheckEveryKind(v1::Event::Kind_descriptor(), v1::Event::KIND_UNSPECIFIED);
  v1::Event e;
  e.set_kind(static_cast<v1::Event::Kind>(99));
  Event out;
  CHECK_FALSE(FromProto(e, &out));
}

TEST_CASE("convert: every report kind of the wire maps to one of ours and back", "[unit]") {
  CheckEveryKind(v1::ReportRequest::Kind_descriptor(), v1::ReportRequest::KIND_UNSPECIFIED);
  v1::ReportRequest r;
  r.set_kind(static_cast<v1::ReportRequest::Kind>(42));
  Report out;
  CHECK_FALSE(FromProto(r, &out));
  r.set_kind(v1::ReportRequest::RESTORED);
  REQUIRE(FromProto(r, &out));
  CHECK(out.kind == ReportKind::kRestored);
}

}  // namespace
}  // namespace elastic::rendezvous
