// Where a rank sits in a communicator: in the whole job, among the ranks of its host, and among
// the hosts (the local rank 0s). Both communicators take one (worker_agent/gloo_communicator.h,
// worker_agent/nccl_communicator.h).
#pragma once

namespace elastic::worker_agent {

struct Topology {
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  int local_size = 1;
  int cross_rank = 0;
  int cross_size = 1;
};

}  // namespace elastic::worker_agent
