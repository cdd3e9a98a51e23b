//! A zero-copy, panic-free msgpack cursor: just what the KV-event wire needs.
//!
//! Every read either returns a value and advances, or returns a [`MsgpackError`] and leaves the
//! cursor where it was. Lengths claimed by headers are never trusted for allocation: a container
//! that claims more elements than there are bytes left is reported as truncated before anything
//! is reserved. [`Reader::skip`] walks any value iteratively, so hostile nesting cannot overflow
//! the stack.

use std::fmt;

/// What went wrong reading msgpack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MsgpackError {
    /// The input ended inside a value.
    Truncated,
    /// A marker byte of a different type than the reader asked for (the marker is kept).
    Type(u8),
    /// A string that is not UTF-8.
    Utf8,
    /// A marker that msgpack never uses (`0xc1`).
    Reserved,
    /// A string of this many bytes where the field allows fewer.
    TooLong(usize),
}

impl fmt::Display for MsgpackError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MsgpackError::Truncated => f.write_str("truncated msgpack"),
            MsgpackError::Type(m) => write!(f, "unexpected msgpack marker 0x{m:02x}"),
            MsgpackError::Utf8 => f.write_str("string is not utf-8"),
            MsgpackError::Reserved => f.write_str("reserved msgpack marker 0xc1"),
            MsgpackError::TooLong(n) => write!(f, "string of {n} bytes, longer than the field allows"),
        }
    }
}

impl std::error::Error for MsgpackError {}

/// An integer as msgpack carries it: unsigned when non-negative, signed when negative.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Int {
    /// `0 ..= u64::MAX`.
    U(u64),
    /// A negative value.
    I(i64),
}

impl Int {
    /// The 64-bit pattern: unsigned values as they are, negative ones as two's complement.
    pub fn bits(self) -> u64 {
        match self {
            Int::U(u) => u,
            Int::I(i) => i as u64,
        }
    }

    /// The value as `i64`, if it fits.
    pub fn to_i64(self) -> Option<i64> {
        match self {
            Int::U(u) => i64::try_from(u).ok(),
            Int::I(i) => Some(i),
        }
    }

    /// The value as `u32`, if it fits.
    pub fn to_u32(self) -> Option<u32> {
        match self {
            Int::U(u) => u32::try_from(u).ok(),
            Int::I(_) => None,
        }
    }
}

/// The broad type of the next value, for decoders that accept several shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Nil,
    Bool,
    Int,
    Float,
    Str,
    Bin,
    Array,
    Map,
    Ext,
}

