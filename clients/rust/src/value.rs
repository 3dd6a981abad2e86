// SPDX-License-Identifier: Apache-2.0
//! A msgpack value as the protocol uses them (maps with string keys), read through rmp-serde
//! within a depth limit and written with rmp.

use std::collections::HashSet;
use std::fmt;

use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::error::{Code, Error, Result};

/// One msgpack value. Maps keep their entries in order; their keys are strings (an entry whose key
/// is not a str is not kept).
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Nil,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Float(f64),
    Str(String),
    Bin(Vec<u8>),
    Array(Vec<Value>),
    Map(Vec<(String, Value)>),
}

/// Elements reserved ahead for a container: its declared length, but never more than this, so a
/// hostile length costs nothing until its values are really there.
const RESERVE_LIMIT: usize = 4096;

/// Nesting that a reply may have (a DECISION is 4 deep: message, decisions, decision, row).
pub(crate) const MAX_DEPTH: usize = 32;

impl Value {
    /// The value of `key` in a map; None for a missing key, nil, or a value that is not a map.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Map(entries) => entries
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v)
                .filter(|v| !matches!(v, Value::Nil)),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::UInt(u) => Some(u),
            Value::Int(i) if i >= 0 => Some(i as u64),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::Int(i) => Some(i),
            Value::UInt(u) if u <= i64::MAX as u64 => Some(u as i64),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::Float(f) => Some(f),
            Value::Int(i) => Some(i as f64),
            Value::UInt(u) => Some(u as f64),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Value::Nil => "nil",
            Value::Bool(_) => "bool",
            Value::Int(_) | Value::UInt(_) => "int",
            Value::Float(_) => "float",
            Value::Str(_) => "str",
            Value::Bin(_) => "bin",
            Value::Array(_) => "array",
            Value::Map(_) => "map",
        }
    }

    /// Decode one msgpack value that must fill `bytes` exactly, nested at most MAX_DEPTH deep.
    /// The bytes are walked first (`check_extent`), so every declared length is known to fit.
    pub fn decode(bytes: &[u8]) -> Result<Value> {
        check_extent(bytes)?;
        let mut de = rmp_serde::Deserializer::from_read_ref(bytes);
        de.set_max_depth(MAX_DEPTH + 1);
        Value::deserialize(&mut de)
            .map_err(|e| Error::new(Code::PARSE, format!("unreadable reply: {}", e)))
    }

    /// Append this value's msgpack encoding to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        use rmp::encode as enc;
        // Writes into a Vec cannot fail.
        match self {
            Value::Nil => {
                let _ = enc::write_nil(out);
            }
            Value::Bool(b) => {
                let _ = enc::write_bool(out, *b);
            }
            Value::Int(i) => {
                let _ = enc::write_sint(out, *i);
            }
            Value::UInt(u) => {
                let _ = enc::write_uint(out, *u);
            }
            Value::Float(f) => {
                let _ = enc::write_f64(out, *f);
            }
            Value::Str(s) => {
                let _ = enc::write_str(out, s);
            }
            Value::Bin(b) => {
                let _ = enc::write_bin(out, b);
            }
            Value::Array(items) => {
                let _ = enc::write_array_len(out, items.len() as u32);
                for v in items {
                    v.encode(out);
                }
            }
            Value::Map(entries) => {
                let _ = enc::write_map_len(out, entries.len() as u32);
                for (k, v) in entries {
                    let _ = enc::write_str(out, k);
                    v.encode(out);
                }
            }
        }
    }
}

