// libFuzzer target: the state a newcomer receives in a sync (ObjectState::Sync on a rank that
// is not the root) and a sampler's committed position (ElasticSampler::Deserialize). The
// bytes come from a communicator that hands out the input (tests/state/input_communicator.h);
// a malformed state must be an exception the recovery loop turns into a failure, never a crash
// or an unbounded allocation.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "state/state.h"
#include "tests/state/input_communicator.h"


extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  elastic::ElasticSampler sampler(1000, true, 7);
  if (size >= 16) {
    elastic::Status s = sampler.Deserialize(std::string(reinterpret_cast<const char*>(data), 16));
    if (s.ok() && (sampler.cursor() < 0 || sampler.cursor() > 1000)) std::abort();
  }
  elastic::ObjectState state;
  int64_t step = 0;
  std::string name;
  std::vector<float> weights(4);
  double tracked[3] = {0, 0, 0};
  state.Register("step", &step);
  state.Register("name", &name);
  state.Register("weights", &weights);
  state.Track("tracked", tracked, sizeof tracked);
  state.AddSampler("sampler", &sampler);
  elastic::testing::InputCommunicator comm(std::string(reinterpret_cast<const char*>(data), size));
  try {
    state.Sync(comm, 0);
  } catch (const std::runtime_error&) {
    // A malformed or truncated state, or the root gone (WorkerLostError): the recovery loop
    // sees a failure. Anything else (std::length_error, std::bad_alloc) is a crash.
  }
  return 0;
}