/// A cursor over one msgpack buffer.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    /// Bytes consumed so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Bytes not yet read.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// The bytes between two positions of this reader.
    pub fn slice(&self, from: usize, to: usize) -> &'a [u8] {
        &self.buf[from.min(self.buf.len())..to.min(self.buf.len())]
    }

    fn peek_byte(&self) -> Result<u8, MsgpackError> {
        self.buf.get(self.pos).copied().ok_or(MsgpackError::Truncated)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], MsgpackError> {
        let end = self.pos.checked_add(n).ok_or(MsgpackError::Truncated)?;
        let s = self.buf.get(self.pos..end).ok_or(MsgpackError::Truncated)?;
        self.pos = end;
        Ok(s)
    }

    fn be(&mut self, n: usize) -> Result<u64, MsgpackError> {
        Ok(self.take(n)?.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
    }

    /// The type of the next value, without consuming it.
    pub fn peek_kind(&self) -> Result<Kind, MsgpackError> {
        let m = self.peek_byte()?;
        Ok(match m {
            0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xd3 => Kind::Int,
            0x80..=0x8f | 0xde | 0xdf => Kind::Map,
            0x90..=0x9f | 0xdc | 0xdd => Kind::Array,
            0xa0..=0xbf | 0xd9..=0xdb => Kind::Str,
            0xc0 => Kind::Nil,
            0xc2 | 0xc3 => Kind::Bool,
            0xc4..=0xc6 => Kind::Bin,
            0xca | 0xcb => Kind::Float,
            0xc7..=0xc9 | 0xd4..=0xd8 => Kind::Ext,
            0xc1 => return Err(MsgpackError::Reserved),
        })
    }

    /// Consumes a nil if one is next; says whether it did.
    pub fn eat_nil(&mut self) -> bool {
        if self.buf.get(self.pos) == Some(&0xc0) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    /// Restores the cursor after a failed typed read.
    fn typed<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T, MsgpackError>) -> Result<T, MsgpackError> {
        let start = self.pos;
        let r = f(self);
        if r.is_err() {
            self.pos = start;
        }
        r
    }

    /// Reads an array header; the length is checked against the bytes left.
    pub fn array_len(&mut self) -> Result<usize, MsgpackError> {
        self.typed(|r| {
            let n = r.array_header()?;
            r.check_claim(n, 1)
        })
    }

    /// Reads an array header and returns the length it claims, unchecked: for a reader that
    /// walks the elements one by one and stops where the input ends (a cut batch keeps the
    /// events before the cut). Never size an allocation by it.
    pub fn array_header(&mut self) -> Result<u64, MsgpackError> {
        self.typed(|r| {
            let m = r.peek_byte()?;
            match m {
                0x90..=0x9f => {
                    r.pos += 1;
                    Ok(u64::from(m & 0x0f))
                }
                0xdc => {
                    r.pos += 1;
                    r.be(2)
                }
                0xdd => {
                    r.pos += 1;
                    r.be(4)
                }
                _ => Err(MsgpackError::Type(m)),
            }
        })
    }

    /// Reads a map header; the entry count is checked against the bytes left.
    pub fn map_len(&mut self) -> Result<usize, MsgpackError> {
        self.typed(|r| {
            let m = r.peek_byte()?;
            let n = match m {
                0x80..=0x8f => {
                    r.pos += 1;
                    u64::from(m & 0x0f)
                }
                0xde => {
                    r.pos += 1;
                    r.be(2)?
                }
                0xdf => {
                    r.pos += 1;
                    r.be(4)?
                }
                _ => return Err(MsgpackError::Type(m)),
            };
            r.check_claim(n, 2)
        })
    }

    /// Every element takes at least one byte: a claim beyond that is a truncated message.
    fn check_claim(&self, n: u64, bytes_per_item: u64) -> Result<usize, MsgpackError> {
        let need = n.checked_mul(bytes_per_item).ok_or(MsgpackError::Truncated)?;
        if need > self.remaining() as u64 {
            return Err(MsgpackError::Truncated);
        }
        Ok(n as usize)
    }

    /// Reads any msgpack integer.
    pub fn int(&mut self) -> Result<Int, MsgpackError> {
        self.typed(|r| {
            let m = r.peek_byte()?;
            r.pos += 1;
            Ok(match m {
                0x00..=0x7f => Int::U(u64::from(m)),
                0xe0..=0xff => Int::I(i64::from(m as i8)),
                0xcc => Int::U(r.be(1)?),
                0xcd => Int::U(r.be(2)?),
                0xce => Int::U(r.be(4)?),
                0xcf => Int::U(r.be(8)?),
                0xd0 => signed(r.be(1)? as u8 as i8 as i64),
                0xd1 => signed(r.be(2)? as u16 as i16 as i64),
                0xd2 => signed(r.be(4)? as u32 as i32 as i64),
                0xd3 => signed(r.be(8)? as i64),
                _ => return Err(MsgpackError::Type(m)),
            })
        })
    }

    /// Reads a float (32 or 64 bit) or an integer, as `f64`.
    pub fn number(&mut self) -> Result<f64, MsgpackError> {
        match self.peek_byte()? {
            0xca => self.typed(|r| {
                r.pos += 1;
                Ok(f64::from(f32::from_bits(r.be(4)? as u32)))
            }),
            0xcb => self.typed(|r| {
                r.pos += 1;
                Ok(f64::from_bits(r.be(8)?))
            }),
            _ => self.int().map(|i| match i {
                Int::U(u) => u as f64,
                Int::I(i) => i as f64,
            }),
        }
    }

    /// Reads a boolean.
    pub fn bool(&mut self) -> Result<bool, MsgpackError> {
        match self.peek_byte()? {
            0xc2 => {
                self.pos += 1;
                Ok(false)
            }
            0xc3 => {
                self.pos += 1;
                Ok(true)
            }
            m => Err(MsgpackError::Type(m)),
        }
    }

    /// Reads a string, borrowed from the buffer.
    pub fn str(&mut self) -> Result<&'a str, MsgpackError> {
        self.typed(|r| {
            let m = r.peek_byte()?;
            r.pos += 1;
            let n = match m {
                0xa0..=0xbf => u64::from(m & 0x1f),
                0xd9 => r.be(1)?,
                0xda => r.be(2)?,
                0xdb => r.be(4)?,
                _ => return Err(MsgpackError::Type(m)),
            };
            let bytes = r.take(usize::try_from(n).map_err(|_| MsgpackError::Truncated)?)?;
            std::str::from_utf8(bytes).map_err(|_| MsgpackError::Utf8)
        })
    }

    /// Reads a byte string, borrowed from the buffer.
    pub fn bin(&mut self) -> Result<&'a [u8], MsgpackError> {
        self.typed(|r| {
            let m = r.peek_byte()?;
            r.pos += 1;
            let n = match m {
                0xc4 => r.be(1)?,
                0xc5 => r.be(2)?,
                0xc6 => r.be(4)?,
                _ => return Err(MsgpackError::Type(m)),
            };
            r.take(usize::try_from(n).map_err(|_| MsgpackError::Truncated)?)
        })
    }

    /// Skips one whole value of any type, iteratively (no recursion, so no nesting limit).
    pub fn skip(&mut self) -> Result<(), MsgpackError> {
        self.typed(|r| {
            let mut pending: u64 = 1;
            while pending > 0 {
                pending -= 1;
                let m = r.peek_byte()?;
                r.pos += 1;
                let (payload, items): (u64, u64) = match m {
                    0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (0, 0),
                    0x80..=0x8f => (0, 2 * u64::from(m & 0x0f)),
                    0x90..=0x9f => (0, u64::from(m & 0x0f)),
                    0xa0..=0xbf => (u64::from(m & 0x1f), 0),
                    0xc1 => return Err(MsgpackError::Reserved),
                    0xc4 | 0xd9 => (r.be(1)?, 0),
                    0xc5 | 0xda => (r.be(2)?, 0),
                    0xc6 | 0xdb => (r.be(4)?, 0),
                    0xc7 => (r.be(1)? + 1, 0),
                    0xc8 => (r.be(2)? + 1, 0),
                    0xc9 => (r.be(4)? + 1, 0),
                    0xca => (4, 0),
                    0xcb => (8, 0),
                    0xcc | 0xd0 => (1, 0),
                    0xcd | 0xd1 => (2, 0),
                    0xce | 0xd2 => (4, 0),
                    0xcf | 0xd3 => (8, 0),
                    0xd4 => (2, 0),
                    0xd5 => (3, 0),
                    0xd6 => (5, 0),
                    0xd7 => (9, 0),
                    0xd8 => (17, 0),
                    0xdc => (0, r.be(2)?),
                    0xdd => (0, r.be(4)?),
                    0xde => (0, 2 * r.be(2)?),
                    0xdf => (0, 2 * r.be(4)?),
                };
                r.take(usize::try_from(payload).map_err(|_| MsgpackError::Truncated)?)?;
                pending = pending.checked_add(items).ok_or(MsgpackError::Truncated)?;
                if pending > r.remaining() as u64 {
                    return Err(MsgpackError::Truncated);
                }
            }
            Ok(())
        })
    }
}

