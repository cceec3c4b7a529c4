#include "comm/store/run_keys.h"

#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <vector>

#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sodium.h>

namespace noloco {

namespace {

void sodium_once() {
  if (sodium_init() < 0) throw std::runtime_error("libsodium could not initialise");
}

std::array<uint8_t, 32> master_key(const std::string& token) {
  static std::mutex mutex;
  static std::map<std::string, std::array<uint8_t, 32>> keys;
  std::lock_guard<std::mutex> lock(mutex);
  if (const auto it = keys.find(token); it != keys.end()) return it->second;
  sodium_once();
  // Argon2id wants a salt; a run has nothing but its token, so the salt names
  // the scheme: another program stretching the same token gets another key.
  std::array<uint8_t, crypto_pwhash_SALTBYTES> salt{};
  const std::string scheme = "noloco run keys v1";
  crypto_generichash(salt.data(), salt.size(), reinterpret_cast<const uint8_t*>(scheme.data()), scheme.size(),
                     nullptr, 0);
  std::array<uint8_t, 32> key{};
  if (crypto_pwhash(key.data(), key.size(), token.data(), token.size(), salt.data(), crypto_pwhash_OPSLIMIT_INTERACTIVE,
                    crypto_pwhash_MEMLIMIT_INTERACTIVE, crypto_pwhash_ALG_ARGON2ID13) != 0)
    throw std::runtime_error("deriving the run's keys ran out of memory (Argon2id needs 64 MiB)");
  keys.emplace(token, key);
  return key;
}

std::string hex(const uint8_t* bytes, size_t n) {
  std::string out(2 * n + 1, '\0');
  sodium_bin2hex(out.data(), out.size(), bytes, n);
  out.pop_back();
  return out;
}

std::string base64(const std::vector<uint8_t>& bytes) {
  std::string out(sodium_base64_ENCODED_LEN(bytes.size(), sodium_base64_VARIANT_ORIGINAL), '\0');
  sodium_bin2base64(out.data(), out.size(), bytes.data(), bytes.size(), sodium_base64_VARIANT_ORIGINAL);
  out.resize(out.find('\0'));
  return out;
}

// The store's certificate, made by OpenSSL from the derived key: the same
// bytes wherever it is made, so that no worker needs the host's copy.
std::string self_signed_certificate(const std::array<uint8_t, 32>& seed, const std::vector<std::string>& addresses) {
  const auto fail = [](const char* what) {
    return std::runtime_error(std::string("could not make the store's TLS certificate: ") + what);
  };
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(
      EVP_PKEY_new_raw_private_key(EVP_PKEY_ED25519, nullptr, seed.data(), seed.size()), EVP_PKEY_free);
  std::unique_ptr<X509, decltype(&X509_free)> cert(X509_new(), X509_free);
  if (!key || !cert) throw fail("out of memory");
  // Named by an organisation, not a common name: etcd would take a client
  // certificate's common name for a user, and its JSON gateway refuses those.
  X509_NAME* name = X509_get_subject_name(cert.get());
  std::unique_ptr<X509_EXTENSION, decltype(&X509_EXTENSION_free)> ca(
      X509V3_EXT_conf_nid(nullptr, nullptr, NID_basic_constraints, "critical,CA:TRUE"), X509_EXTENSION_free);
  // Peers of a store cluster check the address they dialed against these.
  if (!addresses.empty()) {
    std::string names;
    for (const auto& a : addresses) names += (names.empty() ? "IP:" : ",IP:") + a;
    std::unique_ptr<X509_EXTENSION, decltype(&X509_EXTENSION_free)> alt(
        X509V3_EXT_conf_nid(nullptr, nullptr, NID_subject_alt_name, names.c_str()), X509_EXTENSION_free);
    if (!alt || X509_add_ext(cert.get(), alt.get(), -1) != 1) throw fail("an address it names is not an IP address");
  }
  const bool made =
      X509_set_version(cert.get(), 2) == 1 && ASN1_INTEGER_set(X509_get_serialNumber(cert.get()), 1) == 1 &&
      ASN1_TIME_set_string_X509(X509_getm_notBefore(cert.get()), "20000101000000Z") == 1 &&
      ASN1_TIME_set_string_X509(X509_getm_notAfter(cert.get()), "99991231235959Z") == 1 &&  // RFC 5280: no end
      X509_NAME_add_entry_by_txt(name, "O", MBSTRING_ASC, reinterpret_cast<const unsigned char*>("noloco run store"),
                                 -1, -1, 0) == 1 &&
      X509_set_issuer_name(cert.get(), name) == 1 && X509_set_pubkey(cert.get(), key.get()) == 1 && ca &&
      X509_add_ext(cert.get(), ca.get(), -1) == 1 && X509_sign(cert.get(), key.get(), nullptr) > 0;
  if (!made) throw fail("OpenSSL refused a step");
  std::unique_ptr<BIO, decltype(&BIO_free)> out(BIO_new(BIO_s_mem()), BIO_free);
  if (!out || PEM_write_bio_X509(out.get(), cert.get()) != 1) throw fail("PEM encoding");
  char* pem = nullptr;
  const long n = BIO_get_mem_data(out.get(), &pem);
  return std::string(pem, size_t(n));
}

}  // namespace

std::array<uint8_t, 32> run_key(const std::string& token, const std::string& purpose) {
  const auto master = master_key(token);
  std::array<uint8_t, 32> key{};
  crypto_generichash(key.data(), key.size(), reinterpret_cast<const uint8_t*>(purpose.data()), purpose.size(),
                     master.data(), master.size());
  return key;
}

int64_t run_id_of(const std::string& token) {
  const auto key = run_key(token, "run id");
  uint64_t id = 0;
  for (int i = 0; i < 8; ++i) id |= uint64_t(key[size_t(i)]) << (8 * i);
  return int64_t(id & 0x7fffffffffffffffull);
}

std::string store_key_prefix(const std::string& token) {
  const auto key = run_key(token, "store key prefix");
  return hex(key.data(), 16);
}

std::string store_password(const std::string& token) {
  const auto key = run_key(token, "store password");
  return hex(key.data(), 16);
}

std::string view_key(const std::string& token) {
  const auto key = run_key(token, "live view");
  return hex(key.data(), key.size());
}

StoreTlsKey store_tls_key(const std::string& token, const std::vector<std::string>& addresses) {
  const auto seed = run_key(token, "store tls key");
  std::array<uint8_t, crypto_sign_PUBLICKEYBYTES> pk{};
  std::array<uint8_t, crypto_sign_SECRETKEYBYTES> sk{};
  crypto_sign_seed_keypair(pk.data(), sk.data(), seed.data());
  sodium_memzero(sk.data(), sk.size());
  // DER prefixes of RFC 8410: a PKCS#8 Ed25519 private key, and a SubjectPublicKeyInfo.
  std::vector<uint8_t> pkcs8 = {0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20};
  pkcs8.insert(pkcs8.end(), seed.begin(), seed.end());
  std::vector<uint8_t> spki = {0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00};
  spki.insert(spki.end(), pk.begin(), pk.end());
  std::vector<uint8_t> digest(crypto_hash_sha256_BYTES);
  crypto_hash_sha256(digest.data(), spki.data(), spki.size());
  StoreTlsKey out;
  out.private_key_pem = "-----BEGIN PRIVATE KEY-----\n" + base64(pkcs8) + "\n-----END PRIVATE KEY-----\n";
  out.pin = "sha256//" + base64(digest);
  out.certificate_pem = self_signed_certificate(seed, {});
  if (!addresses.empty()) out.peer_certificate_pem = self_signed_certificate(seed, addresses);
  return out;
}

}  // namespace noloco