/// Walk a msgpack payload without recursion: it must be exactly one well-formed value, nested at
/// most MAX_DEPTH deep, and no container may declare more values than bytes remain.
fn check_extent(p: &[u8]) -> Result<()> {
    let truncated = |at: usize| Error::new(Code::PARSE, format!("reply payload truncated at byte {}", at));
    let be = |at: usize, n: usize| -> Option<u64> {
        p.get(at..at + n).map(|b| b.iter().fold(0u64, |v, &x| v << 8 | x as u64))
    };
    let mut pending: Vec<u64> = vec![1]; // values still to read at each open level
    let mut pos = 0usize;
    while let Some(top) = pending.last_mut() {
        if *top == 0 {
            pending.pop();
            continue;
        }
        *top -= 1;
        let c = *p.get(pos).ok_or_else(|| truncated(pos))?;
        pos += 1;
        let (skip, items): (u64, Option<u64>) = match c {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (0, None),
            0x80..=0x8f => (0, Some(2 * (c & 0x0f) as u64)),
            0x90..=0x9f => (0, Some((c & 0x0f) as u64)),
            0xa0..=0xbf => ((c & 0x1f) as u64, None),
            0xc4 | 0xd9 => (be(pos, 1).ok_or_else(|| truncated(pos))? + 1, None),
            0xc5 | 0xda => (be(pos, 2).ok_or_else(|| truncated(pos))? + 2, None),
            0xc6 | 0xdb => (be(pos, 4).ok_or_else(|| truncated(pos))? + 4, None),
            0xc7 => (be(pos, 1).ok_or_else(|| truncated(pos))? + 2, None),
            0xc8 => (be(pos, 2).ok_or_else(|| truncated(pos))? + 3, None),
            0xc9 => (be(pos, 4).ok_or_else(|| truncated(pos))? + 5, None),
            0xca => (4, None),
            0xcb => (8, None),
            0xcc..=0xcf => (1 << (c - 0xcc), None),
            0xd0..=0xd3 => (1 << (c - 0xd0), None),
            0xd4..=0xd8 => ((1 << (c - 0xd4)) + 1, None),
            0xdc => (2, Some(be(pos, 2).ok_or_else(|| truncated(pos))?)),
            0xdd => (4, Some(be(pos, 4).ok_or_else(|| truncated(pos))?)),
            0xde => (2, Some(2 * be(pos, 2).ok_or_else(|| truncated(pos))?)),
            0xdf => (4, Some(2 * be(pos, 4).ok_or_else(|| truncated(pos))?)),
            _ => {
                return Err(Error::new(
                    Code::PARSE,
                    format!("reply payload has the reserved byte 0x{:02x} at byte {}", c, pos - 1),
                ))
            }
        };
        let left = (p.len() - pos) as u64;
        if skip > left {
            return Err(truncated(pos));
        }
        pos += skip as usize;
        if let Some(n) = items {
            let left = (p.len() - pos) as u64;
            if n > left {
                let m = format!("reply declares {} values with {} bytes left", n, left);
                return Err(Error::new(Code::PARSE, m));
            }
            if n > 0 {
                if pending.len() >= MAX_DEPTH {
                    return Err(Error::new(Code::PARSE, format!("reply nests deeper than {}", MAX_DEPTH)));
                }
                pending.push(n);
            }
        }
    }
    if pos != p.len() {
        let m = format!("reply payload has {} bytes after its message", p.len() - pos);
        return Err(Error::new(Code::PARSE, m));
    }
    Ok(())
}

/// Field accessors that say which field was wrong: `Ok(None)` when absent or nil.
pub(crate) struct Fields<'a> {
    pub value: &'a Value,
    pub what: &'a str,
}

impl<'a> Fields<'a> {
    fn wrong(&self, key: &str, expected: &str, got: &Value) -> Error {
        Error::new(
            Code::PARSE,
            format!("{}.{}: expected {}, got {}", self.what, key, expected, got.kind()),
        )
    }

    pub fn u64(&self, key: &str) -> Result<Option<u64>> {
        match self.value.get(key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| self.wrong(key, "a uint", v)),
        }
    }

    pub fn u32(&self, key: &str) -> Result<Option<u32>> {
        match self.value.get(key) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(u) if u <= u32::MAX as u64 => Ok(Some(u as u32)),
                _ => Err(self.wrong(key, "a u32", v)),
            },
        }
    }

    pub fn i64(&self, key: &str) -> Result<Option<i64>> {
        match self.value.get(key) {
            None => Ok(None),
            Some(v) => v.as_i64().map(Some).ok_or_else(|| self.wrong(key, "an int", v)),
        }
    }

    pub fn f64(&self, key: &str) -> Result<Option<f64>> {
        match self.value.get(key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| self.wrong(key, "a number", v)),
        }
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>> {
        match self.value.get(key) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| self.wrong(key, "a bool", v)),
        }
    }

    pub fn string(&self, key: &str) -> Result<Option<String>> {
        match self.value.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(|s| Some(s.to_string()))
                .ok_or_else(|| self.wrong(key, "a str", v)),
        }
    }

    /// A str, or (as attempt ids may be sent) a uint taken as its decimal string.
    pub fn id_string(&self, key: &str) -> Result<Option<String>> {
        match self.value.get(key) {
            Some(Value::UInt(u)) => Ok(Some(u.to_string())),
            Some(Value::Int(i)) if *i >= 0 => Ok(Some(i.to_string())),
            _ => self.string(key),
        }
    }

    pub fn map(&self, key: &str) -> Result<Option<&'a Value>> {
        match self.value.get(key) {
            None => Ok(None),
            Some(v @ Value::Map(_)) => Ok(Some(v)),
            Some(v) => Err(self.wrong(key, "a map", v)),
        }
    }

    pub fn array(&self, key: &str) -> Result<&'a [Value]> {
        match self.value.get(key) {
            None => Ok(&[]),
            Some(v) => v.as_array().ok_or_else(|| self.wrong(key, "an array", v)),
        }
    }
}

