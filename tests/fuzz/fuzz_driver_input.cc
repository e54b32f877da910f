// libFuzzer target: the driver's other outside input: the job file `elastic-run status` reads,
// --launcher-template (expanded around the remote script), --driver-address, --state-store's
// URL and the base64 of etcd's answers.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/etcd.h"
#include "driver/launch.h"
#include "driver/monitor.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  auto job = elastic::driver::ParseJobFile(text);
  if (job.ok() && (job->address.empty() || job->token.empty())) std::abort();
  (void)elastic::driver::CheckDriverAddress(text);
  // An accepted --state-store names 1-16 endpoints of HOST:PORT and a non-empty prefix.
  auto url = elastic::ParseEtcdUrl(text);
  if (url.ok() && (url->endpoints.empty() || url->endpoints.size() > 16 ||
                   url->prefix.size() < 2 || url->prefix[0] != '/' ||
                   url->prefix.back() == '/')) {
    std::abort();
  }
  // Base64: whatever decodes re-encodes to a text that decodes to the same bytes.
  auto bytes = elastic::Base64Decode(text);
  if (bytes.ok()) {
    auto again = elastic::Base64Decode(elastic::Base64Encode(*bytes));
    if (!again.ok() || *again != *bytes) std::abort();
  }
  // Split: template | host | command.
  size_t a = text.find('\x01'), b = a == std::string::npos ? a : text.find('\x01', a + 1);
  std::string tmpl = text.substr(0, a);
  std::string host = a == std::string::npos ? "h" : text.substr(a + 1, b - a - 1);
  std::string command = b == std::string::npos ? "c" : text.substr(b + 1);
  std::string out = elastic::driver::ExpandTemplate(tmpl, host, command);
  // One pass: the output is the template with each placeholder replaced, so its size is known.
  size_t hosts = 0, commands = 0;
  for (size_t i = 0; i < tmpl.size();) {
    if (tmpl.compare(i, 6, "{host}") == 0) {
      ++hosts;
      i += 6;
    } else if (tmpl.compare(i, 9, "{command}") == 0) {
      ++commands;
      i += 9;
    } else {
      ++i;
    }
  }
  if (out.size() != tmpl.size() - 6 * hosts - 9 * commands + hosts * host.size() +
                        commands * command.size()) {
    std::abort();
  }
  (void)elastic::driver::CheckTemplate(tmpl);
  (void)elastic::driver::RemoteScript("/" + host, {{"K", command}}, {command, host}, 2);
  // A remote launch's stderr line: a header is only ever taken whole, with a sane pid, group
  // and an absolute folder of one word.
  auto header = elastic::driver::ParseRemoteHeader(text);
  if (header.ok() && (header->pid <= 1 || (header->group != header->pid &&
                                           header->group != -header->pid) ||
                      header->dir.empty() || header->dir[0] != '/' ||
                      header->dir.find(' ') != std::string::npos)) {
    std::abort();
  }
  return 0;
}
