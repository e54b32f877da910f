// The job's own certificate authority (--tls, docs/security.md): made by the driver when a job
// starts, it signs one certificate for the driver and one the workers share. gRPC then runs
// mutual TLS on every control connection: a worker proves it holds the job's client key, the
// driver proves it holds the server key, and nothing (the job token among it) crosses the
// network in clear. The CA's own key is thrown away once both are signed: no one can make a
// third identity for the job.
//
// The driver's certificate names kTlsServerName, not an address: a standby that takes over
// (docs/high-availability.md) presents the same identity from another host.
#pragma once

#include <string>

#include "common/clock.h"
#include "common/status.h"

namespace elastic {

inline constexpr char kTlsServerName[] = "elastic-run-driver";

// One side's credentials, PEM: the CA certificate it trusts, its certificate, its private key.
struct TlsIdentity {
  std::string ca, cert, key;
  bool empty() const { return ca.empty() && cert.empty() && key.empty(); }
};

struct JobCredentials {
  TlsIdentity server;  // the driver's (and a standby's)
  TlsIdentity client;  // every worker's, and `elastic-run status`'s
};

// A fresh CA (ECDSA P-256) and the two identities it signs, valid for `validity` from an hour
// ago (clocks of the hosts differ). INTERNAL with OpenSSL's reason when that fails.
StatusOr<JobCredentials> MakeJobCredentials(Duration validity);

// An identity as one line of text (base64 of its three PEM blocks, any of them empty), for an
// environment variable and the launcher's stdin; and back ("" is the empty identity).
// Decoding is bounded (kMaxEncodedIdentity) and says what is wrong.
inline constexpr size_t kMaxEncodedIdentity = 64 << 10;
std::string EncodeTlsIdentity(const TlsIdentity& id);
StatusOr<TlsIdentity> DecodeTlsIdentity(const std::string& line);

}  // namespace elastic
