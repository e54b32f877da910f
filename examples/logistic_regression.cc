// A small real training program: logistic regression on a generated dataset, trained with
// mini-batch gradient descent under elastic-run. Every step consumes one global batch of the
// ElasticSampler's order, split across however many workers there are. Each sample's
// gradient is rounded to fixed point (2^-32) and the sums are exact 64-bit integer sums, so
// the model after each step is bit for bit the same whatever the number of workers and the
// order of the reduction: a sample lost or trained twice changes the final model's hash.
//
//   elastic-run -np 4 build/examples/logistic_regression --epochs 5
//
// Options: --samples N (4096)  --features D (16)  --epochs E (5)  --global-batch G (48)
//          --lr X (0.5)  --commit-every K (4)  --step-ms MS (0)  --ledger PREFIX (none)
//          --leave-exit CODE (0)  --work-ms MS (0)  --final-exit CODE (0)
// --step-ms sleeps MS per step (time, not CPU); --work-ms computes for MS of this thread's CPU
// time per step, so that a worker whose CPU is throttled (a cgroup quota) is slower than its
// peers, as a straggler is (tests/python/test_stragglers.py).
// SIGUSR1 makes a worker leave the job gracefully at its next step: it tells the driver
// (LEAVING) and exits with --leave-exit's code (a negative code: it waits to be killed).
// --final-exit: the status a worker ends with once trained (a negative code -N: it kills
// itself with signal N), for tests of how a job takes a worker that fails at its very end.
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "worker_agent/elastic.h"

