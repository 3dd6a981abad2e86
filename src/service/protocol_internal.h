/* SPDX-License-Identifier: Apache-2.0 */
/* Internal: what the source files of the router protocol share (protocol.c: limits and names;
 * protocol_frame_reader.c; protocol_encode.c: the frame buffer and the encoder;
 * protocol_decode.c). Nothing outside them includes it. */
#ifndef KM_PROTOCOL_INTERNAL_H
#define KM_PROTOCOL_INTERNAL_H

/* printf-format checking of the *_fail helpers. */
#if defined(__GNUC__)
#define KM_PRINTF(fmt_index, first_arg) __attribute__((format(printf, fmt_index, first_arg)))
#else
#define KM_PRINTF(fmt_index, first_arg)
#endif

/* The frame reader's and the decoder's error messages, NUL included. */
#define ERROR_BYTES 512

#endif
