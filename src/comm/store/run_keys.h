// Every secret of a run, derived from its token: the token is stretched once
// with Argon2id (a token a user types may be guessable: each guess then costs
// 64 MiB and ~0.1 s), and each purpose gets its own key from that (BLAKE2b,
// keyed). Whatever of them shows on the wire (the run id in message headers,
// the store's key prefix and password on a store without TLS, the store's
// TLS public key) tells nothing about the token or the other keys, short of
// an Argon2id brute force.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace noloco {

// A 32-byte key for `purpose`. Memoized per token in the process.
std::array<uint8_t, 32> run_key(const std::string& token, const std::string& purpose);

// Carried in message headers: tells runs apart.
int64_t run_id_of(const std::string& token);

// What the store sees instead of the token: the prefix of the run's keys,
// and the store's password (hex).
std::string store_key_prefix(const std::string& token);
std::string store_password(const std::string& token);
// The key the live page's URL carries (comm/view/view_server.h), hex.
std::string view_key(const std::string& token);

// The TLS identity of a store that a worker hosts for the run: an Ed25519
// key every worker derives from the token, so that the others pin its public
// key (curl's "sha256//BASE64") and need no certificate authority; and a
// certificate of that key, the same bytes on every worker (fixed serial and
// dates, deterministic signature). The store presents it and takes it as the
// only authority for its clients' certificates (etcd --client-cert-auth);
// a worker presents it too, proving it holds the key, so that a stranger
// never gets past the handshake to etcd's gateway.
struct StoreTlsKey {
  std::string private_key_pem;  // PKCS#8
  std::string pin;              // sha256 of the SubjectPublicKeyInfo, curl's pinned-key form
  std::string certificate_pem;  // X.509, self-signed
  // For a store cluster's members (`noloco serve cluster=`): a certificate
  // of the same key naming every member's IP address, which peers present
  // to each other and check the address they dialed against; the same bytes
  // on every member given the same addresses in the same order.
  std::string peer_certificate_pem;
};
StoreTlsKey store_tls_key(const std::string& token, const std::vector<std::string>& addresses = {});

}  // namespace noloco