namespace {

struct Options {
  int64_t samples = 4096;
  int features = 16;
  int64_t epochs = 5;
  int global_batch = 48;
  double lr = 0.5;
  int commit_every = 4;
  int step_ms = 0;
  int work_ms = 0;
  std::string ledger;
  int leave_exit = 0;
  int final_exit = 0;
};

// Computes for `ms` milliseconds of this thread's CPU time (the result is kept from the
// optimiser by a volatile sink).
void Work(int ms) {
  auto cpu = [] {
    timespec t{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return static_cast<double>(t.tv_sec) * 1e3 + static_cast<double>(t.tv_nsec) / 1e6;
  };
  static volatile double sink = 0;
  const double until = cpu() + ms;
  double x = 1.0;
  while (cpu() < until) {
    for (int i = 0; i < 20000; ++i) x = x * 1.0000001 + 1e-9;
  }
  sink = sink + x;
}

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
    else if (k == "--work-ms")
      o.work_ms = std::atoi(v.c_str());
    else if (k == "--ledger")
      o.ledger = v;
    else if (k == "--leave-exit")
      o.leave_exit = std::atoi(v.c_str());
    else if (k == "--final-exit")
      o.final_exit = std::atoi(v.c_str());
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      std::exit(2);
    }
  }
  if (o.samples < 1 || o.features < 1 || o.global_batch < 1 || o.commit_every < 1 ||
      o.step_ms < 0 || o.work_ms < 0) {
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

constexpr double kFixed = 4294967296.0;  // 2^32: gradients are summed in this fixed point

int64_t ToFixed(double v) { return std::llround(v * kFixed); }

// FNV-1a over the model's bytes: equal hashes mean bitwise-equal models.
uint64_t Hash(const std::vector<double>& model) {
  uint64_t h = 1469598103934665603ull;
  const unsigned char* p = reinterpret_cast<const unsigned char*>(model.data());
  for (size_t i = 0; i < model.size() * sizeof(double); ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

volatile sig_atomic_t g_leave = 0;

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Adds the fixed-point gradient of `batch` (padding has zero weight) into `sums` (D + 1
// components, the loss, the sample count; cleared first). Returns the batch's indices, for the
// ledger.
std::string AddGradients(const Dataset& data, const std::vector<double>& model,
                         const elastic::ElasticSampler::Batch& batch, std::vector<int64_t>* sums) {
  const int D = static_cast<int>(model.size()) - 1;
  std::vector<int64_t>& s = *sums;
  std::fill(s.begin(), s.end(), 0);
  std::string line;
  for (size_t k = 0; k < batch.indices.size(); ++k) {
    if (batch.padding[k]) continue;  // a repeat: zero weight
    int64_t i = batch.indices[k];
    const double* xi = &data.x[i * D];
    double z = model[D];
    for (int j = 0; j < D; ++j) z += model[j] * xi[j];
    double p = 1.0 / (1.0 + std::exp(-z));
    double err = p - data.y[i];
    for (int j = 0; j < D; ++j) s[j] += ToFixed(err * xi[j]);
    s[D] += ToFixed(err);
    s[D + 1] +=
        ToFixed(-(data.y[i] * std::log(p + 1e-12) + (1 - data.y[i]) * std::log(1 - p + 1e-12)));
    s[D + 2] += 1;
    line += (line.empty() ? "" : ",") + std::to_string(i);
  }
  return line;
}

// The full dataset's mean loss under `model`.
double Loss(const Dataset& data, const std::vector<double>& model, int64_t samples) {
  const int D = static_cast<int>(model.size()) - 1;
  double loss = 0;
  for (int64_t i = 0; i < samples; ++i) {
    double z = model[D];
    for (int j = 0; j < D; ++j) z += model[j] * data.x[i * D + j];
    double p = 1.0 / (1.0 + std::exp(-z));
    loss += -(data.y[i] * std::log(p + 1e-12) + (1 - data.y[i]) * std::log(1 - p + 1e-12));
  }
  return loss / samples;
}

// SIGUSR1: this worker leaves the job of its own accord (the job re-forms without it at once),
// then exits with `code` (< 0, for tests: waits to be killed).
[[noreturn]] void Leave(elastic::Agent& agent, int rank, int code, FILE* ledger) {
  std::printf("rank %d (slot %s) leaves the job\n", rank, agent.slot().c_str());
  agent.ReportLeaving("SIGUSR1");
  if (ledger) std::fclose(ledger);
  std::fflush(stdout);
  if (code < 0) pause();
  std::_Exit(code);
}

}  // namespace

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);  // progress lines reach elastic-run as they happen
  Options o = Parse(argc, argv);
  signal(SIGUSR1, [](int) { g_leave = 1; });
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

  // The ledger (for the exactly-once tests): each rank writes the indices of each step before
  // the step's allreduce: "epoch step round rank size time_ms indices". A step that is rolled back
  // and trained again appears again with a newer round, which supersedes the old lines.
  FILE* ledger = nullptr;

  elastic::Run(state, [&](elastic::State&) {
    elastic::Agent& agent = elastic::Init();
    elastic::Communicator& comm = agent.comm();
    if (!o.ledger.empty() && !ledger) {
      std::string slot = agent.slot();
      for (char& c : slot) c = c == ':' ? '_' : c;
      ledger = std::fopen((o.ledger + "." + slot + "." + std::to_string(getpid())).c_str(), "a");
    }
    const int per_rank = (o.global_batch + comm.size() - 1) / comm.size();
    // Fixed-point sums: D + 1 gradient components, the loss, the sample count.
    std::vector<int64_t> sums(D + 3);
    while (epoch < o.epochs) {
      if (g_leave) Leave(agent, comm.rank(), o.leave_exit, ledger);
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
      auto batch = sampler.Next(per_rank, o.global_batch);  // the same steps at any size
      std::string line = AddGradients(data, model, batch, &sums);
      if (ledger) {
        std::fprintf(ledger, "%lld %lld %lld %d %d %lld %s\n", static_cast<long long>(epoch),
                     static_cast<long long>(step + 1), static_cast<long long>(agent.round()),
                     comm.rank(), comm.size(), static_cast<long long>(NowMs()), line.c_str());
        std::fflush(ledger);
      }
      comm.Allreduce(sums.data(), sums.size(), elastic::DataType::kI64, elastic::ReduceOp::kSum);
      const double count = static_cast<double>(sums[D + 2]);
      for (int j = 0; j <= D; ++j) model[j] -= o.lr * (sums[j] / kFixed) / count;
      ++step;
      if (o.step_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(o.step_ms));
      if (o.work_ms > 0) Work(o.work_ms);
      if (step % o.commit_every == 0 || sampler.EpochDone()) state.Commit();
    }
  });
  if (elastic::Init().comm().rank() == 0) {
    std::printf("final: %lld steps, loss %.6f, w[0..3] = %.6f %.6f %.6f %.6f, hash %016llx\n",
                static_cast<long long>(step), Loss(data, model, o.samples), model[0], model[1],
                model[2], model[3], static_cast<unsigned long long>(Hash(model)));
  }
  if (ledger) std::fclose(ledger);
  if (o.final_exit < 0) {
    std::fflush(stdout);
    signal(-o.final_exit, SIG_DFL);
    raise(-o.final_exit);
  }
  return o.final_exit;
}
