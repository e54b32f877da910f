// The one header a C++ training program includes (installed as <elastic/elastic.h>, with the
// few headers it needs: common/communicator.h, common/status.h, state/state.h and what they
// include). Everything else of the worker agent is internal to the library.
//
//   #include <elastic/elastic.h>
//   elastic::ObjectState state; state.Track("w", w.data(), bytes);
//   elastic::Run(state, [&](elastic::State&) {
//     elastic::Communicator& comm = elastic::Init().comm();
//     ... comm.AllreduceMany(...); state.Commit();
//   });
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "common/communicator.h"
#include "common/status.h"
#include "state/state.h"

namespace elastic {

// This process's worker of an elastic-run job: the rounds it joins and what it tells the
// driver. Methods are called from the training thread.
class Agent {
 public:
  virtual ~Agent() = default;

  // The current round's communicator on host memory (Gloo, with shared memory between the
  // ranks of a host). Rebuilt by Run at each new round: ask for it again inside the training
  // function rather than keeping it across rounds.
  virtual Communicator& comm() = 0;
  // The current round's communicator on device memory (NCCL, elastic-run --backend nccl), or
  // nullptr under Gloo (docs/gpu.md).
  virtual DeviceCommunicator* device_comm() = 0;
  // The round this worker is in (0, 1, ...: a new one at every membership change).
  virtual int64_t round() const = 0;
  // This worker's slot: "<host>:<index>", the place the driver started it in.
  virtual const std::string& slot() const = 0;
  // True once the driver announced that the current round is changing (the next
  // State::Commit() throws HostsUpdated on every rank).
  virtual bool change_pending() const = 0;
  // True while the driver is unreachable; training goes on (docs/recovery.md, "When the
  // driver is lost").
  virtual bool driver_lost() const = 0;
  // Tells the driver that this worker leaves the job of its own accord: the job re-forms
  // without it at once. Blocks until the driver has it (a failure is logged). Exit after it.
  virtual void ReportLeaving(const std::string& why) = 0;
};

// The process's agent: reads the environment elastic-run gives, joins the job and builds the
// first round's communicator on the first call; later calls return it. Run outside
// elastic-run, it prints what is missing and exits 2.
// What the agent does to the process: it ignores SIGPIPE when the program left it at the
// default (a dead peer's socket must fail a collective, not end the process: a write to a
// closed pipe then fails with EPIPE), and when the driver refuses the worker or stays
// unreachable past --driver-timeout, Run exits 3 at the next commit or failed collective;
// a process still running 30 s later is ended by the agent's thread (exit 3).
Agent& Init();

// Runs `train` until it returns, recovering from membership changes (docs/architecture.md,
// "Recovery"): a lost peer (WorkerLostError from a collective) rolls `state` back to its last
// commit; an announced change (HostsUpdated, thrown by state.Commit()) re-forms at that commit.
// After each new round the state is Reset() for the new rank and size and synced from a rank
// that holds the newest commit. A worker the driver scales away exits 0.
void Run(State& state, const std::function<void(State&)>& train);

}  // namespace elastic
