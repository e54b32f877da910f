// Public header of elastic_rendezvous: the rendezvous core (rounds, store, events), its gRPC
// service, and the client. See core.h, service.h and client.h for the contracts.
#pragma once

#include "rendezvous/client.h"
#include "rendezvous/core.h"
#include "rendezvous/event_hub.h"
#include "rendezvous/service.h"
#include "rendezvous/types.h"
