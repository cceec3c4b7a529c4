// The files the live page is made of, compiled into the binary
// (cmake/embed_files.cmake): the page itself, and the charting library from
// Debian's libjs-dygraphs (MIT) with its copyright file. Nothing is fetched
// from elsewhere: the page works where the run has no internet.
#pragma once
#include <cstddef>
#include <vector>

namespace noloco {

struct ViewAsset {
  const char* path;  // the URL path it is served at
  const char* type;  // its MIME type
  const unsigned char* data;
  size_t size;
};
const std::vector<ViewAsset>& view_assets();

}  // namespace noloco
