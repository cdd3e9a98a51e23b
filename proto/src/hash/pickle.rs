//! A pickle protocol 5 encoder for [`PyValue`], byte-identical to CPython's C pickler
//! (`pickle.dumps(obj, protocol=5)`) for the value shapes vLLM hashes.
//!
//! What CPython does, and so what this does:
//! * `PROTO 5` (`80 05`) is written outside any frame; everything after it goes into
//!   frames: `FRAME` (`95`) + 8-byte little-endian length. A frame is closed at the start of
//!   the next `save()` of an object once it holds at least 64 KiB, and at the end. A frame
//!   shorter than 4 bytes loses its header (`pickle.dumps(None, protocol=5)` is `80 05 4e 2e`).
//!   A `bytes`/`str` payload of 64 KiB or more closes the frame and is written unframed.
//! * ints: `BININT1` (`4b`) for 0..=255, `BININT2` (`4d`) for 256..=65535, `BININT` (`4a`) for
//!   the rest of the signed 32-bit range, else `LONG1` (`8a`, < 256 bytes) / `LONG4` (`8b`)
//!   with CPython's minimal little-endian two's complement. Ints are never memoized.
//! * `bytes`: `SHORT_BINBYTES` (`43`) / `BINBYTES` (`42`) / `BINBYTES8` (`8e`), then `MEMOIZE`.
//! * `str`: `SHORT_BINUNICODE` (`8c`) / `BINUNICODE` (`58`) / `BINUNICODE8` (`8d`), then `MEMOIZE`.
//! * tuples: `EMPTY_TUPLE` (`29`, not memoized); `TUPLE1/2/3` (`85/86/87`); longer ones
//!   `MARK` (`28`) … `TUPLE` (`74`); then `MEMOIZE` (`94`).
//! * `None` is `4e`; `STOP` is `2e`.
//!
//! # The memo (fragile case)
//! CPython memoizes by object identity: pickling the *same object* a second time writes
//! `BINGET idx` (`68`, or `LONG_BINGET` `6a` past index 255) instead of the object. Whether
//! two equal Python strings are the same object depends on how the engine built them
//! (code literals are interned; strings built at run time are not), which a foreign
//! reimplementation cannot observe. This encoder treats [`PyValue::InternedStr`] as one
//! object per distinct value (later occurrences become memo references, as CPython does
//! for a literal such as vLLM's `"mm"` tag repeated in one block's extra keys) and every
//! other value as a distinct object (never referenced back). An engine that reuses one
//! run-time string object twice in the same hashed tuple (e.g. the same multimodal
//! identifier object in two extra keys of a block) would pickle a memo reference this
//! encoder does not know about; `sha256_cbor` has no such ambiguity.

use std::collections::HashMap;

use super::value::{PyInt, PyValue};

/// Frame payloads are closed once they reach this many bytes (CPython `FRAME_SIZE_TARGET`).
const FRAME_SIZE_TARGET: usize = 64 * 1024;
/// Frames shorter than this lose their header (CPython `FRAME_SIZE_MIN`).
const FRAME_SIZE_MIN: usize = 4;
/// `FRAME` opcode plus its 8-byte length.
const FRAME_HEADER_SIZE: usize = 9;

/// `pickle.dumps(value, protocol=5)` as CPython's C pickler writes it.
pub fn dumps(value: &PyValue) -> Vec<u8> {
    let mut p = Pickler { out: vec![0x80, 5], frame_start: None, framing: true, memo: HashMap::new(), memo_len: 0 };
    p.save(value);
    p.write(&[0x2e]); // STOP
    p.commit_frame();
    p.out
}

struct Pickler<'a> {
    out: Vec<u8>,
    /// Offset of the open frame's header, if a frame is open.
    frame_start: Option<usize>,
    /// Off while an oversized `bytes`/`str` payload is written outside any frame.
    framing: bool,
    /// Interned strings already pickled, with their memo index.
    memo: HashMap<&'a str, u32>,
    /// Number of memo entries so far (every `MEMOIZE` takes the next index).
    memo_len: u32,
}

impl<'a> Pickler<'a> {
    fn write(&mut self, data: &[u8]) {
        if self.framing && self.frame_start.is_none() {
            self.frame_start = Some(self.out.len());
            self.out.extend_from_slice(&[0u8; FRAME_HEADER_SIZE]);
        }
        self.out.extend_from_slice(data);
    }

    fn commit_frame(&mut self) {
        let Some(start) = self.frame_start.take() else {
            return;
        };
        let len = self.out.len() - start - FRAME_HEADER_SIZE;
        if len >= FRAME_SIZE_MIN {
            self.out[start] = 0x95;
            self.out[start + 1..start + FRAME_HEADER_SIZE].copy_from_slice(&(len as u64).to_le_bytes());
        } else {
            self.out.drain(start..start + FRAME_HEADER_SIZE);
        }
    }

    /// Called where CPython starts saving an object: a full frame is closed here.
    fn opcode_boundary(&mut self) {
        if let Some(start) = self.frame_start {
            if self.out.len() - start - FRAME_HEADER_SIZE >= FRAME_SIZE_TARGET {
                self.commit_frame();
            }
        }
    }

    fn memoize(&mut self) {
        self.write(&[0x94]);
        self.memo_len += 1;
    }

