// Numbers and text for people: durations and counts in progress lines and
// tables, help text wrapped to the terminal's usual width.
#pragma once
#include <cstddef>
#include <string>

namespace noloco {

// "1h02m", "3m07s", "12s"; "?" for a negative or non-finite value.
std::string format_duration(double seconds);
// "12.3k", "4.56M", "1.20G"
std::string format_count(double n);
// Decimal units to three significant digits: "512 B", "56 MB", "1.11 GB", "0.5 B"
std::string format_bytes(double bytes);
// The words of `text` on lines of at most `width` columns (a longer word
// stands alone); the first line starts with `first`, the others with as many
// spaces. Ends with a newline.
std::string wrap_words(const std::string& first, const std::string& text, size_t width = 100);
// `text` on one line of at most `max_bytes`: each run of line breaks becomes
// " | ", and a cut falls between UTF-8 characters, never inside one.
std::string one_line(const std::string& text, size_t max_bytes);

}  // namespace noloco
