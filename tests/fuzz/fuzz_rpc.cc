// libFuzzer target: what a client sends the driver, as the wire carries it. Each request
// message of the Rendezvous service parsed from the input, converted to the core's structs
// (rendezvous/convert.h) and back: no crash, and what converts back parses again.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "proto/elastic.pb.h"
#include "rendezvous/convert.h"

namespace v1 = elastic::v1;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t kind = data[0] % 4;
  const void* body = data + 1;
  const int len = static_cast<int>(size - 1);
  switch (kind) {
    case 0: {
      v1::ReportRequest req;
      if (!req.ParseFromArray(body, len)) return 0;
      elastic::rendezvous::Report r;
      if (elastic::rendezvous::FromProto(req, &r)) {
        v1::ReportRequest back;
        elastic::rendezvous::ToProto(r, &back);
        std::string wire = back.SerializeAsString();
        v1::ReportRequest again;
        if (!again.ParseFromString(wire)) std::abort();
      }
      break;
    }
    case 1: {
      v1::Assignment a;
      if (!a.ParseFromArray(body, len)) return 0;
      v1::Assignment back;
      elastic::rendezvous::ToProto(elastic::rendezvous::FromProto(a), &back);
      if (back.rank() != a.rank() || back.round() != a.round()) std::abort();
      break;
    }
    case 2: {
      v1::Event e;
      if (!e.ParseFromArray(body, len)) return 0;
      elastic::rendezvous::Event ours;
      if (!elastic::rendezvous::FromProto(e, &ours)) break;
      v1::Event back;
      elastic::rendezvous::ToProto(ours, &back);
      if (back.round() != e.round() || back.message() != e.message() || back.kind() != e.kind()) {
        std::abort();
      }
      break;
    }
    default: {
      // The other requests reach the service's handlers, which bound every size: parsing
      // must never crash whatever the bytes.
      v1::JoinRequest j;
      (void)j.ParseFromArray(body, len);
      v1::SetRequest s;
      (void)s.ParseFromArray(body, len);
      v1::GetRequest g;
      (void)g.ParseFromArray(body, len);
      break;
    }
  }
  return 0;
}
