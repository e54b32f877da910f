#!/bin/sh
# Certificates for an etcd over TLS in the tests (openssl's command line, not the product's
# common/tls.cc): DIR/ca.pem, DIR/server.pem and .key for the given IPv4 addresses,
# DIR/client.pem and .key (for etcd's --client-cert-auth), and DIR/other-ca.pem, a CA that
# signed none of them.
#   tests/etcd_tls_certs.sh DIR ADDRESS...
set -eu
dir=$1
shift
mkdir -p "$dir"
cd "$dir"
san=$(for a in "$@"; do printf 'IP:%s,' "$a"; done)
san=${san%,}
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
for ca in ca other-ca; do
  key "$ca.key"
  openssl req -x509 -new -key "$ca.key" -subj "/CN=test etcd $ca" -days 2 -out "$ca.pem" \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign 2>/dev/null
done
sign() {  # NAME CN EXTENSIONS
  key "$1.key"
  openssl req -new -key "$1.key" -subj "/CN=$2" -out "$1.csr" 2>/dev/null
  printf '%s\n' "$3" >"$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 \
    -extfile "$1.ext" -out "$1.pem" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}
sign server "test etcd" "subjectAltName=$san
extendedKeyUsage=serverAuth,clientAuth"
sign client "test etcd client" "extendedKeyUsage=clientAuth"
chmod 600 ./*.key
