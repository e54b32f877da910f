// libFuzzer target: discovery output (host[:slots] lines) and -H lists. Either an error that
// names the problem or a host set within the bounds; never a crash, hang or huge allocation.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "discovery/discovery.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  int default_slots = 1 + data[0] % 8;
  std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  std::vector<std::string> warnings;
  auto lines = elastic::discovery::ParseHostLines(text, default_slots, &warnings);
  if (lines.ok()) {
    for (const auto& h : *lines) {
      if (h.host.empty() || h.slots < 0) std::abort();
    }
  } else if (lines.status().message().empty()) {
    std::abort();  // an error must say what was wrong
  }
  auto list = elastic::discovery::ParseHostList(text, default_slots);
  if (list.ok()) {
    for (const auto& h : *list) {
      if (h.host.empty() || h.slots < 0) std::abort();
    }
  } else if (list.status().message().empty()) {
    std::abort();
  }
  return 0;
}
