// A communicator for tests and fuzzers of what a rank receives: rank 1 of 2, whose every
// broadcast delivers the next bytes of a fixed input (what "the root sent"); past the input's
// end the root is gone (WorkerLostError, as a collective whose peer died). Other collectives
// do nothing.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/communicator.h"

namespace elastic::testing {

class InputCommunicator : public Communicator {
 public:
  explicit InputCommunicator(std::string input) : input_(std::move(input)) {}
  int rank() const override { return 1; }
  int size() const override { return 2; }
  int local_rank() const override { return 1; }
  int local_size() const override { return 2; }
  int cross_rank() const override { return 0; }
  int cross_size() const override { return 1; }
  void Allreduce(void*, size_t, DataType, ReduceOp) override {}
  void AllreduceMany(const std::vector<TensorView>&, ReduceOp) override {}
  void Broadcast(void* data, size_t bytes, int) override {
    if (bytes > input_.size() - off_) throw WorkerLostError("the root is gone");
    std::memcpy(data, input_.data() + off_, bytes);
    off_ += bytes;
  }
  std::vector<std::vector<char>> Allgather(const void*, size_t) override { return {}; }
  void Barrier() override {}
  void Abort() override {}

 private:
  std::string input_;
  size_t off_ = 0;
};

}  // namespace elastic::testing
