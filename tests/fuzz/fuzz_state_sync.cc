// libFuzzer target: the state a newcomer receives in a sync (ObjectState::Sync on a rank that
// is not the root) and a sampler's committed position (ElasticSampler::Deserialize). The
// bytes come from a communicator that hands out the input; a malformed state must be an
// exception the recovery loop turns into a failure, never a crash or an unbounded allocation.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/communicator.h"
#include "state/state.h"

namespace {

class InputCommunicator : public elastic::Communicator {
 public:
  InputCommunicator(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  int rank() const override { return 1; }
  int size() const override { return 2; }
  int local_rank() const override { return 1; }
  int local_size() const override { return 2; }
  int cross_rank() const override { return 0; }
  int cross_size() const override { return 1; }
  void Allreduce(void*, size_t, elastic::DataType, elastic::ReduceOp) override {}
  void AllreduceMany(const std::vector<elastic::TensorView>&, elastic::ReduceOp) override {}
  void Broadcast(void* data, size_t bytes, int) override {
    // The receiver of a broadcast: what the root "sent" is the input; past its end the root
    // is gone, as a collective whose peer died.
    if (bytes > size_ - off_) throw elastic::WorkerLostError("the root is gone");
    std::memcpy(data, data_ + off_, bytes);
    off_ += bytes;
  }
  std::vector<std::vector<char>> Allgather(const void*, size_t) override { return {}; }
  void Barrier() override {}
  void Abort() override {}

 private:
  const uint8_t* data_;
  size_t size_, off_ = 0;
};

}  // namespace

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
  InputCommunicator comm(data, size);
  try {
    state.Sync(comm, 0);
  } catch (const std::runtime_error&) {
    // A malformed or truncated state, or the root gone (WorkerLostError): the recovery loop
    // sees a failure. Anything else (std::length_error, std::bad_alloc) is a crash.
  }
  return 0;
}
