// Test hooks: let an end-to-end test stop a worker at an exact point of the protocol, so that a
// race seen once in a random-fault soak becomes a deterministic test. Off unless the worker's
// environment sets ELASTIC_TEST_HOOKS (read by worker_agent/worker_options.cc and handed to
// ConfigureTestHooks by the agent); documented in docs/testing.md. Not for production use.
//
//   ELASTIC_TEST_HOOKS="POINT@SLOT@ROUND@VERSION=ACTION[;...]"
//
// POINT is one of the names passed to TestHook below; SLOT, ROUND and VERSION select where it
// fires ("*" matches anything, "N+" a number N or above); ACTION is `kill` (SIGKILL this
// process), `lost` (throw WorkerLostError, as a collective that lost a peer would), `stop`
// (SIGSTOP this process) or `sleepMS` (sleep MS milliseconds, at most 60000, then go on).
// Each entry fires at most once per process.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"

namespace elastic {

// Replaces the hooks with those of `spec` (the format above; empty: none) for the worker of
// `slot`. INVALID_ARGUMENT naming an entry that is not POINT@SLOT@ROUND@VERSION=ACTION or whose
// action is none of the above; the hooks are then left as they were.
Status ConfigureTestHooks(const std::string& spec, const std::string& slot);

// The round this worker is in (set by the worker agent after each join).
void SetTestHookRound(int64_t round);
// Fires a matching hook, if any: may SIGKILL the process or throw WorkerLostError.
// Points: "before_save" (State::Commit, version = the one being made), "after_save" (version
// made, before the commit's agreement), "sync_root" (rank 0 of a sync, after it announced the
// state's size), "connect" (communicator build, after this rank published its address and
// fetched its peers', before it connects its pairs), "watch_lost" (the driver's stream broke
// during training, before the agent re-opens it),
// "shm_made" (a host's shared-memory segment made, before its ranks have mapped it and its
// name is removed), "shm_reduce" (hierarchical allreduce, after the chunk's copy-in barrier;
// version = the chunk's number on this communicator, counted from 0).
void TestHook(const char* point, int64_t version);

}  // namespace elastic
