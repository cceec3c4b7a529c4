// File helpers with the error handling every reader and writer needs.
#pragma once
#include <string>
#include <string_view>

#include <nlohmann/json_fwd.hpp>

namespace noloco {

// Whole file as bytes; throws std::runtime_error naming the path.
std::string read_file(const std::string& path);
// Writes to a temporary file beside `path`, fsyncs, then renames over it, so a
// crash leaves either the old file or the new one, never a torn one. `mode`:
// the new file's permissions (0600 for a secret), less the umask.
void write_file_atomic(const std::string& path, std::string_view bytes, unsigned mode = 0644);
nlohmann::json read_json(const std::string& path);
bool file_exists(const std::string& path);
bool ends_with(std::string_view text, std::string_view suffix);
void write_json_atomic(const std::string& path, const nlohmann::json& j);

}  // namespace noloco
