/* SPDX-License-Identifier: Apache-2.0 */
/* kvmatch's version, for logs, the protocol's WELCOME, records and /status. */
#ifndef KVMATCH_VERSION_H
#define KVMATCH_VERSION_H

#define KVMATCH_VERSION "0.1.0"

#endif
