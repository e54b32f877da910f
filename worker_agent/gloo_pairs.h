// The pairs of a Gloo communicator: their addresses on the wire and their sockets' reset on
// close (worker_agent/gloo_pairs.cc).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <sys/socket.h>

#include "common/status.h"

namespace elastic::worker_agent {

// Finds this process's connected TCP sockets whose peer is one of `peers` or whose own
// address is one of `own`, and makes them close with a reset instead of leaving a minute of
// TIME_WAIT behind (SO_LINGER 0). Returns how many. GlooCommunicator calls it on its pairs.
int ResetPairsOnClose(const std::vector<struct sockaddr_storage>& peers,
                      const std::vector<struct sockaddr_storage>& own);

// What a rank publishes for its peers: for each (peer, address of this rank's pair for it),
// the first address whole and the others as their differences from it (a few bytes each).
std::string EncodeAddresses(const std::vector<std::pair<int, std::vector<char>>>& per_peer);
// A pair's address (Gloo's tcp::Address bytes) with the bytes of its sockaddr_storage that the
// address family does not use zeroed (getsockname leaves them as they were: stack garbage,
// which differs from pair to pair and would defeat EncodeAddresses).
std::vector<char> CanonicalPairAddress(const std::vector<char>& bytes);
// The address that rank `peer` published (`blob`, from EncodeAddresses) for `rank`; an
// INVALID_ARGUMENT that names `peer` when there is none or the blob is malformed.
StatusOr<std::vector<char>> AddressFor(const std::string& blob, int rank, int peer);

}  // namespace elastic::worker_agent
