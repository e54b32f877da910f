#include "common/tls.h"

#include <openssl/bio.h>
#include <openssl/bn.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <memory>
#include <vector>

#include "common/etcd.h"  // Base64Encode, Base64Decode

namespace elastic {
namespace {

template <typename T, void (*Free)(T*)>
struct Deleter {
  void operator()(T* p) const { Free(p); }
};
using Key = std::unique_ptr<EVP_PKEY, Deleter<EVP_PKEY, EVP_PKEY_free>>;
using Cert = std::unique_ptr<X509, Deleter<X509, X509_free>>;
using Bio = std::unique_ptr<BIO, Deleter<BIO, BIO_free_all>>;

// OpenSSL's reasons for the last failure, oldest first.
Status Failed(const std::string& what) {
  std::string why;
  while (unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof buf);
    why += (why.empty() ? "" : "; ") + std::string(buf);
  }
  return Internal("cannot make the job's TLS credentials: " + what +
                  (why.empty() ? "" : " (" + why + ")"));
}

StatusOr<Key> NewKey() {
  Key key(EVP_EC_gen("P-256"));
  if (!key) return Failed("an ECDSA key");
  return key;
}

bool AddExtension(X509* cert, X509* issuer, int nid, const char* value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value);
  if (!ext) return false;
  bool ok = X509_add_ext(cert, ext, -1) == 1;
  X509_EXTENSION_free(ext);
  return ok;
}

struct Profile {
  const char* common_name;
  bool ca = false;
  const char* usage = nullptr;  // extendedKeyUsage
  const char* alt_name = nullptr;
};

// A certificate for `key`, signed by `issuer_key` (issuer: null for the CA itself).
StatusOr<Cert> Sign(const Profile& p, EVP_PKEY* key, X509* issuer, EVP_PKEY* issuer_key,
                    Duration validity) {
  Cert cert(X509_new());
  if (!cert) return Failed("a certificate");
  unsigned char serial[16];
  if (RAND_bytes(serial, sizeof serial) != 1) return Failed("a serial number");
  serial[0] &= 0x7f;  // positive
  BIGNUM* bn = BN_bin2bn(serial, sizeof serial, nullptr);
  bool ok = bn && BN_to_ASN1_INTEGER(bn, X509_get_serialNumber(cert.get())) != nullptr;
  BN_free(bn);
  const long seconds = static_cast<long>(
      std::chrono::duration_cast<std::chrono::seconds>(validity).count());
  X509_NAME* name = X509_get_subject_name(cert.get());
  ok = ok && X509_set_version(cert.get(), 2) == 1 &&
       X509_gmtime_adj(X509_getm_notBefore(cert.get()), -3600) != nullptr &&
       X509_gmtime_adj(X509_getm_notAfter(cert.get()), seconds) != nullptr &&
       X509_set_pubkey(cert.get(), key) == 1 &&
       X509_NAME_add_entry_by_txt(name, "O", MBSTRING_ASC,
                                  reinterpret_cast<const unsigned char*>("elastic-run job"), -1,
                                  -1, 0) == 1 &&
       X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                                  reinterpret_cast<const unsigned char*>(p.common_name), -1, -1,
                                  0) == 1 &&
       X509_set_issuer_name(cert.get(), issuer ? X509_get_subject_name(issuer) : name) == 1;
  X509* by = issuer ? issuer : cert.get();
  if (ok && p.ca) {
    ok = AddExtension(cert.get(), by, NID_basic_constraints, "critical,CA:TRUE,pathlen:0") &&
         AddExtension(cert.get(), by, NID_key_usage, "critical,keyCertSign,cRLSign") &&
         AddExtension(cert.get(), by, NID_subject_key_identifier, "hash");
  } else if (ok) {
    ok = AddExtension(cert.get(), by, NID_basic_constraints, "critical,CA:FALSE") &&
         AddExtension(cert.get(), by, NID_key_usage, "critical,digitalSignature") &&
         AddExtension(cert.get(), by, NID_ext_key_usage, p.usage) &&
         AddExtension(cert.get(), by, NID_authority_key_identifier, "keyid:always") &&
         (!p.alt_name || AddExtension(cert.get(), by, NID_subject_alt_name, p.alt_name));
  }
  if (!ok) return Failed(std::string("the certificate of ") + p.common_name);
  if (X509_sign(cert.get(), issuer_key, EVP_sha256()) == 0) {
    return Failed(std::string("the signature of ") + p.common_name);
  }
  return cert;
}

