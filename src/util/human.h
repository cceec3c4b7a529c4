// Numbers for people: durations and counts in progress lines and tables.
#pragma once
#include <string>

namespace noloco {

// "1h02m", "3m07s", "12s"; "?" for a negative or non-finite value.
std::string format_duration(double seconds);
// "12.3k", "4.56M", "1.20G"
std::string format_count(double n);
// Decimal units to three significant digits: "512 B", "56 MB", "1.11 GB", "0.5 B"
std::string format_bytes(double bytes);

}  // namespace noloco
