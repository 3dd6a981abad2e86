/* SPDX-License-Identifier: Apache-2.0 */
/* C client of `kvmatch serve` (docs/PROTOCOL.md): connect + handshake, blocking calls, and a
 * pipelined API for many requests in flight on one connection.
 *
 * Lifecycle: km_client_connect -> any number of calls -> km_client_close. A handle is not
 * thread-safe: use one per thread (connections are cheap; the server serves hundreds).
 *
 * Two ways to call:
 *  - Blocking: km_client_route / km_client_lifecycle / km_client_call send one request and return
 *    its reply. A reply of type ERROR makes them return its code (negative), with the server's
 *    message in km_client_last_error; *reply still holds the ERROR message.
 *  - Pipelined: km_client_send_* returns the request's id at once; km_client_receive returns the
 *    next reply to arrive (any id), km_client_wait the reply to one id. Replies may come in any
 *    order; those that arrive while waiting for another id are kept (raw, in arrival order) and
 *    handed out later, so nothing is lost. Blocking calls may be mixed with pipelined ones.
 *
 * Reply memory: what a returned km_message points to is owned by the client and valid until the
 * next call that returns a reply (receive, wait, or any blocking call) or km_client_close.
 *
 * Replies are read within the limits the server announced in WELCOME (docs/PROTOCOL.md, "Reading
 * replies"), so that every reply the server may send can be read: a frame over its
 * max_frame_bytes is refused (KM_ERR_TOO_LARGE, final); within a frame, up to max_frame_bytes
 * msgpack values and string bytes (a value takes at least one byte), up to
 * max(max_batch_items, KM_MAX_WORKERS_LIMIT) decisions, ACK items, workers or pools, and up to
 * max(max_candidates, KM_MAX_WORKERS_LIMIT) candidate rows per decision. Decoding a reply takes
 * about 40 bytes per msgpack value it holds, so at most about 40 * max_frame_bytes.
 *
 * Errors: every function returns KM_OK or a negative km_status; km_client_last_error has the
 * sentence. KM_ERR_TIMEOUT leaves the connection usable (the reply may still arrive later and is
 * returned by a later receive / wait). KM_ERR_CLOSED (the server closed the connection), KM_ERR_IO
 * and KM_ERR_PROTOCOL / KM_ERR_PARSE on a reply that cannot be read, or that does not fit its
 * request (see km_client_receive), are final: the handle only answers KM_ERR_CLOSED afterwards.
 * A connection-level ERROR (id 0: the server is closing the connection) makes the call that reads
 * it fail with KM_ERR_CLOSED whatever its code; km_client_last_error names the server's code and
 * message. */
#ifndef KVMATCH_CLIENT_H
#define KVMATCH_CLIENT_H

#include <stdint.h>

#include "kvmatch/protocol.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct km_client km_client;

/* Connect to "unix:/path/to/socket" or "tcp:127.0.0.1:7070" (a numeric IPv4 or [IPv6] address),
 * send HELLO (protocol KM_PROTOCOL_VERSION, client name "kvmatch-c") and wait for WELCOME, all
 * within timeout_ms (< 0: no limit); while a Unix server's listen queue is full, connect is tried
 * again within that time. Errors: KM_ERR_NULL_POINTER, KM_ERR_INVALID_ARGUMENT (address
 * form), KM_ERR_IO (connect failed), KM_ERR_TIMEOUT, KM_ERR_CLOSED, KM_ERR_INCOMPATIBLE (the server
 * does not speak our version, or answers with another one), KM_ERR_PARSE / KM_ERR_PROTOCOL (an
 * unreadable reply, one that is neither WELCOME nor ERROR, or a WELCOME to another id than the
 * HELLO's), any code of the server's ERROR reply, KM_ERR_OUT_OF_MEMORY. On failure *out is NULL
 * and, when why is not NULL, why[0..why_size) holds the sentence. */
int km_client_connect(const char *address, int timeout_ms, km_client **out, char *why,
                      size_t why_size);
void km_client_close(km_client *client); /* NULL is a no-op */

