// libFuzzer target: the Gloo address blob a peer publishes in the round's store
// (EncodeAddresses / AddressFor). A malformed blob is an INVALID_ARGUMENT naming the peer;
// a well-formed one round-trips.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "worker_agent/gloo_communicator.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  int rank = data[0] % 64, peer = data[1] % 64;
  std::string blob(reinterpret_cast<const char*>(data + 2), size - 2);
  auto got = elastic::worker_agent::AddressFor(blob, rank, peer);
  if (!got.ok() && got.status().message().find(std::to_string(peer)) == std::string::npos) {
    std::abort();  // the error names the peer
  }
  // Round trip: addresses made from the input's bytes come back as they went in.
  std::vector<std::pair<int, std::vector<char>>> per_peer;
  size_t n = 1 + data[2] % 8, len = 1 + data[3] % 160;
  for (size_t i = 0; i < n && (i + 1) * len <= blob.size(); ++i) {
    per_peer.emplace_back(static_cast<int>(i * 3 + 1),
                          std::vector<char>(blob.begin() + i * len, blob.begin() + (i + 1) * len));
  }
  if (per_peer.empty()) return 0;
  std::string encoded = elastic::worker_agent::EncodeAddresses(per_peer);
  for (const auto& [r, bytes] : per_peer) {
    auto back = elastic::worker_agent::AddressFor(encoded, r, 0);
    if (!back.ok() || *back != bytes) std::abort();
  }
  return 0;
}
