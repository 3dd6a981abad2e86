/* SPDX-License-Identifier: Apache-2.0 */
/* Internal: the configuration checks that the JSON config reader (server_config.c), the POOLS
 * message and `kvmatch serve`'s flags share. */
#ifndef KM_SERVER_CONFIG_H
#define KM_SERVER_CONFIG_H

#include <stdbool.h>
#include <stddef.h>

#include "kvmatch/policy.h"

/* Set one policy parameter by name (docs/SERVICE.md lists them). KM_ERR_INVALID_ARGUMENT for an
 * unknown name or a value out of range, with the detail in why. */
int km_server_policy_param(km_policy_config *policy, const char *name, double value, char *why,
                           size_t why_size);

/* The policy a parameter tunes ("temperature": kv), or NULL for an unknown name. A parameter
 * set on a pool of another policy would change nothing: the config file and `kvmatch serve
 * --param` refuse it. */
const char *km_server_policy_param_owner(const char *name);

/* Pool names: [A-Za-z0-9._-], 1 .. KM_SERVER_NAME_MAX - 1 bytes, not starting with '.'. */
bool km_server_name_valid(const char *name);

#endif
