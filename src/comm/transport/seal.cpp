#include "comm/transport/seal.h"

#include <sodium.h>

#include "comm/store/run_keys.h"

namespace noloco {

static_assert(Seal::kOverhead ==
              crypto_aead_xchacha20poly1305_ietf_NPUBBYTES + crypto_aead_xchacha20poly1305_ietf_ABYTES);

// run_key initialises libsodium before the first key exists.
Seal::Seal(const std::string& token) : key_(run_key(token, "payload seal")) {}

void Seal::seal(const uint8_t* plain, size_t n, const std::vector<uint8_t>& context, uint8_t* out) const {
  uint8_t* nonce = out;
  randombytes_buf(nonce, crypto_aead_xchacha20poly1305_ietf_NPUBBYTES);
  crypto_aead_xchacha20poly1305_ietf_encrypt(out + crypto_aead_xchacha20poly1305_ietf_NPUBBYTES, nullptr, plain, n,
                                             context.data(), context.size(), nullptr, nonce, key_.data());
}

bool Seal::open(const uint8_t* sealed, size_t n, const std::vector<uint8_t>& context, uint8_t* out) const {
  const uint8_t* nonce = sealed;
  return crypto_aead_xchacha20poly1305_ietf_decrypt(
             out, nullptr, nullptr, sealed + crypto_aead_xchacha20poly1305_ietf_NPUBBYTES,
             n + crypto_aead_xchacha20poly1305_ietf_ABYTES, context.data(), context.size(), nonce, key_.data()) == 0;
}

std::vector<uint8_t> seal_context(std::initializer_list<int64_t> words) {
  std::vector<uint8_t> bytes;
  bytes.reserve(words.size() * 8);
  for (int64_t w : words)
    for (int i = 0; i < 8; ++i) bytes.push_back(uint8_t(uint64_t(w) >> (8 * i)));
  return bytes;
}

}  // namespace noloco
