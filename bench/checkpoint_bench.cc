// Checkpoints of a large tracked state (state/checkpoint.h), each figure beside its anchor in
// the same run, alternating repeats, medians:
//
//   1. write throughput: WriteCheckpoint of the state against `dd if=/dev/zero bs=8M
//      conv=fsync` of the same size into the same folder;
//   2. the training thread's pause: how long handing a checkpoint to the writer takes
//      (CheckpointFiles + Submit), and the commit right after it against a commit without
//      one in flight;
//   3. steps per second of a training loop (a pass over the state per step, a commit every
//      --commit-every steps) with a checkpoint every --interval seconds against none.
//
//   build/bench/checkpoint_bench [--gib 1] [--dir /var/tmp] [--repeats 3] [--seconds 30]
//                                [--interval 10] [--commit-every 5]
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "state/checkpoint.h"
#include "state/state.h"

namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct Options {
  double gib = 1;
  std::string dir = "/var/tmp";
  int repeats = 3;
  double seconds = 30;
  double interval = 10;
  int commit_every = 5;
};

// A step: one pass over the state (what a real step's compute touches), a checksum that keeps
// the compiler honest.
uint64_t Step(std::vector<uint64_t>& w, uint64_t k) {
  uint64_t sum = 0;
  for (size_t i = 0; i < w.size(); i += 8) {
    w[i] += k;
    sum += w[i];
  }
  return sum;
}

}  // namespace

// 1. Write throughput, alternating with dd. False when a write failed.
bool MeasureWrite(const Options& o, elastic::ObjectState& state, const std::string& folder,
                  size_t bytes) {
  std::vector<double> ours, dd;
  for (int r = 0; r < o.repeats; ++r) {
    elastic::CheckpointInfo meta;
    meta.version = state.version() + r;
    auto t0 = Clock::now();
    elastic::CheckpointInfo written;
    elastic::Status s = elastic::WriteCheckpoint(folder, meta, state.CheckpointFiles(), 1, &written);
    if (!s.ok()) {
      std::fprintf(stderr, "write failed: %s\n", s.message().c_str());
      return false;
    }
    ours.push_back(Since(t0));
    std::string cmd = "dd if=/dev/zero of=" + folder + "/dd.bin bs=8M count=" +
                      std::to_string(bytes >> 23) + " conv=fsync status=none";
    t0 = Clock::now();
    if (std::system(cmd.c_str()) != 0) return false;
    dd.push_back(Since(t0));
    unlink((folder + "/dd.bin").c_str());
  }
  double gb = static_cast<double>(bytes) / (1u << 30);
  std::printf("write: checkpoint %.3f s (%.2f GiB/s), dd conv=fsync %.3f s (%.2f GiB/s): %.2fx\n",
              Median(ours), gb / Median(ours), Median(dd), gb / Median(dd),
              Median(dd) / Median(ours));

  return true;
}

// 2. The pause: hand-off, and the commit right after it against one without a write running.
void MeasurePause(const Options& o, elastic::ObjectState& state, std::vector<uint64_t>& w,
                  const std::string& folder) {
  std::vector<double> handoff, commit_during, commit_plain;
  {
    elastic::Checkpointer::Options co;
    co.dir = folder;
    co.interval = std::chrono::duration<double>(0);
    co.keep = 1;
    elastic::Checkpointer writer(co, nullptr);
    for (int r = 0; r < o.repeats; ++r) {
      auto t0 = Clock::now();
      state.Commit();
      commit_plain.push_back(Since(t0));
      elastic::CheckpointInfo meta;
      meta.version = state.version();
      t0 = Clock::now();
      auto files = state.CheckpointFiles();
      writer.Submit(meta, std::move(files));
      handoff.push_back(Since(t0));
      Step(w, 1);
      t0 = Clock::now();
      state.Commit();  // the writer still holds the last version: this one goes to the other buffer
      commit_during.push_back(Since(t0));
      writer.Wait(std::chrono::seconds(600));
    }
  }
  std::printf("pause: hand-off median %.3f ms, max %.3f ms; a commit while a checkpoint is "
              "written %.1f ms against %.1f ms without (medians)\n",
              Median(handoff) * 1e3, *std::max_element(handoff.begin(), handoff.end()) * 1e3,
              Median(commit_during) * 1e3, Median(commit_plain) * 1e3);
}

// 3. Steps per second, alternating: none, then every --interval.
void MeasureSteps(const Options& o, elastic::ObjectState& state, std::vector<uint64_t>& w,
                  const std::string& folder) {
  std::vector<double> with, without;
  uint64_t sink = 0;
  for (int r = 0; r < 2 * o.repeats; ++r) {
    bool ckpt = r % 2 == 1;
    elastic::Checkpointer::Options co;
    co.dir = folder;
    co.interval = std::chrono::duration<double>(o.interval);
    co.keep = 1;
    int written = 0;
    elastic::Checkpointer writer(co, [&](const elastic::Status&, const elastic::CheckpointInfo&,
                                         double) { ++written; });
    auto t0 = Clock::now();
    int64_t steps = 0;
    while (Since(t0) < o.seconds) {
      sink += Step(w, static_cast<uint64_t>(steps));
      ++steps;
      if (steps % o.commit_every == 0) {
        state.Commit();
        if (ckpt && writer.Due()) {
          elastic::CheckpointInfo meta;
          meta.version = state.version();
          writer.Submit(meta, state.CheckpointFiles());
        }
      }
    }
    double rate = static_cast<double>(steps) / Since(t0);
    writer.Wait(std::chrono::seconds(600));
    (ckpt ? with : without).push_back(rate);
    std::printf("  run %d: %s: %.2f steps/s%s\n", r, ckpt ? "checkpoints" : "none", rate,
                ckpt ? (" (" + std::to_string(written) + " written)").c_str() : "");
  }
  std::printf("steps/s: with a checkpoint every %.0f s %.2f, without %.2f: %.3fx (sink %llu)\n",
              o.interval, Median(with), Median(without), Median(with) / Median(without),
              static_cast<unsigned long long>(sink % 10));
}

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--gib")
      o.gib = std::atof(v.c_str());
    else if (k == "--dir")
      o.dir = v;
    else if (k == "--repeats")
      o.repeats = std::atoi(v.c_str());
    else if (k == "--seconds")
      o.seconds = std::atof(v.c_str());
    else if (k == "--interval")
      o.interval = std::atof(v.c_str());
    else if (k == "--commit-every")
      o.commit_every = std::atoi(v.c_str());
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  const size_t bytes = static_cast<size_t>(o.gib * (1u << 30));
  std::string folder = o.dir + "/elastic-ckpt-bench-" + std::to_string(getpid());
  std::vector<uint64_t> w(bytes / 8);
  for (size_t i = 0; i < w.size(); ++i) w[i] = i * 0x9E3779B97F4A7C15ull;
  elastic::ObjectState state;
  state.Track("w", w.data(), w.size() * 8);
  int64_t step = 0;
  state.Register("step", &step);
  state.PrepareCheckpoints();
  state.Commit();
  std::printf("checkpoint_bench: %.2f GiB tracked state, folder %s, %d repeats\n", o.gib,
              o.dir.c_str(), o.repeats);

  if (!MeasureWrite(o, state, folder, bytes)) return 1;
  MeasurePause(o, state, w, folder);
  MeasureSteps(o, state, w, folder);
  std::system(("rm -rf '" + folder + "'").c_str());
  return 0;
}
