//! Canonical CBOR for [`PyValue`], byte-identical to `cbor2.dumps(x, canonical=True)` for
//! the value shapes vLLM hashes (`sha256_cbor`, `xxhash_cbor`, and `sha256_cbor_64bit`).
//!
//! * `None` → `f6`; tuple → array (major 4); `bytes` → major 2; `str` → major 3 (UTF-8).
//! * int in `-2**64 ..= 2**64 - 1` → major 0 / major 1 (`-1 - n`) with the shortest head;
//!   larger magnitudes → tag 2 / tag 3 bignum over the minimal big-endian bytes of
//!   `n` / `-1 - n`, as cbor2 does.
//!
//! Interned and plain strings encode the same; CBOR has no memo.

use super::value::{PyInt, PyValue};

/// `cbor2.dumps(value, canonical=True)`.
pub fn dumps(value: &PyValue) -> Vec<u8> {
    let mut out = Vec::new();
    encode(value, &mut out);
    out
}

fn head(major: u8, n: u64, out: &mut Vec<u8>) {
    let m = major << 5;
    if n < 24 {
        out.push(m | n as u8);
    } else if n <= 0xff {
        out.extend_from_slice(&[m | 24, n as u8]);
    } else if n <= 0xffff {
        out.push(m | 25);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else if n <= 0xffff_ffff {
        out.push(m | 26);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    } else {
        out.push(m | 27);
        out.extend_from_slice(&n.to_be_bytes());
    }
}

fn encode(value: &PyValue, out: &mut Vec<u8>) {
    match value {
        PyValue::None => out.push(0xf6),
        PyValue::Int(i) => encode_int(i, out),
        PyValue::Bytes(b) => {
            head(2, b.len() as u64, out);
            out.extend_from_slice(b);
        }
        PyValue::Str(s) | PyValue::InternedStr(s) => {
            head(3, s.len() as u64, out);
            out.extend_from_slice(s.as_bytes());
        }
        PyValue::Tuple(items) => {
            head(4, items.len() as u64, out);
            for item in items {
                encode(item, out);
            }
        }
    }
}

/// Big-endian magnitude minus one (`|x| - 1`), minimal; used for negative ints.
fn magnitude_minus_one(mag: &[u8]) -> Vec<u8> {
    let mut v = mag.to_vec();
    for b in v.iter_mut().rev() {
        if *b == 0 {
            *b = 0xff;
        } else {
            *b -= 1;
            break;
        }
    }
    let first = v.iter().position(|&b| b != 0).unwrap_or(v.len());
    v.drain(..first);
    v
}

fn encode_int(i: &PyInt, out: &mut Vec<u8>) {
    // Negative n is carried as -1 - n = |n| - 1.
    let (major, payload) =
        if i.is_negative() { (1u8, magnitude_minus_one(i.magnitude_be())) } else { (0u8, i.magnitude_be().to_vec()) };
    if payload.len() <= 8 {
        let mut buf = [0u8; 8];
        buf[8 - payload.len()..].copy_from_slice(&payload);
        head(major, u64::from_be_bytes(buf), out);
    } else {
        // Bignum: tag 2 (positive) or 3 (negative) over a byte string.
        head(6, 2 + u64::from(major), out);
        head(2, payload.len() as u64, out);
        out.extend_from_slice(&payload);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn ints_use_the_shortest_head_and_bignum_tags() {
        let cases: Vec<(PyValue, &str)> = vec![
            (PyValue::int(0u64), "00"),
            (PyValue::int(23u64), "17"),
            (PyValue::int(24u64), "1818"),
            (PyValue::int(300u64), "19012c"),
            (PyValue::int(70000u64), "1a00011170"),
            (PyValue::int(u64::MAX), "1bffffffffffffffff"),
            (PyValue::int(-1i64), "20"),
            (PyValue::int(-25i64), "3818"),
            (PyValue::int(-(1i128 << 64)), "3bffffffffffffffff"),
            (PyValue::int(1u128 << 64), "c249010000000000000000"),
            (PyValue::int(-(1i128 << 64) - 1), "c349010000000000000000"),
            (PyValue::str("a"), "6161"),
            (PyValue::interned("a"), "6161"),
            (PyValue::None, "f6"),
        ];
        for (v, want) in cases {
            assert_eq!(hex(&dumps(&v)), want, "{v:?}");
        }
    }

    #[test]
    fn spec_example_tuple() {
        // Spec §3: (NONE_HASH, (1,2,3,300,70000,5), None) → 83 5820<32B> 86 01 02 03 19012c 1a00011170 05 f6
        let digest = [0xabu8; 32];
        let v = PyValue::Tuple(vec![
            PyValue::bytes(digest.to_vec()),
            PyValue::token_tuple(&[1, 2, 3, 300, 70000, 5]),
            PyValue::None,
        ]);
        let want = format!("835820{}8601020319012c1a0001117005f6", "ab".repeat(32));
        assert_eq!(hex(&dumps(&v)), want);
    }
}