const char *km_client_last_error(const km_client *client);
/* The server's WELCOME (versions and limits); valid for the client's life. */
const km_welcome *km_client_welcome(const km_client *client);
/* The socket, for an external poll(). Readable means more bytes arrived; replies the client has
 * already read (several in one read, or kept by km_client_wait) do not make it readable. So once
 * it polls readable, call km_client_receive with timeout 0 until KM_ERR_TIMEOUT before polling
 * again, or a reply can wait in the client while the poll sleeps. */
int km_client_fd(const km_client *client);
/* Requests sent whose reply has not been returned yet and still can be: not given up by a blocking
 * call that timed out, and after a final error only those whose reply had arrived (kept by
 * km_client_wait; receive / wait still return them). The client keeps their ids, 16 bytes each,
 * in memory that grows to the most requests in flight at once. */
uint32_t km_client_outstanding(const km_client *client);

/* ---- pipelined ------------------------------------------------------------------------------- */

/* Send any request message (HELLO excepted). The client assigns the id (msg->id is ignored and
 * *id_out receives it; id_out may be NULL). Blocks only while the socket's send buffer is full,
 * at most timeout_ms. Errors: those of km_protocol_encode (a frame larger than the server's
 * max_frame_bytes is refused before anything is sent; the server checks its other limits and
 * answers an ERROR), KM_ERR_TIMEOUT (part of the frame may have been
 * sent: the connection is then closed, since the stream would be cut mid-frame), KM_ERR_CLOSED,
 * KM_ERR_IO, KM_ERR_OUT_OF_MEMORY (nothing is sent). */
int km_client_send(km_client *client, const km_message *msg, int timeout_ms, uint64_t *id_out);
int km_client_send_route(km_client *client, const km_route_request *routes, uint32_t n_routes,
                         int timeout_ms, uint64_t *id_out);
int km_client_send_lifecycle(km_client *client, const km_lifecycle_event *events,
                             uint32_t n_events, int timeout_ms, uint64_t *id_out);

/* The next reply, kept ones first. Errors: KM_ERR_TIMEOUT, KM_ERR_CLOSED, KM_ERR_IO,
 * KM_ERR_PARSE / KM_ERR_PROTOCOL (unreadable reply, a reply to an id that is not outstanding, a
 * reply of another type than its request's (docs/PROTOCOL.md, "Messages"), or a DECISION / ACK
 * whose count differs from its request's routes / events / workers / pools: final),
 * KM_ERR_INVALID_ARGUMENT (nothing outstanding: no reply can come). An ERROR reply is returned as
 * a message, with KM_OK. Any other reply is of its request's type: a DECISION to a ROUTE holding
 * one decision per route, an ACK to a LIFECYCLE or WORKERS / POOLS add, remove, update holding one
 * item per event, worker or pool, a WORKER_LIST / POOL_LIST to a list, a STATUS_REPLY to STATUS. */
int km_client_receive(km_client *client, int timeout_ms, km_message *reply);
/* The reply to request `id`; other replies arriving meanwhile are kept. Errors as
 * km_client_receive, plus KM_ERR_NOT_FOUND at once, without reading (id was never sent or its reply
 * was already returned; kept replies to other ids stay kept), and KM_ERR_OUT_OF_MEMORY when a
 * reply to another id cannot be kept (final: that reply would be lost). An ERROR reply to `id` is
 * returned as a message, with KM_OK. */
int km_client_wait(km_client *client, uint64_t id, int timeout_ms, km_message *reply);

/* ---- blocking -------------------------------------------------------------------------------- */

/* send + wait. An ERROR reply returns its code (the message is in km_client_last_error and
 * *reply). On KM_ERR_TIMEOUT the request is given up: km_client_outstanding stops counting it and
 * its reply, if it comes, is read and dropped (a km_client_wait that times out is not given up:
 * it may be called again). */
int km_client_call(km_client *client, const km_message *request, int timeout_ms,
                   km_message *reply);
/* ROUTE -> DECISION (one decision per route, in order; check each decision's status). */
int km_client_route(km_client *client, const km_route_request *routes, uint32_t n_routes,
                    int timeout_ms, km_message *reply);
/* LIFECYCLE -> ACK (one status per event). */
int km_client_lifecycle(km_client *client, const km_lifecycle_event *events, uint32_t n_events,
                        int timeout_ms, km_message *reply);
/* STATUS -> STATUS_REPLY. */
int km_client_status(km_client *client, int timeout_ms, km_message *reply);

#ifdef __cplusplus
}
#endif
#endif
