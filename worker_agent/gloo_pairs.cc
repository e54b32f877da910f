// The pairs of a Gloo communicator: their addresses on the wire (EncodeAddresses, AddressFor)
// and their sockets' reset on close (ResetPairsOnClose).
#include "worker_agent/gloo_pairs.h"

#include <gloo/transport/tcp/address.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstdlib>
#include <cstring>

namespace elastic::worker_agent {

// A rank's pairs all listen on the same device, so their addresses differ in a few bytes (the
// port and the sequence number): the first address goes out whole and each one after it as
// the bytes where it differs from the first. At 1024 ranks that is ~12 bytes per pair instead
// of 148, and the rendezvous server relays ~7 MiB instead of ~52 MiB per round.
//
//   "GA1" | base length (u32) | base | count (u32) |
//   count x [ peer (i32) | n (u16) | n x (offset (u16), byte) ]      n == 0xFFFF: whole address
//                                                                     follows (u32 length, bytes)
std::string EncodeAddresses(const std::vector<std::pair<int, std::vector<char>>>& per_peer) {
  auto put = [](std::string& out, auto v) {
    out.append(reinterpret_cast<const char*>(&v), sizeof v);
  };
  const std::vector<char> empty;
  const std::vector<char>& base = per_peer.empty() ? empty : per_peer.front().second;
  std::string out = "GA1";
  put(out, static_cast<uint32_t>(base.size()));
  out.append(base.data(), base.size());
  put(out, static_cast<uint32_t>(per_peer.size()));
  for (const auto& [peer, a] : per_peer) {
    put(out, static_cast<int32_t>(peer));
    std::string diffs;
    uint16_t n = 0;
    bool whole = a.size() != base.size() || a.size() > 0xFFFF;
    for (size_t i = 0; !whole && i < a.size(); ++i) {
      if (a[i] == base[i]) continue;
      if (++n == 0xFFFF) whole = true;
      put(diffs, static_cast<uint16_t>(i));
      diffs.push_back(a[i]);
    }
    if (whole) {
      put(out, static_cast<uint16_t>(0xFFFF));
      put(out, static_cast<uint32_t>(a.size()));
      out.append(a.data(), a.size());
    } else {
      put(out, n);
      out += diffs;
    }
  }
  return out;
}

std::vector<char> CanonicalPairAddress(const std::vector<char>& bytes) {
  gloo::transport::tcp::Address a(bytes);
  const sockaddr_storage& ss = a.getSockaddr();
  sockaddr_storage clean{};
  size_t len = ss.ss_family == AF_INET6 ? sizeof(sockaddr_in6)
               : ss.ss_family == AF_INET ? sizeof(sockaddr_in)
                                         : sizeof(sockaddr_storage);
  std::memcpy(&clean, &ss, len);
  return gloo::transport::tcp::Address(clean, a.getSeq()).bytes();
}

StatusOr<std::vector<char>> AddressFor(const std::string& blob, int rank, int peer) {
  size_t off = 0;
  auto get = [&](auto* v) {
    if (blob.size() - off < sizeof *v) return false;
    std::memcpy(v, blob.data() + off, sizeof *v);
    off += sizeof *v;
    return true;
  };
  auto bad = [&](const std::string& what) {
    return InvalidArgument("the addresses published by rank " + std::to_string(peer) +
                           " are malformed (" + what + ", " + std::to_string(blob.size()) +
                           " bytes)");
  };
  if (blob.compare(0, 3, "GA1") != 0) return bad("no GA1 header");
  off = 3;
  uint32_t base_len = 0, count = 0;
  if (!get(&base_len) || blob.size() - off < base_len) return bad("truncated first address");
  std::vector<char> base(blob.data() + off, blob.data() + off + base_len);
  off += base_len;
  if (!get(&count)) return bad("no count");
  for (uint32_t k = 0; k < count; ++k) {
    int32_t r = -1;
    uint16_t n = 0;
    if (!get(&r) || !get(&n)) return bad("truncated entry");
    if (n == 0xFFFF) {
      uint32_t len = 0;
      if (!get(&len) || blob.size() - off < len) return bad("truncated whole address");
      if (r == rank) return std::vector<char>(blob.data() + off, blob.data() + off + len);
      off += len;
      continue;
    }
    if (blob.size() - off < n * size_t{3}) return bad("truncated differences");
    if (r != rank) {
      off += n * size_t{3};
      continue;
    }
    std::vector<char> a = base;
    for (uint16_t d = 0; d < n; ++d) {
      uint16_t at = 0;
      get(&at);
      if (at >= a.size()) return bad("difference past the address");
      a[at] = blob[off++];
    }
    return a;
  }
  return InvalidArgument("rank " + std::to_string(peer) + " published no address for rank " +
                         std::to_string(rank));
}

namespace {

// Whether two socket addresses are the same IP address and port.
bool SameEndpoint(const sockaddr_storage& a, const sockaddr_storage& b) {
  if (a.ss_family != b.ss_family) return false;
  if (a.ss_family == AF_INET) {
    const auto& x = reinterpret_cast<const sockaddr_in&>(a);
    const auto& y = reinterpret_cast<const sockaddr_in&>(b);
    return x.sin_port == y.sin_port && x.sin_addr.s_addr == y.sin_addr.s_addr;
  }
  if (a.ss_family == AF_INET6) {
    const auto& x = reinterpret_cast<const sockaddr_in6&>(a);
    const auto& y = reinterpret_cast<const sockaddr_in6&>(b);
    return x.sin6_port == y.sin6_port &&
           std::memcmp(&x.sin6_addr, &y.sin6_addr, sizeof x.sin6_addr) == 0;
  }
  return false;
}

}  // namespace

// Gloo closes a pair with a FIN, and the side that closes first keeps the connection in
// TIME_WAIT for a minute. A job whose rounds change often (every recovery closes every
// pair) fills the ephemeral port range with them, and each new pair's listening socket then
// has to search that range for a free port (bind to port 0): at 128 local ranks, with 10k
// such sockets left by earlier rounds, a round change took 1-2 s instead of 0.4 s, most of it
// in the kernel. Gloo does not expose its sockets, so this process's connected TCP sockets
// are matched by address, once the pairs are connected: those to a peer's pair address (this
// side connected) and those on one of this rank's own pair addresses (it accepted). They
// close with a reset (SO_LINGER 0) instead: nothing is in flight when a communicator goes.
int ResetPairsOnClose(const std::vector<sockaddr_storage>& peers,
                      const std::vector<sockaddr_storage>& own) {
  DIR* dir = opendir("/proc/self/fd");
  if (!dir) return 0;
  const int dir_fd = dirfd(dir);
  int found = 0;
  while (dirent* e = readdir(dir)) {
    char* end = nullptr;
    long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == dir_fd) continue;
    sockaddr_storage local{}, remote{};
    socklen_t len = sizeof local;
    if (getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&local), &len) != 0) {
      continue;  // not a socket
    }
    if (local.ss_family != AF_INET && local.ss_family != AF_INET6) continue;
    len = sizeof remote;
    if (getpeername(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&remote), &len) != 0) {
      continue;  // not connected (a listening socket)
    }
    bool pair = false;
    for (const auto& a : peers) pair = pair || SameEndpoint(remote, a);
    for (const auto& a : own) pair = pair || SameEndpoint(local, a);
    if (!pair) continue;
    linger l{1, 0};
    if (setsockopt(static_cast<int>(fd), SOL_SOCKET, SO_LINGER, &l, sizeof l) == 0) ++found;
  }
  closedir(dir);
  return found;
}

}  // namespace elastic::worker_agent
