// A worker program for the end-to-end tests of elastic-run. Usage: test_worker MODE [ARGS]
//   collectives        every collective, dtype and op; prints "collectives ok rank R of N"
//   exit CODE RANK     rank RANK exits with CODE after the round forms, the others exit 0
//   sleep              prints "sleeping pid P" and sleeps until killed
//   print LINES        prints LINES numbered lines on stdout and stderr as fast as it can
//   lost               allreduce in a loop; rank N-1 prints its pid and waits to be killed;
//                      the others print "lost detected rank R" on WorkerLostError, join the
//                      next round and exit 0
//   big                64 MiB allreduces in a loop; each rank prints "looping rank R pid P";
//                      on WorkerLostError prints "lost detected rank R", re-forms, exits 0
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "worker_agent/worker_agent.h"

using namespace elastic;

namespace {

uint16_t ToHalf(float f) {  // exact for the small integers used here
  int e;
  float m = std::frexp(f, &e);
  return static_cast<uint16_t>(((e - 1 + 15) << 10) | std::lround((m * 2 - 1) * 1024));
}
double FromHalf(uint16_t h) {
  return std::ldexp(1.0 + (h & 0x3ff) / 1024.0, ((h >> 10) & 0x1f) - 15);
}
uint16_t ToBf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return static_cast<uint16_t>(b >> 16);
}
double FromBf16(uint16_t h) {
  uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

int Collectives(Communicator& c) {
  for (DataType dt : {DataType::kF32, DataType::kF64, DataType::kI32, DataType::kI64}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax}) {
      std::vector<double> want(100);
      std::vector<char> buf(100 * DataTypeSize(dt));
      for (int i = 0; i < 100; ++i) {
        double v = c.rank() + 1 + i % 3;
        switch (dt) {
          case DataType::kF32:
            reinterpret_cast<float*>(buf.data())[i] = static_cast<float>(v);
            break;
          case DataType::kF64:
            reinterpret_cast<double*>(buf.data())[i] = v;
            break;
          case DataType::kI32:
            reinterpret_cast<int32_t*>(buf.data())[i] = static_cast<int32_t>(v);
            break;
          default:
            reinterpret_cast<int64_t*>(buf.data())[i] = static_cast<int64_t>(v);
            break;
        }
        double n = c.size(), base = 1 + i % 3;
        double sum = n * base + n * (n - 1) / 2;
        want[i] = op == ReduceOp::kSum   ? sum
                  : op == ReduceOp::kAvg ? sum / n
                  : op == ReduceOp::kMin ? base
                                         : base + n - 1;
        if (op == ReduceOp::kAvg && (dt == DataType::kI32 || dt == DataType::kI64)) {
          want[i] = static_cast<double>(static_cast<int64_t>(sum) / c.size());
        }
      }
      c.Allreduce(buf.data(), 100, dt, op);
      for (int i = 0; i < 100; ++i) {
        double got = dt == DataType::kF32   ? reinterpret_cast<float*>(buf.data())[i]
                     : dt == DataType::kF64 ? reinterpret_cast<double*>(buf.data())[i]
                     : dt == DataType::kI32
                         ? reinterpret_cast<int32_t*>(buf.data())[i]
                         : static_cast<double>(reinterpret_cast<int64_t*>(buf.data())[i]);
        if (std::abs(got - want[i]) > 1e-4) {
          std::fprintf(stderr, "mismatch %s %s [%d]: %f != %f\n", DataTypeName(dt),
                       ReduceOpName(op), i, got, want[i]);
          return 1;
        }
      }
    }
  }
  // 16-bit floats: small integers are exact in both formats.
  for (DataType dt : {DataType::kF16, DataType::kBF16}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax}) {
      float v = static_cast<float>(2 * (c.rank() + 1));
      std::vector<uint16_t> buf(64, dt == DataType::kF16 ? ToHalf(v) : ToBf16(v));
      c.Allreduce(buf.data(), buf.size(), dt, op);
      double n = c.size();
      double want = op == ReduceOp::kSum   ? n * (n + 1)
                    : op == ReduceOp::kAvg ? n + 1
                    : op == ReduceOp::kMin ? 2
                                           : 2 * n;
      double got = dt == DataType::kF16 ? FromHalf(buf[63]) : FromBf16(buf[63]);
      if (std::abs(got - want) > want * 0.01) {
        std::fprintf(stderr, "mismatch %s %s: %f != %f\n", DataTypeName(dt), ReduceOpName(op), got,
                     want);
        return 1;
      }
    }
  }
  std::string mine(c.rank() + 1, 'x');
  auto all = c.Allgather(mine.data(), mine.size());
  for (int r = 0; r < c.size(); ++r) {
    if (all[r].size() != static_cast<size_t>(r + 1)) return 1;
  }
  int64_t value = c.rank() == 0 ? 4242 : 0;
  c.Broadcast(&value, sizeof value, 0);
  if (value != 4242) return 1;
  c.Barrier();
  std::printf("collectives ok rank %d of %d\n", c.rank(), c.size());
  return 0;
}