StatusOr<std::string> Pem(X509* cert, EVP_PKEY* key) {
  Bio bio(BIO_new(BIO_s_mem()));
  bool ok = bio && (cert ? PEM_write_bio_X509(bio.get(), cert)
                         : PEM_write_bio_PrivateKey(bio.get(), key, nullptr, nullptr, 0,
                                                    nullptr, nullptr)) == 1;
  if (!ok) return Failed("PEM text");
  char* data = nullptr;
  long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(n));
}

}  // namespace

StatusOr<JobCredentials> MakeJobCredentials(Duration validity) {
  ASSIGN_OR_RETURN(Key ca_key, NewKey());
  ASSIGN_OR_RETURN(Cert ca, Sign({"elastic-run job CA", true}, ca_key.get(), nullptr,
                                 ca_key.get(), validity));
  const std::string san = std::string("DNS:") + kTlsServerName;
  JobCredentials out;
  ASSIGN_OR_RETURN(out.server.ca, Pem(ca.get(), nullptr));
  out.client.ca = out.server.ca;
  for (auto [id, profile] :
       {std::pair<TlsIdentity*, Profile>{&out.server,
                                         {kTlsServerName, false, "serverAuth", san.c_str()}},
        std::pair<TlsIdentity*, Profile>{&out.client,
                                         {"elastic-run worker", false, "clientAuth"}}}) {
    ASSIGN_OR_RETURN(Key key, NewKey());
    ASSIGN_OR_RETURN(Cert cert, Sign(profile, key.get(), ca.get(), ca_key.get(), validity));
    ASSIGN_OR_RETURN(id->cert, Pem(cert.get(), nullptr));
    ASSIGN_OR_RETURN(id->key, Pem(nullptr, key.get()));
  }
  return out;
}

std::string EncodeTlsIdentity(const TlsIdentity& id) {
  if (id.empty()) return "";
  return Base64Encode(id.ca + '\0' + id.cert + '\0' + id.key);
}

StatusOr<TlsIdentity> DecodeTlsIdentity(const std::string& line) {
  if (line.size() > kMaxEncodedIdentity) {
    return InvalidArgument("the TLS credentials are " + std::to_string(line.size()) +
                           " bytes, more than the " + std::to_string(kMaxEncodedIdentity) +
                           " allowed");
  }
  TlsIdentity id;
  if (line.empty()) return id;
  auto text = Base64Decode(line);
  if (!text.ok()) return InvalidArgument("the TLS credentials are not base64");
  std::vector<std::string> parts;
  size_t from = 0;
  while (parts.size() < 4) {
    size_t end = text->find('\0', from);
    parts.push_back(text->substr(from, end == std::string::npos ? std::string::npos : end - from));
    if (end == std::string::npos) break;
    from = end + 1;
  }
  if (parts.size() != 3) {
    return InvalidArgument("the TLS credentials hold " + std::to_string(parts.size()) +
                           " parts, not 3 (CA, certificate, key)");
  }
  for (const auto& p : parts) {
    if (!p.empty() && p.rfind("-----BEGIN ", 0) != 0) {
      return InvalidArgument("the TLS credentials hold a part that is not PEM");
    }
  }
  id.ca = parts[0];
  id.cert = parts[1];
  id.key = parts[2];
  return id;
}

}  // namespace elastic