struct ValueVisitor;

impl<'de> Visitor<'de> for ValueVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a msgpack value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> std::result::Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> std::result::Result<Value, E> {
        Ok(if v >= 0 { Value::UInt(v as u64) } else { Value::Int(v) })
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> std::result::Result<Value, E> {
        Ok(Value::UInt(v))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> std::result::Result<Value, E> {
        Ok(Value::Float(v))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<Value, E> {
        Ok(Value::Str(v.to_string()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> std::result::Result<Value, E> {
        Ok(Value::Str(v))
    }
    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> std::result::Result<Value, E> {
        Ok(Value::Bin(v.to_vec()))
    }
    fn visit_unit<E: de::Error>(self) -> std::result::Result<Value, E> {
        Ok(Value::Nil)
    }
    fn visit_none<E: de::Error>(self) -> std::result::Result<Value, E> {
        Ok(Value::Nil)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> std::result::Result<Value, D::Error> {
        Value::deserialize(d)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(RESERVE_LIMIT));
        while let Some(v) = seq.next_element::<Value>()? {
            items.push(v);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Value, A::Error> {
        let mut entries: Vec<(String, Value)> =
            Vec::with_capacity(map.size_hint().unwrap_or(0).min(RESERVE_LIMIT));
        // Keys seen, once the map is too big for a linear scan to refuse a key given twice.
        let mut seen: Option<HashSet<String>> = None;
        while let Some(key) = map.next_key::<MapKey>()? {
            let key = match key {
                MapKey::Str(s) => s,
                MapKey::Other => {
                    // Not a str: the entry is ignored (docs/PROTOCOL.md), its value skipped whole.
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
            };
            let repeated = match seen.as_mut() {
                Some(set) => !set.insert(key.clone()),
                None => entries.iter().any(|(k, _)| *k == key),
            };
            if repeated {
                return Err(de::Error::custom(format!("key \"{}\" appears twice", key)));
            }
            if seen.is_none() && entries.len() >= 16 {
                let mut set: HashSet<String> = entries.iter().map(|(k, _)| k.clone()).collect();
                set.insert(key.clone());
                seen = Some(set);
            }
            let value = map.next_value::<Value>()?;
            entries.push((key, value));
        }
        Ok(Value::Map(entries))
    }
}

/// A map's key as read: a str, or any other value, read whole and not kept.
enum MapKey {
    Str(String),
    Other,
}

struct MapKeyVisitor;

impl<'de> Visitor<'de> for MapKeyVisitor {
    type Value = MapKey;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a msgpack map key")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<MapKey, E> {
        Ok(MapKey::Str(v.to_string()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> std::result::Result<MapKey, E> {
        Ok(MapKey::Str(v))
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> std::result::Result<MapKey, E> {
        Ok(MapKey::Other)
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> std::result::Result<MapKey, E> {
        Ok(MapKey::Other)
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> std::result::Result<MapKey, E> {
        Ok(MapKey::Other)
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> std::result::Result<MapKey, E> {
        Ok(MapKey::Other)
    }
    fn visit_bytes<E: de::Error>(self, _: &[u8]) -> std::result::Result<MapKey, E> {
        Ok(MapKey::Other)
    }
    fn visit_unit<E: de::Error>(self) -> std::result::Result<MapKey, E> {
        Ok(MapKey::Other)
    }
    fn visit_none<E: de::Error>(self) -> std::result::Result<MapKey, E> {
        Ok(MapKey::Other)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> std::result::Result<MapKey, D::Error> {
        IgnoredAny::deserialize(d).map(|_| MapKey::Other)
    }
    // An ext value comes as a newtype of its type and data.
    fn visit_newtype_struct<D: Deserializer<'de>>(
        self,
        d: D,
    ) -> std::result::Result<MapKey, D::Error> {
        IgnoredAny::deserialize(d).map(|_| MapKey::Other)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<MapKey, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(MapKey::Other)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<MapKey, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(MapKey::Other)
    }
}

impl<'de> Deserialize<'de> for MapKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<MapKey, D::Error> {
        d.deserialize_any(MapKeyVisitor)
    }
}

impl<'de> Deserialize<'de> for Value {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Value, D::Error> {
        d.deserialize_any(ValueVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_then_decode() {
        let v = Value::Map(vec![
            ("type".into(), Value::Str("HELLO".into())),
            ("id".into(), Value::UInt(1)),
            ("n".into(), Value::Int(-5)),
            ("f".into(), Value::Float(1.5)),
            ("a".into(), Value::Array(vec![Value::Nil, Value::Bool(true)])),
        ]);
        let mut out = Vec::new();
        v.encode(&mut out);
        assert_eq!(Value::decode(&out), Ok(v.clone()), "{:x?}", out);
        // Every truncation, and a trailing byte, is refused, never a panic.
        for cut in 0..out.len() {
            assert_eq!(Value::decode(&out[..cut]).map_err(|e| e.code), Err(Code::PARSE), "cut {}", cut);
        }
        out.push(0xc0);
        assert_eq!(Value::decode(&out).map_err(|e| e.code), Err(Code::PARSE));
    }

    #[test]
    fn hostile_payloads_are_refused() {
        let deep: Vec<u8> = std::iter::repeat(0x91).take(100).chain(std::iter::once(0xc0)).collect();
        assert_eq!(Value::decode(&deep).map_err(|e| e.code), Err(Code::PARSE));
        // An array32 declaring 4 billion values in 5 bytes; a str32 of 4 GiB.
        assert!(Value::decode(&[0xdd, 0xff, 0xff, 0xff, 0xff]).is_err());
        assert!(Value::decode(&[0xdb, 0xff, 0xff, 0xff, 0xff, b'x']).is_err());
        // A key given twice.
        assert!(Value::decode(&[0x82, 0xa1, b'a', 0x01, 0xa1, b'a', 0x02]).is_err());
        // Every byte pattern of two bytes decodes or is refused, without a panic.
        for a in 0..=255u8 {
            for b in 0..=255u8 {
                let _ = Value::decode(&[a, b]);
            }
        }
    }
    #[test]
    fn entries_whose_key_is_not_a_str_are_ignored() {
        // Keys of every other type (int, negative int, nil, bool, float, bin, array, map, ext),
        // each with a value that nests and holds names the reader looks for, in two maps.
        let value = [
            0x92, 0x01, 0x82, 0xa4, b't', b'y', b'p', b'e', 0xa1, b'x', 0x05, 0x91, 0xa2, b'i',
            b'd',
        ];
        let keys: [&[u8]; 9] = [
            &[0x07],
            &[0xfd],
            &[0xc0],
            &[0xc3],
            &[0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0],
            &[0xc4, 0x04, b't', b'y', b'p', b'e'],
            &[0x92, 0xa2, b'i', b'd', 0x91, 0x02],
            &[0x81, 0xa4, b't', b'y', b'p', b'e', 0x81, 0xa1, b'x', 0x01],
            &[0xd4, 0x01, 0x02],
        ];
        let odd = |range: std::ops::Range<usize>| -> Vec<u8> {
            keys[range].iter().flat_map(|k| k.iter().chain(value.iter()).copied()).collect()
        };
        let mut item = vec![0x80 | 10];
        item.extend(odd(0..5));
        item.extend_from_slice(&[0xa6, b's', b't', b'a', b't', b'u', b's', 0xf1]);
        item.extend(odd(5..9));
        let mut reply = vec![0x80 | 11];
        reply.extend(odd(0..4));
        reply.extend_from_slice(&[0xa4, b't', b'y', b'p', b'e', 0xa3, b'A', b'C', b'K']);
        reply.extend_from_slice(&[0xa5, b'i', b't', b'e', b'm', b's', 0x91]);
        reply.extend(item);
        reply.extend(odd(4..9));
        let want = Value::Map(vec![
            ("type".into(), Value::Str("ACK".into())),
            (
                "items".into(),
                Value::Array(vec![Value::Map(vec![("status".into(), Value::Int(-15))])]),
            ),
        ]);
        assert_eq!(Value::decode(&reply), Ok(want), "{:x?}", reply);
        let mut only_odd = vec![0x80 | 9];
        only_odd.extend(odd(0..9));
        assert_eq!(Value::decode(&only_odd), Ok(Value::Map(vec![])));
    }
}
