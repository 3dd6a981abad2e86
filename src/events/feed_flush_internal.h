/* SPDX-License-Identifier: Apache-2.0 */
/* The feed's flush in three steps, for km_subscriber (feed_updates.c). */
#ifndef KVMATCH_EVENTS_FEED_FLUSH_INTERNAL_H
#define KVMATCH_EVENTS_FEED_FLUSH_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "kvmatch/feed.h"

/* A flush in three steps for a caller that lets intake go on while the index applies
 * (km_subscriber): under the caller's lock, km_feed_flush_take moves the queued updates out
 * (false: nothing queued) and the feed goes on queuing into fresh arrays; km_feed_flush_apply
 * hands them to the index with no feed state touched, so it alone may run without that lock,
 * while other feed calls (never another flush) go on under it; km_feed_flush_finish, under the
 * lock again, counts them applied and publishes the positions and sets the window rules as of
 * the take (what was queued since follows with its own updates at the next flush). If the index
 * refused them, they are put back in front of what was queued since and the whole queue is
 * flushed as km_feed_flush does, as if this flush had come later. Until the finish, worker info
 * reports the positions of the flush before, and the state cannot be exported (feed_updates.c). */
bool km_feed_flush_take(km_feed *feed);
bool km_feed_flush_in_flight(const km_feed *feed);
void km_feed_flush_apply(km_feed *feed);
int km_feed_flush_finish(km_feed *feed, uint64_t now_ns, km_feed_flush_stats *stats);
/* sum += s, field by field: one report for a caller that flushed twice. */
void km_feed_flush_stats_add(km_feed_flush_stats *sum, const km_feed_flush_stats *s);

#endif
