// A small real training program: logistic regression on a generated dataset, trained with
// mini-batch gradient descent under elastic-run. Every step consumes one global batch of the
// ElasticSampler's order, split across however many workers there are; gradients are summed
// with AllreduceMany, so the model after each step does not depend on the number of workers.
//
//   elastic-run -np 4 build/examples/logistic_regression --epochs 5
//
// Options: --samples N (4096)  --features D (16)  --epochs E (5)  --global-batch G (48)
//          --lr X (0.5)  --commit-every K (4)  --step-ms MS (0)  --ledger PREFIX (none)
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "state/state.h"
#include "worker_agent/worker_agent.h"

namespace {

struct Options {
  int64_t samples = 4096;
  int features = 16;
  int64_t epochs = 5;
  int global_batch = 48;
  double lr = 0.5;
  int commit_every = 4;
  int step_ms = 0;
  std::string ledger;
};

Options Parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--samples")
      o.samples = std::atoll(v.c_str());
    else if (k == "--features")
      o.features = std::atoi(v.c_str());
    else if (k == "--epochs")
      o.epochs = std::atoll(v.c_str());
    else if (k == "--global-batch")
      o.global_batch = std::atoi(v.c_str());
    else if (k == "--lr")
      o.lr = std::atof(v.c_str());
    else if (k == "--commit-every")
      o.commit_every = std::atoi(v.c_str());
    else if (k == "--step-ms")
      o.step_ms = std::atoi(v.c_str());
    else if (k == "--ledger")
      o.ledger = v;
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      std::exit(2);
    }
  }
  if (o.samples < 1 || o.features < 1 || o.global_batch < 1 || o.commit_every < 1) {
    std::fprintf(stderr, "options must be positive\n");
    std::exit(2);
  }
  return o;
}

// The dataset: x ~ N(0, 1), labels from a fixed true model plus noise. Same on every worker.
struct Dataset {
  std::vector<double> x;  // samples * features
  std::vector<double> y;
};

Dataset Generate(const Options& o) {
  std::mt19937_64 rng(1234);
  auto uniform = [&rng] { return (static_cast<double>(rng() >> 11) + 0.5) / 9007199254740992.0; };
  auto normal = [&] {
    return std::sqrt(-2 * std::log(uniform())) * std::cos(6.283185307179586 * uniform());
  };
  std::vector<double> w_true(o.features);
  for (int j = 0; j < o.features; ++j) w_true[j] = (j % 2 ? 1.0 : -1.0) * (1.0 + j % 3);
  Dataset d;
  d.x.resize(static_cast<size_t>(o.samples) * o.features);
  d.y.resize(static_cast<size_t>(o.samples));
  for (int64_t i = 0; i < o.samples; ++i) {
    double z = 0.3;
    for (int j = 0; j < o.features; ++j) {
      double v = normal();
      d.x[i * o.features + j] = v;
      z += v * w_true[j] * 0.5;
    }
    d.y[i] = uniform() < 1.0 / (1.0 + std::exp(-z)) ? 1.0 : 0.0;
  }
  return d;
}

}  // namespace

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);  // progress lines reach elastic-run as they happen
  Options o = Parse(argc, argv);
  Dataset data = Generate(o);
  const int D = o.features;

  elastic::ObjectState state;
  std::vector<double> model(D + 1, 0.0);  // weights, then bias
  int64_t step = 0, epoch = 0;
  elastic::ElasticSampler sampler(o.samples, /*shuffle=*/true, /*seed=*/42);
  state.Track("model", model.data(), model.size() * sizeof(double));
  state.Register("step", &step);
  state.Register("epoch", &epoch);
  state.AddSampler("sampler", &sampler);

  // The ledger (for the exactly-once test): each rank writes the indices of each step before
  // the step's allreduce, tagged with epoch, step and round. A step that is rolled back and
  // trained again appears again with a newer round, which supersedes the old lines.
  FILE* ledger = nullptr;

  elastic::Run(state, [&](elastic::State&) {
    elastic::Agent& agent = elastic::Init();
    elastic::Communicator& comm = agent.comm();
    if (!o.ledger.empty() && !ledger) {
      std::string slot = agent.env().slot;
      for (char& c : slot) c = c == ':' ? '_' : c;
      ledger = std::fopen((o.ledger + "." + slot + "." + std::to_string(getpid())).c_str(), "a");
    }
    const int per_rank = (o.global_batch + comm.size() - 1) / comm.size();
    std::vector<double> grad(D + 1), stats(2);  // stats: loss sum, sample count
    while (epoch < o.epochs) {
      if (sampler.EpochDone()) {
        if (comm.rank() == 0) {
          std::printf("epoch %lld done: step %lld, %d workers\n", static_cast<long long>(epoch),
                      static_cast<long long>(step), comm.size());
        }
        ++epoch;
        sampler.SetEpoch(epoch);
        state.Commit();
        continue;
      }
      auto batch = sampler.Next(per_rank);
      std::fill(grad.begin(), grad.end(), 0.0);
      std::fill(stats.begin(), stats.end(), 0.0);
      std::string line;
      for (size_t k = 0; k < batch.indices.size(); ++k) {
        if (batch.padding[k]) continue;  // a repeat: zero weight
        int64_t i = batch.indices[k];
        const double* xi = &data.x[i * D];
        double z = model[D];
        for (int j = 0; j < D; ++j) z += model[j] * xi[j];
        double p = 1.0 / (1.0 + std::exp(-z));
        double err = p - data.y[i];
        for (int j = 0; j < D; ++j) grad[j] += err * xi[j];
        grad[D] += err;
        stats[0] += -(data.y[i] * std::log(p + 1e-12) + (1 - data.y[i]) * std::log(1 - p + 1e-12));
        stats[1] += 1;
        line += (line.empty() ? "" : ",") + std::to_string(i);
      }
      if (ledger) {
        std::fprintf(ledger, "%lld %lld %lld %d %s\n", static_cast<long long>(epoch),
                     static_cast<long long>(step + 1),
                     static_cast<long long>(agent.assignment().round), comm.rank(), line.c_str());
        std::fflush(ledger);
      }
      comm.AllreduceMany({{grad.data(), grad.size(), elastic::DataType::kF64},
                          {stats.data(), stats.size(), elastic::DataType::kF64}},
                         elastic::ReduceOp::kSum);
      for (int j = 0; j <= D; ++j) model[j] -= o.lr * grad[j] / stats[1];
      ++step;
      if (o.step_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(o.step_ms));
      if (step % o.commit_every == 0 || sampler.EpochDone()) state.Commit();
    }
  });
  if (elastic::Init().comm().rank() == 0) {
    // Full-dataset loss of the final model.
    double loss = 0;
    for (int64_t i = 0; i < o.samples; ++i) {
      double z = model[D];
      for (int j = 0; j < D; ++j) z += model[j] * data.x[i * D + j];
      double p = 1.0 / (1.0 + std::exp(-z));
      loss += -(data.y[i] * std::log(p + 1e-12) + (1 - data.y[i]) * std::log(1 - p + 1e-12));
    }
    std::printf("final: %lld steps, loss %.6f, w[0..3] = %.6f %.6f %.6f %.6f\n",
                static_cast<long long>(step), loss / o.samples, model[0], model[1], model[2],
                model[3]);
  }
  if (ledger) std::fclose(ledger);
  return 0;
}
