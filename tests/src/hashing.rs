//! Engine-style block hashes, so generated traffic carries hashes a real engine would publish
//! for the same tokens (and a relay that recomputes hashes can check them).
//!
//! - vLLM `sha256_cbor` (0.10.2+): `digest_i = SHA256(cbor((digest_{i-1}, tuple(tokens), None)))`
//!   with `digest_{-1} = NONE_HASH = SHA256(cbor("vllm-none-hash"))` (0.29+ without
//!   PYTHONHASHSEED); the event value is the digest's last 8 bytes, big-endian.
//! - SGLang (0.5.6+): `digest_i = SHA256([digest_{i-1}] || tokens as u32 LE)`, no prior digest
//!   for the first page; the event value is the digest's first 8 bytes as a signed i64.

use sha2::{Digest, Sha256};

pub type Digest32 = [u8; 32];

fn cbor_head(out: &mut Vec<u8>, major: u8, v: u64) {
    let m = major << 5;
    if v < 24 {
        out.push(m | v as u8);
    } else if v < 0x100 {
        out.extend_from_slice(&[m | 24, v as u8]);
    } else if v < 0x1_0000 {
        out.push(m | 25);
        out.extend_from_slice(&(v as u16).to_be_bytes());
    } else if v < 0x1_0000_0000 {
        out.push(m | 26);
        out.extend_from_slice(&(v as u32).to_be_bytes());
    } else {
        out.push(m | 27);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

/// vLLM's `NONE_HASH` for `sha256_cbor` seeded with `"vllm-none-hash"`.
pub fn vllm_none_hash() -> Digest32 {
    let seed = "vllm-none-hash";
    let mut cbor = Vec::new();
    cbor_head(&mut cbor, 3, seed.len() as u64);
    cbor.extend_from_slice(seed.as_bytes());
    Sha256::digest(&cbor).into()
}

/// One block of vLLM's `sha256_cbor` chain (no extra keys).
pub fn vllm_sha256_cbor(parent: &Digest32, tokens: &[u64]) -> Digest32 {
    let mut cbor = Vec::with_capacity(40 + tokens.len() * 3);
    cbor_head(&mut cbor, 4, 3);
    cbor_head(&mut cbor, 2, 32);
    cbor.extend_from_slice(parent);
    cbor_head(&mut cbor, 4, tokens.len() as u64);
    for &t in tokens {
        cbor_head(&mut cbor, 0, t);
    }
    cbor.push(0xf6); // None
    Sha256::digest(&cbor).into()
}

/// vLLM's event value of a digest: last 8 bytes, big-endian.
pub fn vllm_event_hash(d: &Digest32) -> u64 {
    u64::from_be_bytes(d[24..32].try_into().expect("8 bytes"))
}

/// One page of SGLang's chained SHA-256 (tokens as u32 little-endian).
pub fn sglang_page_hash(prior: Option<&Digest32>, tokens: &[u64]) -> Digest32 {
    let mut h = Sha256::new();
    if let Some(p) = prior {
        h.update(p);
    }
    for &t in tokens {
        h.update((t as u32).to_le_bytes());
    }
    h.finalize().into()
}

/// SGLang's event value of a digest: first 8 bytes, big-endian, signed.
pub fn sglang_event_hash(d: &Digest32) -> i64 {
    i64::from_be_bytes(d[0..8].try_into().expect("8 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    // Test vectors from docs/engine-wire-formats.md, sections 3 and 4.2.
    #[test]
    fn vllm_sha256_cbor_matches_spec_vectors() {
        let t0: Vec<u64> = (1..=16).collect();
        let t1: Vec<u64> = (17..=32).collect();
        let b0 = vllm_sha256_cbor(&vllm_none_hash(), &t0);
        let b1 = vllm_sha256_cbor(&b0, &t1);
        assert_eq!(vllm_event_hash(&b0), 8866452693264111234);
        assert_eq!(vllm_event_hash(&b1), 807986237951177663);
    }

    #[test]
    fn sglang_chain_matches_spec_vectors() {
        let t0: Vec<u64> = (1..=16).collect();
        let t1: Vec<u64> = (17..=32).collect();
        let p0 = sglang_page_hash(None, &t0);
        let p1 = sglang_page_hash(Some(&p0), &t1);
        assert_eq!(sglang_event_hash(&p0), 8635429971592222890);
        assert_eq!(sglang_event_hash(&p1), 1256577331724852459);
    }
}
