//! Where a hash lives in a table: its probe (shard, home group, fingerprint, version
//! counter), and the control words that a probe's group walk reads.

/// Slots per group (the control word's eighth byte is the overflow count).
pub(super) const GROUP: usize = 7;
/// Bit 7 of each slot control byte (bytes 0..7).
pub(super) const HI: u64 = 0x0080_8080_8080_8080;
pub(super) const LO: u64 = 0x0101_0101_0101_0101;
/// The control byte of a dead slot (its value a tomb): bits 7 and 6 set, where an unused
/// slot's (`EMPTY`, 0x80) has bit 6 clear and a fingerprint has bit 7 clear.
pub(super) const DELETED: u8 = 0xfe;
/// Seven `EMPTY` control bytes, overflow count 0.
pub(super) const EMPTY_WORD: u64 = HI;
pub(super) const OVERFLOW_SHIFT: u32 = 56;

/// Where a block hash lives: computed once per hash from a strong mix of it.
#[derive(Clone, Copy, Debug, Default)]
pub(in crate::index) struct Probe {
    pub hash: u64,
    mixed: u64,
}

impl Probe {
    pub fn new(hash: u64) -> Self {
        // A 64-bit finalizer: engine hashes are already uniform, but tests and synthetic
        // workloads use small integers, and the shard, home group and fingerprint must not
        // correlate.
        let mut x = hash;
        x ^= x >> 33;
        x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^= x >> 33;
        x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        x ^= x >> 33;
        Self { hash, mixed: x }
    }

    /// The strong mix of the hash (its bits choose the shard, group, fingerprint, version
    /// counter and crowd record place).
    pub fn mixed(&self) -> u64 {
        self.mixed
    }

    /// Bits 32.. choose the shard.
    pub fn shard(&self, mask: usize) -> usize {
        (self.mixed >> 32) as usize & mask
    }

    /// Bits 40..52: the key's version counter (of `counters`, a power of two up to 4,096).
    pub(super) fn stripe(&self, counters: usize) -> usize {
        (self.mixed >> 40) as usize & (counters - 1)
    }

    /// Bits 57..64: the control-byte fingerprint (0..=0x7f).
    pub(super) fn fingerprint(&self) -> u8 {
        (self.mixed >> 57) as u8
    }

    /// Bits 0..32 pick the home group by multiply-shift (group counts need not be powers of 2).
    pub(super) fn home(&self, groups: usize) -> usize {
        (((self.mixed & 0xffff_ffff) * groups as u64) >> 32) as usize
    }
}

/// Slot control bytes of `word` equal to `fp` (bit 7 of each matching byte set). May flag a
/// full byte next to a true match (borrow), never an `EMPTY` byte nor the overflow byte;
/// callers compare keys anyway.
pub(super) fn match_byte(word: u64, fp: u8) -> u64 {
    let x = word ^ (LO * fp as u64);
    x.wrapping_sub(LO) & !x & HI
}

/// The group after `g` (the last wraps to the first).
#[inline]
pub(super) fn next_group(g: usize, groups: usize) -> usize {
    if g + 1 == groups {
        0
    } else {
        g + 1
    }
}

/// Bit 7 of each `DELETED` slot control byte of `word`: those bytes have bits 7 and 6 set,
/// `EMPTY` ones bit 7 alone, fingerprints not bit 7.
pub(super) fn dead_bytes(word: u64) -> u64 {
    word & HI & (word << 1)
}

/// True when some insert went past this group: a probe must look at the next group too.
pub(super) fn overflowed(word: u64) -> bool {
    word >> OVERFLOW_SHIFT != 0
}
