// The process's Gloo TCP devices, one per address while some communicator uses it
// (worker_agent/gloo_device.cc).
#pragma once

#include <gloo/transport/device.h>
#include <gloo/transport/tcp/attr.h>

#include <memory>
#include <string>

namespace elastic::worker_agent {

struct GlooOptions;

// The device for `attr` (`key` names it), made when no communicator holds one. only_if_new:
// returns nullptr (and makes nothing) when this process made the device of this key before,
// so its address is known to work. Throws for an address it cannot use.
std::shared_ptr<gloo::transport::Device> SharedDevice(const gloo::transport::tcp::attr& attr,
                                                      const std::string& key,
                                                      bool only_if_new = false);
// The device attributes of `options` (interface or host name), and their key.
gloo::transport::tcp::attr DeviceAttr(const GlooOptions& options, std::string* key);
// Drops `device`; when that is its last reference, on a helper thread (common/thread_pool.h).
void ReleaseDevice(std::shared_ptr<gloo::transport::Device> device);

}  // namespace elastic::worker_agent
