// Strict number parsing for every key=value the program reads: the whole text
// must be the number, or std::invalid_argument names the key and the text.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace noloco {

int64_t parse_integer(const std::string& key, const std::string& text);
// Finite only.
double parse_real(const std::string& key, const std::string& text);
// Finite and >= 0.
double parse_non_negative(const std::string& key, const std::string& text);

// A link rate: "10mbit", "100mbit", "1gbit", "500kbit", "1.5mbit" -> bits
// per second, between 100 kbit/s and 100 gbit/s.
double parse_bit_rate(const std::string& key, const std::string& text);

// A size in bytes as Hugging Face writes shard sizes: "2GB" (10^9), "500MB",
// "4GiB" (2^30), "100KB", or a plain byte count; at least 1.
uint64_t parse_byte_size(const std::string& key, const std::string& text);

// "HOST:PORT", or "HOST" alone, split at the last colon: how every address
// the program reads (advertise, a tcp:// store, relays, a serve's cluster
// members) is taken apart.
struct HostPort {
  std::string host;
  std::optional<int> port;  // none: the text has no colon
};
// Throws std::invalid_argument naming `what` and the text where the host is
// empty or the port is not a whole number in [1, max_port].
HostPort parse_host_port(const std::string& what, const std::string& text, int max_port = 65535);

// The entries of a comma-separated list (store URLs, relays), empty ones left out.
std::vector<std::string> comma_separated(const std::string& text);

}  // namespace noloco
