//! The Python values that vLLM hashes: a tiny model of `None`, `int`, `bytes`, `str` and
//! `tuple`, enough to serialise `(parent, tuple(token_ids), extra_keys)` exactly as CPython
//! (pickle) or cbor2 (CBOR) does.

/// A Python `int` of any size: sign and big-endian magnitude without leading zero bytes.
///
/// Zero has an empty magnitude and is never negative.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PyInt {
    negative: bool,
    magnitude: Vec<u8>,
}

impl PyInt {
    /// Builds an int from a sign and a big-endian magnitude (leading zeros are trimmed).
    pub fn from_sign_magnitude(negative: bool, magnitude_be: &[u8]) -> Self {
        let first = magnitude_be.iter().position(|&b| b != 0).unwrap_or(magnitude_be.len());
        let magnitude = magnitude_be[first..].to_vec();
        let negative = negative && !magnitude.is_empty();
        Self { negative, magnitude }
    }

    /// `int.from_bytes(bytes, "big")`: the non-negative int of a big-endian byte string.
    pub fn from_be_bytes_unsigned(bytes: &[u8]) -> Self {
        Self::from_sign_magnitude(false, bytes)
    }

    /// Whether the int is below zero.
    pub fn is_negative(&self) -> bool {
        self.negative
    }

    /// Whether the int is zero.
    pub fn is_zero(&self) -> bool {
        self.magnitude.is_empty()
    }

    /// The absolute value, big-endian, no leading zero bytes (empty for zero).
    pub fn magnitude_be(&self) -> &[u8] {
        &self.magnitude
    }

    /// Number of bits of the absolute value (Python's `abs(x).bit_length()`).
    pub fn bit_length(&self) -> usize {
        match self.magnitude.first() {
            None => 0,
            Some(&top) => (self.magnitude.len() - 1) * 8 + (8 - top.leading_zeros() as usize),
        }
    }

    /// The value as an `i128` when it fits.
    pub fn to_i128(&self) -> Option<i128> {
        if self.magnitude.len() > 16 {
            return None;
        }
        let mut buf = [0u8; 16];
        buf[16 - self.magnitude.len()..].copy_from_slice(&self.magnitude);
        let m = u128::from_be_bytes(buf);
        if self.negative {
            if m <= i128::MAX as u128 + 1 {
                Some((m as i128).wrapping_neg())
            } else {
                None
            }
        } else {
            i128::try_from(m).ok()
        }
    }

    /// Two's complement little-endian bytes of exactly `len` bytes (the value must fit).
    pub(crate) fn twos_complement_le(&self, len: usize) -> Vec<u8> {
        let mut out: Vec<u8> = self.magnitude.iter().rev().copied().collect();
        out.resize(len, 0);
        if self.negative {
            // -m = !m + 1 in two's complement.
            let mut carry = true;
            for b in out.iter_mut() {
                let (v, c) = (!*b).overflowing_add(u8::from(carry));
                *b = v;
                carry = c;
            }
        }
        out
    }
}

impl From<u64> for PyInt {
    fn from(v: u64) -> Self {
        Self::from_sign_magnitude(false, &v.to_be_bytes())
    }
}

impl From<i64> for PyInt {
    fn from(v: i64) -> Self {
        Self::from_sign_magnitude(v < 0, &v.unsigned_abs().to_be_bytes())
    }
}

impl From<u32> for PyInt {
    fn from(v: u32) -> Self {
        u64::from(v).into()
    }
}

impl From<i32> for PyInt {
    fn from(v: i32) -> Self {
        i64::from(v).into()
    }
}

impl From<u128> for PyInt {
    fn from(v: u128) -> Self {
        Self::from_sign_magnitude(false, &v.to_be_bytes())
    }
}

impl From<i128> for PyInt {
    fn from(v: i128) -> Self {
        Self::from_sign_magnitude(v < 0, &v.unsigned_abs().to_be_bytes())
    }
}

/// A Python value as vLLM feeds it to its block hash function.
///
/// Strings come in two flavours because pickle memoizes by *object identity*: CPython
/// emits a back-reference (`BINGET`) instead of the string when the very same object is
/// pickled twice. [`PyValue::Str`] is a fresh object every time it appears;
/// [`PyValue::InternedStr`] models an interned string (a code literal such as the `"mm"`
/// tag of vLLM 0.31+ extra keys), so two equal interned strings in one value are the same
/// object and the second one is pickled as a memo reference. CBOR makes no difference.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum PyValue {
    /// `None`.
    None,
    /// `int`.
    Int(PyInt),
    /// `bytes`.
    Bytes(Vec<u8>),
    /// `str`, a distinct object at each occurrence.
    Str(String),
    /// `str`, an interned object: equal interned strings are one object.
    InternedStr(String),
    /// `tuple`.
    Tuple(Vec<PyValue>),
}

impl PyValue {
    /// An `int` value.
    pub fn int(v: impl Into<PyInt>) -> Self {
        PyValue::Int(v.into())
    }

    /// A fresh `str` value.
    pub fn str(s: impl Into<String>) -> Self {
        PyValue::Str(s.into())
    }

    /// An interned `str` value (a code literal).
    pub fn interned(s: impl Into<String>) -> Self {
        PyValue::InternedStr(s.into())
    }

    /// A `bytes` value.
    pub fn bytes(b: impl Into<Vec<u8>>) -> Self {
        PyValue::Bytes(b.into())
    }

    /// A tuple of token ids, `tuple(token_ids)`.
    pub fn token_tuple(tokens: &[u64]) -> Self {
        PyValue::Tuple(tokens.iter().map(|&t| PyValue::int(t)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int_conversions_round_trip_through_i128() {
        for v in [0i128, 1, -1, 255, -256, i64::MIN as i128, u64::MAX as i128, i128::MIN] {
            assert_eq!(PyInt::from(v).to_i128(), Some(v), "{v}");
        }
        assert!(PyInt::from(0u64).is_zero());
        assert!(!PyInt::from_sign_magnitude(true, &[0, 0]).is_negative());
        assert_eq!(PyInt::from(256u64).bit_length(), 9);
        assert_eq!(PyInt::from(-1i64).twos_complement_le(2), vec![0xff, 0xff]);
        assert_eq!(PyInt::from(-256i64).twos_complement_le(2), vec![0x00, 0xff]);
    }
}
