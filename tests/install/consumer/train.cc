#include <elastic/elastic.h>

#include <cstdio>
#include <vector>

int main() {
  elastic::ObjectState state;
  std::vector<float> w(1000, 1.0f);
  state.Track("w", w.data(), w.size() * sizeof(float));
  elastic::Run(state, [&](elastic::State&) {
    elastic::Agent& agent = elastic::Init();
    elastic::Communicator& comm = agent.comm();
    comm.Allreduce(w.data(), w.size(), elastic::DataType::kF32, elastic::ReduceOp::kSum);
    state.Commit();
    std::printf("consumer rank %d of %d: w[0] = %.1f (round %lld, slot %s, device comm %s)\n",
                comm.rank(), comm.size(), w[0], static_cast<long long>(agent.round()),
                agent.slot().c_str(), agent.device_comm() ? "yes" : "none");
  });
  return 0;
}
