/* SPDX-License-Identifier: Apache-2.0 */
/* km_strerror / km_error_name, generated from the one KM_ERROR_MAP list. */
#include "kvmatch/error.h"

const char *km_strerror(int status)
{
    switch (status) {
#define KM_ERROR_TEXT_CASE(name, value, text) \
    case value:                               \
        return text;
        KM_ERROR_MAP(KM_ERROR_TEXT_CASE)
#undef KM_ERROR_TEXT_CASE
    default:
        return "unknown error";
    }
}

const char *km_error_name(int status)
{
    switch (status) {
#define KM_ERROR_NAME_CASE(name, value, text) \
    case value:                               \
        return #name;
        KM_ERROR_MAP(KM_ERROR_NAME_CASE)
#undef KM_ERROR_NAME_CASE
    default:
        return "KM_ERR_UNKNOWN";
    }
}