// Prints "lost detected rank R", then, as elastic::Run would, re-forms with the survivors and
// finishes.
int ReformAfterLoss(worker_agent::AgentImpl& agent, int rank, const WorkerLostError& e) {
  std::printf("lost detected rank %d: %s\n", rank, e.what());
  std::fflush(stdout);
  auto joined = agent.JoinNextRound(0);
  if (!joined.ok() || !*joined) return 1;
  agent.comm().Barrier();  // nobody leaves while a peer still connects to it
  return 0;
}

int Lost(worker_agent::AgentImpl& agent) {
  Communicator& c = agent.comm();
  std::vector<float> v(1 << 16, 1.0f);
  try {
    // The victim returns from this first allreduce before its peers may have: they can see
    // it go in this call already.
    c.Allreduce(v.data(), v.size(), DataType::kF32, ReduceOp::kSum);
    if (c.rank() == c.size() - 1) {
      std::printf("victim pid %d\n", getpid());
      std::fflush(stdout);
      pause();
      return 0;
    }
    for (int i = 0; i < 100000000; ++i) {
      c.Allreduce(v.data(), v.size(), DataType::kF32, ReduceOp::kSum);
      if (i == 0) {
        std::printf("looping rank %d\n", c.rank());
        std::fflush(stdout);
      }
    }
  } catch (const WorkerLostError& e) {
    return ReformAfterLoss(agent, c.rank(), e);
  }
  return 1;
}

// Every rank allreduces 64 MiB in a loop (a test stops and then kills one of them); a survivor
// prints "lost detected rank R", re-forms and finishes.
int Big(worker_agent::AgentImpl& agent) {
  Communicator& c = agent.comm();
  std::vector<float> v(16 << 20, 1.0f);
  try {
    for (int i = 0; i < 100000000; ++i) {
      c.Allreduce(v.data(), v.size(), DataType::kF32, ReduceOp::kMax);
      if (i == 0) {
        std::printf("looping rank %d pid %d\n", c.rank(), getpid());
        std::fflush(stdout);
      }
    }
  } catch (const WorkerLostError& e) {
    return ReformAfterLoss(agent, c.rank(), e);
  }
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "collectives";
  if (mode == "sleep") {
    std::printf("sleeping pid %d\n", getpid());
    std::fflush(stdout);
    while (true) pause();
  }
  if (mode == "print") {
    int lines = argc > 2 ? std::atoi(argv[2]) : 1000;
    std::string pad(200, 'p');
    for (int i = 0; i < lines; ++i) {
      std::printf("line %d %s end\n", i, pad.c_str());
      std::fprintf(stderr, "err %d %s end\n", i, pad.c_str());
    }
    return 0;
  }
  worker_agent::AgentImpl* joined = nullptr;
  try {
    joined = &worker_agent::InitAgent();
  } catch (const worker_agent::WorkerEnd& end) {
    worker_agent::EndProcess(end);  // as elastic::Init() does: the message, then exit(code)
  }
  worker_agent::AgentImpl& agent = *joined;
  if (mode == "collectives") return Collectives(agent.comm());
  if (mode == "exit") {
    int code = std::atoi(argv[2]);
    int rank = std::atoi(argv[3]);
    agent.comm().Barrier();
    return agent.comm().rank() == rank ? code : 0;
  }
  if (mode == "lost") return Lost(agent);
  if (mode == "big") return Big(agent);
  std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
  return 2;
}
