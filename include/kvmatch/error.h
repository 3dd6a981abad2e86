/* SPDX-License-Identifier: Apache-2.0 */
/* kvmatch error codes: one enum for the whole library, 0 = success, negative = failure.
 * The list is an X-macro so km_strerror() and km_error_name() can never drift from it. */
#ifndef KVMATCH_ERROR_H
#define KVMATCH_ERROR_H

#ifdef __cplusplus
extern "C" {
#endif

#define KM_ERROR_MAP(X)                                                               \
    X(KM_OK, 0, "success")                                                            \
    X(KM_ERR_INVALID_ARGUMENT, -1, "invalid argument")                                \
    X(KM_ERR_NULL_POINTER, -2, "required pointer is NULL")                            \
    X(KM_ERR_BLOCK_SIZE, -3, "block size must be at least 1")                         \
    X(KM_ERR_WORKER_RANGE, -4, "worker id out of range")                              \
    X(KM_ERR_OUT_OF_MEMORY, -5, "out of memory")                                      \
    X(KM_ERR_MEMORY_CAP, -6, "memory cap reached")                                    \
    X(KM_ERR_TOO_LARGE, -7, "input larger than the configured limit")                 \
    X(KM_ERR_PARSE, -8, "malformed input")                                            \
    X(KM_ERR_BACKEND_UNAVAILABLE, -9, "backend unavailable")                          \
    X(KM_ERR_CUDA, -10, "CUDA runtime error")                                         \
    X(KM_ERR_IO, -11, "I/O error")                                                    \
    X(KM_ERR_INTERNAL, -12, "internal error")                                        \
    X(KM_ERR_CORRUPT, -13, "data is corrupt or truncated")                            \
    X(KM_ERR_INCOMPATIBLE, -14, "incompatible version or configuration")              \
    X(KM_ERR_NOT_FOUND, -15, "no such worker, pool or request")                       \
    X(KM_ERR_PROTOCOL, -16, "protocol violation")                                     \
    X(KM_ERR_OVERLOADED, -17, "service overloaded; retry later")                      \
    X(KM_ERR_SHUTTING_DOWN, -18, "service is shutting down")                          \
    X(KM_ERR_TIMEOUT, -19, "timed out")                                               \
    X(KM_ERR_CLOSED, -20, "connection closed")                                        \
    X(KM_ERR_NO_HEALTHY_WORKER, -21, "no healthy worker among the candidates")

typedef enum km_status {
#define KM_ERROR_ENUM_ENTRY(name, value, text) name = value,
    KM_ERROR_MAP(KM_ERROR_ENUM_ENTRY)
#undef KM_ERROR_ENUM_ENTRY
} km_status;

/* A short human sentence for a status code; never NULL (unknown codes get "unknown error"). */
const char *km_strerror(int status);
/* The enum name ("KM_ERR_MEMORY_CAP"), for logs and machine-readable output; never NULL. */
const char *km_error_name(int status);

#ifdef __cplusplus
}
#endif
#endif