fn signed(v: i64) -> Int {
    if v < 0 {
        Int::I(v)
    } else {
        Int::U(v as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ints_in_every_width_read_back_exactly() {
        let cases: &[(&[u8], Int)] = &[
            (&[0x05], Int::U(5)),
            (&[0xff], Int::I(-1)),
            (&[0xe0], Int::I(-32)),
            (&[0xcc, 0xfe], Int::U(254)),
            (&[0xcd, 0x04, 0xd2], Int::U(1234)),
            (&[0xce, 0, 1, 0, 0], Int::U(65536)),
            (&[0xcf, 0xda, 0xb8, 0x9b, 0xaa, 0x7b, 0x58, 0x57, 0xc0], Int::U(15760518052499183552)),
            (&[0xd0, 0x80], Int::I(-128)),
            (&[0xd1, 0xff, 0x00], Int::I(-256)),
            (&[0xd2, 0xff, 0xff, 0xff, 0xfe], Int::I(-2)),
            (&[0xd3, 0x9a, 0x75, 0x87, 0x13, 0x5a, 0x2a, 0x66, 0x08], Int::I(-7316793502406646264)),
            (&[0xd3, 0, 0, 0, 0, 0, 0, 0, 7], Int::U(7)),
        ];
        for (bytes, want) in cases {
            let mut r = Reader::new(bytes);
            assert_eq!(r.int(), Ok(*want), "{bytes:02x?}");
            assert_eq!(r.remaining(), 0);
        }
        assert_eq!(Int::I(-1).bits(), u64::MAX);
    }

    #[test]
    fn a_failed_read_leaves_the_cursor_in_place() {
        let mut r = Reader::new(&[0xcf, 0x01]);
        assert_eq!(r.int(), Err(MsgpackError::Truncated));
        assert_eq!(r.position(), 0);
        assert_eq!(r.str(), Err(MsgpackError::Type(0xcf)));
        assert_eq!(r.position(), 0);
    }

    #[test]
    fn container_claims_beyond_the_input_are_truncation() {
        assert_eq!(Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff]).array_len(), Err(MsgpackError::Truncated));
        assert_eq!(Reader::new(&[0xdf, 0x10, 0, 0, 0, 1, 2]).map_len(), Err(MsgpackError::Truncated));
        assert_eq!(Reader::new(&[0x93, 1, 2, 3]).array_len(), Ok(3));
    }

    #[test]
    fn skip_walks_nested_values_and_rejects_deep_truncation() {
        // [1, {"a": [nil, true]}, "xy", bin(2), 1.5f64]
        let v = [
            0x95, 0x01, 0x81, 0xa1, b'a', 0x92, 0xc0, 0xc3, 0xa2, b'x', b'y', 0xc4, 0x02, 9, 9, 0xcb, 0x3f, 0xf8, 0, 0,
            0, 0, 0, 0, 0x07,
        ];
        let mut r = Reader::new(&v);
        r.skip().unwrap();
        assert_eq!(r.remaining(), 1);
        let deep = vec![0x91u8; 100_000];
        assert_eq!(Reader::new(&deep).skip(), Err(MsgpackError::Truncated));
        assert_eq!(Reader::new(&[0xc1]).skip(), Err(MsgpackError::Reserved));
    }

    #[test]
    fn floats_and_ints_read_as_numbers() {
        assert_eq!(Reader::new(&[0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0]).number(), Ok(1.5));
        assert_eq!(Reader::new(&[0xca, 0x3f, 0xc0, 0, 0]).number(), Ok(1.5));
        assert_eq!(Reader::new(&[0x07]).number(), Ok(7.0));
    }
}
