#include <elastic/elastic.h>

#include <cstdio>
#include <vector>

int main() {
  elastic::ObjectState state;
  std::vector<float> w(1000, 1.0f);
  state.Track("w", w.data(), w.size() * sizeof(float));
  elastic::Run(state, [&](elastic::State&) {
    elastic::Communicator& comm = elastic::Init().comm();
    comm.Allreduce(w.data(), w.size(), elastic::DataType::kF32, elastic::ReduceOp::kSum);
    state.Commit();
    std::printf("consumer rank %d of %d: w[0] = %.1f\n", comm.rank(), comm.size(), w[0]);
  });
  return 0;
}
