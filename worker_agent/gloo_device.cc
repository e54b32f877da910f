#include "worker_agent/gloo_device.h"

#include <gloo/transport/tcp/device.h>

#include <map>
#include <mutex>

#include "common/mutex.h"
#include "common/thread_pool.h"
#include "worker_agent/gloo_communicator.h"

namespace elastic::worker_agent {

// One Gloo TCP device per address while some communicator of the process uses it: a device is
// an epoll loop thread that wakes every 10 ms (Debian's Gloo) as long as it lives. A recovery
// whose new round connects no pairs (one host, shared memory, no state sync) then has none
// ticking, and a waiting worker wakes only for its own work. Building a device costs a thread
// start; destroying one joins that thread (up to a tick), so the last holder hands it to
// ReleaseDevice, which destroys it on a helper thread, off the round's path.
//
// only_if_new: returns nullptr (and makes nothing) when this process made the device of this
// key before, so its address is known to work.
std::shared_ptr<gloo::transport::Device> SharedDevice(const gloo::transport::tcp::attr& attr,
                                                      const std::string& key,
                                                      bool only_if_new) {
  static auto* mu = new Mutex();  // never destroyed: helper threads outlive main()
  static auto* devices = new std::map<std::string, std::weak_ptr<gloo::transport::Device>>();
  MutexLock g(*mu);
  auto it = devices->find(key);
  if (only_if_new && it != devices->end()) return nullptr;
  std::shared_ptr<gloo::transport::Device> d;
  if (it != devices->end()) d = it->second.lock();
  if (!d) {
    d = gloo::transport::tcp::CreateDevice(attr);  // throws for an address it cannot use
    (*devices)[key] = d;
  }
  return d;
}

gloo::transport::tcp::attr DeviceAttr(const GlooOptions& options, std::string* key) {
  gloo::transport::tcp::attr attr;
  if (!options.iface.empty()) {
    attr.iface = options.iface;
    *key = "iface " + attr.iface;
  } else {
    attr.hostname = options.hostname.empty() ? "127.0.0.1" : options.hostname;
    *key = "host " + attr.hostname;
  }
  return attr;
}

// Drops `device`; when that is its last reference, on a pool thread: destroying a device joins
// its loop thread, which takes up to a tick (10 ms) and sat on the path of every recovery.
void ReleaseDevice(std::shared_ptr<gloo::transport::Device> device) {
  if (!device || device.use_count() > 1) return;
  auto holder = std::make_shared<std::shared_ptr<gloo::transport::Device>>(std::move(device));
  PostToHelpers(1, [holder] { holder->reset(); });
}

}  // namespace elastic::worker_agent
