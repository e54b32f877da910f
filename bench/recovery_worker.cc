// The training program of recovery_bench, scale_bench and spares_bench: allreduce steps on a
// model of argv[2] floats (default 4 Mi: 16 MiB), a commit after every step, until the file
// named by argv[1] exists; argv[3], when given, is a start-up delay in seconds (what importing
// torch and building a model cost a real worker), slept before it joins (every rank stops after the same step: the
// ranks agree on it with a max-allreduce). Rank 0 prints JSON lines with wall-clock
// timestamps: {"event": "train_start"|"step", "round": R, "size": N, "ts": T}.
#include <sys/stat.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "worker_agent/elastic.h"

using namespace elastic;

namespace {
double Now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}
}  // namespace

int main(int argc, char** argv) {
  std::string stop_file = argc > 1 ? argv[1] : "/nonexistent";
  ObjectState state;
  const size_t floats = argc > 2 ? std::stoul(argv[2]) : 4u << 20;
  if (argc > 3) std::this_thread::sleep_for(std::chrono::duration<double>(std::stod(argv[3])));
  std::vector<float> model(floats, 0.0f);
  std::vector<float> grad(model.size());
  int64_t step = 0;
  state.Track("model", model.data(), model.size() * sizeof(float));
  state.Register("step", &step);
  Run(state, [&](State&) {
    Agent& agent = Init();
    Communicator& c = agent.comm();
    if (c.rank() == 0) {
      std::printf("{\"event\": \"train_start\", \"round\": %lld, \"size\": %d, \"ts\": %.6f}\n",
                  static_cast<long long>(agent.round()), c.size(), Now());
      std::fflush(stdout);
    }
    struct stat st;
    while (true) {
      float stop = stat(stop_file.c_str(), &st) == 0 ? 1.0f : 0.0f;
      c.Allreduce(&stop, 1, DataType::kF32, ReduceOp::kMax);
      if (stop > 0) break;
      std::fill(grad.begin(), grad.end(), 1.0f);
      c.Allreduce(grad.data(), grad.size(), DataType::kF32, ReduceOp::kAvg);
      for (size_t i = 0; i < model.size(); i += 1024) model[i] -= 0.01f * grad[i];
      ++step;
      if (c.rank() == 0) {
        std::printf("{\"event\": \"step\", \"round\": %lld, \"size\": %d, \"ts\": %.6f}\n",
                    static_cast<long long>(agent.round()), c.size(), Now());
        std::fflush(stdout);
      }
      state.Commit();
    }
  });
  return 0;
}
