//! `Vec<u8>` fields as one byte string (`#[serde(with = "crate::bytes")]`).
//!
//! serde hands a plain `Vec<u8>` to the format one element at a time;
//! postcard then writes each byte through its serializer, about fifty
//! instructions a byte in root's encoder. As a byte string the same field
//! goes out in one call. The wire is the same either way: postcard writes a
//! sequence as its length (varint) and each `u8` as itself, and a byte
//! string as its length (varint) and the bytes. A format that tells the
//! two apart (JSON) reads both back.

use alloc::vec::Vec;
use core::fmt;
use serde::de::{Deserializer, Error, SeqAccess, Visitor};
use serde::Serializer;

/// Writes `v` as one byte string.
pub(crate) fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_bytes(v)
}

/// Reads a byte string, or a sequence of bytes.
pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
    d.deserialize_byte_buf(BytesVisitor)
}

struct BytesVisitor;

impl<'de> Visitor<'de> for BytesVisitor {
    type Value = Vec<u8>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a byte string")
    }

    fn visit_bytes<E: Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
        let mut out = Vec::new();
        out.try_reserve_exact(v.len())
            .map_err(|_| E::custom("no memory for a byte string"))?;
        out.extend_from_slice(v);
        Ok(out)
    }

    fn visit_byte_buf<E: Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
        Ok(v)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
        let mut out = Vec::new();
        while let Some(b) = seq.next_element::<u8>()? {
            out.try_reserve(1)
                .map_err(|_| A::Error::custom("no memory for a byte string"))?;
            out.push(b);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use alloc::vec::Vec;
    use serde::{Deserialize, Serialize};

    #[derive(Serialize, Deserialize, Debug, PartialEq)]
    struct Plain {
        a: u32,
        data: Vec<u8>,
    }

    #[derive(Serialize, Deserialize, Debug, PartialEq)]
    struct AsBytes {
        a: u32,
        #[serde(with = "crate::bytes")]
        data: Vec<u8>,
    }

    /// The wire does not change: each form reads the other's bytes.
    #[test]
    fn a_byte_string_is_the_sequence_on_the_wire() {
        for len in [0usize, 1, 127, 128, 300, 3000] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
            let plain = postcard::to_allocvec(&Plain {
                a: 9,
                data: data.clone(),
            })
            .unwrap();
            let bytes = postcard::to_allocvec(&AsBytes {
                a: 9,
                data: data.clone(),
            })
            .unwrap();
            assert_eq!(plain, bytes, "{len} bytes");
            let back: AsBytes = postcard::from_bytes(&plain).unwrap();
            assert_eq!(back.data, data);
            let back: Plain = postcard::from_bytes(&bytes).unwrap();
            assert_eq!(back.data, data);
        }
    }
}
