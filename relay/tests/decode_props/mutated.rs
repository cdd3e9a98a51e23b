//! Mutated real payloads.

use super::*;

/// Every distinct batch payload of every fixture.
fn real_payloads() -> &'static [Vec<u8>] {
    static P: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    P.get_or_init(|| {
        let mut out = Vec::new();
        for p in kv_relay_testdata::captures() {
            for m in capture::read(&p).unwrap() {
                let frames: Vec<&[u8]> = m.frames.iter().map(Vec::as_slice).collect();
                let f = match m.socket {
                    SocketKind::Pub => wire::split_pub(&frames).ok(),
                    SocketKind::Replay => match wire::split_replay(&frames) {
                        Ok(wire::ReplayReply::Batch(f)) => Some(f),
                        _ => None,
                    },
                };
                if let Some(f) = f {
                    out.push(f.payload.to_vec());
                }
            }
        }
        out.sort();
        out.dedup();
        assert!(out.len() > 500, "only {} payloads found", out.len());
        out
    })
}

#[derive(Debug, Clone)]
enum Mutation {
    FlipBit(usize, u8),
    Truncate(usize),
    Insert(usize, Vec<u8>),
    Overwrite(usize, u8),
    Remove(usize, usize),
}

fn apply(p: &mut Vec<u8>, m: &Mutation) {
    if p.is_empty() {
        return;
    }
    match m {
        Mutation::FlipBit(i, b) => {
            let i = i % p.len();
            p[i] ^= 1 << (b % 8);
        }
        Mutation::Truncate(i) => p.truncate(i % p.len()),
        Mutation::Insert(i, bytes) => {
            let i = i % (p.len() + 1);
            p.splice(i..i, bytes.iter().copied());
        }
        Mutation::Overwrite(i, b) => {
            let i = i % p.len();
            p[i] = *b;
        }
        Mutation::Remove(i, n) => {
            let i = i % p.len();
            let end = (i + n).min(p.len());
            p.drain(i..end);
        }
    }
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::FlipBit(i, b)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..8)).prop_map(|(i, b)| Mutation::Insert(i, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Overwrite(i, b)),
        (any::<usize>(), 1usize..16).prop_map(|(i, n)| Mutation::Remove(i, n)),
    ]
}

proptest! {
    #[test]
    fn mutated_real_payloads_never_panic(
        which in any::<prop::sample::Index>(),
        mutations in prop::collection::vec(mutation(), 1..6),
    ) {
        let all = real_payloads();
        let mut p = all[which.index(all.len())].clone();
        for m in &mutations {
            apply(&mut p, m);
        }
        decode_and_normalize(&p);
    }

    #[test]
    fn a_cut_real_payload_keeps_every_event_before_the_cut(
        which in any::<prop::sample::Index>(),
        cut in any::<prop::sample::Index>(),
    ) {
        let all = real_payloads();
        let full = &all[which.index(all.len())];
        check_cut(full, cut.index(full.len()))?;
    }
}

/// Checks that `cut` (a prefix of `full`) kept exactly the events of `full` that ended before
/// the cut, and dropped the one the cut fell in as truncated.
pub(crate) fn check_cut(full: &[u8], cut: usize) -> Result<(), TestCaseError> {
    let whole = wire::decode_batch(full).unwrap();
    let Ok(b) = wire::decode_batch(&full[..cut]) else {
        // Cut before the first event ended: nothing to keep.
        let first = first_event_end(full);
        prop_assert!(first.is_none_or(|end| cut < end), "cut at {} of {} lost a whole event", cut, full.len());
        return Ok(());
    };
    let k = b.events.len();
    prop_assert!(k <= whole.events.len());
    let complete = if b.truncated && b.events.last() == Some(&Err(DropReason::Truncated)) { k - 1 } else { k };
    prop_assert_eq!(&b.events[..complete], &whole.events[..complete]);
    prop_assert!(b.truncated || k == whole.events.len());
    Ok(())
}

/// Where the first event of a batch payload ends, if the batch has one.
fn first_event_end(payload: &[u8]) -> Option<usize> {
    let mut r = wire::msgpack::Reader::new(payload);
    r.array_len().ok()?;
    r.skip().ok()?;
    if r.array_len().ok()? == 0 {
        return None;
    }
    r.skip().ok()?;
    Some(r.position())
}
