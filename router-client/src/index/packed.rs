//! A slot's packed value: the holder (worker, generation tag, tier), the holder's run entry and
//! the copy count; a dead slot's tomb; and the copy counts too large for their field.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// A dead slot's value (a *tomb*): the worker field all ones (never a live value: worker ids
/// stop below 2^23 - 1), and in the low bits the grace ticket taken when it died
/// ([`NEVER`] until then).
pub(super) const TOMB_MARK: u64 = 0x7f_ffff << 41;
/// The ticket bits of a tomb.
pub(super) const TICKET: u64 = (1 << 41) - 1;
/// The ticket of a tomb not reusable (yet).
pub(super) const NEVER: u64 = TICKET;

/// True if `v` is a tomb.
pub(super) const fn is_tomb(v: u64) -> bool {
    v >> 41 == 0x7f_ffff
}

/// The tomb of a slot that died before grace ticket `ticket` was taken.
pub(super) const fn tomb(ticket: u64) -> u64 {
    TOMB_MARK | (ticket & TICKET)
}

/// True if the tomb `v` may be reused for another key now that `ended` grace periods have
/// ended: more than its ticket. Compared on the ticket's 41 bits: a tomb left unused for 2^40
/// periods looks fresh again and is only rebuilt away.
pub(super) const fn ripe(v: u64, ended: u64) -> bool {
    let t = v & TICKET;
    t != NEVER && (ended.wrapping_sub(t) & TICKET).wrapping_sub(1) < 1 << 40
}
/// Mask of the `copies` field of a packed value.
pub(super) const COPIES: u64 = 0x3f;
/// The `copies` field of a holder with 63 copies or more: the count is in the [`Overflow`].
pub(super) const MANY: u64 = COPIES;
pub(super) const ENTRY_SHIFT: u32 = 6;
/// Bits of an entry id.
pub(super) const ENTRY_BITS: u32 = 28;
/// The entry id of a slot without an entry.
pub(super) const NO_ENTRY: u32 = (1 << ENTRY_BITS) - 1;
pub(super) const ENTRY: u64 = (NO_ENTRY as u64) << ENTRY_SHIFT;
/// The entry field of a packed value without an entry.
pub(super) const NO_ENTRY_BITS: u64 = ENTRY;
/// Mask of the holder bits (worker, tag, tier) of a packed value.
pub(super) const HOLDER: u64 = !(COPIES | ENTRY);

/// Packs a holder (without entry and copies).
pub(super) const fn holder(worker: u32, tag: u64, tier: u8) -> u64 {
    ((worker as u64) << 41) | (tag << 40) | (((tier & 63) as u64) << 34)
}

/// Worker id of a packed value.
pub(super) const fn worker_of(v: u64) -> u32 {
    (v >> 41) as u32
}

/// Generation tag (0 or 1) of a packed value.
pub(super) const fn tag_of(v: u64) -> u64 {
    (v >> 40) & 1
}

/// Tier id of a packed value.
pub(super) const fn tier_of(v: u64) -> u8 {
    ((v >> 34) & 63) as u8
}

/// Entry id of a packed value (`NO_ENTRY` if none).
pub(super) const fn entry_of(v: u64) -> u32 {
    ((v & ENTRY) >> ENTRY_SHIFT) as u32
}

/// Copy counts of 63 or more, by `(hash, holder)`: their slots say `MANY`. Changed only with
/// the lock held, together with the slot, so a reader holding it sees the two agree.
#[derive(Default)]
pub(super) struct Overflow(Mutex<HashMap<(u64, u64), u32>>);

pub(super) type OverflowGuard<'a> = MutexGuard<'a, HashMap<(u64, u64), u32>>;

impl Overflow {
    pub fn lock(&self) -> OverflowGuard<'_> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Copies of the live value `v` of `hash`: its field, or from the map (`many`, the locked
    /// map; locked here if `None`).
    pub fn copies(&self, hash: u64, v: u64, many: Option<&OverflowGuard<'_>>) -> u32 {
        if v & COPIES != MANY {
            return (v & COPIES) as u32;
        }
        let key = (hash, v & HOLDER);
        match many {
            Some(m) => m.get(&key).copied().unwrap_or(0),
            None => self.lock().get(&key).copied().unwrap_or(0),
        }
    }

    /// True if `v` keeps its count here.
    pub fn is_many(v: u64) -> bool {
        v & COPIES == MANY
    }

    pub fn bytes(&self) -> usize {
        self.lock().capacity() * 24
    }
}
