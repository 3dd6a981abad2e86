/* SPDX-License-Identifier: Apache-2.0 */
/* kvmatch: placement index and decision engine for cache-aware LLM routing. Umbrella header. */
#ifndef KVMATCH_H
#define KVMATCH_H
#include "kvmatch/error.h"
#include "kvmatch/log.h"
#include "kvmatch/text.h"
#include "kvmatch/hash.h"
#include "kvmatch/index.h"
#include "kvmatch/kv_events.h"
#include "kvmatch/feed.h"
#include "kvmatch/subscriber.h"
#include "kvmatch/policy.h"
#include "kvmatch/active.h"
#include "kvmatch/approx.h"
#include "kvmatch/cluster.h"
#include "kvmatch/engine_metrics.h"
#include "kvmatch/metrics.h"
#include "kvmatch/records.h"
#include "kvmatch/protocol.h"
#include "kvmatch/client.h"
#include "kvmatch/server.h"
#include "kvmatch/publisher.h"
#include "kvmatch/version.h"
#endif
