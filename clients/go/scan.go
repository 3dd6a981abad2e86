// SPDX-License-Identifier: Apache-2.0

package kvmatch

import "encoding/binary"

// maxReplyDepth bounds the nesting of a reply (a DECISION is 4 deep: message, decisions, decision,
// candidate row), so decoding a hostile frame cannot recurse without limit.
const maxReplyDepth = 32

// checkPayload walks a msgpack payload without recursion and refuses one that is not exactly one
// well-formed value, nests deeper than maxReplyDepth, or declares a container with more values
// than bytes remain. Only then is it decoded.
func checkPayload(p []byte) error {
	pending := []uint64{1} // values still to read at each open level
	pos := uint64(0)
	size := uint64(len(p))
	need := func(n uint64) bool { return size-pos >= n }
	be := func(n uint64) uint64 {
		var v uint64
		for i := uint64(0); i < n; i++ {
			v = v<<8 | uint64(p[pos+i])
		}
		return v
	}
	for len(pending) > 0 {
		top := len(pending) - 1
		if pending[top] == 0 {
			pending = pending[:top]
			continue
		}
		pending[top]--
		if !need(1) {
			return newError(ErrParse, "reply payload truncated at byte %d", pos)
		}
		c := p[pos]
		pos++
		var skip, items uint64
		container := false
		switch {
		case c <= 0x7f || c >= 0xe0 || c == 0xc0 || c == 0xc2 || c == 0xc3:
		case c >= 0x80 && c <= 0x8f:
			items, container = 2*uint64(c&0x0f), true
		case c >= 0x90 && c <= 0x9f:
			items, container = uint64(c&0x0f), true
		case c >= 0xa0 && c <= 0xbf:
			skip = uint64(c & 0x1f)
		case c == 0xc4 || c == 0xd9:
			if !need(1) {
				return newError(ErrParse, "reply payload truncated at byte %d", pos)
			}
			skip = be(1) + 1
		case c == 0xc5 || c == 0xda:
			if !need(2) {
				return newError(ErrParse, "reply payload truncated at byte %d", pos)
			}
			skip = be(2) + 2
		case c == 0xc6 || c == 0xdb:
			if !need(4) {
				return newError(ErrParse, "reply payload truncated at byte %d", pos)
			}
			skip = be(4) + 4
		case c == 0xc7 || c == 0xc8 || c == 0xc9:
			w := map[byte]uint64{0xc7: 1, 0xc8: 2, 0xc9: 4}[c]
			if !need(w) {
				return newError(ErrParse, "reply payload truncated at byte %d", pos)
			}
			skip = be(w) + w + 1
		case c == 0xca:
			skip = 4
		case c == 0xcb:
			skip = 8
		case c >= 0xcc && c <= 0xcf:
			skip = 1 << (c - 0xcc)
		case c >= 0xd0 && c <= 0xd3:
			skip = 1 << (c - 0xd0)
		case c >= 0xd4 && c <= 0xd8:
			skip = 1<<(c-0xd4) + 1
		case c == 0xdc || c == 0xde:
			if !need(2) {
				return newError(ErrParse, "reply payload truncated at byte %d", pos)
			}
			items, container, skip = uint64(binary.BigEndian.Uint16(p[pos:])), true, 2
		case c == 0xdd || c == 0xdf:
			if !need(4) {
				return newError(ErrParse, "reply payload truncated at byte %d", pos)
			}
			items, container, skip = uint64(binary.BigEndian.Uint32(p[pos:])), true, 4
		default: // 0xc1: never used
			return newError(ErrParse, "reply payload has the reserved byte 0xc1 at byte %d", pos-1)
		}
		if !need(skip) {
			return newError(ErrParse, "reply payload truncated at byte %d", pos)
		}
		pos += skip
		if container {
			if c >= 0xde || (c >= 0x80 && c <= 0x8f) {
				if c == 0xde || c == 0xdf {
					items *= 2
				}
			}
			if items > size-pos {
				return newError(ErrParse, "reply declares %d values with %d bytes left", items, size-pos)
			}
			if items > 0 {
				if len(pending) >= maxReplyDepth {
					return newError(ErrParse, "reply nests deeper than %d", maxReplyDepth)
				}
				pending = append(pending, items)
			}
		}
	}
	if pos != size {
		return newError(ErrParse, "reply payload has %d bytes after its message", size-pos)
	}
	return nil
}
