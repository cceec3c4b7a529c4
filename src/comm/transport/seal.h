// Authenticated encryption of payloads on the wire (libsodium's
// XChaCha20-Poly1305): nobody on the path can read a payload, and a payload
// changed on the way, sealed under another key, or moved to another place in
// the run (another exchange, step, message, sender or receiver: all of
// it is bound in as associated data) fails to open and is never used.
//
// The key is derived from the run's token (comm/store/run_keys.h). Nonces are 24 random bytes drawn for every message: with 192 bits two
// messages share one with probability ~2^-100 after 2^46 messages, across
// workers, restarts and resumes alike, with no counter that a restart or a
// resume from an older checkpoint could bring back.
//
// Torch-free: it works on byte spans, and its open() takes untrusted bytes.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace noloco {

class Seal {
 public:
  // Bytes a sealed payload carries beyond the plain one: the nonce and the tag.
  static constexpr size_t kOverhead = 24 + 16;

  // The run's payload key, derived from its token.
  explicit Seal(const std::string& token);

  // Writes `plain` (n bytes), sealed, to `out` (n + kOverhead bytes);
  // `context` (any bytes) must be given identically to open().
  void seal(const uint8_t* plain, size_t n, const std::vector<uint8_t>& context, uint8_t* out) const;
  // Opens `sealed` (n + kOverhead bytes) into `out` (n bytes); false, with
  // `out` left unspecified, if it fails authentication.
  bool open(const uint8_t* sealed, size_t n, const std::vector<uint8_t>& context, uint8_t* out) const;

 private:
  std::array<uint8_t, 32> key_{};
};

// What a sealed message is bound to, as associated data: 64-bit words, little-endian.
std::vector<uint8_t> seal_context(std::initializer_list<int64_t> words);

}  // namespace noloco
