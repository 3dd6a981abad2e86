/* Internal: msgpack object type names for the decoders' error messages (src/events/kv_events.c,
 * src/service/protocol.c). */
#ifndef KM_MSGPACK_NAMES_H
#define KM_MSGPACK_NAMES_H

#include <msgpack.h>

static inline const char *km_msgpack_type_name(const msgpack_object *o)
{
    switch (o->type) {
    case MSGPACK_OBJECT_NIL: return "nil";
    case MSGPACK_OBJECT_BOOLEAN: return "bool";
    case MSGPACK_OBJECT_POSITIVE_INTEGER: return "non-negative int";
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: return "negative int";
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64: return "float";
    case MSGPACK_OBJECT_STR: return "str";
    case MSGPACK_OBJECT_ARRAY: return "array";
    case MSGPACK_OBJECT_MAP: return "map";
    case MSGPACK_OBJECT_BIN: return "bin";
    case MSGPACK_OBJECT_EXT: return "ext";
    }
    return "unknown msgpack type";
}

#endif
