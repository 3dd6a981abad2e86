/* The log callback the handles' configs take (index, feed, subscriber, records writer, server):
 * one call per line, the line without a trailing newline and valid only during the call. A NULL
 * callback means stderr. A handle with threads of its own may call it from any of them. */
#ifndef KVMATCH_LOG_H
#define KVMATCH_LOG_H

#ifdef __cplusplus
extern "C" {
#endif

typedef void (*km_log_fn)(void *user, const char *line);

#ifdef __cplusplus
}
#endif
#endif
