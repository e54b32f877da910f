// Public header of elastic_common: Status, clock, logging and the Communicator interface.
#pragma once

#include "common/clock.h"
#include "common/communicator.h"
#include "common/logging.h"
#include "common/process.h"
#include "common/status.h"