    fn save(&mut self, value: &'a PyValue) {
        self.opcode_boundary();
        match value {
            PyValue::None => self.write(&[0x4e]),
            PyValue::Int(i) => self.save_int(i),
            PyValue::Bytes(b) => {
                self.save_sized(b, [0x43, 0x42, 0x8e]);
                self.memoize();
            }
            PyValue::Str(s) => {
                self.save_sized(s.as_bytes(), [0x8c, 0x58, 0x8d]);
                self.memoize();
            }
            PyValue::InternedStr(s) => {
                if let Some(&idx) = self.memo.get(s.as_str()) {
                    self.save_get(idx);
                } else {
                    self.save_sized(s.as_bytes(), [0x8c, 0x58, 0x8d]);
                    self.memo.insert(s.as_str(), self.memo_len);
                    self.memoize();
                }
            }
            PyValue::Tuple(items) => self.save_tuple(items),
        }
    }

    fn save_get(&mut self, idx: u32) {
        if idx < 256 {
            self.write(&[0x68, idx as u8]);
        } else {
            let mut op = vec![0x6a];
            op.extend_from_slice(&idx.to_le_bytes());
            self.write(&op);
        }
    }

    /// Writes a length-prefixed payload with the short (u8), u32 or u64 length opcode.
    fn save_sized(&mut self, data: &[u8], ops: [u8; 3]) {
        let mut header = Vec::with_capacity(9);
        if data.len() < 256 {
            header.extend_from_slice(&[ops[0], data.len() as u8]);
        } else if let Ok(n) = u32::try_from(data.len()) {
            header.push(ops[1]);
            header.extend_from_slice(&n.to_le_bytes());
        } else {
            header.push(ops[2]);
            header.extend_from_slice(&(data.len() as u64).to_le_bytes());
        }
        if data.len() >= FRAME_SIZE_TARGET {
            // CPython writes big payloads outside any frame.
            self.commit_frame();
            self.framing = false;
            self.write(&header);
            self.write(data);
            self.framing = true;
        } else {
            self.write(&header);
            self.write(data);
        }
    }

    fn save_int(&mut self, v: &PyInt) {
        if let Some(small) = v.to_i128().filter(|x| i32::try_from(*x).is_ok()) {
            let x = small as i32;
            if (0..=0xff).contains(&x) {
                self.write(&[0x4b, x as u8]);
            } else if (0..=0xffff).contains(&x) {
                let b = (x as u16).to_le_bytes();
                self.write(&[0x4d, b[0], b[1]]);
            } else {
                let mut op = vec![0x4a];
                op.extend_from_slice(&x.to_le_bytes());
                self.write(&op);
            }
            return;
        }
        // CPython: nbytes = (bit_length >> 3) + 1, minus one redundant sign byte for
        // negatives whose top byte is 0xff over a byte with its high bit set.
        let mut nbytes = (v.bit_length() >> 3) + 1;
        let mut data = v.twos_complement_le(nbytes);
        if v.is_negative() && nbytes > 1 && data[nbytes - 1] == 0xff && data[nbytes - 2] & 0x80 != 0 {
            nbytes -= 1;
            data.truncate(nbytes);
        }
        let mut op = Vec::with_capacity(nbytes + 5);
        if nbytes < 256 {
            op.extend_from_slice(&[0x8a, nbytes as u8]);
        } else {
            op.push(0x8b);
            op.extend_from_slice(&(nbytes as u32).to_le_bytes());
        }
        op.extend_from_slice(&data);
        self.write(&op);
    }

    fn save_tuple(&mut self, items: &'a [PyValue]) {
        match items.len() {
            0 => {
                self.write(&[0x29]);
                return;
            }
            1..=3 => {
                for item in items {
                    self.save(item);
                }
                self.write(&[[0x85, 0x86, 0x87][items.len() - 1]]);
            }
            _ => {
                self.write(&[0x28]);
                for item in items {
                    self.save(item);
                }
                self.write(&[0x74]);
            }
        }
        self.memoize();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    // Expected bytes below are CPython 3.11 `pickle.dumps(x, protocol=5).hex()`.
    #[test]
    fn scalars_match_cpython() {
        let cases: Vec<(PyValue, &str)> = vec![
            (PyValue::None, "80054e2e"),
            (PyValue::int(1u64), "80054b012e"),
            (PyValue::str("ab"), "80059506000000000000008c026162942e"),
            (PyValue::bytes(vec![]), "80059504000000000000004300942e"),
            (PyValue::str(""), "80059504000000000000008c00942e"),
            (PyValue::Tuple(vec![]), "8005292e"),
            (PyValue::int(-(1i64 << 31) - 1), "80059508000000000000008a05ffffff7fff2e"),
            (PyValue::int(-(1i64 << 39)), "80059508000000000000008a0500000000802e"),
            (PyValue::int(1u128 << 64), "8005950c000000000000008a090000000000000000012e"),
            (PyValue::int(-1i64), "80059506000000000000004affffffff2e"),
            (PyValue::int(1i64 << 31), "80059508000000000000008a0500000080002e"),
            (PyValue::int(-(1i64 << 31)), "80059506000000000000004a000000802e"),
        ];
        for (v, want) in cases {
            assert_eq!(hex(&dumps(&v)), want, "{v:?}");
        }
    }

    #[test]
    fn huge_int_uses_long4() {
        let mut mag = vec![0u8; 263];
        mag[0] = 0x10; // 2**2100
        let v = PyValue::Int(PyInt::from_be_bytes_unsigned(&mag));
        assert_eq!(hex(&dumps(&v)[..12]), "8005950d010000000000008b");
    }

    #[test]
    fn seed_string_matches_spec() {
        // Spec §3: pickle of "vllm-none-hash".
        let got = dumps(&PyValue::str("vllm-none-hash"));
        let mut want = vec![0x80, 0x05, 0x95, 0x12, 0, 0, 0, 0, 0, 0, 0, 0x8c, 0x0e];
        want.extend_from_slice(b"vllm-none-hash");
        want.extend_from_slice(&[0x94, 0x2e]);
        assert_eq!(got, want);
    }
}
