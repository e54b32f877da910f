// The one header a C++ training program includes: elastic::Init, elastic::Run, the
// Communicator, State/ObjectState and ElasticSampler.
//
//   #include <elastic/elastic.h>
//   elastic::ObjectState state; state.Track("w", w.data(), bytes);
//   elastic::Run(state, [&](elastic::State&) { ... comm.AllreduceMany(...); state.Commit(); });
#pragma once

#include "common/common.h"
#include "state/state.h"
#include "worker_agent/worker_agent.h"
