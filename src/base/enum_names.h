/* SPDX-License-Identifier: Apache-2.0 */
/* Names of enum values, generated from the enum's X-macro list.
 *
 * A list is `#define KM_<ENUM>_LIST(X) X(KM_<VALUE>, value, "name") ...` in the header that declares
 * the enum, which generates the enum itself (`name = value,`); a .c file generates the table of
 * names with KM_ENUM_NAME_ENTRY (`[value] = "name"`) and looks a value up with KM_ENUM_NAME, which
 * gives "unknown" for a value outside the list, so a name function never reads past its table.
 * The values index the table: they must be small and non-negative. */
#ifndef KM_BASE_ENUM_NAMES_H
#define KM_BASE_ENUM_NAMES_H

#include <stddef.h>

#define KM_ENUM_NAME_ENTRY(name, value, text) [name] = text,

static inline const char *km_enum_name(const char *const *names, size_t n, unsigned value)
{
    return value < n && names[value] ? names[value] : "unknown";
}

/* The name of value in names, an array generated with KM_ENUM_NAME_ENTRY. */
#define KM_ENUM_NAME(names, value) \
    km_enum_name((names), sizeof(names) / sizeof((names)[0]), (unsigned)(value))

#endif
